"""TLS and SuperNode authentication on loopback: a SuperNode without an accepted key is refused,
the run completes with the accepted ones, over a TLS-only SuperLink."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import httpx
import pytest
from _fedfiot_helpers import ROOT, live_processes

from scripts.launch import LocalFederation, generate_supernode_key, generate_tls_files


@pytest.mark.slow
def test_tls_superlink_accepts_only_registered_supernodes(tmp_path: Path) -> None:
    tls = generate_tls_files(tmp_path / "certs")
    keys = [generate_supernode_key(tmp_path / "keys", f"node{i}") for i in range(3)]
    fed = LocalFederation(
        mode="deployment", num_supernodes=3, workdir=tmp_path / "fed", tls=tls, supernode_auth=True,
        supernode_keys=[private for private, _ in keys],
        registered_keys=[keys[0][1], keys[1][1]],  # node 2's key is never registered
    )
    results = tmp_path / "results" / "tls" / "results.json"
    try:
        fed.start()
        pids = fed.pids()
        # TLS only: plain HTTP is not served, and the certificate verifies against the test CA
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{fed.port}/health", timeout=2.0)
        context = ssl.create_default_context(cafile=str(tls.ca_cert))
        assert httpx.get(f"https://127.0.0.1:{fed.port}/health", timeout=5.0, verify=context).is_success
        accepted = {fed.node_id("supernode-0"), fed.node_id("supernode-1")}
        proc = fed.flwr_run(ROOT, {
            # no federated evaluation: the training round already carries every message this
            # test is about (TLS only, the refused node absent from the sampled set)
            "num-partitions": 0, "node-wait-s": 30.0, "node-settle-s": 1.0, "local-epochs": 1,
            "fraction-evaluate": 0.0, "validation-size": 100, "sweep-rho": "0.5", "sweep-lam": "1e-4",
            "results-dir": str(tmp_path / "results"), "run-name": "tls",
        }, timeout=240)
        refused = fed.processes["supernode-2"].wait(timeout=30)
        logs = {r: fed.log_path(r).read_text(errors="replace") for r in pids}
        assert results.exists(), f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}{logs['superlink'][-2000:]}"
        data = json.loads(results.read_text())
    finally:
        fed.stop()
    assert live_processes(list(pids.values())) == [], pids
    assert refused != 0 and "Failed to activate SuperNode" in logs["supernode-2"], logs["supernode-2"][-1500:]
    assert "SuperNode ID" not in logs["supernode-2"]
    assert data["status"] == "finished", data.get("error")
    (rnd,) = data["rounds"]
    assert {int(c) for c in rnd["clients"]} == accepted and rnd["rejected"] == []
