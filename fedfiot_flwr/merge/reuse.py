"""Exact reuse of alignment work between the merges of one sweep.

A permutation's inner loop is a deterministic function of its inputs: the clients' layers and
damped Fishers (fixed by the uploads, ``(fisher_scaling, rho, lam)`` and the permutations of the
layers before), the options, and the starting point. After the first iteration the starting point
is the first iteration's assignment alone (the next global layer is the merge of the clients it
aligns), not the reference. So two candidates of a sweep that differ only by their reference
(``"largest"`` vs ``"broadcast"``) and whose first iterations assign alike continue identically:
the second one takes the first one's remaining iterations from :class:`AlignmentMemo`,
bit-identically. :class:`ModelCache` keeps the aligned merges, so that two candidates that reach
the same alignment merge once.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np


def permutations_digest(perms: Sequence[np.ndarray] | Sequence[Mapping[str, np.ndarray]]) -> str:
    """Hash of per-client permutations (arrays, or per-client dicts of arrays by name).

    >>> permutations_digest([np.arange(3)]) == permutations_digest([np.arange(3)])
    True
    >>> permutations_digest([{"P": np.arange(2)}]) == permutations_digest([{"P": np.array([1, 0])}])
    False
    """
    h = hashlib.blake2b(digest_size=16)
    for p in perms:
        items = sorted(p.items()) if isinstance(p, Mapping) else [("", p)]
        for name, arr in items:
            h.update(f"{name}|{len(arr)}|".encode())
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    return h.hexdigest()


@dataclass
class AlignmentTail:
    """What a permutation's loop produced after its first iteration.

    Attributes
    ----------
    perms : list[np.ndarray]
        Final per-client permutations.
    iterations : int
        Total inner iterations (the first included).
    alignment_objectives, objectives : list[float]
        The report's entries from the second iteration on.
    """

    perms: list[np.ndarray]
    iterations: int
    alignment_objectives: list[float]
    objectives: list[float]


@dataclass
class AlignmentMemo:
    """Alignment tails keyed by their inputs (see :func:`fedfiot_flwr.merge.engine.merge`).

    Attributes
    ----------
    tails : dict
        ``key -> AlignmentTail``; a key names the layer's data, the options and the first
        iteration's assignment.
    hits : int
        Tails reused.
    """

    tails: dict[Hashable, AlignmentTail] = field(default_factory=dict)
    hits: int = 0

    def get(self, key: Hashable) -> AlignmentTail | None:
        """The tail stored under ``key`` (counted as a hit), or None."""
        tail = self.tails.get(key)
        if tail is not None:
            self.hits += 1
        return tail

    def put(self, key: Hashable, tail: AlignmentTail) -> None:
        """Store ``tail`` under ``key``."""
        self.tails[key] = tail


class ModelCache:
    """Merged models by key, least recently used dropped beyond ``max_bytes``.

    Attributes
    ----------
    max_bytes : int
        Budget of the cached models' arrays.

    Examples
    --------
    >>> cache = ModelCache(max_bytes=16)
    >>> cache.put("a", ({"w": np.zeros(2)}, 0.0)); cache.put("b", ({"w": np.ones(2)}, 1.0))
    >>> cache.get("a") is None, cache.get("b")[1]
    (True, 1.0)
    """

    def __init__(self, max_bytes: int = 2**28) -> None:
        self.max_bytes = int(max_bytes)
        self._items: OrderedDict[Hashable, tuple[dict[str, np.ndarray], float]] = OrderedDict()
        self._bytes = 0
        self.hits = 0

    def get(self, key: Hashable) -> tuple[dict[str, np.ndarray], float] | None:
        """The ``(model, objective)`` stored under ``key``, or None."""
        item = self._items.get(key)
        if item is not None:
            self._items.move_to_end(key)
            self.hits += 1
        return item

    def put(self, key: Hashable, item: tuple[dict[str, np.ndarray], float]) -> None:
        """Store ``(model, objective)`` (not when it alone exceeds the budget)."""
        size = sum(np.asarray(x).nbytes for x in item[0].values())
        if size > self.max_bytes or key in self._items:
            return
        while self._items and self._bytes + size > self.max_bytes:
            _, (old, _) = self._items.popitem(last=False)
            self._bytes -= sum(np.asarray(x).nbytes for x in old.values())
        self._items[key] = item
        self._bytes += size
