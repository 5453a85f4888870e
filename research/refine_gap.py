"""What each server-side refinement of FedFiOT's merge buys, one direction at a time, on cached uploads.

For each setting, the uploads of ``benchmarks/one_shot.py`` are loaded from the cache (trained
if absent) and FedFiOT's default merge is computed with its knobs chosen on the selection fold
(250 of the 500 validation examples). Then, each on the fitting fold (the other 250) only:

- ``uniform`` group: REPAIR and least squares toward the plain mean of the aligned clients' outputs;
- ``repair``: REPAIR's per-neuron rescaling (bias-free layers: scale only);
- ``ls-r<r>``: least-squares refinement toward the label-weighted mean of the aligned clients'
  outputs, ridge r;
- ``finetune`` group: distillation + cross-entropy fine-tuning checkpoints;
- ``repair+ls-r<r>``: both;
- ``aug-ls-r<r>``: least squares on the fitting fold plus augmented copies (shift, flip, mixup);
- ``noalign-ls-r<r>``: least squares from the identity (unaligned) merge;
- ``bary-ls-r<r>``: alignment re-run with the merge itself as the reference (not anchored to
  one client; a MergeMany-style fixed point), then least squares.

Every variant's test accuracy is reported (so one direction can be judged at a time), and the
variant picked on the selection fold within each group.

    .venv/bin/python research/refine_gap.py --alphas 0.1 0.2 --inits shared independent --seeds 0

Writes ``research/results/refine_gap.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from benchmarks import server_methods as S  # noqa: E402
from research import RESULTS_DIR  # noqa: E402
from fedfiot_flwr.merge import MergeOptions, merge, prepare_clients  # noqa: E402
from fedfiot_flwr.refine import ClientModels, Folds, RefineOptions, refine_merged_model  # noqa: E402


def run_setting(setting: H.Setting, args: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    sel_ev = S.selection_evaluator(split, build)
    uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, log=log)
    q = uploads.quantized
    base = H.record_fields(setting)
    recs: list[dict[str, Any]] = []

    def add(group: str, variant: str, model: dict[str, np.ndarray], sel: float, seconds: float, **extra: Any) -> None:
        _, acc = ev.test(model)
        recs.append({**base, "group": group, "variant": variant, "test_accuracy": acc, "selection_accuracy": sel,
                     "seconds": seconds, **extra})
        log(f"  {group:10s} {variant:20s} test {100 * acc:5.1f}%  sel {100 * sel:5.1f}%  {seconds:5.1f}s")

    t0 = time.perf_counter()
    outcome = S.fedfiot_merge_on_fold(uploads, spec, buffers, sel_ev, args.grid, setting.init)
    merge_seconds = time.perf_counter() - t0
    res = outcome.engine_result
    frac = float(np.mean(res.fraction_permuted)) if res.fraction_permuted else 0.0
    perms = res.permutations if outcome.variant == "aligned" else None
    add("merge", f"fedfiot ({outcome.variant})", outcome.model, sel_ev.validate(outcome.model)["accuracy"],
        merge_seconds, fraction_permuted=frac, knobs=outcome.candidate.label())
    fit_loader, select_loader = S.fold_loaders(split)
    ridges = tuple(args.ridges)

    def group(name: str, merged: dict[str, np.ndarray], permutations: Any, options: RefineOptions) -> None:
        t = time.perf_counter()
        _, report = refine_merged_model(merged, ClientModels(q.weights, spec, permutations, q.num_examples), build(),
                                        Folds(fit_loader, select_loader), options=options)
        per = (time.perf_counter() - t) / max(1, len(report.candidates) - 1)
        for variant, model in report.candidates.items():
            if variant == "merged":
                continue
            add(name, variant, model, report.selection_accuracy[variant], per,
                fit_errors=report.fit_errors.get(variant), chosen=report.chosen)

    common = dict(client_candidates=False, keep_candidates=True, seed=setting.seed, finetune_epochs=0,
                  target_weights="label")
    group("uniform", outcome.model, perms,
          RefineOptions(ridges=ridges, repair=True, **{**common, "target_weights": "uniform"}))
    group("aligned", outcome.model, perms, RefineOptions(ridges=ridges, repair=True, **common))
    if args.finetune_epochs:
        group("finetune", outcome.model, perms,
              RefineOptions(ridges=ridges[-1:], **{**common, "finetune_epochs": args.finetune_epochs}))
    if args.augment:
        group("augmented", outcome.model, perms,
              RefineOptions(ridges=ridges, repair=False, augment_copies=args.augment, **common))
    if outcome.variant == "aligned":
        group("noalign", res.identity_model, None, RefineOptions(ridges=ridges, **common))
    # Alignment not anchored to one client: re-align every client to the merge itself.
    t = time.perf_counter()
    cand = outcome.candidate
    bary = outcome.model
    clients = prepare_clients(q.weights, q.fishers, buffers=buffers, num_examples=q.num_examples)
    for _ in range(args.bary_iters):
        r2 = merge(clients, None, spec, MergeOptions(lam=cand.lam, rho=cand.rho, reference=bary, fallback="none",
                                                     fisher_scaling=cand.fisher_scaling))
        bary, bperms = r2.model, r2.permutations
    add("bary", "merge", bary, sel_ev.validate(bary)["accuracy"], time.perf_counter() - t,
        fraction_permuted=float(np.mean(r2.fraction_permuted)))
    group("bary", bary, bperms, RefineOptions(ridges=ridges, **common))
    for r in S.floors_and_ceilings(uploads, build, ev, ["best-single-client", "ensemble", "mean-client"]):
        recs.append({**base, "group": "reference", "variant": r["method"], "test_accuracy": r["test_accuracy"],
                     "selection_accuracy": r["validation_accuracy"], "seconds": r["sweep_seconds"]})
        log(f"  reference  {r['method']:20s} test {100 * r['test_accuracy']:5.1f}%")
    return recs


def markdown(payload: dict[str, Any]) -> str:
    recs = payload["records"]
    cols = []
    for r in recs:
        c = (r["alpha"], r["init"], r["epochs"])
        if c not in cols:
            cols.append(c)
    rows = []
    for r in recs:
        k = (r["group"], r["variant"] if not r["variant"].startswith("fedfiot (") else "fedfiot merge")
        if k not in rows:
            rows.append(k)
    seeds = sorted({r["seed"] for r in recs})
    lines = ["# Server-side refinement of FedFiOT's merge, one direction at a time", "",
             f"Command: `{payload['command']}`", "", f"Machine: {payload['machine']}; {payload['seconds'] / 60:.1f} min.", "",
             f"Fashion-MNIST, paper's CNN, K = 6, seeds {seeds}. Validation: 250 fitting / 250 selection examples "
             "(seeded split). Test accuracy %, mean ± std over seeds; `sel` = selection-fold accuracy; "
             "seconds per variant (server, this machine).", "",
             "| group | variant | " + " | ".join(f"α={a} {i} E={e}" for a, i, e in cols) + " | s |",
             "|---|---|" + "---|" * len(cols) + "---|"]
    for g, v in rows:
        cells, secs = [], []
        for c in cols:
            rs = [r for r in recs if r["group"] == g and (r["variant"] == v or (v == "fedfiot merge" and r["variant"].startswith("fedfiot (")))
                  and (r["alpha"], r["init"], r["epochs"]) == c]
            secs += [r["seconds"] for r in rs]
            if not rs:
                cells.append("–")
                continue
            t = H.fmt_pct(*H.mean_std([r["test_accuracy"] for r in rs]))
            s = H.mean_std([r["selection_accuracy"] for r in rs])[0]
            cells.append(f"{t} (sel {100 * s:.1f})" if s == s else t)
        lines.append(f"| {g} | {v} | " + " | ".join(cells) + f" | {np.mean(secs):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default="fednet")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--validation-size", type=int, default=500)
    p.add_argument("--alphas", nargs="+", type=float, default=[0.1, 0.2])
    p.add_argument("--inits", nargs="+", default=["shared", "independent"])
    p.add_argument("--epochs", nargs="+", type=int, default=[5])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--ridges", nargs="+", type=float, default=[1e-3, 1e-2, 1e-1, 1.0])
    p.add_argument("--augment", type=int, default=3, help="augmented copies for the 'augmented' group (0: skip)")
    p.add_argument("--bary-iters", type=int, default=2)
    p.add_argument("--finetune-epochs", type=int, default=10)
    p.add_argument("--grid", default="small")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    p.add_argument("--name", default="refine_gap")
    args = p.parse_args(argv)
    H.set_threads(args.threads)
    log = H.setup_logging(True)
    start = time.perf_counter()
    payload: dict[str, Any] = {"command": H.command_line(), "machine": H.machine_description(), "records": []}
    for alpha in args.alphas:
        for init in args.inits:
            for epochs in args.epochs:
                for seed in args.seeds:
                    setting = H.Setting(args.dataset, args.model, args.clients, alpha, init, seed, epochs,
                                        validation_size=args.validation_size)
                    log(f"{setting.column()} seed {seed}")
                    payload["records"] += run_setting(setting, args, log)
                    payload["seconds"] = time.perf_counter() - start
                    H.write_results(args.out, args.name, payload, markdown(payload))
    log(f"wrote {args.out / (args.name + '.md')}")
    return payload


if __name__ == "__main__":
    main()
