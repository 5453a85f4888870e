"""Combine several ``one_shot.py`` result files (same uploads, different method subsets or cells) into one page.

Each input is a JSON payload written by ``benchmarks/one_shot.py``; records are concatenated
(a later file's record replaces an earlier one with the same method, cell and seed), settings
are merged per cell and seed (times summed), and the markdown page, JSON and plot are
rendered with ``one_shot.py``'s own functions.

    .venv/bin/python benchmarks/combine_results.py runs/*.json --name one_shot

The epochs chosen on validation (``--select-epochs`` in any input) are chosen again over the
combined records. ``--drop METHOD ...`` leaves those methods' records out. ``--equal-terms equal_terms.json`` adds the
second protocol (server data may also fit: ``benchmarks/equal_terms.py``'s records, kept under the
payload's ``"equal_terms"`` key) to the page.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import epoch_selection as E  # noqa: E402
from benchmarks import harness as H  # noqa: E402
from benchmarks import one_shot  # noqa: E402

ROW_ORDER = (
    "fedavg", "fisher-merge", "otfusion", "wb-fusion", "ablation-b", "ablation-c", "ablation-d", "regmean",
    "fedfisher-diag", "fedfisher-kfac", "fedfiot", "fedfiot-fp32", "fedfiot-default", "fedfiot-own",
    "fedfiot-refined", "best-single-client", "mean-client", "ensemble", "centralized",
)

NUMERIC_SUFFIXES = ("accuracy", "loss", "fraction_permuted", "seconds")
"""Record fields that JSON stores as null when NaN (read back as NaN)."""


def combine(payloads: list[dict[str, Any]], drop: Collection[str] = ()) -> dict[str, Any]:
    """One payload holding every record and setting of ``payloads`` (later files win on duplicates),
    without the records of the methods in ``drop``."""
    records: dict[tuple[Any, ...], dict[str, Any]] = {}
    settings: dict[tuple[Any, ...], dict[str, Any]] = {}
    diagnostics: dict[tuple[Any, ...], dict[str, Any]] = {}
    grids: dict[str, Any] = {}
    commands, methods = [], []
    for p in payloads:
        commands.append(p["command"])
        grids.update(p.get("grids", {}))
        for r in p["records"]:
            if r["method"] in drop:
                continue
            r = {k: (math.nan if v is None and k.endswith(NUMERIC_SUFFIXES) else v) for k, v in r.items()}
            records[(r["method"], r["dataset"], r["alpha"], r["init"], r["epochs"], r["seed"])] = r
            if r["method"] not in methods:
                methods.append(r["method"])
        for s in p["settings"]:
            key = (s["dataset"], s["alpha"], s["init"], s["epochs"], s["seed"])
            if key in settings:
                settings[key]["merge_sweep_seconds"] += s["merge_sweep_seconds"]
                settings[key]["test_seconds"] += s["test_seconds"]
            else:
                settings[key] = dict(s)
        for d in p.get("diagnostics", []):  # fields of the same cell from several files are merged
            key = (d["dataset"], d["alpha"], d["init"], d["epochs"], d["seed"])
            diagnostics[key] = {**diagnostics.get(key, {}), **d}
    sums = list(settings.values())
    wall = sum(p["timing"]["wall_seconds"] for p in payloads)
    ordered = sorted(records.values(), key=lambda r: (r["epochs"], r["alpha"], r["init"] != "shared", r["seed"]))
    equal_terms = next((p["equal_terms"] for p in reversed(payloads) if p.get("equal_terms")), None)
    select = any(p.get("select_epochs") for p in payloads)
    return {
        "command": " ; ".join(commands)
                   + (f" (combined without the records of {', '.join(sorted(drop))})" if drop else ""),
        "machine": payloads[-1]["machine"],
        "started": min(p["started"] for p in payloads),
        "methods": [m for m in ROW_ORDER if m in methods] + [m for m in methods if m not in ROW_ORDER],
        "grid": payloads[-1].get("grid"),
        "grids": grids,
        "select_epochs": select,
        **({"epoch_selection": E.selection_payload(ordered)} if select else {}),
        "settings": sums,
        "records": ordered,
        "diagnostics": list(diagnostics.values()),
        "skipped": sum((p.get("skipped", []) for p in payloads), []),
        "timing": {
            "wall_seconds": wall,
            "train_seconds": sum(s["train_seconds"] for s in sums),
            "fisher_seconds": sum(s["fisher_seconds"] for s in sums),
            "merge_sweep_seconds": sum(s["merge_sweep_seconds"] for s in sums),
            "test_seconds": sum(s["test_seconds"] for s in sums),
            "cached_settings": sum(bool(s["cached"]) for s in sums),
            "complete": True,
        },
        **({"equal_terms": equal_terms} if equal_terms else {}),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=H.RESULTS_DIR)
    p.add_argument("--name", default="one_shot")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--equal-terms", type=Path, default=None,
                   help="an equal_terms.py JSON: its records become the page's second protocol")
    p.add_argument("--drop", nargs="+", default=[], metavar="METHOD",
                   help="leave these methods' records out (e.g. rows measured on uploads the others no longer share)")
    args = p.parse_args(argv)
    payload = combine([json.loads(f.read_text()) for f in args.inputs], drop=args.drop)
    if args.equal_terms is not None:
        payload["equal_terms"] = json.loads(args.equal_terms.read_text())["records"]
    rows = [m for m in payload["methods"] if m != "fedfiot-own"]
    methods = one_shot.table_methods(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    H.write_json(args.out / f"{args.name}.json", payload)
    (args.out / f"{args.name}.md").write_text(one_shot.markdown(payload, methods))
    if not args.no_plots:
        one_shot.plot(payload, methods, args.out, args.name)
        E.plot_selection(payload, args.out, args.name)
    return payload


if __name__ == "__main__":
    main()
