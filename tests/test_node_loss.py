"""A SuperNode lost during a run: later rounds go on with the nodes left, after a bounded wait."""

from __future__ import annotations

import functools
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import ROOT, SHAPES, SPEC, FakeGrid, app_snapshot, live_processes
from flwr.app import Array, ArrayRecord, ConfigRecord

from fedfiot_flwr import FedFiOT
from fedfiot_flwr.server import shell
from fedfiot_flwr.server.nodes import NodeWaiter
from scripts.launch import LocalFederation


def _arrays() -> ArrayRecord:
    return ArrayRecord({k: Array(np.zeros(s, np.float32)) for k, s in SHAPES.items()})


def _strategies_wait_with(monkeypatch: pytest.MonkeyPatch, **fields: Any) -> None:
    """Strategies built from now on wait for nodes with these :class:`NodeWaiter` fields.

    ``clock``, ``sleep`` and ``poll_s`` are the waiter's documented replaceable parts; the strategy
    still builds its waiter itself from ``node_wait_s``.
    """
    monkeypatch.setattr(shell, "NodeWaiter", functools.partial(NodeWaiter, **fields))


def test_sampling_goes_on_with_the_nodes_left_after_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    _strategies_wait_with(monkeypatch, poll_s=0.02)
    grid = FakeGrid([11, 12, 13], None)
    strategy = FedFiOT(spec=SPEC, min_train_nodes=3, min_available_nodes=3, min_valid_replies=2, node_wait_s=0.2)
    first = list(strategy.configure_train(1, _arrays(), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in first) == [11, 12, 13]
    grid.node_ids = [11, 13]  # node 12 is gone
    second = list(strategy.configure_train(2, _arrays(), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in second) == [11, 13]
    assert strategy.min_available_nodes == 3 and strategy.min_train_nodes == 3  # restored for later rounds
    assert strategy.unavailable_nodes == {2: [12]}
    # the round after goes on the same way from the restored minimum (and still names the lost node)
    third = list(strategy.configure_train(3, _arrays(), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in third) == [11, 13]
    assert strategy.min_available_nodes == 3 and strategy.min_train_nodes == 3
    assert strategy.unavailable_nodes == {2: [12], 3: [12]}
    grid.node_ids = [11]
    with pytest.raises(RuntimeError, match=r"round 4: only 1 nodes connected .* at least 2 needed"):
        strategy.configure_train(4, _arrays(), ConfigRecord(), grid)


class FakeClock:
    """``time.monotonic`` and ``time.sleep`` of a :class:`NodeWaiter`: sleeping only moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


Sampled = tuple[list[int], list[int], float]


def _round(strategy: FedFiOT, grid: FakeGrid, clock: FakeClock, server_round: int) -> Sampled:
    """Sample a round's training and evaluation; return both node lists and the time spent waiting."""
    start = clock.now
    train = list(strategy.configure_train(server_round, _arrays(), ConfigRecord(), grid))
    evaluate = list(strategy.configure_evaluate(server_round, _arrays(), ConfigRecord(), grid))
    return (sorted(m.metadata.dst_node_id for m in train), sorted(m.metadata.dst_node_id for m in evaluate),
            clock.now - start)


def _node_lost_in_round_one(monkeypatch: pytest.MonkeyPatch) -> tuple[FedFiOT, FakeGrid, FakeClock]:
    """A FedFiOT strategy with 3 nodes after round 1's training, in which node 13 was lost."""
    grid, clock = FakeGrid([11, 12, 13], None), FakeClock()
    _strategies_wait_with(monkeypatch, clock=clock.monotonic, sleep=clock.sleep)
    strategy = FedFiOT(spec=SPEC, min_train_nodes=3, min_evaluate_nodes=3, min_available_nodes=3,
                       min_valid_replies=2, node_wait_s=5.0)
    strategy.configure_train(1, _arrays(), ConfigRecord(), grid)
    grid.node_ids = [11, 12]
    return strategy, grid, clock


def test_a_lost_node_is_waited_for_once_not_in_every_later_round(monkeypatch: pytest.MonkeyPatch) -> None:
    def flower_waits(seconds: float) -> None:  # Flower's own unbounded wait for min_available_nodes
        raise AssertionError("Flower's sampling waited for a node the strategy knows is missing")

    monkeypatch.setattr("flwr.serverapp.strategy.strategy_utils.sleep", flower_waits)
    strategy, grid, clock = _node_lost_in_round_one(monkeypatch)
    evaluate = list(strategy.configure_evaluate(1, _arrays(), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in evaluate) == [11, 12]
    assert clock.now == 5.0  # the first time it is missed: one full wait
    for server_round in (2, 3):  # the later rounds go on at once, training and evaluation
        assert _round(strategy, grid, clock, server_round) == ([11, 12], [11, 12], 0.0)
    assert strategy.unavailable_nodes == {2: [13], 3: [13]}
    assert strategy.min_available_nodes == strategy.min_train_nodes == strategy.min_evaluate_nodes == 3

    grid.node_ids = [11, 12, 13]  # node 13 is back: used again
    assert _round(strategy, grid, clock, 4) == ([11, 12, 13], [11, 12, 13], 0.0)
    grid.node_ids = [11, 13]  # a new loss is waited for once again
    assert _round(strategy, grid, clock, 5) == ([11, 13], [11, 13], 5.0)
    assert _round(strategy, grid, clock, 6) == ([11, 13], [11, 13], 0.0)

    grid.node_ids = [11]  # below min_valid_replies: never a skipped wait, and the round fails after it
    for server_round in (7, 8):
        start = clock.now
        with pytest.raises(RuntimeError, match=rf"round {server_round}: only 1 nodes connected .* at least 2 needed"):
            strategy.configure_train(server_round, _arrays(), ConfigRecord(), grid)
        assert clock.now - start == 5.0


def test_a_node_that_reconnects_during_the_wait_ends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    grid, clock = FakeGrid([11, 12], None), FakeClock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now >= 3.0:
            grid.node_ids = [11, 12, 13]

    _strategies_wait_with(monkeypatch, clock=clock.monotonic, sleep=sleep)
    strategy = FedFiOT(spec=SPEC, min_train_nodes=3, min_available_nodes=3, min_valid_replies=2, node_wait_s=60.0)
    sent = list(strategy.configure_train(1, _arrays(), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in sent) == [11, 12, 13] and clock.now == 3.0


def _wait_for_line(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} not in {path} after {timeout:.0f}s")


@pytest.mark.slow
def test_a_supernode_killed_in_round_1_does_not_stop_the_run(tmp_path: Path) -> None:
    """A real deployment (one ``flower-superlink``, three ``flower-supernode`` processes, ``flwr
    run`` against them) that loses a SuperNode in round 1 finishes its rounds, records the lost
    node, writes its checkpoint, leaves the app untouched and stops every process by PID.

    Two rounds: round 2 is the first after the loss (bounded wait, sampling and federated
    evaluation with the nodes left, the broadcast reference); the rounds after it repeat that
    path, which the test above checks on a fake Grid."""
    before = app_snapshot()
    fed = LocalFederation(mode="deployment", num_supernodes=3, workdir=tmp_path / "fed")
    results = tmp_path / "results" / "loss" / "results.json"
    outcome: dict[str, object] = {}
    try:
        fed.start()
        pids = fed.pids()
        victim = fed.node_id("supernode-2")
        config = {
            "num-partitions": 3, "alpha": 0.5, "local-epochs": 2, "validation-size": 100, "num-server-rounds": 2,
            "sweep-rho": "0.5", "sweep-lam": "1e-4", "node-wait-s": 3.0,
            "results-dir": str(tmp_path / "results"), "run-name": "loss",
        }
        runner = threading.Thread(target=lambda: outcome.update(proc=fed.flwr_run(ROOT, config, timeout=240)))
        runner.start()
        _wait_for_line(fed.log_path("supernode-2"), "Received successfully", timeout=120)  # round 1 reached it
        fed.kill("supernode-2")
        runner.join(timeout=240)
        logs = "\n".join(fed.log_path(r).read_text(errors="replace")[-2000:] for r in pids)
        assert results.exists(), logs
        data = json.loads(results.read_text())
    finally:
        fed.stop()
    assert live_processes(list(pids.values())) == [], pids
    assert data["status"] == "finished", f"{data.get('error')}\n{logs}"
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    first = data["rounds"][0]
    assert [r["client"] for r in first["rejected"]] == [str(victim)], first["rejected"]
    assert "error reply" in first["rejected"][0]["reason"]
    assert str(victim) not in first["clients"] and len(first["clients"]) == 2
    for later in data["rounds"][1:]:
        assert sorted(later["clients"]) == sorted(first["clients"]) and later["rejected"] == [], later
    assert data["rounds"][1]["unavailable_nodes"] == [victim]
    for rnd in data["rounds"]:
        assert rnd["bytes_received"] > 0 and rnd["test"]["accuracy"] > 0, rnd.get("test")
    # later rounds may also start from the broadcast model (the previous round's merge)
    assert {t["reference"] for t in data["rounds"][1]["trials"]} == {"largest", "broadcast"}
    assert data["final"]["test"]["accuracy"] > data["initial_test"]["accuracy"], (data["final"], data["initial_test"])
    assert (tmp_path / "results" / "loss" / "checkpoints" / "final.pt").exists()
    assert app_snapshot() == before


class JoiningGrid:
    """A grid whose nodes connect at given times of a :class:`FakeClock`."""

    def __init__(self, clock: FakeClock, joins: dict[int, float]) -> None:
        self.clock, self.joins = clock, joins

    def get_node_ids(self) -> list[int]:
        return [n for n, t in self.joins.items() if t <= self.clock.now]


@pytest.mark.parametrize("joins, expected", [
    ({11: 2.0, 12: 2.0, 13: 2.0}, 3),  # all at once (the simulation engine)
    ({11: 1.0, 12: 3.0, 13: 4.5}, 3),  # one by one, each within the settle time of the last
    ({11: 1.0, 12: 3.0, 13: 9.0}, 2),  # the third joins after the set stayed unchanged for settle_s
    ({}, 0),  # nobody within the timeout
])
def test_the_federation_is_taken_once_its_node_set_stays_unchanged(joins: dict[int, float], expected: int) -> None:
    clock = FakeClock()
    waiter = NodeWaiter(timeout_s=5.0, poll_s=0.5, clock=clock.monotonic, sleep=clock.sleep)
    assert waiter.wait_for_stable_set(JoiningGrid(clock, joins), settle_s=2.0) == expected
    assert clock.now <= 5.0 + 2.0 + 0.5  # bounded: the timeout plus the settle time


def test_a_set_that_keeps_changing_is_taken_as_it_is_after_the_timeout_and_the_settle_time() -> None:
    clock = FakeClock()
    waiter = NodeWaiter(timeout_s=3.0, poll_s=0.5, clock=clock.monotonic, sleep=clock.sleep)
    joins = {n: 0.4 * n for n in range(1, 100)}  # a new node every 0.4 s
    connected = waiter.wait_for_stable_set(JoiningGrid(clock, joins), settle_s=1.0)
    assert 0 < connected < 99 and clock.now == pytest.approx(4.0, abs=0.5)


def test_a_lost_node_is_reported_once_with_the_time_actually_waited(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    strategy, grid, clock = _node_lost_in_round_one(monkeypatch)
    with caplog.at_level("INFO"):
        strategy.configure_evaluate(1, _arrays(), ConfigRecord(), grid)
        for server_round in (2, 3):
            _round(strategy, grid, clock, server_round)
    waits = [r.getMessage() for r in caplog.records if "node-wait-s" in r.getMessage()]
    assert waits == ["round 1: 2 of 3 nodes connected after waiting 5s for the missing ones (node-wait-s); "
                     "going on with the connected ones"]
