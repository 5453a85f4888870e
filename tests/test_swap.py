"""The README's swap, end to end: a standard Flower PyTorch app (``tests/template_app``, the shape of
``flwr new``'s template, its own Adam loop, non-IID digits) runs once as written (FedAvg) and once
with exactly the README's diff applied (FedFiOT), on the same seeds in Flower's simulation engine.
FedFiOT must reach at least FedAvg's final test accuracy, with at most six changed lines."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from _fedfiot_helpers import ROOT, live_processes

from fedfiot_flwr.launch import LocalFederation

TEMPLATE = ROOT / "tests" / "template_app"
NUM_SUPERNODES = 4


def readme_swap_diff() -> str:
    """The diff block that follows the swap marker in README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"<!-- swap-diff[^>]*-->\s*```diff\n(.*?)```", text, re.S)
    assert match, "README.md has no swap diff block"
    return match.group(1)


def changed_lines(diff: str) -> tuple[int, int]:
    """(added, removed) lines of a unified diff."""
    lines = diff.splitlines()
    added = sum(1 for ln in lines if ln.startswith("+") and not ln.startswith("+++"))
    removed = sum(1 for ln in lines if ln.startswith("-") and not ln.startswith("---"))
    return added, removed


def test_the_readme_swap_is_at_most_six_changed_lines_and_applies(tmp_path: Path) -> None:
    diff = readme_swap_diff()
    added, removed = changed_lines(diff)
    assert added <= 6 and removed <= added, (added, removed)
    app = tmp_path / "app"
    shutil.copytree(TEMPLATE, app, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "apply", "--check", "-"], input=diff, text=True, cwd=app, check=True)


def _final_accuracy(fed: LocalFederation, app: Path, results: Path) -> float:
    proc = fed.flwr_run(app, {"results-file": str(results)}, timeout=240)
    logs = "\n".join(fed.log_path(r).read_text(errors="replace")[-3000:] for r in fed.processes)
    assert results.exists(), f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    metrics = json.loads(results.read_text())
    return float(metrics[str(max(int(r) for r in metrics))]["accuracy"])


@pytest.mark.slow
def test_fedfiot_after_the_readme_swap_matches_or_beats_fedavg(tmp_path: Path) -> None:
    fedavg_app, fedfiot_app = tmp_path / "fedavg", tmp_path / "fedfiot"
    for app in (fedavg_app, fedfiot_app):
        shutil.copytree(TEMPLATE, app, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "apply", "-"], input=readme_swap_diff(), text=True, cwd=fedfiot_app, check=True)
    assert "fisher_reply" in (fedfiot_app / "digitsapp" / "client_app.py").read_text()

    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
           "OMP_NUM_THREADS": "1"}
    fed = LocalFederation(mode="simulation", num_supernodes=NUM_SUPERNODES, workdir=tmp_path / "fed", env=env)
    try:
        fed.start()
        pids = fed.pids()
        fedavg = _final_accuracy(fed, fedavg_app, tmp_path / "fedavg.json")
        fedfiot = _final_accuracy(fed, fedfiot_app, tmp_path / "fedfiot.json")
    finally:
        fed.stop()
    assert live_processes(list(pids.values())) == []
    print(f"final test accuracy: FedAvg {fedavg:.4f}, FedFiOT {fedfiot:.4f}")
    assert fedfiot >= fedavg, (fedfiot, fedavg)
