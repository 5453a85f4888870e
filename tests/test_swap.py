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

from scripts.launch import LocalFederation

TEMPLATE = ROOT / "tests" / "template_app"
NUM_SUPERNODES = 4


def readme_diff(marker: str) -> str:
    """The diff block that follows ``<!-- marker ... -->`` in README.md."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(rf"<!-- {marker}[^>]*-->\s*```diff\n(.*?)```", text, re.S)
    assert match, f"README.md has no {marker} block"
    return match.group(1)


def readme_swap_diff() -> str:
    """The diff block that follows the swap marker in README.md."""
    return readme_diff("swap-diff")


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


def _example_ids(data) -> list[int]:  # noqa: ANN001
    """The ids of a dataset's or loader's examples (each input is filled with its example's id)."""
    from torch.utils.data import DataLoader

    dataset = data.dataset if isinstance(data, DataLoader) else data
    return [int(dataset[i][0].flatten()[0]) for i in range(len(dataset))]


def test_the_readme_server_data_snippet_never_hands_the_strategy_an_evaluation_example(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    import importlib
    import sys
    import types

    app = tmp_path / "app"
    shutil.copytree(TEMPLATE, app, ignore=shutil.ignore_patterns("__pycache__"))
    for diff in (readme_swap_diff(), readme_diff("server-data-diff")):
        subprocess.run(["git", "apply", "-"], input=diff, text=True, cwd=app, check=True)
    monkeypatch.syspath_prepend(str(app))
    for name in [m for m in sys.modules if m == "digitsapp" or m.startswith("digitsapp.")]:
        monkeypatch.delitem(sys.modules, name)
    server_app = importlib.import_module("digitsapp.server_app")
    seen: dict[str, object] = {}

    class Recording:
        """Stands in for FedFiOT: keeps what the snippet gives it and runs the app's evaluation once."""

        def __init__(self, *, server_data=None, **_: object) -> None:  # noqa: ANN001
            seen["server_data"] = server_data

        def start(self, *, initial_arrays, evaluate_fn, **_: object):  # noqa: ANN001, ANN202
            evaluate_fn(1, initial_arrays)
            return types.SimpleNamespace(evaluate_metrics_serverapp={})

    def spy_test(model, loader, device):  # noqa: ANN001, ANN202
        seen["evaluated"] = loader
        return 0.0, 0.0

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    n_central = len(server_app.load_centralized_dataset().dataset)
    ids = torch.arange(n_central, dtype=torch.float32).reshape(-1, 1, 1, 1).expand(-1, 1, 8, 8).clone()
    labelled_ids = TensorDataset(ids, torch.zeros(n_central, dtype=torch.long))
    monkeypatch.setattr(server_app, "load_centralized_dataset", lambda: DataLoader(labelled_ids, batch_size=256))
    monkeypatch.setattr(server_app, "FedFiOT", Recording)
    monkeypatch.setattr(server_app, "test", spy_test)
    run_config = {"fraction-train": 1.0, "num-server-rounds": 1, "lr": 0.01, "seed": 0, "results-file": ""}
    server_app.main(None, types.SimpleNamespace(run_config=run_config))  # ServerApp.main returns the function
    held, evaluated = _example_ids(seen["server_data"]), _example_ids(seen["evaluated"])
    assert len(held) >= 50 and len(evaluated) >= n_central // 2
    assert set(held).isdisjoint(evaluated)


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
