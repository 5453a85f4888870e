"""End to end: the README's main command (``scripts/run_main.sh``: ``flwr run .`` of the default
app in Flower's simulation engine) on a private SuperLink.

Success is read from the run's results file (``flwr run`` exits 0 even when the run fails); the
test also checks that the repository is left unmodified and that no process is left behind.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from _fedfiot_helpers import ROOT, app_snapshot, live_processes


@pytest.mark.slow
def test_main_command_runs_default_app_end_to_end(tmp_path: Path) -> None:
    before = app_snapshot()
    env = {**os.environ, "SKIP_SETUP": "1"}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_main.sh"), "--results-dir", str(tmp_path), "--run-name", "e2e"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=420, check=False,
    )
    out = proc.stdout + proc.stderr
    results = tmp_path / "e2e" / "results.json"
    assert results.exists(), f"no results file; output:\n{out[-4000:]}"
    data = json.loads(results.read_text())
    assert data["status"] == "finished", f"{data.get('error')}\n{out[-4000:]}"
    assert proc.returncode == 0, out[-4000:]

    # the default: one-shot FedFiOT on digits, K = 6, with FedAvg of the same uploads alongside
    cfg = data["config"]["app"]
    assert cfg["dataset"] == "digits" and cfg["num-server-rounds"] == 1 and cfg["num-partitions"] == 6
    (rnd,) = data["rounds"]
    assert len(rnd["clients"]) == 6 and rnd["rejected"] == []
    assert set(rnd["fraction_permuted"]) == set(rnd["clients"])
    assert rnd["num_trials"] >= 2 and rnd["chosen"]["reference"] == "largest"
    final = data["final"]
    assert final["test"]["accuracy"] > 0.5 > data["initial_test"]["accuracy"]
    assert 0.0 <= final["fedavg_test"]["accuracy"] <= 1.0
    assert re.search(r"final test accuracy: FedFiOT \d+\.\d+% \| FedAvg on the same uploads \d+\.\d+%", out)

    # the final checkpoint loads into the app's model
    from fedfiot_flwr.app_config import AppConfig

    app_cfg = AppConfig.from_run_config(cfg)
    model = app_cfg.build_model(app_cfg.split())
    model.load_state_dict(torch.load(tmp_path / "e2e" / "checkpoints" / "final.pt"))

    # every process the command started is gone, and the repo is untouched
    match = re.search(r"PIDs (\{[^}]*\})", out)
    assert match, out[-2000:]
    pids = list(ast.literal_eval(match.group(1)).values())
    assert pids and live_processes(pids) == []
    assert app_snapshot() == before
