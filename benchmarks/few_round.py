"""Few-round benchmark (the paper's Figure 2): accuracy, bytes and neurons moved per round.

T rounds (default 4), K = 6 clients, alpha = 0.1. Each method follows its own trajectory: its
merged model is broadcast and starts the next round's local training (clients recompute their
Fisher, or their Gram matrices for RegMean, every round). Round 1 starts every method from the
same uploads. Every round each method selects its own knobs on the server validation set (server
data only chooses: nothing is trained on it), with the previous global model offered as a
reference from round 2 on. FedAvg runs ``--fedavg-rounds`` (default 12) rounds on the same
clients: the yardstick for "how many FedAvg rounds buy what FedFiOT reaches in two or four".

Methods (``--methods``):

- ``fedavg``: Flower's FedAvg of the clients' float32 weights (32 bits per weight on the wire);
- ``fisher-merge``, ``fedfisher-diag``, ``regmean``: the same 16-bit uploads (RegMean: 16-bit
  weights + 8-bit rank-capped Grams, at most FedAvg's bytes);
- ``fedfiot``: the paper preset (objective rule for the identity fallback);
- ``fedfiot-default``: FedFiOT as a user gets it (validation picks aligned, identity or FedAvg);
- ``fedfiot-gram``, ``fedfiot-kfac`` (not run by default): the default preset with the Gram or the
  K-FAC curvature, the clients sending that reply every round.

With the full partitions, round 1 is the one-shot benchmark's round: its trained clients are read
from (and added to) ``--cache-dir``, so a method added later shares round 1 with the others.

``--ablations`` merges the uploads of one trajectory (``--ablate-on``, default
``fedfiot-default``) a second time with other methods, on the same clients of the same round, to
tell what does the work once the alignment stops moving neurons: ``fedfiot-default-noalign`` is the
default preset with the matching switched off (same tempering, cap, selection, FedAvg candidate).

"Neurons moved" is, for FedFiOT, the fraction of hidden neurons its kept merge permuted ("kept":
aligned, identity or fedavg); for the other methods it is what FedFiOT's alignment (default
knobs) would move on *their* uploads of that round: a gauge of how misaligned the clients are.

``--train-fraction`` keeps that fraction of each client's Dirichlet partition (the label skew is
kept; the server validation set and the test set are not touched), to fit the CPU budget.

Run:

    .venv/bin/python benchmarks/few_round.py --dataset fashion-mnist --epochs 5 --seeds 0 1 2 \\
        --train-fraction 0.1 --name few_round_fashion
    .venv/bin/python benchmarks/few_round.py --quick        # digits, 1 epoch, seconds

Outputs (``--out``, default ``benchmarks/results``): ``<name>.md``, ``<name>.json``, ``<name>.png``.
``--resume`` keeps the (init, seed, method) trajectories already in ``<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Subset

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from benchmarks.portable import portable_config  # noqa: E402
from fedfiot_flwr.data import FederatedSplit, canonical_name  # noqa: E402
from fedfiot_flwr.server.config import FedFiOTConfig  # noqa: E402
from fedfiot_flwr.task import default_device  # noqa: E402

FEW_ROUND_METHODS = ("fedavg", "fisher-merge", "regmean", "fedfisher-diag", "fedfiot", "fedfiot-default")
FEDFIOT_METHODS = ("fedfiot", "fedfiot-default", "fedfiot-default-noalign")
ABLATIONS = ("fedavg", "fisher-merge", "fedfiot-default-noalign")
DEFAULT_EPOCHS = {"digits": 20, "fashion-mnist": 5, "cifar10": 25, "svhn": 25, "cinic10": 25}
LABELS = {**H.METHOD_LABELS, "fedavg": "FedAvg (float32 uploads)",
          "fedfiot-default": "FedFiOT default (server data only chooses)",
          "fedfiot-default-noalign": "FedFiOT default without alignment"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--model", default=None, help=f"default per data set: {H.DEFAULT_MODELS}")
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--fedavg-rounds", type=int, default=12, help="FedAvg's own, longer trajectory (the yardstick)")
    p.add_argument("--epochs", type=int, default=None, help=f"local epochs per round (default {DEFAULT_EPOCHS})")
    p.add_argument("--seeds", nargs="+", type=int, default=[0], help="training seeds with a shared initialisation")
    p.add_argument("--independent-seeds", nargs="*", type=int, default=[],
                   help="training seeds with one initialisation per client in round 1")
    p.add_argument("--partition-seed", type=int, default=0)
    p.add_argument("--train-fraction", type=float, default=1.0, help="fraction of each client's partition kept")
    p.add_argument("--validation-size", type=int, default=None, help="default 500 (200 for digits)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--methods", nargs="+", default=list(FEW_ROUND_METHODS))
    p.add_argument("--ablations", nargs="*", default=list(ABLATIONS))
    p.add_argument("--ablate-on", default="fedfiot-default", help="the trajectory whose uploads the ablations merge")
    p.add_argument("--grid", choices=sorted(H.GRIDS), default="paper")
    p.add_argument("--fedfisher-steps", type=int, default=H.FEDFISHER_STEPS)
    p.add_argument("--data-root", default="")
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR,
                   help="the one-shot benchmark's cache of trained clients, read and filled for round 1")
    p.add_argument("--out", type=Path, default=H.RESULTS_DIR)
    p.add_argument("--name", default="few_round")
    p.add_argument("--resume", action="store_true", help="keep the trajectories already in <name>.json")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--quick", action="store_true", help="digits, 1 epoch, tiny grid, 50 FedFisher steps (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.dataset, args.grid = "digits", "tiny"
        args.epochs = args.epochs or 1
        args.fedfisher_steps = min(args.fedfisher_steps, 50)
    args.dataset = canonical_name(args.dataset)
    args.model = args.model or H.DEFAULT_MODELS[args.dataset]
    args.epochs = args.epochs or DEFAULT_EPOCHS[args.dataset]
    if args.validation_size is None:
        args.validation_size = 200 if args.dataset == "digits" else 500
    if args.rounds < 1 or args.fedavg_rounds < 1:
        p.error("--rounds and --fedavg-rounds must be >= 1")
    if not 0.0 < args.train_fraction <= 1.0:
        p.error("--train-fraction must be in (0, 1]")
    known = (*FEW_ROUND_METHODS, "fedfiot-default-noalign", "fedfiot-gram", "fedfiot-kfac")
    bad = [m for m in (*args.methods, *args.ablations) if m not in known]
    if bad:
        p.error(f"unknown methods {bad}; choose from {list(known)}")
    if args.ablations and args.ablate_on not in args.methods:
        p.error(f"--ablate-on {args.ablate_on!r} is not among --methods")
    return args


def keep_fraction(split: FederatedSplit, fraction: float, seed: int) -> FederatedSplit:
    """``split`` with a random ``fraction`` of each client's examples (at least one); the rest untouched."""
    if fraction >= 1.0:
        return split
    rng = np.random.default_rng(seed)
    indices = [np.sort(rng.choice(idx, size=max(1, round(fraction * len(idx))), replace=False))
               for idx in split.client_indices]
    return replace(split, client_indices=indices, clients=[Subset(split.bundle.train, idx.tolist()) for idx in indices])


