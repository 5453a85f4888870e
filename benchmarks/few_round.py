"""Few-round benchmark (the paper's Figures 2 and 4): accuracy and neurons permuted per round.

T rounds (default 4), K = 6 clients, alpha = 0.1. Each method follows its own trajectory: the
merged model is broadcast and initialises the next round's local training (clients recompute
their Fisher every round). Round 1 starts every method from the same uploads (the one-shot
benchmark's cached uploads of the same setting). Every round each method selects its own knobs
on the server validation set, with the previous global model offered as a reference from
round 2 on.

"Fraction permuted" is, for FedFiOT, the fraction of hidden neurons its chosen merge moved; for
FedAvg and Fisher merging (which never permute) it is what FedFiOT's alignment (default knobs)
would move on *their* uploads of that round: a gauge of how misaligned the clients are.

Run:

    .venv/bin/python benchmarks/few_round.py --dataset fashion-mnist --rounds 4 --epochs 2
    .venv/bin/python benchmarks/few_round.py --quick        # digits, 1 epoch, seconds

Outputs (``--out``, default ``benchmarks/results``): ``<name>.md``, ``<name>.json``, ``<name>.png``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from benchmarks.portable import portable_config  # noqa: E402
from fedfiot_flwr.data import canonical_name  # noqa: E402
from fedfiot_flwr.task import default_device  # noqa: E402

FEW_ROUND_METHODS = ("fedavg", "fisher-merge", "fedfiot")
DEFAULT_EPOCHS = {"digits": 20, "fashion-mnist": 2, "cifar10": 25, "svhn": 25, "cinic10": 25}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default=None, help=f"default per data set: {H.DEFAULT_MODELS}")
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--epochs", type=int, default=None, help=f"local epochs per round (default {DEFAULT_EPOCHS})")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--init", choices=H.INITS, default="shared", help="round-1 initialisation")
    p.add_argument("--partition-seed", type=int, default=0)
    p.add_argument("--validation-size", type=int, default=None, help="default 500 (200 for digits)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--methods", nargs="+", default=list(FEW_ROUND_METHODS))
    p.add_argument("--grid", choices=sorted(H.GRIDS), default="paper")
    p.add_argument("--data-root", default="")
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR, help="round-1 uploads (shared with one_shot.py)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--out", type=Path, default=H.RESULTS_DIR)
    p.add_argument("--name", default="few_round")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--quick", action="store_true", help="digits, 1 epoch, tiny grid (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.dataset, args.grid = "digits", "tiny"
        args.epochs = args.epochs or 1
    args.dataset = canonical_name(args.dataset)
    args.model = args.model or H.DEFAULT_MODELS[args.dataset]
    args.epochs = args.epochs or DEFAULT_EPOCHS[args.dataset]
    if args.validation_size is None:
        args.validation_size = 200 if args.dataset == "digits" else 500
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def run_seed(args: argparse.Namespace, seed: int, state: dict[str, Any], log: Any) -> list[dict[str, Any]]:
    """All methods' trajectories for one training seed."""
    setting = H.Setting(args.dataset, args.model, args.clients, args.alpha, args.init, seed, args.epochs,
                        args.partition_seed, args.validation_size, args.batch_size, args.lr, args.data_root)
    cfg = setting.app_config()
    split = cfg.split()
    build, spec, buffers = H.model_tools(setting, split)
    if "evaluator" not in state:
        state["evaluator"] = H.Evaluator(split, build, state["device"])
    ev: H.Evaluator = state["evaluator"]
    round1 = H.one_shot_uploads(setting, split, buffers, None if args.no_cache else args.cache_dir, state["device"], log)
    records = []
    for method in args.methods:
        uploads = round1
        for rnd in range(1, args.rounds + 1):
            if rnd > 1:
                results = [H.train_client(cfg, split, pid, uploads_global, rnd, state["device"]) for pid in range(args.clients)]
                uploads = H.collect(results, buffers, uploads_global)
            plan = H.method_plans([method], setting.init, args.grid, server_round=rnd)[0]
            res = H.apply_method(plan, uploads, spec, buffers, ev.validate, server_round=rnd)
            t0 = time.perf_counter()
            res.test_loss, res.test_accuracy = ev.test(res.model)
            res.test_seconds = time.perf_counter() - t0
            rec = {**H.record_fields(setting), **res.record(), "round": rnd,
                   "train_seconds": uploads.train_seconds, "fisher_seconds": uploads.fisher_seconds,
                   "client_train_accuracy": [m.get("train-accuracy") for m in uploads.quantized.metrics]}
            if method != "fedfiot":  # FedFiOT's alignment on this method's uploads, as a misalignment gauge
                rec["alignment_fraction_permuted"] = H.fedfiot_alignment_fraction(uploads.quantized, spec, buffers)
                rec["gauge"] = "fedfiot alignment (rho 0.5, lam 1e-4, largest) on these uploads"
            records.append(rec)
            log(f"  {method:13s} round {rnd}: test {100 * res.test_accuracy:5.1f}%  val {100 * res.validation_accuracy:5.1f}%  "
                f"{H.knob_text(res.knobs):28s} permuted {100 * res.fraction_permuted:4.1f}% "
                f"(alignment {100 * rec['alignment_fraction_permuted']:4.1f}%)  sweep {res.sweep_seconds:.1f}s")
            uploads_global = res.model
    return records


