"""A ``flwr run`` simulation with many SuperNodes: one-shot FedFiOT, small MLP, digits.

Starts a private local federation (:class:`scripts.launch.LocalFederation`: own
``FLWR_HOME``, free ports, processes stopped by PID) with ``--supernodes`` SuperNodes, runs the
app once and writes the wall time, the server's merge and selection time and the accuracies
to ``benchmarks/results/many_supernodes.md``.

Usage::

    python benchmarks/many_supernodes.py [--supernodes 50] [--local-epochs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.portable import command_line  # noqa: E402

RESULT = ROOT / "benchmarks" / "results" / "many_supernodes.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--supernodes", type=int, default=50)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--sweep", default="false", choices=("true", "false"))
    parser.add_argument("--results-dir", default="/tmp/fedfiot-many-supernodes")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    from scripts.launch import main as launch

    k = args.supernodes
    run_name = f"supernodes{k}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = (f"num-partitions={k} alpha={args.alpha:g} local-epochs={args.local_epochs} "
                 f"validation-size=200 num-server-rounds=1 sweep={args.sweep}")
    argv = ["--app", str(ROOT), "--mode", "simulation", "--num-supernodes", str(k),
            "--run-config-file", str(ROOT / "configs" / "digits-oneshot.toml"), "--run-config", overrides,
            "--results-dir", args.results_dir, "--run-name", run_name]
    t0 = time.perf_counter()
    code = launch(argv)
    wall = time.perf_counter() - t0
    results = Path(args.results_dir) / run_name / "results.json"
    data = json.loads(results.read_text()) if results.exists() else {}
    final = data.get("final", {})
    lines = [
        f"# `flwr run` simulation with {k} SuperNodes (benchmarks/many_supernodes.py)",
        "",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
        f"- run config: configs/digits-oneshot.toml with `{overrides}`",
        f"- status: {data.get('status', 'no results file')} (launcher exit code {code})",
        f"- wall time of the whole run (federation start to results): {wall:.0f} s",
        f"- final test accuracy: {json.dumps(final.get('test'))}; FedAvg of the same uploads: "
        f"{json.dumps(final.get('fedavg_test'))}",
        "",
        "Server-side timing of the round (from results.json):",
        "",
        "```json",
        json.dumps({k2: v for k2, v in (data.get("rounds") or [{}])[-1].items()
                    if isinstance(v, (int, float)) and ("second" in k2 or "clients" in k2 or "bytes" in k2
                                                         or "valid" in k2)}, indent=1),
        "```",
        "",
        f"Command: `{command_line(interpreter='python')}`",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main())