def config_for(method: str, init: str, grid: str, server_round: int) -> FedFiOTConfig:
    """The configuration the aggregator runs for a merge-engine method in ``server_round``.

    ``fedfiot-default-noalign`` is the default preset with the matching switched off (same
    tempering, cap, selection and FedAvg candidate).
    """
    if method == "fedfiot-default-noalign":
        return replace(H.method_config("fedfiot-default", init, grid, server_round=server_round), matching="none")
    return H.method_config(method, init, grid, server_round=server_round)


def upload_for(method: str) -> str:
    """The uploads a method merges: FedAvg the float32 ones, as Flower's FedAvg; the others the 16-bit ones."""
    return "fp32" if method == "fedavg" else H.upload_of(method)


class Federation:
    """One setting's clients and server: trains the clients from a global model, merges their uploads with any method."""

    def __init__(self, args: argparse.Namespace, setting: H.Setting, split: FederatedSplit, state: dict[str, Any],
                 log: Callable[[str], None]) -> None:
        self.args, self.setting, self.split, self.log = args, setting, split, log
        self.cfg = setting.app_config()
        self.build, self.spec, self.buffers = H.model_tools(setting, split)
        self.device = state["device"]
        self.evaluator = H.Evaluator(split, self.build, self.device)

    def train(self, start: H.Model | None, server_round: int) -> H.Uploads:
        """Every client's round from ``start`` (None: each client's own random init)."""
        results = [H.train_client(self.cfg, self.split, pid, start, server_round, self.device)
                   for pid in range(self.setting.clients)]
        return H.collect(results, self.buffers, start)

    def merge(self, method: str, uploads: H.Uploads, server_round: int) -> dict[str, Any]:
        """Merge ``uploads`` with ``method``; the record (no model) and the model under ``"model"``."""
        ev = self.evaluator
        if method in H.CURVATURE_METHODS:
            res = H.apply_curvature_method(
                method, self.setting, self.split, uploads, self.build, self.buffers, ev.validate,
                self.args.fedfisher_steps, "empirical", cache_dir=None, device=self.device, log=self.log)
            rec = res.record()
            rec["upload_bytes_per_client"] = res.upload_bytes
            rec["alignment_fraction_permuted"] = H.fedfiot_alignment_fraction(uploads.quantized, self.spec, self.buffers)
            rec["kept"] = res.knobs.get("variant", "-")
        else:
            config = config_for(method, self.setting.init, self.args.grid, server_round)
            res = H.apply_method(method, config, uploads, self.spec, self.buffers, ev.validate,
                                 server_round=server_round, upload=upload_for(method))
            rec = res.record()
            if res.upload == "fp32":
                rec["upload_bytes_per_client"] = float(sum(np.asarray(v).nbytes for v in uploads.float32.weights[0].values()))
            else:
                rec["upload_bytes_per_client"] = float(np.mean(list(uploads.quantized.bytes_per_client.values())))
            if method in FEDFIOT_METHODS:
                rec["kept"] = res.knobs["variant"]
            else:
                rec["kept"] = "-"
                rec["alignment_fraction_permuted"] = H.fedfiot_alignment_fraction(
                    uploads.quantized, self.spec, self.buffers)
        t0 = time.perf_counter()
        rec["test_loss"], rec["test_accuracy"] = ev.test(res.model)
        rec["test_seconds"] = time.perf_counter() - t0
        rec["model"] = res.model
        return rec