def series(records: Sequence[dict[str, Any]], method: str, key: str, rounds: int) -> tuple[list[float], list[float]]:
    """Per round mean and std over seeds of ``key`` (percent)."""
    mus, sds = [], []
    for r in range(1, rounds + 1):
        mu, sd = H.mean_std([x[key] for x in records if x["method"] == method and x["round"] == r])
        mus.append(100 * mu)
        sds.append(0.0 if math.isnan(sd) else 100 * sd)
    return mus, sds


def markdown(payload: dict[str, Any], args: argparse.Namespace) -> str:
    recs = payload["records"]
    rounds = range(1, args.rounds + 1)
    t = payload["timing"]
    lines = [
        "# Few-round benchmark",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Machine: {payload['machine']}. Started {payload['started']}; wall time {t['wall_seconds'] / 60:.1f} min "
        f"(client training {t['train_seconds'] / 60:.1f} min, Fisher {t['fisher_seconds'] / 60:.1f} min, merge + "
        f"validation sweeps {t['merge_sweep_seconds'] / 60:.1f} min).",
        "",
        f"{args.dataset} ({args.model}), K = {args.clients}, α = {args.alpha:g}, {args.epochs} local epochs per round, "
        f"{args.init} initialisation in round 1, seeds {args.seeds}.",
        "",
        "## Test accuracy (%) per round",
        "",
        "| method | " + " | ".join(f"round {r}" for r in rounds) + " |",
        "|---|" + "---|" * len(rounds),
    ]
    for m in args.methods:
        cells = [H.fmt_pct(*H.mean_std([x["test_accuracy"] for x in recs if x["method"] == m and x["round"] == r])) for r in rounds]
        lines.append(f"| {H.METHOD_LABELS.get(m, m)} | " + " | ".join(cells) + " |")
    lines += ["", "## Hidden neurons permuted (%) per round", "",
              "FedFiOT: by its chosen merge (alignment found, in brackets, when the identity fallback was taken). "
              "FedAvg / Fisher merging: what FedFiOT's alignment would move on that method's uploads.", "",
              "| method | " + " | ".join(f"round {r}" for r in rounds) + " |", "|---|" + "---|" * len(rounds)]
    for m in args.methods:
        cells = []
        for r in rounds:
            xs = [x for x in recs if x["method"] == m and x["round"] == r]
            a = H.fmt_pct(*H.mean_std([x["alignment_fraction_permuted"] for x in xs]))
            if m == "fedfiot":
                f = H.fmt_pct(*H.mean_std([x["fraction_permuted"] for x in xs]))
                cells.append(f if f == a else f"{f} ({a})")
            else:
                cells.append(a)
        lines.append(f"| {H.METHOD_LABELS.get(m, m)} | " + " | ".join(cells) + " |")
    lines += ["", "## Knobs chosen on validation", "", "| method | seed | " + " | ".join(f"round {r}" for r in rounds) + " |",
              "|---|---|" + "---|" * len(rounds)]
    for m in args.methods:
        for s in args.seeds:
            cells = [next((H.knob_text(x["knobs"]) for x in recs if x["method"] == m and x["seed"] == s and x["round"] == r), "–")
                     for r in rounds]
            lines.append(f"| {H.METHOD_LABELS.get(m, m)} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], args: argparse.Namespace) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = payload["records"]
    rounds = list(range(1, args.rounds + 1))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for m in args.methods:
        mu, sd = series(recs, m, "test_accuracy", args.rounds)
        a1.errorbar(rounds, mu, yerr=sd, marker="o", capsize=3, label=H.METHOD_LABELS.get(m, m))
        key = "fraction_permuted" if m == "fedfiot" else "alignment_fraction_permuted"
        mu, sd = series(recs, m, key, args.rounds)
        a2.errorbar(rounds, mu, yerr=sd, marker="o", capsize=3, linestyle="-" if m == "fedfiot" else "--",
                    label=H.METHOD_LABELS.get(m, m) + ("" if m == "fedfiot" else " (FedFiOT alignment on its uploads)"))
    a1.set_xlabel("round")
    a1.set_ylabel("test accuracy (%)")
    a1.set_xticks(rounds)
    a1.legend(fontsize=8)
    a2.set_xlabel("round")
    a2.set_ylabel("hidden neurons permuted (%)")
    a2.set_xticks(rounds)
    a2.legend(fontsize=7)
    fig.suptitle(f"{args.dataset}, K={args.clients}, α={args.alpha:g}, {args.epochs} local epochs/round, {args.init} init")
    fig.tight_layout()
    path = args.out / f"{args.name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON payload (also written to ``--out``)."""
    args = parse_args(argv)
    H.set_threads(args.threads)
    log = H.setup_logging(not args.quiet)
    start = time.perf_counter()
    payload: dict[str, Any] = {
        "command": H.command_line(argv, __file__),
        "machine": H.machine_description(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": portable_config(vars(args)), "records": [],
    }
    state: dict[str, Any] = {"device": default_device()}
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        log(f"{args.dataset} a={args.alpha:g} {args.init} E={args.epochs} seed {seed}: {args.rounds} rounds")
        payload["records"].extend(run_seed(args, seed, state, log))
    recs = payload["records"]
    # Round-1 uploads are shared by all methods: count their training once per seed.
    first = {(r["seed"]): r for r in recs if r["round"] == 1}
    later = [r for r in recs if r["round"] > 1]
    payload["timing"] = {
        "wall_seconds": time.perf_counter() - start,
        "train_seconds": sum(r["train_seconds"] for r in [*first.values(), *later]),
        "fisher_seconds": sum(r["fisher_seconds"] for r in [*first.values(), *later]),
        "merge_sweep_seconds": sum(r["sweep_seconds"] for r in recs),
        "test_seconds": sum(r["test_seconds"] for r in recs),
    }
    H.write_json(args.out / f"{args.name}.json", payload)
    (args.out / f"{args.name}.md").write_text(markdown(payload, args))
    if not args.no_plots:
        plot(payload, args)
    log(f"done in {(time.perf_counter() - start) / 60:.1f} min; wrote {args.out / (args.name + '.md')}")
    return payload


if __name__ == "__main__":
    main()
