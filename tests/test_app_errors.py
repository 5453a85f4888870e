"""The app's main ends a failed run with one clear line, the run's last, and marks its results file failed."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedfiot_flwr.server.uploads import Rejection, require_enough


class _Grid:
    """``get_node_ids`` of a federation whose SuperNodes are all connected."""

    def __init__(self, k: int) -> None:
        self.k = k

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.k + 1))


class _NoValidReply:
    """A round's collected uploads: none valid, both replies excluded."""

    rejections = [Rejection("1", "training diverged: weights out of range"), Rejection("2", "error reply (code 5)")]

    def __len__(self) -> int:
        return 0


def _last_record(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    records = [r for r in caplog.records if r.name == "flwr"]
    assert records, "the app logged nothing"
    return records[-1]


def test_a_bad_run_config_value_ends_the_run_with_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import server_app

    context = SimpleNamespace(run_config={"alpha": -1, "results-dir": str(tmp_path), "run-name": "bad"})
    with caplog.at_level(logging.INFO, logger="flwr"):
        server_app.main(_Grid(2), context)
    last = _last_record(caplog)
    line = last.getMessage()
    assert last.levelno == logging.ERROR and last.exc_info is None  # no traceback
    assert line.startswith("FedFiOT run failed: run-config alpha=-1: expected a number > 0")
    assert "\n" not in line
    results = json.loads((tmp_path / "bad" / "results.json").read_text())
    assert results["status"] == "failed" and "alpha=-1: expected a number > 0" in results["error"]
    assert str(tmp_path / "bad" / "results.json") in line


def test_a_round_without_a_valid_reply_ends_the_run_saying_it_failed_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import server_app

    from fedfiot_flwr.server import MergeStrategy

    def start(self: MergeStrategy, **_: object) -> None:
        require_enough(_NoValidReply(), 2, 1)  # type: ignore[arg-type]

    monkeypatch.setattr(MergeStrategy, "start", start)
    context = SimpleNamespace(run_config={"num-partitions": 2, "results-dir": str(tmp_path), "run-name": "none",
                                          "node-wait-s": 1.0})
    with caplog.at_level(logging.INFO, logger="flwr"):
        server_app.main(_Grid(2), context)
    last = _last_record(caplog)
    line = last.getMessage()
    assert last.levelno == logging.ERROR and last.exc_info is None
    assert line.startswith("FedFiOT run failed: FedFiOT round 1: only 0 valid replies, at least 2 needed")
    assert "client 1: training diverged: weights out of range" in line
    assert "results.json" in line
    results = json.loads(next(tmp_path.glob("none*/results.json")).read_text())
    assert results["status"] == "failed" and "only 0 valid replies" in results["error"]


def test_a_resume_from_a_directory_a_live_run_holds_ends_the_run_before_any_client_trains(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import server_app

    from fedfiot_flwr.server import MergeStrategy
    from fedfiot_flwr.server.run_lock import RunLock

    trained: list[object] = []
    monkeypatch.setattr(MergeStrategy, "start", lambda self, **kw: trained.append(kw))
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    live = RunLock.acquire(earlier)  # the earlier run's ServerApp, still going on there
    context = SimpleNamespace(run_config={"num-partitions": 2, "results-dir": str(tmp_path), "run-name": "again",
                                          "resume-from": str(earlier), "node-wait-s": 1.0})
    try:
        with caplog.at_level(logging.INFO, logger="flwr"):
            server_app.main(_Grid(2), context)
    finally:
        live.release()
    last = _last_record(caplog)
    line = last.getMessage()
    assert last.levelno == logging.ERROR and last.exc_info is None and "\n" not in line
    assert line.startswith(f"FedFiOT run failed: cannot resume: {earlier} is held by a live run: PID ")
    assert trained == []
    results = json.loads((tmp_path / "again" / "results.json").read_text())
    assert results["status"] == "failed" and "is held by a live run" in results["error"]
