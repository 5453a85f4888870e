"""The supervisor the launcher starts every process under: the process and everything it started end with
the launcher, however either ends. Real processes, a detached grandchild among them; a few seconds in all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.supervise import supervised_command

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc: Linux")

#: A command that starts a grandchild in a session of its own (double fork, as Flower's SuperExec and Ray's
#: daemons leave the starter's group), records both PIDs, then ``sleep``s, ``exit``s or ``ignore``s SIGTERM.
TREE = """
import os, signal, sys, time
out, mode = sys.argv[1], sys.argv[2]
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(out + ".grandchild", "w").write(str(os.getpid()))
        time.sleep(120)
    os._exit(0)
while not os.path.exists(out + ".grandchild"):
    time.sleep(0.01)
if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(out + ".child", "w").write(str(os.getpid()))
if mode == "exit":
    sys.exit(3)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _pid(path: Path, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.02)
    raise TimeoutError(f"{path} was not written")


def _gone_within(pids: list[int], seconds: float) -> float:
    start = time.monotonic()
    while any(_alive(p) for p in pids):
        if time.monotonic() - start > seconds:
            raise AssertionError(f"still running after {seconds}s: {[p for p in pids if _alive(p)]}")
        time.sleep(0.05)
    return time.monotonic() - start


class _Tree:
    """The command under a supervisor whose lifeline this test holds, as the launcher holds it."""

    def __init__(self, tmp_path: Path, mode: str, grace: float = 2.0) -> None:
        self.read, self.write = os.pipe()
        out = tmp_path / mode
        cmd = supervised_command([sys.executable, "-c", TREE, str(out), mode], self.read, grace=grace)
        self.proc = subprocess.Popen(cmd, pass_fds=(self.read,), start_new_session=True, stderr=subprocess.PIPE)
        os.close(self.read)
        self.child, self.grandchild = _pid(Path(f"{out}.child")), _pid(Path(f"{out}.grandchild"))

    def close_lifeline(self) -> None:
        os.close(self.write)
        self.write = -1

    def cleanup(self) -> None:
        for pid in (self.proc.pid, self.child, self.grandchild):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.write >= 0:
            os.close(self.write)
        self.proc.wait(timeout=10)


@pytest.fixture
def tree(tmp_path: Path, request: pytest.FixtureRequest):  # noqa: ANN201
    made: list[_Tree] = []

    def make(mode: str, grace: float = 2.0) -> _Tree:
        made.append(_Tree(tmp_path, mode, grace))
        return made[-1]

    yield make
    for t in made:
        t.cleanup()


def test_when_the_launcher_ends_the_command_and_its_detached_grandchild_end(tree) -> None:  # noqa: ANN001
    t = tree("sleep")
    assert os.getsid(t.grandchild) != os.getsid(t.child)  # out of reach of a process-group signal
    t.close_lifeline()  # what the launcher's death does, SIGKILL included
    took = _gone_within([t.child, t.grandchild], 8.0)
    assert t.proc.wait(timeout=5) == -signal.SIGTERM  # the supervisor ends as its command did
    assert b"the launcher ended" in t.proc.stderr.read()
    print(f"\nlifeline closed: the command and its grandchild ended in {took:.2f}s")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_is_forwarded_and_the_grandchild_is_stopped_after_the_command(tree, signum: int) -> None:  # noqa: ANN001
    t = tree("sleep")
    os.kill(t.proc.pid, signum)
    _gone_within([t.child, t.grandchild], 8.0)
    assert t.proc.wait(timeout=5) == -signum


def test_a_command_that_ends_by_itself_leaves_nothing_behind_and_its_exit_code_is_kept(tree) -> None:  # noqa: ANN001
    t = tree("exit")
    assert t.proc.wait(timeout=10) == 3
    assert not _alive(t.grandchild)


def test_a_command_that_ignores_sigterm_is_killed_after_the_grace(tree) -> None:  # noqa: ANN001
    t = tree("ignore", grace=0.5)
    os.kill(t.proc.pid, signal.SIGTERM)
    _gone_within([t.child, t.grandchild], 6.0)
    assert t.proc.wait(timeout=5) == -signal.SIGKILL
    assert b"did not stop within 0.5s: SIGKILL" in t.proc.stderr.read()


def test_a_killed_supervisor_takes_its_command_with_it(tree) -> None:  # noqa: ANN001
    t = tree("sleep")
    os.kill(t.proc.pid, signal.SIGKILL)
    assert t.proc.wait(timeout=5) == -signal.SIGKILL
    _gone_within([t.child], 5.0)  # the parent-death signal; the detached grandchild is the launcher's to stop


#: A command (a SuperLink) that starts a server (a ServerApp) which starts a worker (a ClientApp) and then
#: ends; on SIGTERM the server writes, half a second later, whether its worker is still running.
GENERATIONS = """
import os, signal, sys, time
out = sys.argv[1]
if os.fork() == 0:
    worker = os.fork()
    if worker == 0:
        time.sleep(120)
        os._exit(0)
    def on_term(signum, frame):
        time.sleep(0.5)  # a ServerApp finishing its exit handlers
        alive = os.waitpid(worker, os.WNOHANG) == (0, 0)
        open(out + ".worker-alive", "w").write(str(alive))
        os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    open(out + ".server", "w").write(str(os.getpid()))
    open(out + ".worker", "w").write(str(worker))
    time.sleep(120)
    os._exit(0)
while not os.path.exists(out + ".worker"):
    time.sleep(0.01)
sys.exit(0)
"""


def test_after_the_command_ends_the_processes_it_started_are_stopped_before_the_ones_they_started(tmp_path: Path) -> None:
    read, write = os.pipe()
    out = tmp_path / "gen"
    cmd = supervised_command([sys.executable, "-c", GENERATIONS, str(out)], read)
    proc = subprocess.Popen(cmd, pass_fds=(read,), start_new_session=True)
    os.close(read)
    try:
        assert proc.wait(timeout=20) == 0
        server, worker = _pid(Path(f"{out}.server")), _pid(Path(f"{out}.worker"))
        assert not _alive(server) and not _alive(worker)
        assert Path(f"{out}.worker-alive").read_text() == "True"  # the server heard of the stop first
    finally:
        os.close(write)
        for name in ("server", "worker"):
            if Path(f"{out}.{name}").exists() and _alive(pid := int(Path(f"{out}.{name}").read_text())):
                os.kill(pid, signal.SIGKILL)
