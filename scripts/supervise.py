"""Run one command so that it, and everything it starts, ends with the process that asked for it.

::

    python -I scripts/supervise.py --lifeline FD [--grace SECONDS] -- COMMAND [ARG ...]

The launcher (:mod:`scripts.launch`) starts every SuperLink, SuperNode and ``flwr run`` through
this small supervisor, because Flower starts its ServerApps and ClientApps in sessions of their
own: a signal to a process group, or the death of the launcher, does not reach them. The
supervisor

- becomes a *child subreaper* (Linux ``prctl``), so every process the command starts, however
  far down and however detached (``setsid``, double forks, Ray's daemons), stays its descendant;
- starts the command with a parent-death signal (``SIGKILL``): the command dies if the
  supervisor is killed outright;
- holds the read end ``FD`` of a pipe whose write end only the launcher holds: when the launcher
  ends, by any means, ``SIGKILL`` included, the read returns end-of-file and the supervisor stops
  the command as if it had been sent ``SIGTERM``;
- forwards ``SIGTERM``, ``SIGINT`` and ``SIGHUP`` to the command, and sends it ``SIGKILL`` when it
  has not ended ``--grace`` seconds later;
- once the command has ended, for whatever reason, stops what is left of its descendants, the
  processes the command started itself first (``SIGTERM``, then ``SIGKILL`` after ``--grace``
  seconds), and reaps them;
- ends as the command ended: with its exit code, or by the same signal.

Standard library only and nothing imported from the repository (``-I`` keeps it from reading the
environment's Python settings), so that it starts in a few tens of milliseconds. Without
``/proc`` and ``prctl`` (not Linux) it still forwards signals and watches the lifeline, but
cannot find descendants that left the command's process group.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path

#: ``prctl`` options (linux/prctl.h).
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
#: The signals that ask the command to stop; each is forwarded to it.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Seconds the command, then its leftovers, get between ``SIGTERM`` and ``SIGKILL``.
DEFAULT_GRACE_S = 2.0

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; False where there is no ``prctl`` or it failed."""
    return _LIBC is not None and _LIBC.prctl(option, value, 0, 0, 0) == 0


def processes() -> dict[int, tuple[int, list[str]]]:
    """``pid -> (parent pid, argv)`` of every live (non-zombie) process (Linux ``/proc``; empty elsewhere)."""
    found = {}
    root = Path("/proc")
    if not root.is_dir():
        return found
    for proc in root.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        # /proc/<pid>/stat: pid (comm) state ppid ...
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if state != "Z":
            found[int(proc.name)] = (int(ppid), argv)
    return found


def descendants(pid: int) -> dict[int, list[str]]:
    """``pid -> argv`` of the live processes ``pid`` started, directly or not (Flower's SuperExec
    starts the ServerApp and ClientApps in sessions of their own, outside the starter's group)."""
    table = processes()
    found: dict[int, list[str]] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, argv) in table.items():
            if ppid == parent and child not in found:
                found[child] = argv
                frontier.append(child)
    return found


def supervised_command(command: Sequence[str], lifeline: int, grace: float = DEFAULT_GRACE_S) -> list[str]:
    """The command line that runs ``command`` under this supervisor, watching the pipe end ``lifeline``.

    The caller passes ``lifeline`` to the new process (``subprocess.Popen(..., pass_fds=(lifeline,))``)
    and keeps the pipe's write end open, in itself only, for as long as the command may run.
    """
    return [sys.executable, "-I", str(Path(__file__).resolve()), "--lifeline", str(lifeline), "--grace", str(grace),
            "--", *command]


