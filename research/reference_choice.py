"""Where FedFiOT's alignment starts: every client as the reference, and the merge's own identity merge.

The paper starts each layer's alternating minimisation from the largest client (one-shot). With
independent initialisations the merge then lives in that client's neuron order, so the reference
decides much of what the merge can reach. On cached one-shot uploads, for a few knob settings,
this runs the aligned merge (no identity fallback) from

- every client in turn (``ref=k``), with its full-model objective ``J``, its selection-fold and
  test accuracy, and each client's own model's accuracy next to it;
- the identity merge itself (``ref=identity``: the Fisher-weighted average of the unaligned
  clients, a start anchored to no client), next to that identity merge unaligned (``ref=none``),

and reports what the reference rules would return: the paper's (the largest client, then its
identity rule), the lowest objective (data-free), and the best validation accuracy (the server
data selects only).

    .venv/bin/python research/reference_choice.py --inits independent shared --seeds 0

Writes ``research/results/reference_choice.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from research import writing_here  # noqa: E402
from fedfiot_flwr.merge import MergeOptions, merge, prepare_clients  # noqa: E402

KNOBS = ((0.5, 1e-3, "size"), (0.3, 1e-3, "none"), (0.7, 1e-3, "size"))
"""(rho, lam, Fisher scaling) settings, each run from every reference."""


def run_setting(setting: H.Setting, args: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    """Every reference at every knob setting of one cell."""
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    q = H.one_shot_uploads(setting, split, buffers, args.cache_dir, None, log).quantized
    clients = prepare_clients(q.weights, q.fishers, buffers=buffers, num_examples=q.num_examples, checked=True)
    base = H.record_fields(setting)
    own = [(ev.validate(w)["accuracy"], ev.test(w)[1]) for w in q.weights]
    largest = int(np.argmax(q.num_examples))
    rows: list[dict[str, Any]] = []
    for rho, lam, scaling in KNOBS[:args.knobs]:
        identity = None
        for ref in [*range(len(q.weights)), "identity"]:
            t0 = time.perf_counter()
            reference = identity if ref == "identity" else ref
            res = merge(clients, None, spec,
                        MergeOptions(lam=lam, rho=rho, reference=reference, fisher_scaling=scaling, fallback="none"))
            if identity is None:  # the identity merge (no alignment), what the paper's rule may fall back to
                identity = res.identity_model
                rows.append({**base, "rho": rho, "lam": lam, "fisher_scaling": scaling, "reference": "none",
                             "largest": False, "objective": res.identity_objective,
                             "identity_objective": res.identity_objective, "fraction_permuted": 0.0,
                             "validation_accuracy": ev.validate(identity)["accuracy"],
                             "test_accuracy": ev.test(identity)[1], "client_validation_accuracy": None,
                             "client_test_accuracy": None, "seconds": 0.0})
            val, test = ev.validate(res.aligned_model)["accuracy"], ev.test(res.aligned_model)[1]
            row = {**base, "rho": rho, "lam": lam, "fisher_scaling": scaling, "reference": ref,
                   "largest": ref == largest, "objective": res.aligned_objective,
                   "identity_objective": res.identity_objective,
                   "fraction_permuted": float(np.mean(res.fraction_permuted)),
                   "validation_accuracy": val, "test_accuracy": test,
                   "client_validation_accuracy": own[ref][0] if isinstance(ref, int) else None,
                   "client_test_accuracy": own[ref][1] if isinstance(ref, int) else None,
                   "seconds": time.perf_counter() - t0}
            rows.append(row)
            log(f"  rho={rho} lam={lam:g} {scaling:4s} ref={ref}: J {res.aligned_objective:.4g} "
                f"(identity {res.identity_objective:.4g}), moved {100 * row['fraction_permuted']:.1f}%, "
                f"val {100 * val:.1f}% test {100 * test:.1f}%")
    return rows


def rule_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What each reference rule returns, per cell, seed and knob setting."""
    out = []
    keys = dict.fromkeys((r["alpha"], r["init"], r["seed"], r["rho"], r["lam"], r["fisher_scaling"]) for r in rows)
    for key in keys:
        group = [r for r in rows if (r["alpha"], r["init"], r["seed"], r["rho"], r["lam"], r["fisher_scaling"]) == key]
        clients = [r for r in group if isinstance(r["reference"], int)]
        paper = next(r for r in clients if r["largest"])
        unaligned = next(r for r in group if r["reference"] == "none")
        chosen = {
            "largest client (the paper)": next(r for r in clients if r["largest"]),
            "lowest objective": min(clients, key=lambda r: r["objective"]),
            "best validation": max(clients, key=lambda r: r["validation_accuracy"]),
            "identity merge": next(r for r in group if r["reference"] == "identity"),
            "no alignment": unaligned,
            # the paper's identity rule on the largest client's merge: kept only if it lowers the objective
            "the paper's rule": paper if paper["objective"] < unaligned["objective"] else unaligned,
        }
        best_client = max(clients, key=lambda r: r["client_validation_accuracy"])
        out.append({"key": key, "chosen": {k: (v["reference"], v["test_accuracy"]) for k, v in chosen.items()},
                    "best_reference_test": max(r["test_accuracy"] for r in clients),
                    "best_client": (best_client["reference"], best_client["client_test_accuracy"])})
    return out


