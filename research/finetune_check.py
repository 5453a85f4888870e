"""Which fine-tuning should the refinement ship? Judged on a held-out audit fold, never on the test set.

The server refinement fits candidates on one fold of the server's labelled data and picks one on
another. Here the 500 validation examples are split into the strategy's fitting fold (250), a
selection fold (125) and an audit fold (125) that neither fits nor selects (``audit_folds.py``). FedFiOT's default merge is chosen on the selection fold, then refined twice
on the fitting fold:

- the short run (rule ``previous`` in the JSON, "10 epochs, constant" on the page): 10 epochs at a
  constant learning rate, 3 augmented copies, every other epoch's checkpoint and the least-squares
  starts offered as candidates;
- the longer run (20 epochs, cosine learning rate, 8 augmented copies), from which three
  choice rules are read off the same candidates:

  - ``cosine, every 2``: every other epoch's checkpoint and the starts are candidates;
  - ``cosine, last``: the last epoch and the starts are candidates;
  - ``cosine, last, starts only``: the last epoch competes with the merge (and the clients);
    the least-squares candidates only choose where fine-tuning starts (``offer_starts=False``).

Each rule's returned model is scored on the audit fold (the decision) and the test set (reported).

    .venv/bin/python research/finetune_check.py --cells 0.1:shared:0:30 0.1:shared:0:5

Writes ``research/results/finetune_check.{md,json}``.
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
from research.audit_folds import audit_cell, cell_arguments  # noqa: E402
from fedfiot_flwr.choose import best_index  # noqa: E402
from fedfiot_flwr.refine import RefineOptions  # noqa: E402

PREVIOUS = RefineOptions(finetune_epochs=10, augment_copies=3, finetune_schedule="constant", checkpoint_every=2,
                         offer_starts=True)
"""The short run: 10 epochs at a constant learning rate (rule ``previous``)."""
LONGER = RefineOptions(finetune_epochs=20, augment_copies=8, finetune_schedule="cosine", checkpoint_every=2,
                       offer_starts=True)
"""The longer, annealed run; its candidates serve every ``cosine`` rule below."""
RULES = ("previous", "cosine, every 2", "cosine, last", "cosine, last, starts only")
RULE_LABELS = {"previous": "10 epochs, constant"}
"""How the results page names a rule (the JSON keeps the rule's key)."""


def _pick(scores: dict[str, float], names: list[str]) -> str:
    """The winner among ``names`` by selection score, under the refinement's own rule (:mod:`fedfiot_flwr.choose`)."""
    return names[best_index([scores[n] for n in names])]


def choices(scores: dict[str, float]) -> dict[str, str]:
    """Each cosine rule's choice among the longer run's scored candidates (clients included)."""
    tuned = [n for n in scores if n.startswith("ft")]
    last = max(tuned, key=lambda n: int(n[2:n.index("(")]))
    starts = [n for n in scores if n.startswith(("ls-", "repair"))]
    clients = [n for n in scores if n.startswith("client-")]
    return {
        "cosine, every 2": _pick(scores, ["merged", *starts, *tuned, *clients]),
        "cosine, last": _pick(scores, ["merged", *starts, last, *clients]),
        "cosine, last, starts only": _pick(scores, ["merged", last, *clients]),
    }


def run_cell(cell: str, args: argparse.Namespace, log: Any) -> dict[str, Any]:
    c = audit_cell(cell, args, log)
    clients = {f"client-{k}": w for k, w in enumerate(c.uploads.quantized.weights)}
    rec: dict[str, Any] = {**H.record_fields(c.setting), "rules": {}}
    for label, opts in (("previous", PREVIOUS), ("longer", LONGER)):
        t0 = time.perf_counter()
        _, report = c.refine(replace(opts, keep_candidates=True))
        rec[f"{label}_seconds"] = time.perf_counter() - t0
        picked = {"previous": report.chosen} if label == "previous" else choices(report.selection_accuracy)
        for rule, name in picked.items():
            audit, test = c.scores(report.candidates.get(name, clients.get(name)))
            rec["rules"][rule] = {"chosen": name, "selection": report.selection_accuracy[name],
                                  "audit": audit, "test": test}
    log(cell + ": " + "; ".join(f"{rule} {r['chosen']} audit {100 * r['audit']:.1f} test {100 * r['test']:.1f}"
                                for rule, r in rec["rules"].items()))
    return rec


def markdown(recs: list[dict[str, Any]]) -> str:
    head = "| alpha | init | E | seed | " + " | ".join(f"{RULE_LABELS.get(r, r)}: audit / test" for r in RULES) + " |"
    lines = [head, "|---|---|---|---|" + "---:|" * len(RULES)]
    for rec in recs:
        cells = [f"{100 * rec['rules'][r]['audit']:.1f} / {100 * rec['rules'][r]['test']:.1f}" for r in RULES]
        lines.append(f"| {rec['alpha']:g} | {rec['init']} | {rec['epochs']} | {rec['seed']} | " + " | ".join(cells) + " |")
    means = [f"**{100 * np.mean([x['rules'][r]['audit'] for x in recs]):.2f} / "
             f"{100 * np.mean([x['rules'][r]['test'] for x in recs]):.2f}**" for r in RULES]
    lines.append("| mean | | | | " + " | ".join(means) + " |")
    base = [x["rules"]["previous"]["audit"] for x in recs]
    lines.append("")
    for r in RULES[1:]:
        gain = [x["rules"][r]["audit"] - b for x, b in zip(recs, base)]
        lines.append(f"- {r}: audit {100 * np.mean(gain):+.2f} points against `{RULE_LABELS['previous']}` "
                     f"({sum(g > 0 for g in gain)} up, {sum(g < 0 for g in gain)} down of {len(gain)}).")
    secs = [x["longer_seconds"] / x["previous_seconds"] for x in recs]
    lines.append(f"- Refinement time of the longer run against `{RULE_LABELS['previous']}`, same process: {np.mean(secs):.2f}x "
                 f"({min(secs):.2f}-{max(secs):.2f}x).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = cell_arguments(argv, __doc__.splitlines()[0], "finetune_check")
    out = args.out / f"{args.name}.json"
    recs: list[dict[str, Any]] = []
    for cell in args.cells:
        rec = run_cell(cell, args, print)
        # Read the file again just before writing: runs of other cells may share it.
        recs = json.loads(out.read_text())["records"] if out.exists() else []
        recs = [r for r in recs if f"{r['alpha']:g}:{r['init']}:{r['seed']}:{r['epochs']}" != cell] + [rec]
        args.out.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"command": "research/finetune_check.py --cells " + " ".join(
            f"{r['alpha']:g}:{r['init']}:{r['seed']}:{r['epochs']}" for r in recs), "records": recs}, indent=1))
        (args.out / f"{args.name}.md").write_text(markdown(recs))
    return recs


if __name__ == "__main__":
    main()
