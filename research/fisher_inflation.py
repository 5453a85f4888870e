"""Fisher inflation: how much one client that multiplies its Fisher can take over the merge.

For each data set the K clients are trained once (the one-shot benchmark's uploads, cached);
then one client at a time re-packs its upload with its Fisher multiplied by a factor (``1e3``,
``1e6``, or scaled to float32's largest value), replaced by a flat Fisher with every entry at
float32's largest value (``flat``), or inflated to just under the outlier rule's threshold
(``under``: every tensor at 0.95 ``c`` times the other clients' median, in mean or largest entry,
whichever binds first), and the round goes through the strategy's own
path: :func:`~fedfiot_flwr.server.uploads.collect_uploads` (the reply bounds: with a cap, any finite
Fisher is accepted; without one, a Fisher above ``MAX_FISHER_MAGNITUDE`` excludes the reply) and
the strategy's aggregator (:class:`~fedfiot_flwr.server.aggregators.FedFiOTAggregator`) with the
default preset (validation choice between the aligned merge, the identity merge and FedAvg), with
and without the robust Fisher cap (:func:`fedfiot_flwr.merge.robust.cap_fishers`, either rule). Reported: test
accuracy, the honest-run difference, the attacker's mean per-coordinate weight share (at the
chosen rho, lam) and whether the attacker was excluded by the reply bounds.

Run (digits, the app's default data, then Fashion-MNIST on the cached one-shot uploads):

    .venv/bin/python research/fisher_inflation.py --datasets digits fashion-mnist --cache-dir <cache-dir>

Outputs: ``research/results/fisher_inflation.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from research import RESULTS_DIR  # noqa: E402
from fedfiot_flwr.client import pack_reply  # noqa: E402
from fedfiot_flwr.merge.robust import (  # noqa: E402
    DEFAULT_FISHER_CAP,
    DEFAULT_FISHER_CAP_RULE,
    cap_fishers,
    weight_shares,
)
from fedfiot_flwr.server.aggregators import FedFiOTAggregator  # noqa: E402
from fedfiot_flwr.server.config import FedFiOTConfig  # noqa: E402
from fedfiot_flwr.server.uploads import collect_uploads  # noqa: E402

F32_MAX = float(np.finfo(np.float32).max)
FACTORS = {"1e3": 1e3, "1e6": 1e6, "f32max": None, "flat": "flat", "under": "under"}
"""Inflations: a factor; None: every tensor's largest entry at float32 max; "flat": every entry at float32
max; "under": just below the outlier threshold of the cap being measured."""
UNDER = 0.95
"""How close to the outlier threshold the ``under`` attacker stays."""
MODELS = {"digits": "mlp", "fashion-mnist": "fednet"}
VALIDATION = {"digits": 200, "fashion-mnist": 500}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=["digits"], choices=sorted(MODELS))
    p.add_argument("--factors", nargs="*", default=list(FACTORS), choices=list(FACTORS),
                   help="inflations (none: only the honest round of each cap)")
    p.add_argument("--caps", nargs="+", type=parse_cap, default=["none", f"{DEFAULT_FISHER_CAP_RULE}:{DEFAULT_FISHER_CAP:g}"],
                   help="caps to compare: 'none' (the paper's weighting), 'median:C' or 'outliers:C' "
                        "(a bare number C is 'median:C', 0 is 'none')")
    p.add_argument("--attackers", nargs="+", type=int, default=None, help="client indices (default: every client)")
    p.add_argument("--grid", choices=sorted(H.GRIDS), default="paper", help="rho x lam grid of the default preset")
    p.add_argument("--fashion-grid", choices=sorted(H.GRIDS), default="small",
                   help="grid on Fashion-MNIST (its CNN merges are slower)")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--alpha", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--init", choices=H.INITS, default="shared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default="fisher_inflation")
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args(argv)


def parse_cap(text: str) -> str:
    """``"none"``, ``"median:C"`` or ``"outliers:C"`` (a bare number ``C`` is ``"median:C"``, 0 is ``"none"``)."""
    rule, _, factor = text.rpartition(":")
    rule = rule or "median"
    if text == "none" or (not _ and float(text) == 0):
        return "none"
    if rule not in ("median", "outliers") or not float(factor) >= 1:
        raise argparse.ArgumentTypeError(f"not a cap: {text!r}")
    return f"{rule}:{float(factor):g}"


def cap_options(cap: str) -> tuple[float | None, str]:
    """``(fisher_cap, fisher_cap_rule)`` of a cap label."""
    if cap == "none":
        return None, DEFAULT_FISHER_CAP_RULE
    rule, factor = cap.split(":")
    return float(factor), rule


def under_threshold(fishers: Sequence[Mapping[str, np.ndarray]], k: int, factor: float) -> dict[str, np.ndarray]:
    """Client ``k``'s Fisher scaled, per tensor, to ``UNDER * factor`` times the other clients' median
    (mean or largest entry, whichever reaches it first): the largest inflation the outlier rule leaves alone."""
    out = {}
    for name, f in fishers[k].items():
        f64 = np.asarray(f, np.float64)
        others = [np.asarray(fishers[j][name], np.float64) for j in range(len(fishers)) if j != k]
        ref_mean = float(np.median([o.mean() for o in others]))
        ref_max = float(np.median([o.max() for o in others]))
        scale = min(ref_mean / max(f64.mean(), 1e-300), ref_max / max(f64.max(), 1e-300)) * UNDER * factor
        out[name] = f64 * scale
    return out


def inflated_reply(uploads: H.Uploads, k: int, factor: float | str | None, cap_factor: float | None = None) -> Any:
    """Client ``k``'s reply re-packed with its float32 Fisher inflated (see :data:`FACTORS`)."""
    weights, fisher = uploads.float32.weights[k], uploads.float32.fishers[k]
    if factor is None:
        big = {n: np.asarray(f, np.float64) / max(float(np.max(f)), 1e-30) * F32_MAX for n, f in fisher.items()}
    elif factor == "flat":
        big = {n: np.full(np.shape(f), F32_MAX) for n, f in fisher.items()}
    elif factor == "under":
        big = under_threshold(uploads.float32.fishers, k, cap_factor or 1.0)
    else:
        big = {n: np.asarray(f, np.float64) * float(factor) for n, f in fisher.items()}
    return pack_reply(weights, big, uploads.quantized.num_examples[k], uploads.quantized.metrics[k])