def markdown(payload: dict[str, Any]) -> str:
    rows = payload["rows"]
    lines = [
        "# Where the alignment starts: the reference",
        "",
        "Aligned merge (no identity fallback) of the same cached uploads from every client as the reference, and "
        "from the identity merge (the Fisher-weighted average of the unaligned clients); test and validation "
        "accuracy in %.",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Machine: {payload['machine']}. Wall time {payload['seconds'] / 60:.1f} min.",
        "",
        "## What each reference rule returns",
        "",
        "| cell | seed | ρ, λ, scaling | largest client (the paper) | the paper's identity rule on it | no alignment "
        "| lowest objective (data-free) | best validation | identity merge as reference | best of the references "
        "| best single client (chosen on validation) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rule_rows(rows):
        alpha, init, seed, rho, lam, scaling = r["key"]
        c = r["chosen"]

        def cell(name: str) -> str:
            ref, acc = c[name]
            return f"{100 * acc:.1f} (ref {ref})"

        paper_rule = cell("the paper's rule")
        lines.append(f"| α={alpha:g} {init} | {seed} | {rho:g}, {lam:g}, {scaling} | {cell('largest client (the paper)')} "
                     f"| {paper_rule} | {100 * c['no alignment'][1]:.1f} | {cell('lowest objective')} "
                     f"| {cell('best validation')} | {cell('identity merge')} "
                     f"| {100 * r['best_reference_test']:.1f} | {100 * r['best_client'][1]:.1f} "
                     f"(client {r['best_client'][0]}) |")
    lines += ["", "## Every reference", "",
              "| cell | seed | ρ, λ, scaling | reference | J | identity J | moved (%) | val | test | the reference "
              "client alone (val / test) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        alone = ("" if r["client_test_accuracy"] is None else
                 f"{100 * r['client_validation_accuracy']:.1f} / {100 * r['client_test_accuracy']:.1f}")
        lines.append(f"| α={r['alpha']:g} {r['init']} | {r['seed']} | {r['rho']:g}, {r['lam']:g}, {r['fisher_scaling']} "
                     f"| {r['reference']}{' (largest)' if r['largest'] else ''} | {r['objective']:.4g} "
                     f"| {r['identity_objective']:.4g} | {100 * r['fraction_permuted']:.1f} "
                     f"| {100 * r['validation_accuracy']:.1f} | {100 * r['test_accuracy']:.1f} | {alone} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every cell and seed of the command line; returns the payload written to the results files."""
    return H.run_cell_analysis(argv, __doc__, "reference_choice", len(KNOBS), run_setting, markdown, writing_here())


if __name__ == "__main__":
    main()
