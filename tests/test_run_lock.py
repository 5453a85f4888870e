"""One writer per run directory: a live holder is named to whoever is refused; a dead one's lock is taken over."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest
from _fedfiot_helpers import held_by_another_process

from fedfiot_flwr.server.run_lock import LOCK_NAME, RunDirectoryHeld, RunLock, lock_holder

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock")

@pytest.fixture
def holder(tmp_path: Path):  # noqa: ANN201
    """Another process that holds ``tmp_path / "run"``'s lock until it is killed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = held_by_another_process(run_dir)
    yield run_dir, proc
    proc.kill()
    proc.wait(timeout=10)


def test_a_live_holder_in_another_process_is_named_and_nothing_is_written(holder) -> None:  # noqa: ANN001
    run_dir, proc = holder
    before = (run_dir / LOCK_NAME).read_bytes()
    with pytest.raises(RunDirectoryHeld, match=rf"held by a live run: PID {proc.pid} on host ") as err:
        RunLock.acquire(run_dir)
    assert err.value.holder is not None and err.value.holder.pid == proc.pid
    assert lock_holder(run_dir) == err.value.holder
    assert (run_dir / LOCK_NAME).read_bytes() == before


def test_the_lock_of_a_killed_holder_is_taken_over_and_the_log_names_it(holder, caplog) -> None:  # noqa: ANN001
    run_dir, proc = holder
    proc.send_signal(signal.SIGKILL)  # no clean-up: the lock file stays, the kernel drops the flock
    proc.wait(timeout=10)
    assert (run_dir / LOCK_NAME).exists()
    assert lock_holder(run_dir) is None  # asking changes nothing
    with caplog.at_level(logging.WARNING, logger="flwr"):
        lock = RunLock.acquire(run_dir, "resumes from")
    assert lock.stale is not None and lock.stale.pid == proc.pid
    assert lock_holder(run_dir).pid == os.getpid()
    assert f"took over the lock left by PID {proc.pid}" in caplog.text and "resumes from it" in caplog.text
    lock.release()
    assert not (run_dir / LOCK_NAME).exists()
    assert RunLock.acquire(run_dir).stale is None  # a clean release leaves nothing to take over


def test_a_second_holder_in_the_same_process_is_refused_until_the_first_releases(tmp_path: Path) -> None:
    first = RunLock.acquire(tmp_path)
    with pytest.raises(RunDirectoryHeld, match=r"\(this process\)"):
        RunLock.acquire(tmp_path)
    first.release()
    first.release()  # a second release does nothing
    second = RunLock.acquire(tmp_path)
    assert second.held and second.stale is None


def test_a_dropped_lock_is_released_with_its_object(tmp_path: Path) -> None:
    RunLock.acquire(tmp_path)  # never released: garbage collected at once
    lock = RunLock.acquire(tmp_path)
    assert lock.stale is not None and lock.stale.pid == os.getpid()  # its file stayed; its flock did not