def trajectory(federation: Federation, method: str, round1: H.Uploads, num_rounds: int, ablations: Sequence[str]) -> list[dict[str, Any]]:
    """``method``'s records over ``num_rounds`` rounds (plus the ablations merged on its uploads)."""
    records: list[dict[str, Any]] = []
    uploads, fields = round1, H.record_fields(federation.setting)
    for rnd in range(1, num_rounds + 1):
        if rnd > 1:
            uploads = federation.train(global_model, rnd)
        rec = federation.merge(method, uploads, rnd)
        global_model = rec.pop("model")
        base = {**fields, "round": rnd, "trajectory": method, "train_seconds": uploads.train_seconds,
                "fisher_seconds": uploads.fisher_seconds,
                "client_train_accuracy": [m.get("train-accuracy") for m in uploads.quantized.metrics]}
        records.append({**base, **rec})
        federation.log(f"  {method:24s} round {rnd:2d}: test {100 * rec['test_accuracy']:5.1f}%  "
                   f"val {100 * rec['validation_accuracy']:5.1f}%  {H.knob_text(rec['knobs']):30s} kept {rec['kept']:8s} "
                   f"moved {100 * rec['fraction_permuted']:4.1f}% (alignment {100 * rec['alignment_fraction_permuted']:4.1f}%)"
                   f"  {rec['sweep_seconds']:.0f}s")
        for other in ablations:
            arec = federation.merge(other, uploads, rnd)
            arec.pop("model")
            arec["ablation_of"] = arec["method"]
            records.append({**base, **arec, "method": f"ablation:{other}"})
            federation.log(f"    same clients, {other:24s}: test {100 * arec['test_accuracy']:5.1f}%  kept {arec['kept']}")
    return records


