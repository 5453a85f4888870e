"""A run stopped after a round goes on from its last checkpoint; a bad checkpoint fails before any client trains."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import (
    ROOT,
    SHAPES,
    FakeGrid,
    app_snapshot,
    held_by_another_process,
    live_processes,
    packed,
    tiny_mlp,
)
from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from torch.utils.data import TensorDataset

from fedfiot_flwr import FedFiOT
from fedfiot_flwr.server import FedFiOTConfig, RunRecorder, SweepGrid
from fedfiot_flwr.server.checkpoint import FORMAT_VERSION, CheckpointError, load_resume_point
from fedfiot_flwr.server.run_lock import RunDirectoryHeld, lock_holder
from fedfiot_flwr.server.shell import arrays_to_numpy, numpy_to_arrays
from scripts.launch import wait_for_results

NODES = [101, 102, 103]
CONFIG = {"app": {"lr": 0.02, "seed": 0, "results-dir": "somewhere"}}
MAY_DIFFER = ["app.results-dir"]


class Stopped(BaseException):
    """The ServerApp dying mid-run (not an error the strategy could handle)."""


class Clients:
    """Three deterministic clients: a round's upload depends only on the broadcast model, the node and the round."""

    def __init__(self, stop_in_round: int | None = None) -> None:
        self.stop_in_round = stop_in_round
        self.trained: list[tuple[int, int]] = []  # (round, node) of every training instruction answered

    def __call__(self, node: int, msg: Message) -> Message:
        server_round = int(msg.content["config"]["server-round"])
        if msg.metadata.message_type == MessageType.EVALUATE:
            metrics = MetricRecord({"eval-loss": 1.0 / (server_round + node), "num-examples": 10})
            return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
        if server_round == self.stop_in_round:
            raise Stopped(f"killed in round {server_round}")
        self.trained.append((server_round, node))
        rng = np.random.default_rng(1000 * server_round + node)
        broadcast = arrays_to_numpy(msg.content["arrays"])
        weights = {k: (0.5 * v + rng.normal(scale=0.3, size=v.shape)).astype(np.float32) for k, v in broadcast.items()}
        fisher = {k: (rng.random(v.shape) ** 2).astype(np.float32) for k, v in broadcast.items()}
        return Message(content=packed(weights, fisher, 20 + node % 7), reply_to=msg)


def _server_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(48, 4, generator=gen), torch.randint(0, 3, (48,), generator=gen))


def _strategy(model: torch.nn.Module | None = None, **options: Any) -> FedFiOT:
    """The default preset with a small grid: validation chooses among the largest client and the broadcast model
    as reference (the previous round's global model, what a resumed run takes from the checkpoint)."""
    sweep = SweepGrid(rhos=(0.3, 0.5), lams=(1e-4,), references=("largest", "broadcast"), fisher_scalings=("none",))
    return FedFiOT(model=model or tiny_mlp(), config=FedFiOTConfig.default(sweep=sweep), server_data=_server_data(),
                   min_train_nodes=3, min_available_nodes=3, **options)


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def _test_fn(server_round: int, arrays: Any) -> MetricRecord:
    return MetricRecord({"accuracy": float(np.mean(arrays_to_numpy(arrays)["fc3.bias"] > 0)), "round": server_round})


def _run(recorder: RecordDict | RunRecorder, clients: Clients, num_rounds: int = 4, model: Any = None) -> Any:
    strategy = _strategy(model)
    initial = _initial() if model is None else {k: v.numpy() for k, v in model.state_dict().items()}
    return recorder.run(strategy, grid=FakeGrid(NODES, clients), initial_arrays=numpy_to_arrays(initial),
                        num_rounds=num_rounds, train_config=ConfigRecord({"lr": 0.02}), evaluate_fn=_test_fn)


def _stopped_run(tmp_path: Path) -> Path:
    """A run of 4 rounds whose ServerApp died in round 3: its directory, with rounds 1 and 2 checkpointed."""
    recorder = RunRecorder.create(tmp_path, "stopped", CONFIG)
    with pytest.raises(Stopped):
        _run(recorder, Clients(stop_in_round=3))
    return recorder.run_dir


