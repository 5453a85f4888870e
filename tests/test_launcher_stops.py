"""A launcher that is killed or stopped mid-run takes its whole federation with it, and the run resumes.

The README's main command (``python -m scripts.launch``, a Ray simulation on loopback) is signalled by PID once
round 2 is checkpointed: ``SIGKILL`` (a crash, the out-of-memory killer), ``SIGTERM`` and ``SIGINT``. Every process
the run started carries a marker in its environment; none may be left 10 s later, and nothing may write into the
run directory afterwards. ``--resume`` then goes on and ends with the model of an uninterrupted run. While the run
is live, a second launcher on its directory is refused and told which process holds it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from _fedfiot_helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, prctl")]

#: Twelve rounds of three digits clients (about a second each): a launcher run takes under a minute, and the rounds
#: left after round 2 outlast the two refused launchers the SIGKILL case starts while the run is live.
RUN_CONFIG = ("num-partitions=3 num-server-rounds=12 local-epochs=20 validation-size=100 sweep-rho='0.5' "
              "sweep-lam='1e-4' fraction-evaluate=0.0")
MARKER = "FEDFIOT_TEST_LAUNCHER_RUN"


def _launcher(results: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "scripts.launch", "--app", str(ROOT), "--results-dir", str(results), *args]


def _start(results: Path, *args: str, marker: str) -> subprocess.Popen[str]:
    return subprocess.Popen(_launcher(results, *args), cwd=ROOT, env={**os.environ, MARKER: marker}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _run(results: Path, *args: str, marker: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_launcher(results, *args), cwd=ROOT, env={**os.environ, MARKER: marker}, capture_output=True, text=True,
                          timeout=timeout, check=False)


def _marked(marker: str) -> dict[int, str]:
    """``pid -> command`` of the live processes whose environment carries ``marker`` (the run's, however detached)."""
    needle = f"{MARKER}={marker}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            if stat[stat.rindex(")") + 2] == "Z" or needle not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    return found


def _wait_for(path: Path, launcher: subprocess.Popen[str], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if launcher.poll() is not None:
            raise AssertionError(f"the launcher ended (code {launcher.returncode}) before {path} existed:\n"
                                 f"{launcher.stdout.read()[-3000:] if launcher.stdout else ''}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout}s")
        time.sleep(0.1)


def _files(run_dir: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*"))
            if p.is_file()}


def _final_model(run_dir: Path) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    results = tmp_path_factory.mktemp("uninterrupted")
    proc = _run(results, "--run-name", "whole", "--run-config", RUN_CONFIG, marker=uuid.uuid4().hex)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _final_model(results / "whole")


def _refused_while_live(results: Path, run_dir: Path, holders: dict[int, str]) -> None:
    """A second launcher on the live run's directory, by --resume and by --run-name, starts nothing."""
    for args in (("--resume", str(run_dir)), ("--run-name", run_dir.name)):
        second = _run(results, *args, marker=uuid.uuid4().hex, timeout=60)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"{run_dir} is held by a live run: PID " in second.stderr
        pid = int(second.stderr.split("held by a live run: PID ")[1].split()[0])
        assert pid in holders and "flwr-simulation" in holders[pid]  # the ServerApp's process, named


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_stopped_launcher_leaves_nothing_running_and_the_run_resumes_as_uninterrupted(
    tmp_path: Path, signum: signal.Signals, uninterrupted: dict[str, np.ndarray],
) -> None:
    results, marker = tmp_path / "results", uuid.uuid4().hex
    run_dir = results / "run"
    launcher = _start(results, "--run-name", "run", "--run-config", RUN_CONFIG, marker=marker)
    try:
        _wait_for(run_dir / "checkpoints" / "round-001.state.json", launcher)
        running = _marked(marker)
        commands = " | ".join(running.values())
        assert all(name in commands for name in ("flower-superlink", "flwr-simulation", "flwr run", "ray::"))
        if signum == signal.SIGKILL:
            _refused_while_live(results, run_dir, running)
        _wait_for(run_dir / "checkpoints" / "round-002.state.json", launcher)
        os.kill(launcher.pid, signum)
        stopped_at = time.monotonic()
        while (left := _marked(marker)) and time.monotonic() - stopped_at < 10:
            time.sleep(0.1)
        took = time.monotonic() - stopped_at
        assert not left, f"{len(left)} processes of the run still running 10 s after {signum.name}: {left}"
        out = launcher.communicate(timeout=10)[0]
    finally:
        for pid in _marked(marker):
            os.kill(pid, signal.SIGKILL)
    assert launcher.returncode == (-signum if signum == signal.SIGKILL else 128 + signum), out[-3000:]
    if signum != signal.SIGKILL:
        assert f"stopped by {signum.name}; the federation is stopped." in out
        assert f"go on with --resume {run_dir}" in out
    files = _files(run_dir)
    time.sleep(3.0)
    assert _files(run_dir) == files, "something still writes into the run directory"
    stale = (run_dir / "run.lock").exists()

    resumed = _run(results, "--resume", str(run_dir), "--run-name", "resumed", marker=marker)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert ("took over the lock left by PID" in resumed.stdout + resumed.stderr) == stale
    assert not (run_dir / "run.lock").exists() and not _marked(marker)
    model = _final_model(results / "resumed")
    largest = max(float(np.max(np.abs(model[k] - uninterrupted[k]))) for k in uninterrupted)
    print(f"\n{signum.name}: nothing of the run left {took:.1f}s after the signal; resumed to a final model "
          f"{largest:.3g} from the uninterrupted one (stale lock taken over: {stale})")
    assert largest <= 1e-6, _what_the_run_left(run_dir, results / "resumed")


def _what_the_run_left(run_dir: Path, resumed_dir: Path) -> str:
    """The stopped run's rounds (replies, exclusions) and where the resumed run went on from, for a failure."""
    stopped, resumed = (json.loads((d / "results.json").read_text()) for d in (run_dir, resumed_dir))
    rounds = [(r["round"], len(r.get("clients", [])), r.get("rejected"), "test" in r) for r in stopped["rounds"]]
    return (f"stopped run: status {stopped['status']}, error {stopped.get('error')}, rounds (round, replies, excluded, "
            f"tested) {rounds}; resumed from {resumed.get('resumed_from')}")
