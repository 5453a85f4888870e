"""Server data may also fit: the same refinement after every method, and the server's labels alone.

Every row below gets the same uploads and the same 500 server examples, split the same way into a
250-example fitting fold and a 250-example selection fold (the shipped
:class:`fedfiot_flwr.refine.RefinementStage` with ``RefineOptions()``): each method's knobs are
chosen on the selection fold, then its model goes through the stage. The rows:

- ``fedfiot-refined``: FedFiOT's default merge (no FedAvg candidate, as the strategy runs it with
  ``refine``), then the stage with the merge's permutations;
- ``fedfiot-refined-unaligned``: the same merge through the same stage without its permutations (the
  clients taken as they are): what the alignment adds to the refinement;
- ``fedavg-refined``, ``regmean-refined``, ``best-single-client-refined``: the same stage after
  FedAvg, RegMean (alpha chosen on the selection fold) and the client that scores best on the
  selection fold;
- ``fresh-refined``: the stage from a freshly initialised model, the clients serving only as
  teachers (distillation, least-squares targets, candidates): the FedDF-style rival;
- ``server-only``: a freshly initialised model fine-tuned with the stage's recipe on the fitting
  fold's labels alone (cross-entropy, no clients), chosen on the selection fold.

Test accuracy on the data set's test split. Run::

    .venv/bin/python benchmarks/equal_terms.py --alphas 0.1 --inits shared --seeds 0 --epochs 5

Uploads are cached with ``benchmarks/one_shot.py``'s cache (``--cache-dir``), so both benchmarks
train each setting's clients once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness as H  # noqa: E402
from benchmarks import server_methods as S  # noqa: E402
from fedfiot_flwr.baselines import size_weighted_average  # noqa: E402
from fedfiot_flwr.choose import best_index  # noqa: E402
from fedfiot_flwr.options import Model  # noqa: E402
from fedfiot_flwr.refine import RefineOptions, RefinementStage  # noqa: E402

METHODS = ("fedfiot-refined", "fedfiot-refined-unaligned", "fedavg-refined", "regmean-refined",
           "best-single-client-refined", "fresh-refined", "server-only")
LABELS = {
    "fedfiot-refined": "FedFiOT default merge + refinement",
    "fedfiot-refined-unaligned": "FedFiOT default merge + refinement without its permutations (ablation)",
    "fedavg-refined": "FedAvg + refinement",
    "regmean-refined": "RegMean + refinement",
    "best-single-client-refined": "best single client + refinement",
    "fresh-refined": "fresh model + refinement (clients as teachers only)",
    "server-only": "server-only (the 250 fitting labels alone, same recipe)",
}


def _fresh(build: Callable[[], torch.nn.Module], seed: int) -> Model:
    torch.manual_seed(10_000 + seed)
    return H.state_numpy(build())


def starts(setting: H.Setting, split: Any, uploads: H.Uploads, build: Callable[[], torch.nn.Module],
           spec: Any, buffers: Sequence[str], sel_validate: Callable[[Model], dict[str, float]], args: Any,
           log: Callable[[str], None], methods: Sequence[str] = METHODS) -> dict[str, tuple[Model, Any]]:
    """The model of each of ``methods`` before the stage, with its permutations of the clients
    (``None``: unaligned); only the starts asked for are built."""
    q = uploads.quantized
    out: dict[str, tuple[Model, Any]] = {}
    if {"fedfiot-refined", "fedfiot-refined-unaligned"} & set(methods):
        merged = S.fedfiot_merge_on_fold(uploads, spec, buffers, S.selection_evaluator(split, build), args.grid,
                                         setting.init)
        out["fedfiot-refined"] = (merged.model, merged.result.permutations if merged.variant == "aligned" else None)
        out["fedfiot-refined-unaligned"] = (merged.model, None)
    if "fedavg-refined" in methods:
        out["fedavg-refined"] = (size_weighted_average(q.weights, q.num_examples), None)
    if "regmean-refined" in methods:
        reg = H.apply_curvature_method("regmean", setting, split, uploads, build, buffers, sel_validate,
                                       cache_dir=args.cache_dir, log=log)
        out["regmean-refined"] = (reg.model, None)
    if "best-single-client-refined" in methods:
        scores = [sel_validate(w)["accuracy"] for w in q.weights]
        out["best-single-client-refined"] = (q.weights[best_index(scores)], None)
    if "fresh-refined" in methods:
        out["fresh-refined"] = (_fresh(build, setting.seed), None)
    return {m: start for m, start in out.items() if m in methods}


def run_setting(setting: H.Setting, args: Any, log: Callable[[str], None],
                methods: Sequence[str] = METHODS) -> list[dict[str, Any]]:
    """The rows of one setting (``methods`` of them)."""
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, None, log)
    options = replace(RefineOptions(), seed=setting.seed)
    stage = RefinementStage(build(), split.validation, options, spec=spec)
    q = uploads.quantized
    records = []
    base = H.record_fields(setting)
    for method, (model, perms) in starts(setting, split, uploads, build, spec, buffers, stage.validate_fn, args,
                                         log, methods).items():
        t0 = time.perf_counter()
        refined, rep = stage.refine(model, q.weights, perms, q.num_examples)
        records.append(_record(base, method, ev, refined, rep, time.perf_counter() - t0))
        log(f"  {method:28s} test {100 * records[-1]['test_accuracy']:5.1f}%  returned {rep.chosen}")
    if "server-only" in methods:
        fresh = _fresh(build, setting.seed)
        alone = RefinementStage(build(), split.validation,
                                replace(options, ridges=(), distill_weight=0.0, client_candidates=False))
        t0 = time.perf_counter()
        refined, rep = alone.refine(fresh, [fresh], None, [1])
        records.append(_record(base, "server-only", ev, refined, rep, time.perf_counter() - t0))
        log(f"  {'server-only':28s} test {100 * records[-1]['test_accuracy']:5.1f}%  returned {rep.chosen}")
    return records


def _record(base: dict[str, Any], method: str, ev: H.Evaluator, model: Model, rep: Any,
            seconds: float) -> dict[str, Any]:
    _, acc = ev.test(model)
    return {**base, "method": method, "test_accuracy": acc, "selection_accuracy": rep.selection_accuracy[rep.chosen],
            "returned": rep.chosen, "refine_seconds": seconds}


def markdown(records: Sequence[dict[str, Any]], command: str) -> str:
    """The results page: one column per setting, mean ± std over seeds."""
    cols = sorted({(r["dataset"], r["alpha"], r["init"], r["epochs"]) for r in records})
    head = "| method | " + " | ".join(f"{d} α={a:g} {i} E={e}" for d, a, i, e in cols) + " |"
    lines = ["# Server data may also fit: the same refinement after every method", "",
             f"Command: `{command}`", "", head, "|---" * (len(cols) + 1) + "|"]
    for m in METHODS:
        cells = []
        for c in cols:
            vals = [r["test_accuracy"] for r in records if r["method"] == m
                    and (r["dataset"], r["alpha"], r["init"], r["epochs"]) == c]
            seeds = len(vals)
            cells.append(H.fmt_pct(*H.mean_std(vals)) + (f" (n={seeds})" if seeds > 1 else "") if vals else "")
        if any(cells):
            lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    lines += ["", "Test accuracy (%), mean ± sample std over the seeds run (n = 1 where no n is given). Every row: "
              "the same uploads, the same 250 fitting and 250 selection examples, the same `RefineOptions()`; "
              "`returned` in the JSON names the candidate the selection fold chose."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    """Run the settings and write ``equal_terms.{md,json}``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default="fednet")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--alphas", nargs="+", type=float, default=[0.1])
    p.add_argument("--inits", nargs="+", default=["shared", "independent"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--epochs", nargs="+", type=int, default=[5])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--grid", default="small")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--name", default="equal_terms")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    records: list[dict[str, Any]] = []
    out_json = args.out / f"{args.name}.json"
    if out_json.is_file():  # resume: keep the settings already run
        records = json.loads(out_json.read_text())["records"]
    command = H.command_line(argv, __file__, interpreter="python")
    for e in args.epochs:
        for a in args.alphas:
            for init in args.inits:
                for seed in args.seeds:
                    setting = H.Setting(args.dataset, args.model, args.clients, a, init, seed, e)
                    done = {r["method"] for r in records if (r["alpha"], r["init"], r["seed"], r["epochs"]) == (a, init, seed, e)}
                    todo = [m for m in args.methods if m not in done]
                    if not todo:
                        continue
                    print(f"{setting.column()} seed {seed}", flush=True)
                    records += run_setting(setting, args, lambda s: print(s, flush=True), todo)
                    args.out.mkdir(parents=True, exist_ok=True)
                    H.write_json(out_json, {"records": records})
                    (args.out / f"{args.name}.md").write_text(markdown(records, command))


if __name__ == "__main__":
    main()
