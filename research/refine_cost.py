"""The server refinement's cost: the reference implementation and recipe against the shipped ones, in one process.

Every cell gets the same uploads (the one-shot uploads cached by ``benchmarks/one_shot.py``, or
with ``--fraction`` below 1 the subset uploads of ``benchmarks/resnet.py``), starts from FedAvg
of them, and splits the server's 500 validation examples as ``audit_folds.py`` does: a
250-example fitting fold, a 125-example selection fold that picks the returned candidate, and a
125-example audit fold that neither fits nor selects. The refinement then runs once per path,
the paths interleaved (their order rotates from cell to cell):

- ``reference``: ``RefineOptions(reference=True)`` with the recipe of ``TODAY`` (20
  epochs, 8 augmented copies, batches of 50): separate forward passes for the label weights,
  the layer targets and the teacher, every refit's sums computed afresh over whole forward
  passes, the default memory layout, ``torch.no_grad``;
- ``same recipe``: the shipped passes with ``TODAY``'s recipe (the returned model is the
  reference's up to rounding, as ``tests/test_refine_speed.py`` checks);
- ``shipped``: the shipped passes with ``RefineOptions()``, where its recipe is not ``TODAY``'s
  (its Fisher-anchored fine-tuning runs included: every path gets the uploads' Fishers);
- any ``--recipes`` given as ``c<copies>e<epochs>[b<batch>][l<learning rate>]`` (e.g.
  ``c3e10`` or ``c8e5l0.03``): the shipped passes with those fine-tuning rows, epochs, batch and
  learning rate (the rest as ``TODAY``).

Each path's process CPU seconds and wall seconds, and its returned model's accuracy on the audit
fold (what a recipe is chosen on) and on the test split (reported, never chosen on). Run::

    .venv/bin/python research/refine_cost.py
    .venv/bin/python research/refine_cost.py --cells 0.1:shared:0:5 --recipes c8e6 c3e10 --name refine_cost_trial

The default run (4 cells, 5 paths) takes about 9 minutes on one core once the uploads are cached.
Writes ``research/results/refine_cost.{md,json}`` (``--name`` changes the stem); ``--quick``
is a smoke run (one cell, tiny uploads, one epoch, the reference and the same recipe only).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as H  # noqa: E402
from benchmarks.resnet import subset_cache, subset_uploads  # noqa: E402
from research import RESULTS_DIR  # noqa: E402
from research.audit_folds import three_folds  # noqa: E402
from fedfiot_flwr.baselines import size_weighted_average  # noqa: E402
from fedfiot_flwr.refine import ClientModels, Folds, RefineOptions, refine_merged_model  # noqa: E402

TODAY = replace(RefineOptions(), finetune_epochs=20, augment_copies=8, finetune_batch=50, fisher_anchor=())
"""The recipe the reference path runs: 20 epochs of distillation on 8 augmented copies, batches of 50,
no Fisher-anchored runs."""
QUICK = {"finetune_epochs": 1, "augment_copies": 1}
"""``--quick``: every path's recipe shrunk to one epoch on one augmented copy."""
FIXED_PATHS = ("reference", "same recipe", "shipped")


@dataclass(frozen=True)
class Variant:
    """One way of running the refinement (a path): its options and whether it runs the reference passes."""

    name: str
    options: RefineOptions
    reference: bool = False


def recipe_options(name: str, base: RefineOptions) -> RefineOptions:
    """``c<copies>e<epochs>[b<batch>][l<learning rate>]`` as ``base`` with those fine-tuning knobs.

    >>> recipe_options("c3e10b100l0.02", RefineOptions()).finetune_lr
    0.02
    """
    m = re.fullmatch(r"c(\d+)e(\d+)(?:b(\d+))?(?:l(\d*\.?\d+(?:e-?\d+)?))?", name)
    if not m:
        raise ValueError(f"a recipe is c<copies>e<epochs>[b<batch>][l<learning rate>], got {name!r}")
    batch = int(m.group(3)) if m.group(3) else base.finetune_batch
    lr = float(m.group(4)) if m.group(4) else base.finetune_lr
    return replace(base, augment_copies=int(m.group(1)), finetune_epochs=int(m.group(2)), finetune_batch=batch,
                   finetune_lr=lr)


