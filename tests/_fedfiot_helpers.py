"""Shared fixtures for the strategy tests: a tiny MLP, client uploads, reply messages, a fake Grid."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedfiot_flwr.client import pack_reply
from fedfiot_flwr.merge import PermutationSpec, mlp_spec
from fedfiot_flwr.server.shell import numpy_to_arrays
from fedfiot_flwr.server.uploads import CollectedUploads

@pytest.fixture(scope="module")
def one_torch_thread():  # noqa: ANN201
    """torch on one thread for a module's tests (long benchmark smoke runs beside other jobs), restored after."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def task_identity():  # noqa: ANN201
    """Messages need the identity of the running task (set by Flower inside a real ServerApp).

    It is set through ``TaskIdentity``'s public setters; the previous values are saved and restored
    through its private fields because the public getters raise while a value is unset, the state
    a test must leave behind for the next one.
    """
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


ROOT = Path(__file__).resolve().parents[1]

SHAPES = {"fc1.weight": (6, 4), "fc1.bias": (6,), "fc2.weight": (5, 6), "fc2.bias": (5,), "fc3.weight": (3, 5), "fc3.bias": (3,)}
SPEC = mlp_spec(["fc1", "fc2", "fc3"], bias=True)


def random_model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random float32 state dict of the tiny MLP."""
    return {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}


def random_fisher(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A random non-negative Fisher of the tiny MLP."""
    return {k: (rng.random(size=s) ** 2).astype(np.float32) for k, s in SHAPES.items()}


def client_uploads(n: int, seed: int = 0) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]]:
    """``n`` (weights, Fisher, num_examples) triples."""
    rng = np.random.default_rng(seed)
    return [(random_model(rng), random_fisher(rng), int(rng.integers(20, 200))) for _ in range(n)]