def run_setting(args: argparse.Namespace, init: str, seed: int, state: dict[str, Any], done: set[tuple[str, int, str]],
                log: Callable[[str], None], save: Callable[[list[dict[str, Any]]], None]) -> None:
    """Every method's trajectory for one initialisation and training seed (skipping those in ``done``)."""
    setting = H.Setting(args.dataset, args.model, args.clients, args.alpha, init, seed, args.epochs,
                        args.partition_seed, args.validation_size, args.batch_size, args.lr, args.data_root)
    split = keep_fraction(setting.app_config().split(), args.train_fraction, args.partition_seed)
    state["client_sizes"] = split.client_sizes  # the partition does not depend on the seed or the init
    todo = [m for m in args.methods if (init, seed, m) not in done]
    if not todo:
        return
    federation = Federation(args, setting, split, state, log)
    log(f"{args.dataset} a={args.alpha:g} {init} E={args.epochs} seed {seed}: clients hold {split.client_sizes}")
    if args.train_fraction >= 1.0:  # round 1 is the one-shot benchmark's round: its cached clients when there
        round1 = H.one_shot_uploads(setting, split, federation.buffers, cache_dir=args.cache_dir,
                                    device=federation.device, log=log)
    else:
        round1 = federation.train(H.shared_init(setting, split), 1)
    for method in todo:
        num_rounds = args.fedavg_rounds if method == "fedavg" else args.rounds
        ablations = args.ablations if method == args.ablate_on else ()
        save(trajectory(federation, method, round1, max(num_rounds, args.rounds), ablations))


# ---------------------------------------------------------------------------------------- report


def accuracy(recs: Sequence[dict[str, Any]], init: str, method: str, rnd: int) -> list[float]:
    """Test accuracies of ``method`` in round ``rnd`` over seeds."""
    return [r["test_accuracy"] for r in recs if r["init"] == init and r["method"] == method and r["round"] == rnd]


def rounds_to_reach(recs: Sequence[dict[str, Any]], init: str, seed: int, level: float) -> int | None:
    """First FedAvg round (of its long run) whose test accuracy reaches ``level``; None if none does."""
    curve = sorted((r["round"], r["test_accuracy"]) for r in recs
                   if r["init"] == init and r["seed"] == seed and r["method"] == "fedavg")
    return next((rnd for rnd, acc in curve if acc >= level), None)


def mean_curve(recs: Sequence[dict[str, Any]], init: str, method: str, rounds: int) -> tuple[list[float], list[float]]:
    """Per round mean and std (percent, std 0 for one seed) of ``method``'s test accuracy."""
    mus, sds = [], []
    for r in range(1, rounds + 1):
        mu, sd = H.mean_std(accuracy(recs, init, method, r))
        mus.append(100 * mu)
        sds.append(0.0 if math.isnan(sd) else 100 * sd)
    return mus, sds


def margin_rows(recs: Sequence[dict[str, Any]], init: str, methods: Sequence[str], rounds: int) -> list[str]:
    """Markdown rows: each FedFiOT method's mean margin over the best other method, per round."""
    rows = []
    rivals = [m for m in methods if m not in FEDFIOT_METHODS]
    for ours in (m for m in methods if m in FEDFIOT_METHODS):
        cells = []
        for rnd in range(1, rounds + 1):
            mine = H.mean_std(accuracy(recs, init, ours, rnd))[0]
            best = max(((H.mean_std(accuracy(recs, init, m, rnd))[0], m) for m in rivals), default=(math.nan, "-"))
            cells.append(f"{100 * (mine - best[0]):+.1f} ({LABELS.get(best[1], best[1])})")
        rows.append(f"| {LABELS.get(ours, ours)} | " + " | ".join(cells) + " |")
    return rows


def yardstick_lines(recs: Sequence[dict[str, Any]], init: str, seeds: Sequence[int], methods: Sequence[str],
                    rounds: int, fedavg_rounds: int) -> list[str]:
    """Markdown rows: FedAvg rounds needed to reach each FedFiOT method's round-2 and round-T accuracy, per seed."""
    lines = [f"| method | seed | " + " | ".join(f"round {r}: FedAvg rounds to match" for r in sorted({2, rounds}) if r <= rounds)
             + " |", "|---|---|" + "---|" * len([r for r in sorted({2, rounds}) if r <= rounds])]
    for ours in (m for m in methods if m in FEDFIOT_METHODS):
        for seed in seeds:
            cells = []
            for rnd in sorted({2, rounds}):
                if rnd > rounds:
                    continue
                level = next((r["test_accuracy"] for r in recs if r["init"] == init and r["seed"] == seed
                              and r["method"] == ours and r["round"] == rnd), math.nan)
                reach = rounds_to_reach(recs, init, seed, level) if math.isfinite(level) else None
                cells.append(f"{100 * level:.1f}%: " + (f"{reach}" if reach else f"> {fedavg_rounds}"))
            lines.append(f"| {LABELS.get(ours, ours)} | {seed} | " + " | ".join(cells) + " |")
    return lines


