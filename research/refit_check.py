"""Does refitting the refinement's chosen recipe on both folds help? Judged on held-out validation only.

The server refinement fits candidates on one fold of the server's labelled data and picks one on
the other. ``RefineOptions(refit=True)`` then builds the picked recipe once more on both folds.
Whether that helps is decided here without the test set: the 500 validation examples are split
into a fitting fold (250, the strategy's own split), a selection fold (125) and an audit fold
(125) that neither fits nor selects. On each cached upload set:

- ``selection only``: the default preset's refinement without refit (fit 250, select 125);
- ``refit``: the same choice, refitted on fit + selection (375).

Both are scored on the audit fold (the decision) and on the test set (reported only).

    .venv/bin/python research/refit_check.py --cells 0.1:shared:0:5 0.1:independent:0:30

Writes ``research/results/refit_check.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from benchmarks import server_methods as S  # noqa: E402
from research.audit_folds import audit_cell, cell_arguments  # noqa: E402


def run_cell(cell: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    c = audit_cell(cell, args, log)
    t0 = time.perf_counter()
    refit_model, report = c.refine(replace(S.DEFAULT_REFINE, refit=True, keep_candidates=True))
    chosen = report.candidates[report.chosen]
    rec: dict[str, Any] = {**H.record_fields(c.setting), "chosen": report.chosen,
                           "refit_examples": report.refit_examples, "seconds": time.perf_counter() - t0,
                           "refine_seconds": report.seconds}
    for name, model in (("selection_only", chosen), ("refit", refit_model)):
        rec[f"{name}_audit"], rec[f"{name}_test"] = c.scores(model)
    log(f"{cell}: chosen {report.chosen}; audit {100 * rec['selection_only_audit']:.1f} -> "
        f"{100 * rec['refit_audit']:.1f}; test {100 * rec['selection_only_test']:.1f} -> {100 * rec['refit_test']:.1f}")
    return rec


def markdown(recs: list[dict[str, Any]]) -> str:
    lines = ["| alpha | init | E | seed | chosen | audit: selection only | audit: refit | test: selection only | "
             "test: refit |", "|---|---|---|---|---|---:|---:|---:|---:|"]
    for r in recs:
        lines.append(f"| {r['alpha']:g} | {r['init']} | {r['epochs']} | {r['seed']} | {r['chosen']} | "
                     f"{100 * r['selection_only_audit']:.1f} | {100 * r['refit_audit']:.1f} | "
                     f"{100 * r['selection_only_test']:.1f} | {100 * r['refit_test']:.1f} |")
    gain = [r["refit_audit"] - r["selection_only_audit"] for r in recs]
    tgain = [r["refit_test"] - r["selection_only_test"] for r in recs]
    lines += ["", f"Mean gain of the refit: audit {100 * np.mean(gain):+.2f} points "
              f"({sum(g > 0 for g in gain)} up, {sum(g < 0 for g in gain)} down of {len(gain)}); "
              f"test {100 * np.mean(tgain):+.2f} points."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = cell_arguments(argv, __doc__.splitlines()[0], "refit_check")
    recs = []
    for cell in args.cells:
        recs.append(run_cell(cell, args, print))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.name}.json").write_text(json.dumps({"command": H.command_line(argv, __file__), "records": recs},
                                                               indent=1))
        (args.out / f"{args.name}.md").write_text(markdown(recs))
    return recs


if __name__ == "__main__":
    main()
