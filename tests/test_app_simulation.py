"""End to end: the README's main command (``scripts/run_main.sh``: ``flwr run .`` of the default
app in Flower's simulation engine) on a private SuperLink.

Success is read from the run's results file (``flwr run`` exits 0 even when the run fails); the
test also checks that the repository is left unmodified and that no process is left behind.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _fedfiot_helpers import ROOT, app_snapshot, live_processes


@pytest.mark.slow
def test_main_command_runs_default_app_end_to_end(tmp_path: Path) -> None:
    before = app_snapshot()
    env = {**os.environ, "SKIP_SETUP": "1"}
    # The main command with a lighter workload (5 local epochs, a 2 x 1 sweep): what it checks is the
    # path from the script to the results, not the accuracy of the full default.
    light = "local-epochs=5 sweep-rho='0.3,0.5' sweep-lam='1e-4'"
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run_main.sh"), "--results-dir", str(tmp_path), "--run-name", "e2e",
         "--run-config", light],
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
    assert set(rnd["alignment_moved_fraction"]) == set(rnd["clients"])
    assert rnd["num_trials"] >= 2 and rnd["chosen"]["reference"] == "largest"
    assert isinstance(rnd["server_metrics"]["alignment-moved-fraction"], list)
    assert "train-loss" in data["final"]["train_metrics_clientapp"]["1"]  # client metrics, own names
    assert "objective-aligned" not in data["final"]["train_metrics_clientapp"]["1"]
    assert data["final"]["evaluate_metrics_clientapp"]["1"]  # federated evaluation ran (FedAvg's default)
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


def _superlink_pids(marker: str) -> list[int]:
    """PIDs of ``flower-superlink`` processes whose command line contains ``marker``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in cmd and marker in cmd:
            pids.append(int(proc.name))
    return pids


def _stop(pids: list[int], grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, each PID and its process group (Flower starts the managed
    SuperLink with ``start_new_session=True``, so its PID is its group's id)."""
    for pid in pids:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for kill in (os.kill, os.killpg):
                try:
                    kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace
            while live_processes([pid]) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not live_processes([pid]):
                break


@pytest.mark.slow
def test_plain_flwr_run_follows_the_default_federation(tmp_path: Path) -> None:
    """Plain ``flwr run . --stream`` (no overrides, no --federation-config): Flower's managed
    local SuperLink with its default federation (2 simulated SuperNodes in flwr 1.42) runs
    the default app to the end with K = the number of SuperNodes (num-partitions = 0). Without a
    validation set, the clients' evaluation chooses the round's model: each SuperNode answers two
    evaluate messages of the same round."""
    app = tmp_path / "app"
    app.mkdir()
    for name in ("pyproject.toml", "README.md", "server_app.py", "client_app.py"):
        shutil.copy2(ROOT / name, app / name)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "fedfiot_flwr", app / "fedfiot_flwr", ignore=ignore)
    shutil.copytree(ROOT / "configs", app / "configs", ignore=ignore)
    # a lighter default workload in the copy (what this test checks is the federation's size)
    text = (app / "pyproject.toml").read_text()
    text = re.sub(r"(?m)^local-epochs = \d+", "local-epochs = 5", text)
    text = re.sub(r'(?m)^sweep-rho = "[^"]*"', 'sweep-rho = "0.3,0.5"', text)
    text = re.sub(r"(?m)^validation-size = \d+", "validation-size = 0", text)
    (app / "pyproject.toml").write_text(text)
    pyproject = (app / "pyproject.toml").read_bytes()
    home = tmp_path / "flwr-home"
    from scripts.launch import free_ports

    # Free ports, so that neither another SuperLink on Flower's default 39091 is reused nor
    # this one collides with anything (the managed SuperLink honours these variables).
    http_port, control_port = free_ports(2)
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http_port),
        "FLWR_LOCAL_CONTROL_API_PORT": str(control_port),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    pids: list[int] = []
    try:
        proc = subprocess.run(
            [str(Path(sys.executable).parent / "flwr"), "run", ".", "--stream"],
            cwd=app, env=env, capture_output=True, text=True, timeout=240, check=False,
        )
        pids = _superlink_pids(str(home))
    finally:
        pids = pids or _superlink_pids(str(home))
        _stop(pids)
    out = proc.stdout + proc.stderr
    assert len(pids) == 1, out[-3000:]  # the managed SuperLink it started, now stopped
    assert live_processes(pids) == []

    # results-dir = "results" is resolved in the SuperLink's working directory: flwr run's cwd
    (results,) = sorted((app / "results").glob("*/results.json"))
    data = json.loads(results.read_text())
    assert data["status"] == "finished", f"{data.get('error')}\n{out[-3000:]}"
    cfg = data["config"]["app"]
    assert cfg["num-partitions"] == 2 and cfg["dataset"] == "digits" and cfg["num-server-rounds"] == 1
    (rnd,) = data["rounds"]
    assert len(rnd["clients"]) == 2 and rnd["rejected"] == []
    assert rnd["clients_choice"]["nodes"] == 2 and rnd["clients_choice"]["kept"] in ("merge", "fedavg")
    assert re.search(r"FedFiOT round 1 \(clients' evaluation\): (the merge|FedAvg of the same uploads) goes on", out)
    assert data["final"]["test"]["accuracy"] > data["initial_test"]["accuracy"]
    assert re.search(r"FINAL test accuracy after 1 round\(s\): FedFiOT \d+\.\d+% \| FedAvg on the same uploads \d+\.\d+%", out)
    assert (app / "pyproject.toml").read_bytes() == pyproject  # flwr run did not rewrite it