def _files(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _outcome(record: dict[str, Any]) -> dict[str, Any]:
    """What a round's record says about its result (not the order the replies arrived in, nor timings; the
    validation scores are sums in arrival order, equal to rounding)."""
    return {**{k: record[k] for k in ("round", "chosen", "test", "fedavg_test", "rejected")},
            "validation": {k: round(v, 6) for k, v in record["validation"].items()}}


def test_a_resumed_run_ends_as_the_uninterrupted_one_and_leaves_the_earlier_directory_alone(tmp_path: Path) -> None:
    whole = RunRecorder.create(tmp_path, "whole", CONFIG)
    expected = _run(whole, Clients())
    stopped = _stopped_run(tmp_path)
    before = _files(stopped)
    assert {"checkpoints/round-002.pt", "checkpoints/round-002.state.json"} <= set(before)

    clients = Clients()
    resumed = RunRecorder.create(tmp_path, "resumed", dict(CONFIG, app=dict(CONFIG["app"], **{"results-dir": "x"})),
                                 resume_from=stopped, may_differ=MAY_DIFFER)
    result = _run(resumed, clients)

    assert sorted(clients.trained) == [(r, n) for r in (3, 4) for n in NODES]  # only the rounds left
    final, reference = arrays_to_numpy(result.arrays), arrays_to_numpy(expected.arrays)
    assert all(np.array_equal(final[k], reference[k]) for k in reference)
    assert _files(stopped) == before  # the earlier run is never written to
    data = json.loads(resumed.path.read_text())
    assert data["status"] == "finished" and data["resumed_from"]["round"] == 2
    assert data["resumed_from"]["run_dir"] == str(stopped)
    assert [r["round"] for r in data["rounds"]] == [1, 2, 3, 4]
    assert [r.get("carried_over", False) for r in data["rounds"]] == [True, True, False, False]
    reference_data = json.loads(whole.path.read_text())
    assert [_outcome(r) for r in data["rounds"]] == [_outcome(r) for r in reference_data["rounds"]]
    assert data["rounds"][0]["checkpoint"] == str(stopped / "checkpoints" / "round-001.pt")  # where it lies
    assert data["initial_test"] == reference_data["initial_test"]
    assert data["final"]["test"] == reference_data["final"]["test"] and data["final"]["resumed_after_round"] == 2
    for name in ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp"):
        got, want = getattr(result, name), getattr(expected, name)
        assert set(got) == set(want) and all(dict(got[r]) == pytest.approx(dict(want[r])) for r in want), name
    assert set(result.aggregation_metrics_serverapp) == {1, 2, 3, 4}
    # the resumed run's own checkpoints can be resumed from in turn
    assert load_resume_point(resumed.run_dir).round == 4


def test_a_resumed_run_can_be_resumed_again(tmp_path: Path) -> None:
    expected = _run(RunRecorder.create(tmp_path, "whole", CONFIG), Clients(), num_rounds=5)
    stopped = _stopped_run(tmp_path)
    second = RunRecorder.create(tmp_path, "second", CONFIG, resume_from=stopped)
    with pytest.raises(Stopped):
        _run(second, Clients(stop_in_round=4), num_rounds=5)
    third = RunRecorder.create(tmp_path, "third", CONFIG, resume_from=second.run_dir)
    clients = Clients()
    result = _run(third, clients, num_rounds=5)
    assert sorted(clients.trained) == [(r, n) for r in (4, 5) for n in NODES]
    final, reference = arrays_to_numpy(result.arrays), arrays_to_numpy(expected.arrays)
    assert all(np.array_equal(final[k], reference[k]) for k in reference)
    data = json.loads(third.path.read_text())
    assert [(r["round"], r.get("carried_over", False)) for r in data["rounds"]] == \
        [(1, True), (2, True), (3, True), (4, False), (5, False)]


# -- bad checkpoints: each fails naming the file and what is wrong, before any client trains ---------------------


def _truncate_model(run: Path) -> None:
    path = run / "checkpoints" / "round-002.pt"
    path.write_bytes(path.read_bytes()[:100])


def _truncate_state(run: Path) -> None:
    path = run / "checkpoints" / "round-002.state.json"
    path.write_text(path.read_text()[:300])


def _corrupt_model(run: Path) -> None:
    path = run / "checkpoints" / "round-002.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _newer_format(run: Path) -> None:
    path = run / "checkpoints" / "round-002.state.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), format_version=FORMAT_VERSION + 1)))


def _no_state(run: Path) -> None:
    for path in (run / "checkpoints").glob("*.state.json"):
        path.unlink()


FILE_CASES = {
    "truncated-model": (_truncate_model, "round-002.pt", r"SHA-256 differs .* truncated, corrupted or replaced"),
    "corrupted-model": (_corrupt_model, "round-002.pt", r"SHA-256 differs .* truncated, corrupted or replaced"),
    "truncated-state": (_truncate_state, "round-002.state.json", r"unreadable resume state, truncated or corrupted"),
    "newer-format": (_newer_format, "round-002.state.json", rf"format version {FORMAT_VERSION + 1} is newer than "
                                                            rf"this fedfiot-flwr reads \(up to {FORMAT_VERSION}\)"),
    "no-state": (_no_state, "", r"has model checkpoints \(round-001.pt, round-002.pt\) but no "
                                           r"round-NNN.state.json .* nothing to resume from"),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_a_damaged_checkpoint_fails_naming_the_file_before_any_client_trains(tmp_path: Path, case: str) -> None:
    damage, file_name, what = FILE_CASES[case]
    stopped = _stopped_run(tmp_path)
    damage(stopped)
    with pytest.raises(CheckpointError, match=what) as info:
        recorder = RunRecorder.create(tmp_path, "resumed", CONFIG, resume_from=stopped)
        _run(recorder, Clients())  # not reached: the recorder refuses the checkpoint when it is created
    assert str(info.value).startswith(f"{stopped / 'checkpoints' / file_name}: ".replace("/: ", ": "))
    failed = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert failed["status"] == "failed" and str(info.value) in failed["error"] and failed["rounds"] == []
    assert failed["resumed_from"]["path"] == str(stopped)


def _other_model() -> torch.nn.Module:
    model = tiny_mlp()
    model.fc2 = torch.nn.Linear(6, 7)
    model.fc3 = torch.nn.Linear(7, 3)
    return model


MISMATCH_CASES = {
    "other-model": ({"model": _other_model()}, r"written for another model \(3 tensors differ: fc2.weight: "
                                               r"\['float32', \[5, 6\]\] in the checkpoint, \['float32', \[7, 6\]\] now"),
    "other-configuration": ({"config": {"app": dict(CONFIG["app"], lr=0.05)}},
                            r"written with another configuration \(app.lr=0.02 in the checkpoint, 0.05 now\)"),
    "nothing-left": ({"num_rounds": 2}, r"round 2 is already complete and the run has num_rounds = 2; nothing left"),
}


@pytest.mark.parametrize("case", list(MISMATCH_CASES))
def test_a_checkpoint_of_another_run_fails_naming_the_file_before_any_client_trains(tmp_path: Path, case: str) -> None:
    change, what = MISMATCH_CASES[case]
    stopped = _stopped_run(tmp_path)
    recorder = RunRecorder.create(tmp_path, "resumed", change.get("config", CONFIG), resume_from=stopped)
    clients = Clients()
    with pytest.raises(CheckpointError, match=what) as info:
        _run(recorder, clients, num_rounds=change.get("num_rounds", 4), model=change.get("model"))
    assert str(info.value).startswith(str(stopped / "checkpoints" / "round-002.state.json"))
    assert clients.trained == []
    failed = json.loads(recorder.path.read_text())
    assert failed["status"] == "failed" and str(info.value) in failed["error"]


def test_a_round_checkpoint_file_resumes_from_that_round(tmp_path: Path) -> None:
    stopped = _stopped_run(tmp_path)
    point = load_resume_point(stopped / "checkpoints" / "round-001.pt")
    assert point.round == 1 and point.state_path.name == "round-001.state.json" and point.run_dir == stopped
    model = torch.load(stopped / "checkpoints" / "round-001.pt", weights_only=True)  # still a plain state_dict
    assert all(np.array_equal(model[k].numpy(), point.model[k]) for k in SHAPES)
    with pytest.raises(CheckpointError, match=r"no such run directory"):
        load_resume_point(tmp_path / "nowhere")


# -- the launcher -----------------------------------------------------------------------------------------------


# -- one writer per run directory ------------------------------------------------------------------------------------

def test_a_resume_from_a_directory_a_live_run_holds_fails_before_any_client_trains(tmp_path: Path) -> None:
    stopped = _stopped_run(tmp_path)
    live = held_by_another_process(stopped)
    try:
        before = _files(stopped)
        with pytest.raises(RunDirectoryHeld, match=rf"held by a live run: PID {live.pid} on host"):
            RunRecorder.create(tmp_path, "second", CONFIG, resume_from=stopped)
        assert _files(stopped) == before
        record = json.loads((tmp_path / "second" / "results.json").read_text())
        assert record["status"] == "failed" and f"PID {live.pid}" in record["error"]
        assert not (tmp_path / "second" / "run.lock").exists()  # the refused run let go of its own directory
    finally:
        live.kill()
        live.wait(timeout=10)


def test_a_resumed_run_holds_the_earlier_directory_until_it_ends(tmp_path: Path) -> None:
    stopped = _stopped_run(tmp_path)
    before = _files(stopped)
    first = RunRecorder.create(tmp_path, "first", CONFIG, resume_from=stopped)
    assert lock_holder(stopped).pid == os.getpid() and lock_holder(first.run_dir).pid == os.getpid()
    with pytest.raises(RunDirectoryHeld):  # the same run cannot go on in two places at once
        RunRecorder.create(tmp_path, "second", CONFIG, resume_from=stopped)
    _run(first, Clients())
    assert lock_holder(stopped) is None and lock_holder(first.run_dir) is None
    assert _files(stopped) == before and not (first.run_dir / "run.lock").exists()
    again = RunRecorder.create(tmp_path, "third", CONFIG, resume_from=stopped)  # free again once it ended
    assert again.resume is not None and again.resume.round == 2


def test_the_launcher_resumes_with_the_settings_the_checkpoint_recorded(tmp_path: Path) -> None:
    from scripts.launch import resumed_run_config

    stopped = _stopped_run(tmp_path)
    settings = resumed_run_config(stopped, None, {"num-server-rounds": 6})
    assert settings == {"lr": 0.02, "seed": 0, "num-server-rounds": 6, "resume-from": str(stopped)}
    toml = tmp_path / "more.toml"
    toml.write_text("lr = 0.05\nseed = 3\n")
    assert resumed_run_config(stopped, toml, {"seed": 4})["lr"] == 0.05  # then checked by the app against the checkpoint
    assert resumed_run_config(stopped, toml, {"seed": 4})["seed"] == 4


def test_the_launcher_refuses_a_bad_checkpoint_before_starting_a_federation(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from scripts import launch

    stopped = _stopped_run(tmp_path)
    _truncate_state(stopped)
    assert launch.main(["--resume", str(stopped), "--results-dir", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err
    assert f"FAILED: {stopped / 'checkpoints' / 'round-002.state.json'}: unreadable resume state" in err
    assert not (tmp_path / "new").exists()  # no federation started, no run directory


# -- a real deployment killed after round 2 and resumed -----------------------------------------------------------


def _wait_for(path: Path, timeout: float, alive: Any = None) -> float:
    """Wait until ``path`` exists (``alive()`` must stay true meanwhile); return the time it took."""
    start = time.monotonic()
    while not path.exists():
        if time.monotonic() - start > timeout or (alive is not None and not alive()):
            raise TimeoutError(f"{path} did not appear within {time.monotonic() - start:.0f}s")
        time.sleep(0.1)
    return time.monotonic() - start


def _final_model(run_dir: Path) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in torch.load(run_dir / "checkpoints" / "final.pt", weights_only=True).items()}


@pytest.mark.slow
def test_a_deployment_killed_after_round_2_resumes_and_ends_as_the_uninterrupted_run(tmp_path: Path) -> None:
    """Three real SuperNodes, 4 rounds. The SuperLink and the ServerApp are killed by PID (SIGKILL) once round 2
    is checkpointed; the SuperLink is restarted on its database, the SuperNodes reconnect on their own, and the
    run resumed from the killed run's directory ends with the model of an uninterrupted run with the same seeds."""
    from scripts.launch import LocalFederation, descendants

    before = app_snapshot()
    results = tmp_path / "results"
    config = {
        "num-partitions": 3, "alpha": 0.5, "local-epochs": 1, "validation-size": 100, "num-server-rounds": 4,
        "sweep-rho": "0.5", "sweep-lam": "1e-4", "fraction-evaluate": 0.0, "node-wait-s": 60.0,
        "results-dir": str(results),
    }
    fed = LocalFederation(mode="deployment", num_supernodes=3, workdir=tmp_path / "fed")
    seen: set[int] = set()
    try:
        fed.start()
        fed.flwr_run(ROOT, {**config, "run-name": "whole"}, timeout=300)
        whole = json.loads((results / "whole" / "results.json").read_text())
        assert whole["status"] == "finished", whole.get("error")

        run = fed.start_flwr_run(ROOT, {**config, "run-name": "killed"})
        _wait_for(results / "killed" / "checkpoints" / "round-002.state.json", 240, alive=lambda: run.poll() is None)
        superlink = fed.processes["superlink"]
        serverapps = fed.serverapp_pids()
        seen |= {superlink.pid, *descendants(superlink.pid), *serverapps}
        assert len(serverapps) == 1
        os.kill(superlink.pid, signal.SIGKILL)
        os.kill(serverapps[0], signal.SIGKILL)
        superlink.wait(timeout=30)
        fed.kill("flwr-run", signal.SIGKILL)
        # The killed ServerApp's lock file stays behind (stale), for the resumed run to take over and remove.
        assert (results / "killed" / "run.lock").exists()
        killed_files = {p: p.read_bytes() for p in (results / "killed").rglob("*") if p.is_file() and p.name != "run.lock"}

        restarted = time.monotonic()
        fed.restart_superlink()
        resumed_run = fed.start_flwr_run(ROOT, {**config, "run-name": "resumed",
                                                "resume-from": str(results / "killed")}, role="flwr-run-resumed")
        _wait_for(results / "resumed" / "checkpoints" / "round-003.state.json", 240,
                  alive=lambda: resumed_run.poll() is None)
        first = time.monotonic() - restarted
        data = wait_for_results(results / "resumed" / "results.json", timeout=240)
        seen |= set(fed.pids().values()) | {p for pid in fed.pids().values() for p in descendants(pid)}
    finally:
        fed.stop()
        seen |= {p.pid for p in fed._replaced}
    assert live_processes(sorted(seen)) == [], "left running"
    assert data["status"] == "finished", data.get("error")
    killed = json.loads((results / "killed" / "results.json").read_text())
    assert killed["status"] == "running" and [r["round"] for r in killed["rounds"]][:2] == [1, 2]
    assert {p: p.read_bytes() for p in (results / "killed").rglob("*") if p.is_file()} == killed_files  # lock gone
    assert data["resumed_from"]["round"] == 2 and data["resumed_from"]["run_dir"] == str(results / "killed")
    assert [(r["round"], r.get("carried_over", False)) for r in data["rounds"]] == \
        [(1, True), (2, True), (3, False), (4, False)]
    assert not (results / "resumed" / "checkpoints" / "round-002.pt").exists()  # the earlier rounds stay where they are
    resumed_model, whole_model = _final_model(results / "resumed"), _final_model(results / "whole")
    largest = max(float(np.max(np.abs(resumed_model[k] - whole_model[k]))) for k in whole_model)
    print(f"\nresume: {first:.1f}s from the SuperLink's restart to the end of the first resumed round; "
          f"largest difference from the uninterrupted final model {largest:.3g}")
    assert largest <= 1e-6
    assert data["final"]["test"] == pytest.approx(whole["final"]["test"], abs=1e-6)
    assert app_snapshot() == before


#: A ServerApp process as Flower's simulation runtime runs it: Flower's signal handlers in the main thread, the
#: recorded run in another. In round 3 the process is asked to stop (``SIGNUM``) and the last client of the round
#: dies in the shutdown (an error reply), as a ClientApp does when its federation is stopped under it: after the
#: process heard of the stop ("stop-first"), or a second before it ("dies-first": the stop reached the clients
#: before the ServerApp's main thread ran its handler).
STOPPED_PROCESS = """
import os, signal, sys, threading, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from flwr.app import Error, Message, MessageType
from flwr.supercore.exit import register_signal_handlers
from flwr.supercore.task_identity import TaskIdentity
from flwr.supercore.telemetry import EventType
from fedfiot_flwr.server import RunRecorder
from fedfiot_flwr.server.stop_request import stop_requested
import test_resume
from test_resume import CONFIG, NODES, Clients, _run, _strategy

test_resume._strategy = lambda model=None: _strategy(model, min_valid_replies=2)  # a round goes on without one client

class DyingInTheShutdown(Clients):
    def __call__(self, node, msg):
        if (msg.metadata.message_type == MessageType.TRAIN and int(msg.content["config"]["server-round"]) == 3
                and node == NODES[-1]):
            stop = lambda: os.kill(os.getpid(), getattr(signal, sys.argv[3]))
            if sys.argv[4] == "dies-first":
                threading.Timer(1.0, stop).start()
            elif sys.argv[4] == "stop-first":
                stop()
                deadline = time.monotonic() + 10
                while not stop_requested() and time.monotonic() < deadline:
                    time.sleep(0.01)
            return Message(Error(code=0, reason="ClientAppActor died"), reply_to=msg)
        return super().__call__(node, msg)

TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
recorder = RunRecorder.create(sys.argv[2], "stopped", CONFIG)
server = threading.Thread(target=lambda: _run(recorder, DyingInTheShutdown()), daemon=True)
register_signal_handlers(event_type=EventType.FLWR_SIMULATION_RUN_LEAVE, bckg_threads=[server])
server.start()
server.join()
"""


@pytest.mark.parametrize(("signum", "order"), [("SIGTERM", "stop-first"), ("SIGINT", "stop-first"),
                                               ("SIGTERM", "dies-first")])
def test_a_round_during_which_the_serverapp_was_asked_to_stop_is_not_taken_for_complete(tmp_path: Path, signum: str,
                                                                                         order: str) -> None:
    proc = subprocess.run([sys.executable, "-c", STOPPED_PROCESS, str(Path(__file__).parent), str(tmp_path), signum,
                           order],
                          capture_output=True, text=True, timeout=120, check=False)
    run_dir = tmp_path / "stopped"
    data = json.loads((run_dir / "results.json").read_text())
    assert [r["round"] for r in data["rounds"] if "test" in r] == [1, 2], proc.stderr[-3000:]
    assert data["status"] == "failed" and "asked to stop (a signal) during round 3" in data["error"]
    assert not (run_dir / "checkpoints" / "round-003.pt").exists()
    assert load_resume_point(run_dir).round == 2  # a resumed run goes on from the last complete round

    resumed = RunRecorder.create(tmp_path, "resumed", CONFIG, resume_from=run_dir)
    result = _run(resumed, Clients())
    whole = _run(RunRecorder.create(tmp_path, "whole", CONFIG), Clients())
    final, reference = arrays_to_numpy(result.arrays), arrays_to_numpy(whole.arrays)
    assert all(np.array_equal(final[k], reference[k]) for k in reference)


def test_a_round_that_lost_a_client_without_a_stop_is_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", STOPPED_PROCESS, str(Path(__file__).parent), str(tmp_path), "SIGTERM",
                           "dies-alone"], capture_output=True, text=True, timeout=120, check=False)
    data = json.loads((tmp_path / "stopped" / "results.json").read_text())
    assert data["status"] == "finished", proc.stderr[-3000:]
    rounds = {r["round"]: r for r in data["rounds"]}
    assert sorted(rounds) == [1, 2, 3, 4] and all("test" in r for r in rounds.values())
    assert [r["client"] for r in rounds[3]["rejected"]] == [str(NODES[-1])]
    assert load_resume_point(tmp_path / "stopped").round == len(rounds)
