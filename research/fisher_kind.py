"""Which diagonal Fisher the clients upload: empirical, sampled or true, on the same trained weights.

FedFiOT's clients upload the empirical Fisher (observed labels; the paper's choice). Once a client
fits its data, most examples' gradients vanish and its empirical Fisher is carried by the few it
still gets wrong. The true Fisher (an expectation over the model's own predictions) and its
one-sample estimate (``fisher_kind="sampled"``) weigh every example by the model's uncertainty
instead. All three are the same bytes on the wire.

On cached one-shot uploads this keeps each client's trained weights, recomputes its Fisher of every
kind over the client's own examples (as the ClientApp does: no augmentation, batches of 1000), packs
it with the client's own code, and runs the Fisher-weighted methods on each: FedFiOT's default
preset (server data selects only), the paper preset and Fisher merging. The rivals that do not read
the Fisher are unchanged by the kind; their figures are in ``one_shot.md``.

    .venv/bin/python research/fisher_kind.py --alphas 0.1 --inits shared independent --seeds 0 --epochs 30

Writes ``research/results/fisher_kind.{md,json}``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from research import writing_here  # noqa: E402
from fedfiot_flwr.client import ClientRound, pack_reply  # noqa: E402
from fedfiot_flwr.fisher import diagonal_fisher  # noqa: E402

KINDS = ("empirical", "sampled", "true")
"""The Fisher kinds compared, in table order."""
METHODS = ("fedfiot-default", "fedfiot", "fisher-merge")
"""The Fisher-weighted rows recomputed for each kind."""


def uploads_with_fisher(uploads: H.Uploads, setting: H.Setting, split: Any, build: Any, buffers: Sequence[str],
                        kind: str) -> H.Uploads:
    """The same trained weights with each client's diagonal Fisher of ``kind``, packed by the client's code.

    Their ``fisher_seconds`` is the summed time of the Fisher passes.
    """
    rounds = []
    for pid, weights in enumerate(uploads.float32.weights):
        model = H.load_numpy(build(), weights)
        torch.manual_seed(1000 * setting.seed + pid)  # the sampled labels
        t0 = time.perf_counter()
        fisher = {k: v.detach().cpu().numpy()
                  for k, v in diagonal_fisher(model, H.fisher_loader(split, pid), kind, progress=False).items()}
        seconds = time.perf_counter() - t0
        reply = pack_reply(weights, fisher, uploads.quantized.num_examples[pid], uploads.quantized.metrics[pid])
        rounds.append(ClientRound(reply, dict(weights), fisher, 0.0, seconds))
    return H.collect(rounds, buffers, uploads.broadcast)


def run_setting(setting: H.Setting, args: argparse.Namespace, log: Any) -> list[dict[str, Any]]:
    """Every Fisher kind through every Fisher-weighted method on one cell's uploads."""
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build)
    cached = H.one_shot_uploads(setting, split, buffers, args.cache_dir, None, log)
    configs = H.method_configs(METHODS, setting.init, grid="small")
    base = H.record_fields(setting)
    rows: list[dict[str, Any]] = []
    for kind in KINDS[:args.knobs]:
        # the empirical kind: the uploads as the clients sent them
        uploads = cached if kind == "empirical" else uploads_with_fisher(cached, setting, split, build, buffers, kind)
        seconds = uploads.fisher_seconds
        for method in METHODS:
            res = H.apply_method(method, configs[method], uploads, spec, buffers, ev.validate)
            test = ev.test(res.model)[1]
            rows.append({**base, "fisher_kind": kind, "method": method, "test_accuracy": test,
                         "validation_accuracy": res.validation_accuracy, "knobs": res.knobs,
                         "fraction_permuted": res.fraction_permuted, "fisher_seconds": seconds,
                         "sweep_seconds": res.sweep_seconds})
            log(f"  {kind:9s} {method:15s} val {100 * res.validation_accuracy:.1f}% test {100 * test:.1f}% "
                f"(Fisher {seconds:.0f}s, sweep {res.sweep_seconds:.0f}s)")
    return rows


def page(payload: dict[str, Any]) -> str:
    """The results page: one row per method and Fisher kind, one column per cell (mean ± std over seeds)."""
    rows = payload["rows"]
    cells = sorted({(r["alpha"], r["init"], r["epochs"]) for r in rows})
    lines = ["# Which Fisher the clients upload", "", f"Command: `{payload['command']}`", "",
             f"Machine: {payload['machine']}.", "",
             "| method | Fisher | " + " | ".join(f"α={a:g} {i} E={e}" for a, i, e in cells) + " |",
             "|---|---|" + "---|" * len(cells)]
    for method in METHODS:
        for kind in KINDS:
            vals = [[r["test_accuracy"] for r in rows if (r["alpha"], r["init"], r["epochs"]) == c
                     and r["method"] == method and r["fisher_kind"] == kind] for c in cells]
            if any(vals):
                lines.append(f"| {H.METHOD_LABELS[method]} | {kind} | " + " | ".join(
                    (H.fmt_pct(*H.mean_std(v)) + (f" (n={len(v)})" if len(v) > 1 else "")) if v else ""
                    for v in vals) + " |")
    secs = {k: np.mean([r["fisher_seconds"] for r in rows if r["fisher_kind"] == k]) for k in KINDS
            if any(r["fisher_kind"] == k for r in rows)}
    lines += ["", f"Test accuracy (%), {rows[0]['dataset']}, K = {rows[0]['clients']}, the same trained weights "
              "in every row of a column; knobs chosen on the "
              f"{rows[0]['validation_size']} server validation examples, which fit nothing. Fisher pass, all "
              "clients of a cell summed (mean over cells; the empirical one as measured when the uploads were "
              "produced, the others in this run): " + ", ".join(f"{k} {s:.0f} s" for k, s in secs.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the cells and write ``fisher_kind.{md,json}``; returns the payload."""
    return H.run_cell_analysis(argv, __doc__, "fisher_kind", len(KINDS), run_setting, page, writing_here())


if __name__ == "__main__":
    main()