def instruction(node_id: int, arrays: dict[str, np.ndarray] | None = None) -> Message:
    """A train instruction to ``node_id`` (what configure_train would send)."""
    arrays = arrays if arrays is not None else {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    content = RecordDict({"arrays": ArrayRecord({k: _arr(v) for k, v in arrays.items()})})
    return Message(content=content, dst_node_id=node_id, message_type=MessageType.TRAIN)


def _arr(x: np.ndarray):  # noqa: ANN202
    from flwr.app import Array

    return Array.from_numpy_ndarray(np.ascontiguousarray(x))


def reply(node_id: int, content: RecordDict) -> Message:
    """A reply from ``node_id`` carrying ``content``."""
    return Message(content=content, reply_to=instruction(node_id))


def packed(weights: dict[str, np.ndarray], fisher: dict[str, np.ndarray], n: int) -> RecordDict:
    """The RecordDict a FedFiOT client sends."""
    return pack_reply(weights, fisher, n, {"train-loss": 1.0})


class FakeGrid(Grid):
    """An in-process Grid: ``send_and_receive`` runs ``client_fn(node_id, message)`` per message."""

    def __init__(self, node_ids: Iterable[int], client_fn: Callable[[int, Message], Message]) -> None:
        self.node_ids = list(node_ids)
        self.client_fn = client_fn
        self.sent: list[Message] = []

    def set_run(self, run):  # noqa: ANN001, ANN201
        self._run = run

    @property
    def run(self):  # noqa: ANN201
        return getattr(self, "_run", None)

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # noqa: ANN001, ANN201
        return Message(content=content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return list(self.node_ids)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Give each message an id and keep it in :attr:`sent`, as Flower's grids do when they push one."""
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"msg-{len(self.sent)}"
            self.sent.append(msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        """Push ``messages``, then answer each with ``client_fn(node_id, message)``."""
        messages = list(messages)
        self.push_messages(messages)
        return [self.client_fn(msg.metadata.dst_node_id, msg) for msg in messages]


def zeros_model() -> dict[str, np.ndarray]:
    """The tiny MLP of ``SHAPES`` with every entry 0 (a broadcast model)."""
    return {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}


def configure_round(
    strategy: Any,
    node_ids: Iterable[int],
    broadcast: Mapping[str, np.ndarray] | None = None,
    server_round: int = 1,
) -> dict[int, Message]:
    """The instructions a Message-API strategy sends to a federation of ``node_ids``, pushed as a grid pushes them.

    Runs ``strategy.configure_train`` on a :class:`FakeGrid`, the first half of a round of
    Flower's ``start`` loop; answer the instructions with :func:`answer` and pass the answers to
    ``strategy.aggregate_train`` for the second half.

    Parameters
    ----------
    strategy : flwr.serverapp.strategy.Strategy
        The strategy (it records the broadcast model and the instructions itself).
    node_ids : iterable of int
        The connected nodes.
    broadcast : mapping of str to np.ndarray, optional
        The global model sent (default :func:`zeros_model`).
    server_round : int
        The round.

    Returns
    -------
    dict of int to Message
        The instruction sent to each sampled node, with the id the grid gave it.
    """
    grid = FakeGrid(node_ids, _never_called)
    arrays = numpy_to_arrays(zeros_model() if broadcast is None else broadcast)
    sent = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
    grid.push_messages(sent)
    return {int(msg.metadata.dst_node_id): msg for msg in sent}


def answer(instruction: Message, content: RecordDict | Error) -> Message:
    """A node's answer to ``instruction``: a reply carrying ``content``, or an error reply."""
    return Message(content, reply_to=instruction)


def _never_called(node_id: int, message: Message) -> Message:
    raise AssertionError("configure_round pushes the instructions; nothing answers them")



def _replace_array(content: RecordDict, name: str, new) -> RecordDict:  # noqa: ANN001
    from fedfiot_flwr.client import ARRAYS_RECORD

    content[ARRAYS_RECORD][name] = new
    return content


def corrupt_nan_fisher(content: RecordDict, name: str) -> RecordDict:
    """Set the Fisher scale of tensor ``name`` to NaN (every Fisher entry becomes NaN)."""
    import struct

    from flwr.app import Array

    from fedfiot_flwr.client import ARRAYS_RECORD

    arr = content[ARRAYS_RECORD][name]
    data = arr.data[:4] + struct.pack("<f", float("nan")) + arr.data[8:]
    return _replace_array(content, name, Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=arr.stype, data=data))


def corrupt_missing_fisher(content: RecordDict, name: str) -> RecordDict:
    """Re-encode tensor ``name`` as weights only (its Fisher is missing)."""
    from flwr.app import Array

    from fedfiot_flwr.client import ARRAYS_RECORD, STYPE_WEIGHT

    arr = content[ARRAYS_RECORD][name]
    n = int(np.prod(arr.shape))
    data = arr.data[:4] + arr.data[8 : 8 + 2 * n]
    return _replace_array(content, name, Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=STYPE_WEIGHT, data=data))


def app_snapshot(root: Path = ROOT) -> dict[str, str]:
    """Hashes of the files ``flwr run`` could touch: pyproject.toml, the apps, configs/."""
    paths = [root / "pyproject.toml", root / "server_app.py", root / "client_app.py", *sorted((root / "configs").glob("*"))]
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def live_processes(pids: list[int]) -> list[str]:
    """Non-zombie processes among ``pids`` or in their process groups (each was a group leader)."""
    alive = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        # /proc/<pid>/stat: pid (comm) state ppid pgrp ...
        rest = stat[stat.rindex(")") + 2 :].split()
        state, pgrp = rest[0], int(rest[2])
        if state != "Z" and (int(proc.name) in pids or pgrp in pids):
            alive.append(f"{proc.name} {stat[: stat.rindex(')') + 1]}")
    return alive



def tiny_mlp():  # noqa: ANN201
    """The 4-6-5-3 MLP of ``SHAPES`` as a torch module (the fuzz tests' ``TinyMLP``)."""
    from _fuzz_replies import TinyMLP

    return TinyMLP()


# The worked example of the paper's Appendix G: two clients, one 3-neuron layer; the aligned merge
# has objective J = 9 against the identity merge's J = 83.
WORKED_SPEC = PermutationSpec({"w": ("P0", None)})
WORKED_MODELS = [{"w": np.array([[0.0], [4.0], [8.0]])}, {"w": np.array([[10.0], [2.0], [6.0]])}]
WORKED_FISHERS = [{"w": np.array([[2.0], [0.0], [2.0]])}, {"w": np.array([[0.0], [0.0], [2.0]])}]


def worked_uploads() -> CollectedUploads:
    """The worked example as a round's collected uploads (clients ``a`` and ``b``, sizes 3 and 1)."""
    return CollectedUploads(client_ids=["a", "b"], weights=WORKED_MODELS, fishers=WORKED_FISHERS, num_examples=[3, 1])



_HOLD = """
import sys, time
from fedfiot_flwr.server.run_lock import RunLock
lock = RunLock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(120)
"""


def held_by_another_process(run_dir: Path) -> subprocess.Popen[str]:
    """A process that holds ``run_dir``'s lock until it is killed, as a live run's ServerApp does."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc
