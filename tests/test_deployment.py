"""End to end on real Flower processes over loopback: one ``flower-superlink``, two
``flower-supernode`` processes (partition-id 0 and 1), ``flwr run`` against them; the results
file is checked and all three processes are stopped by PID."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _fedfiot_helpers import ROOT, app_snapshot, live_processes

from fedfiot_flwr.launch import LocalFederation


@pytest.mark.slow
def test_deployment_with_superlink_and_two_supernodes(tmp_path: Path) -> None:
    before = app_snapshot()
    fed = LocalFederation(mode="deployment", num_supernodes=2, workdir=tmp_path / "fed")
    try:
        fed.start()
        pids = fed.pids()
        assert set(pids) == {"superlink", "supernode-0", "supernode-1"}
        proc = fed.flwr_run(
            ROOT,
            {
                "num-partitions": 2, "alpha": 0.5, "local-epochs": 2, "validation-size": 100, "fraction-evaluate": 0.0,
                "sweep-rho": "0.3,0.5", "sweep-lam": "1e-4", "num-server-rounds": 2,
                "results-dir": str(tmp_path / "results"), "run-name": "deploy", "node-wait-s": 60.0,
            },
            timeout=300,
        )
        results = tmp_path / "results" / "deploy" / "results.json"
        logs = "\n".join(fed.log_path(r).read_text(errors="replace")[-3000:] for r in pids)
        assert results.exists(), f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
        data = json.loads(results.read_text())
        assert data["status"] == "finished", f"{data.get('error')}\n{logs}"
    finally:
        fed.stop()
    assert all(p.poll() is not None for p in fed.processes.values()), pids
    assert live_processes(list(pids.values())) == [], pids

    assert [r["round"] for r in data["rounds"]] == [1, 2]
    for rnd in data["rounds"]:
        summary = {k: rnd.get(k) for k in ("round", "clients", "rejected", "test", "chosen")}
        assert len(rnd["clients"]) == 2 and rnd["rejected"] == [], summary  # both real SuperNodes replied
        assert rnd["bytes_received"] > 0 and rnd["test"]["accuracy"] > 0, summary
    # round 2 may also start from the broadcast model (the round-1 merge)
    assert {t["reference"] for t in data["rounds"][1]["trials"]} == {"largest", "broadcast"}
    assert data["final"]["test"]["accuracy"] > data["initial_test"]["accuracy"], (data["final"], data["initial_test"])
    assert (tmp_path / "results" / "deploy" / "checkpoints" / "final.pt").exists()
    assert app_snapshot() == before