def paths(recipes: Sequence[str], quick: bool) -> list[Variant]:
    """The fixed paths (``shipped`` only where ``RefineOptions()`` differs from :data:`TODAY`), then one per
    recipe; ``quick`` shrinks the fixed paths' recipes (:data:`QUICK`)."""
    today, shipped = TODAY, RefineOptions()
    if quick:
        today, shipped = replace(today, **QUICK), replace(shipped, **QUICK)
    out = [Variant("reference", today, reference=True), Variant("same recipe", today)]
    if shipped != today:
        out.append(Variant("shipped", shipped))
    return out + [Variant(r, recipe_options(r, today)) for r in recipes]


@dataclass
class Cell:
    """One cell's uploads, start, folds and evaluators."""

    setting: H.Setting
    clients: list[dict[str, np.ndarray]]
    fishers: list[dict[str, np.ndarray]]
    num_examples: list[int]
    start: dict[str, np.ndarray]
    build: Callable[[], torch.nn.Module]
    folds: dict[str, Subset[Any]]
    audit: H.Evaluator
    test: H.Evaluator


def build_cell(cell: str, args: argparse.Namespace, log: Callable[[str], None]) -> Cell:
    """The cell ``alpha:init:seed:epochs`` (Fashion-MNIST, the paper's CNN, K = 6), uploads from the cache."""
    alpha, init, seed, epochs = cell.split(":")
    setting = H.Setting(dataset="fashion-mnist", model="fednet", clients=6, alpha=float(alpha), init=init,
                        seed=int(seed), epochs=int(epochs))
    split = setting.app_config().split()
    build, _, buffers = H.model_tools(setting, split)
    if args.fraction < 1:
        cache = subset_cache(args.cache_dir, args.fraction, args.fisher_examples)
        uploads = subset_uploads(setting, split, buffers, args.fraction, args.fisher_examples, cache,
                                 torch.device("cpu"), log)
    else:
        uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, torch.device("cpu"), log)
    q = uploads.quantized
    fit, select, audit = three_folds(len(split.validation))
    folds = {name: Subset(split.validation, idx.tolist())
             for name, idx in (("fit", fit), ("select", select), ("audit", audit))}
    cpu = torch.device("cpu")
    return Cell(setting, list(q.weights), list(q.fishers), list(q.num_examples), size_weighted_average(q.weights, q.num_examples),
                build, folds, H.Evaluator(replace(split, validation=folds["audit"]), build, cpu),
                H.Evaluator(split, build, cpu))


def run_path(cell: Cell, path: Variant) -> dict[str, Any]:
    """One refinement of the cell's start: CPU and wall seconds, the returned candidate and its accuracies."""
    options = replace(path.options, seed=cell.setting.seed)
    fit = DataLoader(cell.folds["fit"], batch_size=500)
    select = DataLoader(cell.folds["select"], batch_size=500)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    clients = ClientModels(cell.clients, num_examples=cell.num_examples, fishers=cell.fishers)
    model, report = refine_merged_model(cell.start, clients, cell.build(), Folds(fit, select),
                                        options=replace(options, reference=path.reference))
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    audit = cell.audit.validate(model)
    return {"cpu_seconds": cpu, "wall_seconds": wall, "returned": report.chosen,
            "selection": report.selection_accuracy[report.chosen], "audit": audit["accuracy"],
            "audit_loss": audit["loss"], "test": cell.test.test(model)[1], "options": options.as_dict(),
            "reference": path.reference}


def run_cell(cell_name: str, position: int, todo: Sequence[Variant], args: argparse.Namespace,
             log: Callable[[str], None]) -> dict[str, Any]:
    """Every path on one cell, in an order rotated by ``position`` (so no path always runs first)."""
    cell = build_cell(cell_name, args, log)
    order = [todo[(i + position) % len(todo)] for i in range(len(todo))]
    runs: dict[str, dict[str, Any]] = {}
    for path in order:
        runs[path.name] = run_path(cell, path)
        r = runs[path.name]
        log(f"  {path.name:12s} cpu {r['cpu_seconds']:6.1f}s wall {r['wall_seconds']:6.1f}s "
            f"audit {100 * r['audit']:5.1f} test {100 * r['test']:5.2f} returned {r['returned']}")
    return {**H.record_fields(cell.setting), "cell": cell_name, "order": [p.name for p in order],
            "runs": {p.name: runs[p.name] for p in todo}}