def run_scenario(uploads: H.Uploads, replies: list[Any], spec: Any, buffers: Sequence[str], config: FedFiOTConfig,
                 ev: H.Evaluator, cap: str, attacker: int | None) -> dict[str, Any]:
    """One round through the strategy's collection and its aggregator; the chosen model's test accuracy.

    ``config`` (the default preset) runs with the Fisher cap ``cap`` (a :func:`parse_cap` label) and every
    assignment solved (``certify=False``, as in the recorded results; certified assignments
    give the same permutations).
    """
    factor, rule = cap_options(cap)
    aggregator = FedFiOTAggregator(spec, replace(config, fisher_cap=factor, fisher_cap_rule=rule, certify=False))
    ids = [str(i) for i in range(len(replies))]
    expected = {k: tuple(np.shape(v)) for k, v in uploads.float32.weights[0].items()}
    collected = collect_uploads(list(zip(ids, replies)), expected, buffers, fisher_bound=aggregator.fisher_bound)
    t0 = time.perf_counter()
    outcome = aggregator.aggregate(collected, H.round_context(uploads, buffers, ev.validate))
    seconds = time.perf_counter() - t0
    _, acc = ev.test(outcome.model)
    _, own_acc = ev.test(outcome.own_model) if outcome.own_model is not None else (None, acc)
    fishers = cap_fishers(collected.fishers, factor, rule=rule) if factor else collected.fishers
    shares = weight_shares(fishers, outcome.candidate.rho, outcome.candidate.lam)
    excluded = attacker is not None and str(attacker) not in collected.client_ids
    share = 0.0 if attacker is None or excluded else float(shares[collected.client_ids.index(str(attacker))])
    return {
        "test_accuracy": float(acc), "own_test_accuracy": float(own_acc), "variant": outcome.variant,
        "candidate": outcome.candidate.label(), "attacker_share": share, "attacker_excluded": excluded,
        "max_share": float(np.max(shares)), "rejections": [r.reason[:160] for r in collected.rejections],
        "seconds": seconds,
    }


def run_dataset(dataset: str, args: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    setting = H.Setting(dataset, MODELS[dataset], args.clients, args.alpha, args.init, args.seed, args.epochs,
                        0, VALIDATION[dataset])
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, None, log)
    grid = args.grid if dataset == "digits" else args.fashion_grid
    config = H.method_config("fedfiot-default", args.init, grid)
    attackers = args.attackers if args.attackers is not None else list(range(args.clients))
    rows: list[dict[str, Any]] = []
    for cap in args.caps:
        scenarios: list[tuple[str, int | None]] = [("honest", None)]
        scenarios += [(f, a) for f in args.factors for a in attackers]
        for factor, attacker in scenarios:
            replies = list(uploads.replies)
            if attacker is not None:
                if factor == "under" and cap == "none":
                    continue  # no threshold to stay under
                replies[attacker] = inflated_reply(uploads, attacker, FACTORS[factor], cap_options(cap)[0])
            res = run_scenario(uploads, replies, spec, buffers, config, ev, cap, attacker)
            row = {"dataset": dataset, "cap": cap, "factor": factor, "attacker": attacker, "grid": grid, **res}
            rows.append(row)
            log(f"{dataset} cap={cap} {factor:6s} attacker={attacker}: test {100 * res['test_accuracy']:.1f}% "
                f"({res['variant']}, {res['candidate']}) share {100 * res['attacker_share']:.1f}%"
                f"{' EXCLUDED' if res['attacker_excluded'] else ''} [{res['seconds']:.1f}s]")
    return rows