class _GrowingGrid:
    """``get_node_ids`` of a federation whose SuperNodes connect one by one, then stay."""

    def __init__(self, arrivals: list[float]) -> None:
        self.start = time.monotonic()
        self.arrivals = arrivals

    def get_node_ids(self) -> list[int]:
        now = time.monotonic() - self.start
        return [100 + i for i, t in enumerate(self.arrivals) if t <= now]


def test_num_partitions_zero_follows_the_federation(tmp_path: Path) -> None:
    import server_app
    from client_app import _partition

    from fedfiot_flwr.app_config import AppConfig

    auto = AppConfig.from_run_config({"results-dir": str(tmp_path), "node-wait-s": 5.0, "node-settle-s": 0.6})
    assert auto.num_partitions == 0  # the app's default
    with pytest.raises(ValueError, match="with_partitions"):
        auto.split()

    # server: every SuperNode that connected before the set stayed unchanged for node-settle-s
    cfg = server_app._resolve_federation(_GrowingGrid([0.2, 0.4, 0.7]), auto)
    assert cfg.num_partitions == 3 and cfg.alpha == auto.alpha
    with pytest.raises(RuntimeError, match="no SuperNode connected"):
        server_app._resolve_federation(_GrowingGrid([]), dataclasses.replace(auto, node_wait_s=0.3))
    fixed = AppConfig.from_run_config({"num-partitions": 4, "node-wait-s": 0.5, "results-dir": str(tmp_path)})
    with pytest.raises(RuntimeError, match="only 3 SuperNodes connected.*num-partitions = 4"):
        server_app._resolve_federation(_GrowingGrid([0.0, 0.0, 0.0]), fixed)
    assert server_app._resolve_federation(_GrowingGrid([0.0] * 4), fixed) is fixed

    # client: K from the node config (set by the simulation engine or --node-config)
    node = SimpleNamespace(node_config={"partition-id": 2, "num-partitions": 3})
    cfg, pid = _partition(node, auto)
    assert (cfg.num_partitions, pid) == (3, 2)
    with pytest.raises(ValueError, match="does not fit the run config's num-partitions=4"):
        _partition(node, fixed)
    with pytest.raises(ValueError, match="lacks 'num-partitions'"):
        _partition(SimpleNamespace(node_config={"partition-id": 0}), auto)
    assert _partition(SimpleNamespace(node_config={"partition-id": 3}), fixed)[1] == 3