class _Supervisor:
    """The supervisor's state: the command's PID, how it ended, and the stop in progress."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.pid = os.getpid()
        self.child = 0
        self.status: int | None = None
        self.stopping = False

    def on_stop_signal(self, signum: int, _frame: object) -> None:
        """Forward a stop signal to the command (once), and arm the ``SIGKILL`` after ``grace``."""
        if self.status is not None:
            return
        _signal(self.child, signum)
        if not self.stopping:
            self.stopping = True
            signal.setitimer(signal.ITIMER_REAL, self.grace)

    def on_alarm(self, _signum: int, _frame: object) -> None:
        if self.status is None:
            _say(f"PID {self.child} did not stop within {self.grace:g}s: SIGKILL")
            _signal(self.child, signal.SIGKILL)

    def watch(self, lifeline: int) -> None:
        """Block until the launcher's end of the lifeline closes, then stop the command."""
        try:
            while os.read(lifeline, 64):
                pass
        except OSError:
            pass
        if self.status is None:
            _say(f"the launcher ended: stopping PID {self.child}")
            os.kill(self.pid, signal.SIGTERM)  # handled on the main thread, as a signal from outside is

    def start(self, command: Sequence[str]) -> None:
        """Fork and exec ``command``; it gets ``SIGKILL`` when the supervisor dies."""
        self.child = os.fork()
        if self.child == 0:  # the command's process, until exec
            try:
                for signum in (*STOP_SIGNALS, signal.SIGALRM):
                    signal.signal(signum, signal.SIG_DFL)
                _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                if os.getppid() != self.pid:  # the supervisor died before the prctl took effect
                    os._exit(128 + signal.SIGKILL)
                os.execvp(command[0], list(command))
            except BaseException as exc:  # noqa: BLE001 - nothing may escape a forked child
                _say(f"cannot run {command[0]!r}: {exc}")
                os._exit(127)

    def wait(self) -> None:
        """Reap children (orphans included) until the command itself has ended."""
        while self.status is None:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return
            if pid == self.child:
                self.status = status
        signal.setitimer(signal.ITIMER_REAL, 0)

    def sweep(self) -> None:
        """Stop and reap every descendant left after the command ended, the eldest first.

        The processes the command started itself (now the supervisor's children: a SuperLink's
        ServerApp) get ``SIGTERM`` and up to ``grace`` seconds before the rest (the ClientApps and
        Ray's workers they started), so that a ServerApp hears of the stop before its clients die
        under it and does not take the round they were in for complete. What is left then gets
        ``SIGTERM``, and ``SIGKILL`` after ``grace``.
        """
        eldest = [pid for pid, (ppid, _) in processes().items() if ppid == self.pid]
        self._stop(eldest, signal.SIGTERM, lambda: set(eldest) & set(descendants(self.pid)))
        for signum in (signal.SIGTERM, signal.SIGKILL):
            left = descendants(self.pid)
            if not left:
                break
            if signum == signal.SIGKILL:
                _say(f"{len(left)} processes still running after {self.grace:g}s: SIGKILL")
            self._stop(left, signum, lambda: descendants(self.pid))
        _reap()

    def _stop(self, pids: Iterable[int], signum: int, running: Callable[[], Collection[int]]) -> None:
        """Send ``signum`` to ``pids``; reap until ``running()`` is empty or ``grace`` has passed."""
        for pid in pids:
            _signal(pid, signum)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and running():
            _reap()
            time.sleep(0.05)

    def end(self) -> None:
        """End as the command did: its exit code, or the signal that killed it."""
        status = self.status if self.status is not None else 0
        if os.WIFSIGNALED(status):
            signum = os.WTERMSIG(status)
            if signum not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
                signal.signal(signum, signal.SIG_DFL)
            os.kill(self.pid, signum)
            time.sleep(1.0)  # the signal ends the process; SIGSTOP and the like would not
            sys.exit(128 + signum)
        sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _reap() -> None:
    """Collect every child that has ended (the subreaper inherits the orphans)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _say(message: str) -> None:
    print(f"[supervise {os.getpid()}] {message}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: supervise ``COMMAND`` (see the module docstring); never returns."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lifeline", type=int, required=True, help="read end of the launcher's pipe")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    supervisor = _Supervisor(args.grace)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    for signum in STOP_SIGNALS:
        signal.signal(signum, supervisor.on_stop_signal)
    signal.signal(signal.SIGALRM, supervisor.on_alarm)
    supervisor.start(command)
    threading.Thread(target=supervisor.watch, args=(args.lifeline,), daemon=True).start()
    supervisor.wait()
    supervisor.sweep()
    supervisor.end()


if __name__ == "__main__":
    main()
