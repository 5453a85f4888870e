"""Server data may also fit: the same refinement after every method, and the server's labels alone.

Every row below gets the same uploads and the same 500 server examples, split the same way into a
250-example fitting fold and a 250-example selection fold (the shipped
:class:`fedfiot_flwr.refine.RefinementStage`): each method's knobs are chosen on the selection
fold, then its model goes through the stage. The rows with the shipped stage, ``RefineOptions()``,
whose fine-tuning also runs with the clients' Fisher anchor (their uploaded Fishers; in FedFiOT's
neuron order for FedFiOT, as they are for the others):

- ``fedfiot-anchored``: FedFiOT's default merge (no FedAvg candidate, as the strategy runs it with
  ``refine``), then the stage with the merge's permutations;
- ``fedavg-anchored``, ``regmean-anchored``, ``best-single-client-anchored``: the same stage after
  FedAvg, RegMean (alpha chosen on the selection fold) and the client that scores best on the
  selection fold;
- ``fresh-anchored``: the stage from a freshly initialised model, the clients serving only as
  teachers, least-squares targets, anchor and candidates: the FedDF-style rival;
- ``server-only``: a freshly initialised model fine-tuned with the stage's recipe on the fitting
  fold's labels alone (cross-entropy, no clients), chosen on the selection fold.

The same starts through the stage without the anchor (``--anchor`` sets the anchored rows'
strengths): ``fedfiot-refined``, ``fedavg-refined``, ``regmean-refined``,
``best-single-client-refined``, ``fresh-refined``; and two ablations:
``fedfiot-refined-unaligned`` (FedFiOT's merge without its permutations: what the alignment adds)
and ``fedfiot-l2anchored`` / ``fedavg-l2anchored`` (every Fisher tensor replaced by its mean: the
anchor keeps its strength and loses the Fisher's shape).

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

ANCHORED = {"fedfiot-anchored": "fedfiot-refined", "fedavg-anchored": "fedavg-refined",
            "regmean-anchored": "regmean-refined", "best-single-client-anchored": "best-single-client-refined",
            "fresh-anchored": "fresh-refined", "fedfiot-l2anchored": "fedfiot-refined", "fedavg-l2anchored": "fedavg-refined"}
"""Each anchored method and the start it shares with its plain refined row."""
METHODS = ("fedfiot-anchored", "fedavg-anchored", "regmean-anchored", "best-single-client-anchored", "fresh-anchored",
           "server-only", "fedfiot-refined", "fedfiot-refined-unaligned", "fedavg-refined", "regmean-refined",
           "best-single-client-refined", "fresh-refined", "fedfiot-l2anchored", "fedavg-l2anchored")
"""Table order: the shipped stage (``RefineOptions()``, with the Fisher anchor) after every start, the
server's labels alone, the stage without the anchor, the ablations."""
LABELS = {
    "fedfiot-refined": "FedFiOT default merge + refinement without the Fisher anchor",
    "fedfiot-refined-unaligned": "FedFiOT default merge + refinement without the anchor and without its permutations (ablation)",
    "fedavg-refined": "FedAvg + refinement without the Fisher anchor",
    "regmean-refined": "RegMean + refinement without the Fisher anchor",
    "best-single-client-refined": "best single client + refinement without the Fisher anchor",
    "fresh-refined": "fresh model + refinement without the Fisher anchor (clients as teachers only)",
    "server-only": "server-only (the 250 fitting labels alone, same recipe)",
    "fedfiot-anchored": "FedFiOT default merge + refinement (with the aligned clients' Fisher anchor)",
    "fedavg-anchored": "FedAvg + refinement (with the clients' Fisher anchor)",
    "regmean-anchored": "RegMean + refinement (with the clients' Fisher anchor)",
    "best-single-client-anchored": "best single client + refinement (with the clients' Fisher anchor)",
    "fresh-anchored": "fresh model + refinement (clients as teachers and Fisher anchor only)",
    "fedfiot-l2anchored": "FedFiOT default merge + refinement with a flat anchor (ablation: each Fisher tensor "
                          "replaced by its mean)",
    "fedavg-l2anchored": "FedAvg + refinement with a flat anchor (ablation: each Fisher tensor replaced by its mean)",
}


def flat_fishers(fishers: Sequence[Model]) -> list[Model]:
    """Each client's Fisher tensor replaced by its mean: the anchor keeps its strength per tensor and
    client but loses the Fisher's shape (an L2 pull toward the size-weighted mean of the clients)."""
    return [{k: np.full_like(np.asarray(v, dtype=np.float64), float(np.mean(v))) for k, v in f.items()}
            for f in fishers]


def _fresh(build: Callable[[], torch.nn.Module], seed: int) -> Model:
    torch.manual_seed(10_000 + seed)
    return H.state_numpy(build())


def starts(setting: H.Setting, split: Any, uploads: H.Uploads, build: Callable[[], torch.nn.Module],
           spec: Any, buffers: Sequence[str], sel_validate: Callable[[Model], dict[str, float]], args: Any,
           log: Callable[[str], None], methods: Sequence[str] = METHODS) -> dict[str, tuple[Model, Any]]:
    """The model of each of ``methods`` before the stage, with its permutations of the clients
    (``None``: unaligned); only the starts asked for are built."""
    requested = set(methods)
    q = uploads.quantized
    out: dict[str, tuple[Model, Any]] = {}
    methods = [*methods, *(ANCHORED[m] for m in methods if m in ANCHORED)]
    if {"fedfiot-refined", "fedfiot-refined-unaligned"} & set(methods):
        merged = S.fedfiot_merge_on_fold(uploads, spec, buffers, S.selection_evaluator(split, build), args.grid,
                                         setting.init)
        out["fedfiot-refined"] = (merged.model, merged.engine_result.permutations if merged.variant == "aligned" else None)
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
    for anchored, plain in ANCHORED.items():
        if plain in out:
            out[anchored] = out[plain]
    return {m: start for m, start in out.items() if m in requested}


def run_setting(setting: H.Setting, args: Any, log: Callable[[str], None],
                methods: Sequence[str] = METHODS) -> list[dict[str, Any]]:
    """The rows of one setting (``methods`` of them)."""
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, None, log)
    options = replace(RefineOptions(), seed=setting.seed, keep_candidates=args.candidate_tests)
    stage = RefinementStage(build(), split.validation, options, spec=spec)
    anchored = RefinementStage(build(), split.validation, replace(options, fisher_anchor=tuple(args.anchor)), spec=spec)
    q = uploads.quantized
    records = []
    base = H.record_fields(setting)
    for method, (model, perms) in starts(setting, split, uploads, build, spec, buffers, stage.validate_fn, args,
                                         log, methods).items():
        t0 = time.perf_counter()
        if method in ANCHORED:
            fishers = flat_fishers(q.fishers) if method.endswith("-l2anchored") else q.fishers
            refined, rep = anchored.refine(model, q.weights, perms, q.num_examples, fishers=fishers)
        else:
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
    out = {**base, "method": method, "test_accuracy": acc, "selection_accuracy": rep.selection_accuracy[rep.chosen],
           "returned": rep.chosen, "refine_seconds": seconds, "candidates_selection": dict(rep.selection_accuracy)}
    if rep.candidates:  # --candidate-tests: every candidate's test score, for the analysis (never selects)
        out["candidates_test"] = {name: ev.test(state)[1] for name, state in rep.candidates.items()}
    return out


def _cell(r: dict[str, Any]) -> tuple[Any, ...]:
    return (r["dataset"], r["alpha"], r["init"], r["epochs"])


def table(records: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per method, one column per setting, test accuracy mean ± std over seeds."""
    cols = sorted({_cell(r) for r in records})
    lines = ["| method | " + " | ".join(f"{d} α={a:g} {i} E={e}" for d, a, i, e in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for m in METHODS:
        cells = []
        for c in cols:
            vals = [r["test_accuracy"] for r in records if r["method"] == m and _cell(r) == c]
            cells.append(H.fmt_pct(*H.mean_std(vals)) + (f" (n={len(vals)})" if len(vals) > 1 else "") if vals else "")
        if any(cells):
            lines.append(f"| {LABELS[m]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


RIVALS = {
    "fedfiot-anchored": ("fedavg-anchored", "regmean-anchored", "best-single-client-anchored", "fresh-anchored",
                         "server-only"),
    "fedfiot-refined": ("fedavg-refined", "regmean-refined", "best-single-client-refined", "fresh-refined",
                        "server-only"),
}
"""FedFiOT's row under each form of the stage, and the rows it must beat (the same stage after every
rival; the server's labels alone have no clients to anchor to)."""


def margins(records: Sequence[dict[str, Any]]) -> str:
    """Markdown: per setting and form of the stage, FedFiOT's margin over the best rival, per seed and on the mean."""
    lines = ["| setting | FedFiOT row | seeds | FedFiOT | best rival (mean) | margin on the mean | margin per seed |",
             "|---|---|---|---|---|---|---|"]
    for c in sorted({_cell(r) for r in records}):
        for ours, rivals in RIVALS.items():
            acc = {(r["method"], r["seed"]): r["test_accuracy"] for r in records if _cell(r) == c}
            seeds = sorted(s for m, s in acc if m == ours and all((v, s) in acc for v in rivals))
            if not seeds:
                continue
            mean = {m: float(np.mean([acc[(m, s)] for s in seeds])) for m in (ours, *rivals)}
            best = max(rivals, key=lambda m: mean[m])
            per_seed = [100 * (acc[(ours, s)] - max(acc[(v, s)] for v in rivals)) for s in seeds]
            lines.append(f"| {c[0]} α={c[1]:g} {c[2]} E={c[3]} | {LABELS[ours]} | {len(seeds)} | {100 * mean[ours]:.1f} | "
                         f"{LABELS[best]} {100 * mean[best]:.1f} | {100 * (mean[ours] - mean[best]):+.1f} | "
                         + " / ".join(f"{m:+.1f}" for m in per_seed) + " |")
    return "\n".join(lines)


def markdown(records: Sequence[dict[str, Any]], command: str) -> str:
    """The results page: the table, then FedFiOT's margins."""
    lines = ["# Server data may also fit: the same refinement after every method", "", f"Command: `{command}`", "",
             table(records), "",
             "Test accuracy (%), mean ± sample std over the seeds run (n = 1 where no n is given). Every row: "
             "the same uploads, the same 250 fitting and 250 selection examples, the same `RefineOptions()` "
             "(the anchored rows: with the clients' Fisher anchor); `returned` in the JSON names the candidate "
             "the selection fold chose.", "",
             "## FedFiOT's margin over the best other row given the same stage", "",
             margins(records), "",
             "Points of test accuracy; a seed's margin is against the best rival on that seed."]
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
    p.add_argument("--anchor", nargs="+", type=float, default=list(RefineOptions().fisher_anchor),
                   help="Fisher-anchor strengths of the -anchored rows (default: RefineOptions()'s)")
    p.add_argument("--candidate-tests", action="store_true",
                   help="also record every refinement candidate's test accuracy (analysis only)")
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