def summary(records: Sequence[dict[str, Any]], names: Sequence[str]) -> list[dict[str, Any]]:
    """Per path, over the cells: summed seconds, their ratio to the reference, and mean accuracies."""
    ref_cpu = sum(r["runs"]["reference"]["cpu_seconds"] for r in records)
    ref_wall = sum(r["runs"]["reference"]["wall_seconds"] for r in records)
    out = []
    for name in names:
        runs = [r["runs"][name] for r in records]
        per_cell = [run["cpu_seconds"] / r["runs"]["reference"]["cpu_seconds"] for run, r in zip(runs, records)]
        out.append({
            "path": name, "cpu_seconds": sum(x["cpu_seconds"] for x in runs),
            "wall_seconds": sum(x["wall_seconds"] for x in runs),
            "cpu_ratio": sum(x["cpu_seconds"] for x in runs) / ref_cpu,
            "wall_ratio": sum(x["wall_seconds"] for x in runs) / ref_wall,
            "cell_cpu_ratio_min": min(per_cell), "cell_cpu_ratio_max": max(per_cell),
            "audit": float(np.mean([x["audit"] for x in runs])), "test": float(np.mean([x["test"] for x in runs])),
            "audit_vs_reference": float(np.mean([x["audit"] - r["runs"]["reference"]["audit"]
                                                 for x, r in zip(runs, records)])),
            "test_vs_reference": float(np.mean([x["test"] - r["runs"]["reference"]["test"]
                                                for x, r in zip(runs, records)])),
        })
    return out


def markdown(records: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], command: str) -> str:
    """The results page: the summary over cells, then each cell."""
    lines = ["# The server refinement's cost", "", f"Command: `{command}`", "",
             f"{len(records)} cells; each path's process CPU and wall seconds summed over them, their ratio to "
             "the reference path, and the returned model's mean accuracy (audit fold: 125 examples that "
             "neither fit nor select; test: the test split), with the mean difference to the reference.", "",
             "| path | recipe | CPU s | CPU ratio (cells) | wall ratio | audit % (vs ref.) | test % (vs ref.) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        o = records[0]["runs"][row["path"]]["options"]
        recipe = f"{o['finetune_epochs']} epochs, {o['augment_copies']} copies, batch {o['finetune_batch']}"
        lines.append(
            f"| {row['path']} | {recipe} | {row['cpu_seconds']:.1f} | {row['cpu_ratio']:.2f} "
            f"({row['cell_cpu_ratio_min']:.2f}-{row['cell_cpu_ratio_max']:.2f}) | {row['wall_ratio']:.2f} | "
            f"{100 * row['audit']:.2f} ({100 * row['audit_vs_reference']:+.2f}) | "
            f"{100 * row['test']:.2f} ({100 * row['test_vs_reference']:+.2f}) |")
    lines += ["", "Per cell (CPU seconds / test accuracy %, returned candidate):", "",
              "| cell | " + " | ".join(r["path"] for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for rec in records:
        cells = [f"{rec['runs'][r['path']]['cpu_seconds']:.1f} s / {100 * rec['runs'][r['path']]['test']:.2f} "
                 f"`{rec['runs'][r['path']]['returned']}`" for r in rows]
        lines.append(f"| {rec['cell']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cells", nargs="+", help="alpha:init:seed:epochs",
                   default=["0.1:shared:0:5", "0.1:independent:0:5", "0.1:shared:1:5", "0.1:independent:1:5"])
    p.add_argument("--recipes", nargs="*", default=["c8e4", "c8e5", "c8e6"],
                   help="extra recipes c<copies>e<epochs>[b<batch>][l<lr>]")
    p.add_argument("--fraction", type=float, default=1.0,
                   help="below 1: each client trains on this fraction of its examples (benchmarks/resnet.py's uploads)")
    p.add_argument("--fisher-examples", type=int, default=100)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one cell, tiny uploads, one epoch, no extra recipes")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default="refine_cost")
    args = p.parse_args(argv)
    if args.quick:
        args.cells, args.fraction, args.recipes = args.cells[:1], min(args.fraction, 0.02), []
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run every path on every cell and write ``<name>.{md,json}``."""
    args = parse(argv)
    H.set_threads(args.threads)
    todo = paths(args.recipes, args.quick)
    records = []
    for i, cell in enumerate(args.cells):
        print(cell, flush=True)
        records.append(run_cell(cell, i, todo, args, lambda s: print(s, flush=True)))
    rows = summary(records, [p.name for p in todo])
    command = H.command_line(argv, __file__, interpreter="python")
    args.out.mkdir(parents=True, exist_ok=True)
    H.write_json(args.out / f"{args.name}.json", {"command": command, "machine": H.machine_description(),
                                                  "summary": rows, "records": records})
    (args.out / f"{args.name}.md").write_text(markdown(records, rows, command))
    return records


if __name__ == "__main__":
    main()