def markdown(rows: list[dict[str, Any]], command: str, machine: str, wall: float) -> str:
    lines = [
        "# Fisher inflation",
        "",
        "One client re-packs its upload with its Fisher multiplied by 1e3, 1e6, scaled so that every tensor's "
        "largest entry is float32's maximum (f32max), replaced by a flat Fisher with every entry at float32's maximum "
        "(flat), or scaled to just under the cap's threshold (under: 0.95 c times the other clients' median); the "
        "round runs through the strategy's reply checks and the default preset's selection (aligned / identity / "
        "FedAvg on validation). `cap` is the robust weighting rule and factor (none: the paper's weighting; "
        "median: every client above c times the median scaled down to it; outliers: only a client more than c "
        "times the others' median mapped to the median client's values). Accuracy is on the test set; the loss is against the honest run with the "
        "same cap; the share is the attacker's mean per-coordinate merge weight at the chosen rho and lambda "
        "(1/K = honest share).",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine}. Wall time {wall / 60:.1f} min.",
        "",
        "| data set | cap | inflation | honest acc. | worst acc. | mean acc. | worst loss (pts) | attacker share "
        "(mean / max) | attacker excluded | FedAvg chosen |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (dataset, cap) in dict.fromkeys((r["dataset"], r["cap"]) for r in rows):
        honest = next(r for r in rows if r["dataset"] == dataset and r["cap"] == cap and r["attacker"] is None)
        lines.append(f"| {dataset} | {cap} | none | {100 * honest['test_accuracy']:.1f}% | | | | "
                     f"{100 * honest['max_share']:.1f}% (largest client) | | {honest['variant'] == 'fedavg'} |")
        for factor in dict.fromkeys(r["factor"] for r in rows if r["attacker"] is not None):
            sel = [r for r in rows if r["dataset"] == dataset and r["cap"] == cap and r["factor"] == factor
                   and r["attacker"] is not None]
            if not sel:
                continue
            accs = [r["test_accuracy"] for r in sel]
            shares = [r["attacker_share"] for r in sel]
            lines.append(
                f"| {dataset} | {cap} | {factor} | | {100 * min(accs):.1f}% | {100 * float(np.mean(accs)):.1f}% | "
                f"{100 * (honest['test_accuracy'] - min(accs)):.1f} | {100 * float(np.mean(shares)):.1f}% / "
                f"{100 * max(shares):.1f}% | {sum(r['attacker_excluded'] for r in sel)}/{len(sel)} | "
                f"{sum(r['variant'] == 'fedavg' for r in sel)}/{len(sel)} |")
    lines.append("")
    lines.append("With a cap, any finite Fisher is accepted and capped. Without one, an attacker whose Fisher exceeds "
                 "`MAX_FISHER_MAGNITUDE` is excluded by the reply bounds, which leaves exactly the honest merge of the "
                 "other K-1 clients: that row's loss is what losing the client's data costs, not what its Fisher does.")
    lines.append("")
    lines.append("Honest-run cost of the cap (default preset, cap against no cap):")
    lines.append("")
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        honest = {r["cap"]: r["test_accuracy"] for r in rows if r["dataset"] == dataset and r["attacker"] is None}
        if "none" in honest:
            for cap, acc in honest.items():
                if cap != "none":
                    lines.append(f"- {dataset}: cap {cap}: {100 * acc:.1f}% vs {100 * honest['none']:.1f}% "
                                 f"({100 * (acc - honest['none']):+.1f} points)")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    H.set_threads(args.threads)
    log = H.setup_logging(True)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for dataset in args.datasets:
        rows += run_dataset(dataset, args, log)
    wall = time.perf_counter() - t0
    payload = {"command": H.command_line(), "machine": H.machine_description(), "wall_seconds": wall, "rows": rows}
    H.write_results(args.out, args.name, payload, markdown(rows, payload["command"], payload["machine"], wall))
    log(f"wrote {args.out / args.name}.md/.json")


if __name__ == "__main__":
    main()
