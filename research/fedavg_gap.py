"""Why can FedFiOT lose to FedAvg on the same uploads, and what fixes it?

Loads (or trains) the cached uploads of ``benchmarks/one_shot.py`` for each setting and merges them
with one remedy at a time, each with its knobs (rho x lam x reference, and the Fisher scaling where
it is the remedy) chosen on the server validation set. Reports validation and test accuracy per
remedy, the objective of the aligned vs the identity merge, and per-client Fisher mass (empirical,
and true when ``--true-fisher``), so that each candidate cause is measured, not assumed.

Run (after the one-shot runs that cached the uploads):

    .venv/bin/python research/fedavg_gap.py --alphas 0.1 0.2 --epochs 5 30 --seeds 0 1 2

Writes ``research/results/fedavg_gap.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from research import RESULTS_DIR  # noqa: E402
from fedfiot_flwr.fisher import diagonal_fisher  # noqa: E402
from fedfiot_flwr.server.config import FedFiOTConfig  # noqa: E402
from fedfiot_flwr.server.outcome import RoundContext  # noqa: E402
from fedfiot_flwr.server.selection import SweepGrid, sweep_candidates  # noqa: E402
from fedfiot_flwr.server.uploads import CollectedUploads  # noqa: E402

RHOS = (0.3, 0.5, 0.7)
WIDE_RHOS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7)
LAMS = (1e-3, 1e-5)

# name -> (matching, aggregation, fallback, rhos, fisher scalings, fedavg candidate, what it tests)
REMEDIES: dict[str, tuple[str, str, str, tuple[float, ...], tuple[str, ...], bool, str]] = {
    "fedavg": ("none", "size", "objective", (0.5,), ("none",), False, "baseline"),
    "fisher-merge": ("none", "fisher", "objective", (1.0,), ("none",), False, "baseline (raw Fisher)"),
    "identity": ("none", "fisher", "objective", RHOS, ("none",), False, "FedFiOT's identity merge alone (tempered)"),
    "paper": ("fisher", "fisher", "objective", RHOS, ("none",), False, "the paper: objective-based fallback"),
    "aligned": ("fisher", "fisher", "none", RHOS, ("none",), False, "aligned merge, never the fallback"),
    "validation-fallback": ("fisher", "fisher", "validation", RHOS, ("none",), False,
                            "fallback judged on validation accuracy"),
    "aligned-size": ("fisher", "fisher", "none", RHOS, ("size",), False, "aligned, Fisher x n_k / n"),
    "aligned-normalized": ("fisher", "fisher", "none", RHOS, ("normalized",), False,
                           "aligned, Fisher / client mean"),
    "aligned-normalized-size": ("fisher", "fisher", "none", RHOS, ("normalized-size",), False,
                                "aligned, normalized then x K n_k / n"),
    "aligned-wide-rho": ("fisher", "fisher", "none", WIDE_RHOS, ("none",), False,
                         "aligned, rho grid down to 0.05 (near-uniform weights)"),
    "own-default": ("fisher", "fisher", "validation", RHOS, ("none", "size"), False,
                    "default preset without the FedAvg candidate (its own merge)"),
    "default": ("fisher", "fisher", "validation", RHOS, ("none", "size"), True,
                "default preset: validation picks aligned / identity / FedAvg"),
}


def true_fisher_uploads(setting: H.Setting, split: Any, uploads: H.Uploads) -> CollectedUploads:
    """The same trained weights with the true (model) Fisher instead of the empirical one."""
    cfg = setting.app_config()
    q = uploads.quantized
    fishers = []
    for pid, weights in enumerate(q.weights):
        model = H.load_numpy(cfg.build_model(split), weights)
        loader = DataLoader(split.client_eval(pid), batch_size=256)
        fishers.append({k: v.numpy().astype(np.float64) for k, v in diagonal_fisher(model, loader, kind="true").items()})
    return CollectedUploads(client_ids=list(q.client_ids), weights=list(q.weights), fishers=fishers,
                            num_examples=list(q.num_examples), metrics=list(q.metrics))


def run_remedy(name: str, collected: CollectedUploads, uploads: H.Uploads, spec: Any, buffers: Any,
               ev: H.Evaluator) -> dict[str, Any]:
    matching, aggregation, fallback, rhos, scalings, fedavg_candidate, _ = REMEDIES[name]
    refs = ("largest", "broadcast") if uploads.broadcast is not None and matching != "none" else ("largest",)
    grid = SweepGrid(rhos, LAMS if name != "fedavg" else (1e-3,), refs, scalings)
    config = FedFiOTConfig(rho=rhos[len(rhos) // 2], lam=LAMS[0], fisher_scaling=scalings[0], matching=matching,
                           aggregation=aggregation, selection=fallback, sweep=grid, fedavg_candidate=fedavg_candidate)
    context = RoundContext(2 if "broadcast" in refs else 1, uploads.broadcast, tuple(buffers), ev.validate)
    out = sweep_candidates(collected, spec, config, context)
    _, test_acc = ev.test(out.model)
    res = out.engine_result
    return {
        "remedy": name, "test_accuracy": test_acc, "validation_accuracy": (out.validation or {}).get("accuracy"),
        "variant": out.variant, "knobs": out.candidate.label(),
        "objective_aligned": res.aligned_objective, "objective_identity": res.identity_objective,
        "paper_rule_keeps_aligned": bool(not res.aligned_objective > res.identity_objective),
        "fraction_permuted": float(np.mean(res.fraction_permuted)) if res.fraction_permuted else 0.0,
        "trials": len(out.trials), "seconds": out.seconds,
    }


def client_table(collected: CollectedUploads, true: CollectedUploads | None) -> list[dict[str, Any]]:
    rows = []
    for k, (n, f, m) in enumerate(zip(collected.num_examples, collected.fishers, collected.metrics)):
        row = {"client": k, "num_examples": n, "train_accuracy": m.get("train-accuracy"),
               "empirical_fisher_mass": float(sum(np.sum(v) for v in f.values()))}
        if true is not None:
            row["true_fisher_mass"] = float(sum(np.sum(v) for v in true.fishers[k].values()))
        rows.append(row)
    return rows


def markdown(payload: dict[str, Any]) -> str:
    recs = payload["records"]
    settings = sorted({(r["alpha"], r["epochs"], r["fisher"]) for r in recs})
    seeds = sorted({r["seed"] for r in recs})
    remedies = [n for n in REMEDIES if any(r["remedy"] == n for r in recs)]
    head = "| remedy | what it tests | " + " | ".join(f"α={a} E={e} {f}" for a, e, f in settings) + " |"
    lines = [
        "# FedFiOT against FedAvg on the same uploads", "",
        f"Command: `{payload['command']}`", "", f"Machine: {payload['machine']}; {payload['seconds'] / 60:.1f} min.", "",
        f"Fashion-MNIST, paper's CNN (28x28), K = 6, shared init, seeds {seeds}; knobs of every row chosen on the "
        "500-example validation set over rho x lam x reference (and the Fisher scaling where named). "
        "Test accuracy %, mean ± std over seeds.", "", head, "|---|---|" + "---|" * len(settings),
    ]
    for name in remedies:
        cells = []
        for a, e, f in settings:
            vals = [r["test_accuracy"] for r in recs if r["remedy"] == name and (r["alpha"], r["epochs"], r["fisher"]) == (a, e, f)]
            cells.append(H.fmt_pct(*H.mean_std(vals)) if vals else "")
        lines.append(f"| {name} | {REMEDIES[name][6]} | " + " | ".join(cells) + " |")
    lines += ["", "## The paper's fallback: aligned vs identity objective, and what validation says", "",
              "| setting | seed | J aligned | J identity | paper keeps aligned | aligned test % | identity test % | FedAvg test % |",
              "|---|---|---|---|---|---|---|---|"]
    for a, e, f in settings:
        for s in seeds:
            def get(name: str) -> dict[str, Any] | None:
                return next((r for r in recs if r["remedy"] == name and r["seed"] == s
                             and (r["alpha"], r["epochs"], r["fisher"]) == (a, e, f)), None)
            p, al, idn, fa = get("paper"), get("aligned"), get("identity"), get("fedavg")
            if p and al and idn and fa:
                lines.append(f"| α={a} E={e} {f} | {s} | {p['objective_aligned']:.4g} | {p['objective_identity']:.4g} | "
                             f"{p['paper_rule_keeps_aligned']} | {100 * al['test_accuracy']:.1f} | "
                             f"{100 * idn['test_accuracy']:.1f} | {100 * fa['test_accuracy']:.1f} |")
    lines += ["", "## Clients: size, local fit and Fisher mass", "",
              "| setting | seed | client | examples | train acc | empirical Fisher mass | true Fisher mass |",
              "|---|---|---|---|---|---|---|"]
    for c in payload["clients"]:
        lines.append(f"| α={c['alpha']} E={c['epochs']} | {c['seed']} | {c['client']} | {c['num_examples']} | "
                     f"{c['train_accuracy']:.3f} | {c['empirical_fisher_mass']:.3g} | "
                     f"{c.get('true_fisher_mass', float('nan')):.3g} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist")
    p.add_argument("--alphas", nargs="+", type=float, default=[0.1, 0.2])
    p.add_argument("--epochs", nargs="+", type=int, default=[5, 30])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--remedies", nargs="+", default=list(REMEDIES), choices=list(REMEDIES))
    p.add_argument("--true-fisher", action="store_true", help="also merge with the true Fisher of the same weights")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    p.add_argument("--name", default="fedavg_gap")
    args = p.parse_args(argv)
    H.set_threads(args.threads)
    log = H.setup_logging(True)
    start = time.perf_counter()
    recs: list[dict[str, Any]] = []
    clients: list[dict[str, Any]] = []
    model = H.DEFAULT_MODELS[args.dataset]
    for alpha in args.alphas:
        for epochs in args.epochs:
            for seed in args.seeds:
                setting = H.Setting(args.dataset, model, 6, alpha, "shared", seed, epochs,
                                    validation_size=200 if args.dataset == "digits" else 500)
                split = setting.app_config().split()
                build, spec, buffers = H.model_tools(setting, split)
                ev = H.Evaluator(split, build)
                uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, log=log)
                variants = [("empirical", uploads.quantized)]
                true = None
                if args.true_fisher:
                    true = true_fisher_uploads(setting, split, uploads)
                    variants.append(("true", true))
                for row in client_table(uploads.quantized, true):
                    clients.append({"alpha": alpha, "epochs": epochs, "seed": seed, **row})
                for fisher, collected in variants:
                    for name in args.remedies:
                        if fisher == "true" and name in ("fedavg",):
                            continue
                        rec = run_remedy(name, collected, uploads, spec, buffers, ev)
                        rec.update(alpha=alpha, epochs=epochs, seed=seed, fisher=fisher)
                        recs.append(rec)
                        log(f"α={alpha} E={epochs} seed {seed} {fisher:9s} {name:24s} test {100 * rec['test_accuracy']:5.1f}% "
                            f"val {100 * (rec['validation_accuracy'] or float('nan')):5.1f}% {rec['variant']:8s} {rec['knobs']}")
    payload = {"command": H.command_line(), "machine": H.machine_description(),
               "seconds": time.perf_counter() - start, "records": recs, "clients": clients}
    args.out.mkdir(parents=True, exist_ok=True)
    H.write_json(args.out / f"{args.name}.json", payload)
    (args.out / f"{args.name}.md").write_text(markdown(payload))
    log(f"wrote {args.out / (args.name + '.md')}")
    return payload


if __name__ == "__main__":
    main()