def markdown(payload: dict[str, Any], args: argparse.Namespace) -> str:
    recs = payload["records"]
    t = payload["timing"]
    lines = [
        "# Few-round benchmark",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Machine: {payload['machine']}. Wall time {t['wall_seconds'] / 60:.1f} min (client training "
        f"{t['train_seconds'] / 60:.1f} min, Fisher {t['fisher_seconds'] / 60:.1f} min, merges and validation "
        f"{t['merge_sweep_seconds'] / 60:.1f} min).",
        "",
        f"{args.dataset} ({args.model}), K = {args.clients}, α = {args.alpha:g}, {args.epochs} local epochs per round, "
        f"{100 * args.train_fraction:g}% of each client's partition ({payload['client_sizes']} examples), "
        f"{args.validation_size} server validation examples (they only choose), the full test set. Each method's model "
        f"starts its own next round; round 1 is the same uploads for every method.",
    ]
    for init, seeds in (("shared", args.seeds), ("independent", args.independent_seeds)):
        if not seeds or not any(r["init"] == init for r in recs):
            continue
        fa_rounds = max((r["round"] for r in recs if r["init"] == init and r["method"] == "fedavg"), default=args.rounds)
        cols = range(1, fa_rounds + 1)
        lines += ["", f"## {init.capitalize()} initialisation, seeds {list(seeds)}: test accuracy (%) per round", "",
                  "| method | " + " | ".join(f"round {r}" for r in cols) + " |", "|---|" + "---|" * len(cols)]
        for m in args.methods:
            cells = [H.fmt_pct(*H.mean_std(accuracy(recs, init, m, r))) for r in cols]
            lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(cells) + " |")
        lines += ["", "Margin of each FedFiOT row over the best other row (mean over seeds, points):", "",
                  "| method | " + " | ".join(f"round {r}" for r in range(1, args.rounds + 1)) + " |",
                  "|---|" + "---|" * args.rounds, *margin_rows(recs, init, args.methods, args.rounds)]
        if "fedavg" in args.methods:
            lines += ["", f"FedAvg rounds (of {fa_rounds}, same clients, same bytes per round) needed to reach FedFiOT's "
                      "accuracy:", "", *yardstick_lines(recs, init, seeds, args.methods, args.rounds, fa_rounds)]
        lines += ["", "Upload per client per round (kB, array payload):", "", "| method | kB |", "|---|---|"]
        for m in args.methods:
            b = [r["upload_bytes_per_client"] for r in recs if r["init"] == init and r["method"] == m]
            lines.append(f"| {LABELS.get(m, m)} | {np.mean(b) / 1e3:.0f} |" if b else f"| {LABELS.get(m, m)} | – |")
        lines += ["", "Hidden neurons moved (%) and the merge kept, per round (seeds joined by /). FedFiOT rows: by "
                  "the kept merge; in brackets what its alignment found. Other rows: what FedFiOT's alignment would "
                  "move on that method's uploads.", "",
                  "| method | " + " | ".join(f"round {r}" for r in range(1, args.rounds + 1)) + " |",
                  "|---|" + "---|" * args.rounds]
        for m in args.methods:
            cells = []
            for rnd in range(1, args.rounds + 1):
                xs = sorted((x for x in recs if x["init"] == init and x["method"] == m and x["round"] == rnd),
                            key=lambda x: x["seed"])
                found = H.fmt_pct(*H.mean_std([x["alignment_fraction_permuted"] for x in xs]))
                if m in FEDFIOT_METHODS:
                    moved = H.fmt_pct(*H.mean_std([x["fraction_permuted"] for x in xs]))
                    cells.append(f"{moved} ({found}); " + "/".join(x["kept"] for x in xs))
                else:
                    cells.append(found)
            lines.append(f"| {LABELS.get(m, m)} | " + " | ".join(cells) + " |")
        abl = sorted({r["method"] for r in recs if r["init"] == init and r["method"].startswith("ablation:")})
        if abl:
            base = next(r["trajectory"] for r in recs if r["method"] in abl)
            lines += ["", f"Ablation on the same clients ({LABELS.get(base, base)}'s uploads of each round, merged "
                      "again by other methods; test %, mean over seeds):", "",
                      "| merge of the same uploads | " + " | ".join(f"round {r}" for r in range(1, args.rounds + 1)) + " |",
                      "|---|" + "---|" * args.rounds]
            for m in (base, *abl):
                cells = [H.fmt_pct(*H.mean_std([x["test_accuracy"] for x in recs if x["init"] == init and x["method"] == m
                                                and x["round"] == r and x["trajectory"] == base]))
                         for r in range(1, args.rounds + 1)]
                name = m.split(":", 1)[-1]
                lines.append(f"| {LABELS.get(name, name)} | " + " | ".join(cells) + " |")
        lines += ["", "Knobs chosen on validation:", "", "| method | seed | " +
                  " | ".join(f"round {r}" for r in range(1, args.rounds + 1)) + " |", "|---|---|" + "---|" * args.rounds]
        for m in args.methods:
            for s in seeds:
                cells = [next((H.knob_text(x["knobs"]) for x in recs if x["init"] == init and x["method"] == m
                               and x["seed"] == s and x["round"] == r), "–") for r in range(1, args.rounds + 1)]
                lines.append(f"| {LABELS.get(m, m)} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(payload: dict[str, Any], args: argparse.Namespace) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = payload["records"]
    inits = [i for i, s in (("shared", args.seeds), ("independent", args.independent_seeds))
             if s and any(r["init"] == i for r in recs)]
    fig, axes = plt.subplots(1, len(inits), figsize=(6.5 * len(inits), 4.5), squeeze=False)
    for ax, init in zip(axes[0], inits):
        for m in args.methods:
            n = max((r["round"] for r in recs if r["init"] == init and r["method"] == m), default=0)
            mu, sd = mean_curve(recs, init, m, n)
            ax.errorbar(range(1, n + 1), mu, yerr=sd, marker="o", markersize=3, capsize=2,
                        linestyle="--" if m == "fedavg" else "-", label=LABELS.get(m, m))
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{init} init, seeds {list(args.seeds if init == 'shared' else args.independent_seeds)}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{args.dataset}, K={args.clients}, α={args.alpha:g}, {args.epochs} local epochs/round")
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
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    old = json.loads(path.read_text()) if args.resume and path.is_file() else {}
    payload: dict[str, Any] = {
        "command": H.command_line(argv, __file__), "machine": H.machine_description(),
        "config": portable_config(vars(args)), "records": list(old.get("records", [])),
        "wall_seconds_before": float(old.get("timing", {}).get("wall_seconds", 0.0)),
    }
    done = {(r["init"], r["seed"], r["trajectory"]) for r in payload["records"]}
    state: dict[str, Any] = {"device": default_device()}

    def write() -> None:
        recs = payload["records"]
        first = {(r["init"], r["seed"]): r for r in recs if r["round"] == 1}  # round 1 is trained once per seed
        later = [r for r in recs if r["round"] > 1 and not r["method"].startswith("ablation:")]
        payload["timing"] = {
            "wall_seconds": payload["wall_seconds_before"] + time.perf_counter() - start,
            "train_seconds": sum(r["train_seconds"] for r in [*first.values(), *later]),
            "fisher_seconds": sum(r["fisher_seconds"] for r in [*first.values(), *later]),
            "merge_sweep_seconds": sum(r["sweep_seconds"] + r.get("curvature_seconds", 0.0) for r in recs),
        }
        H.write_json(path, payload)

    def save(records: list[dict[str, Any]]) -> None:
        payload["records"].extend(records)
        write()

    for init, seeds in (("shared", args.seeds), ("independent", args.independent_seeds)):
        for seed in seeds:
            run_setting(args, init, seed, state, done, log, save)
    payload["client_sizes"] = state["client_sizes"]
    write()
    (args.out / f"{args.name}.md").write_text(markdown(payload, args))
    if not args.no_plots:
        plot(payload, args)
    log(f"done in {(time.perf_counter() - start) / 60:.1f} min; wrote {args.out / (args.name + '.md')}")
    return payload


if __name__ == "__main__":
    main()
