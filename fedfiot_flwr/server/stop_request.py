"""Whether the ServerApp's process has been asked to stop, so that an interrupted round is not recorded.

A federation that is being stopped (``SIGTERM``, ``SIGINT``, ``SIGHUP``: a launcher, a SuperLink or a
SuperExec shutting down) takes its ClientApps down while the ServerApp may still be in a round.
The round then goes on with the replies that arrived, the ClientApps that died excluded as broken
clients, and its model differs from the one the round would have had. Such a round must not become a
checkpoint: a resumed run would go on from it. :func:`watch_stop_signals` notes the request in
the process, and :func:`stop_requested` says whether it came.

Flower's runtimes take these signals over in their main thread and run their exit handlers (last
registered first); the ServerApp itself runs in another thread (simulation) or in the main one
(``flwr-serverapp``). So the request is noted twice: as Flower's first exit handler, and, in the
main thread, by a handler for each of these signals that nobody else handles, which then does what
the signal would have done.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

__all__ = ["STOP_NOTICE_S", "RunStopped", "STOP_SIGNALS", "stop_requested", "stop_requested_within",
           "watch_stop_signals"]

#: The signals that ask a process to stop.
STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: Seconds a round that lost replies (error replies, nodes gone) waits for a stop request before it is recorded. A
#: federation being stopped can take its ClientApps down before the ServerApp's process hears of it: the signal's
#: handler runs in the main thread, which may be busy in native code, and Flower notices a dead parent by polling.
STOP_NOTICE_S = 5.0

_requested = threading.Event()
_watching = threading.Lock()
_installed = False


class RunStopped(RuntimeError):
    """The run's process was asked to stop during a round; that round is not recorded."""


def stop_requested() -> bool:
    """Whether this process has been asked to stop since :func:`watch_stop_signals` was called."""
    return _requested.is_set()


def stop_requested_within(seconds: float) -> bool:
    """Whether this process has been asked to stop, or is asked within ``seconds`` (it waits at most that long)."""
    return _requested.wait(seconds)


def watch_stop_signals() -> None:
    """Note a stop request from now on (idempotent; callable from any thread)."""
    global _installed
    with _watching:
        if _installed:
            return
        _installed = True
    try:
        from flwr.supercore.exit import add_exit_handler  # Flower's runtimes call these on SIGINT/SIGTERM
    except ImportError:  # another Flower version: the signal handlers below still note the request
        pass
    else:
        add_exit_handler(_requested.set, run_before_force_exit=True)
    if threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(signum, _note_and_stop)


def _note_and_stop(signum: int, _frame: FrameType | None) -> None:
    """Note the request, then do what Python's handler would have done (end the process, or raise
    ``KeyboardInterrupt`` for ``SIGINT``)."""
    _requested.set()
    signal.signal(signum, signal.SIG_DFL)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    os.kill(os.getpid(), signum)
