"""One writer per run directory: a lock file that the kernel releases when its holder dies.

A run directory's writer (a :class:`~fedfiot_flwr.server.RunRecorder`, in the ServerApp's process)
holds ``<run dir>/run.lock``: an exclusive ``flock`` on the file, whose content names the holder
(PID, host, start time, program name) for whoever is refused. A run resuming from an earlier
directory holds that directory's lock too, so that a run goes on in one place at a time. The
kernel drops the ``flock`` when the holding process ends, however it ends, so a lock is never left
held by a dead process; a lock *file* left by one (``SIGKILL``, a power cut) is stale and is taken
over, and the log says whose it was. A clean release removes the file.

::

    lock = RunLock.acquire("results/my-run")   # RunDirectoryHeld when a live run holds it
    ...                                         # write the run
    lock.release()

``flock`` is advisory and local to one machine's kernel (on NFS, Linux maps it to NFS locks,
which cover every client of the share). Without :mod:`fcntl` (Windows) locks are not taken.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import weakref
from dataclasses import dataclass
from logging import WARNING
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "LockHolder", "RunDirectoryHeld", "RunLock", "lock_holder"]

#: The lock file's name inside a run directory.
LOCK_NAME = "run.lock"


@dataclass(frozen=True)
class LockHolder:
    """Who wrote a run directory's lock file: the process, its host, since when, and its program's name."""

    pid: int | None
    host: str
    started: float | None
    command: str

    @classmethod
    def from_text(cls, text: str) -> LockHolder | None:
        """The holder a lock file's text names; None for an empty file (being written, or not ours)."""
        try:
            data: Any = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            return None
        pid = data.get("pid")
        started = data.get("started")
        return cls(pid if isinstance(pid, int) else None, str(data.get("host", "?")),
                   float(started) if isinstance(started, (int, float)) else None, str(data.get("command", "")))

    @classmethod
    def this_process(cls) -> LockHolder:
        # The program's name only: a command line can carry secrets (Flower passes a run token).
        return cls(os.getpid(), socket.gethostname(), time.time(), Path(sys.argv[0]).name if sys.argv else "")

    def describe(self) -> str:
        """``"PID 123 on host h, since 2026-12-06 02:40:00 (flwr-simulation)"``."""
        since = ("" if self.started is None
                 else f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.started))}")
        me = " (this process)" if self.pid == os.getpid() and self.host == socket.gethostname() else ""
        command = f" ({self.command})" if self.command else ""
        return f"PID {self.pid}{me} on host {self.host}{since}{command}"

    def as_text(self) -> str:
        return json.dumps({"pid": self.pid, "host": self.host, "started": self.started, "command": self.command})


class RunDirectoryHeld(RuntimeError):
    """A live run holds the run directory; the message names its process.

    Attributes
    ----------
    run_dir : Path
        The directory.
    holder : LockHolder or None
        Who holds it (None when the holder has not written its name yet).
    """

    def __init__(self, run_dir: Path, holder: LockHolder | None) -> None:
        self.run_dir, self.holder = run_dir, holder
        who = holder.describe() if holder is not None else "a process that has not written its name yet"
        super().__init__(f"{run_dir} is held by a live run: {who}; a run directory has one writer at a time: "
                         "stop that run first (or wait for it to end), then resume from its directory")


def _holder_of(fd: int) -> LockHolder | None:
    os.lseek(fd, 0, os.SEEK_SET)
    return LockHolder.from_text(os.read(fd, 4096).decode(errors="replace"))


def lock_holder(run_dir: str | os.PathLike[str]) -> LockHolder | None:
    """The live process holding ``run_dir``, or None when none does (no lock file, or a stale one).

    Changes nothing: a caller that only asks (the launcher, before it starts a federation) leaves
    a stale lock file for the run that takes the directory over.
    """
    path = Path(run_dir).expanduser().resolve() / LOCK_NAME
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_of(fd) or LockHolder(None, "?", None, "")
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunLock:
    """The held lock of one run directory (see the module docstring).

    Attributes
    ----------
    run_dir : Path
        The directory it holds.
    stale : LockHolder or None
        The dead holder whose lock file it took over, if any.
    """

    def __init__(self, run_dir: Path, fd: int | None, stale: LockHolder | None) -> None:
        self.run_dir, self.stale = run_dir, stale
        self._fd = fd
        # A lock that is dropped without release() (an exception, a lost reference) still ends.
        self._finalizer = weakref.finalize(self, _close, fd)

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike[str], purpose: str = "writes") -> RunLock:
        """Hold ``run_dir``'s lock; take a stale lock file over, and log whose it was.

        Parameters
        ----------
        run_dir : path
            An existing run directory.
        purpose : str
            What this process does with it, for the takeover's log line (``"writes"``,
            ``"resumes from"``).

        Raises
        ------
        RunDirectoryHeld
            When a live process holds it (the message names that process).
        """
        directory = Path(run_dir).expanduser().resolve()
        if fcntl is None:
            return cls(directory, None, None)
        path = directory / LOCK_NAME
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_of(fd)
                os.close(fd)
                raise RunDirectoryHeld(directory, holder) from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:
                break
            os.close(fd)  # released (and removed) between our open and our lock: open the new one
        stale = _holder_of(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, LockHolder.this_process().as_text().encode(), 0)
        os.fsync(fd)
        if stale is not None:
            from flwr.supercore import log  # the server's logger; imported here, where it is needed

            log(WARNING, "%s: took over the lock left by %s, which no longer runs; this process %s it",
                directory, stale.describe(), purpose)
        return cls(directory, fd, stale)

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Remove the lock file and drop the lock (a second call does nothing)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.run_dir / LOCK_NAME)
        except FileNotFoundError:
            pass
        self._finalizer()
        self._fd = None


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)
