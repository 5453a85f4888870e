"""Bounded waiting for the federation's nodes before each round's sampling, once per lost node."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message

__all__ = ["NodeWaiter"]

logger = logging.getLogger("flwr")


@dataclass
class NodeWaiter:
    """Sampling that waits a bounded time for the federation's nodes, then goes on with those left.

    Flower's sampling waits without a timeout until ``min_available_nodes`` nodes are connected,
    so a SuperNode lost in round ``r`` would stop every later round. Before a round's training
    (:meth:`configure`) or federated evaluation (:meth:`configure_evaluate`) is sampled, this
    waits up to ``timeout_s`` for the strategy's minimum; if fewer nodes are connected by then,
    it samples the nodes that are (at least the minimum needed, else training fails with a clear
    error and evaluation is skipped).

    A lost node is waited for once: when a wait runs out, the nodes connected at that moment are
    remembered (:attr:`settled`), and a later wait goes on at once while all of them are still
    connected and at least the minimum needed are. A node lost after that, or a settled node
    lost later, is waited for once again; a node that reconnects is sampled again.

    Attributes
    ----------
    timeout_s : float or None
        Seconds to wait for the missing nodes; ``None`` keeps Flower's unbounded wait.
    poll_s : float
        Seconds between two looks at the connected nodes while waiting.
    seen : set of int
        Every node id connected when an earlier round's training was sampled.
    settled : frozenset of int or None
        The nodes connected when a wait last ran out (None: no wait has run out yet).
    clock, sleep : callable
        ``time.monotonic`` and ``time.sleep`` (replaceable in tests).
    waited_s : float
        How long the last :meth:`wait` waited (0: it went on at once).
    """

    timeout_s: float | None = None
    poll_s: float = 1.0
    seen: set[int] = field(default_factory=set)
    settled: frozenset[int] | None = None
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    waited_s: float = 0.0

    def wait(self, grid: Any, wanted: int, needed: int) -> int:
        """Wait up to ``timeout_s`` until ``wanted`` nodes are connected, unless the missing ones were waited for.

        Parameters
        ----------
        grid : Grid
            The run's grid.
        wanted : int
            Nodes the strategy asks for (its ``min_available_nodes`` and sampling minimum).
        needed : int
            Fewest nodes the caller can go on with; below it, the wait never ends early.

        Returns
        -------
        int
            Number of nodes connected when the wait ended.
        """
        self.waited_s = 0.0
        connected = _connected(grid)
        if len(connected) >= wanted or self.timeout_s is None:
            return len(connected)
        start = self.clock()
        deadline = start + self.timeout_s
        while not self._can_go_on(connected, wanted, needed) and self.clock() < deadline:
            self.sleep(self.poll_s)
            connected = _connected(grid)
        self.waited_s = self.clock() - start
        if len(connected) < wanted:
            self.settled = frozenset(connected)
        return len(connected)

    def wait_for_stable_set(self, grid: Any, settle_s: float) -> int:
        """Wait up to ``timeout_s`` for a first node, then until the connected set is stable; return its size.

        The set of node ids must stay unchanged for ``settle_s`` seconds (the simulation engine
        registers all its SuperNodes at once; real SuperNodes may connect one by one). Returns 0
        if no node connected within ``timeout_s``; a set that keeps changing is taken as it is
        ``timeout_s + settle_s`` seconds after the start. ``timeout_s=None`` waits for the first
        node without a bound.
        """
        start = self.clock()
        limit = math.inf if self.timeout_s is None else self.timeout_s
        seen = _connected(grid)
        while not seen and self.clock() - start < limit:
            self.sleep(self.poll_s)
            seen = _connected(grid)
        if not seen:
            return 0
        stable_since = self.clock()
        while self.clock() - stable_since < settle_s and self.clock() - start < limit + settle_s:
            self.sleep(min(self.poll_s, settle_s))
            now = _connected(grid)
            if now != seen:
                seen, stable_since = now, self.clock()
        return len(seen)

    def _can_go_on(self, connected: set[int], wanted: int, needed: int) -> bool:
        """Whether ``wanted`` nodes are connected, or every node missing was already waited for."""
        if len(connected) >= wanted:
            return True
        return self.settled is not None and self.settled <= connected and len(connected) >= needed

    def sample(
        self, strategy: Any, grid: Any, server_round: int, minimum_attr: str, needed: int,
        configure: Callable[[], Iterable[Message]],
    ) -> tuple[list[Message], int]:
        """Wait for nodes, then run ``configure()`` (the strategy's sampling) on the connected ones.

        Parameters
        ----------
        strategy : flwr FedAvg-like strategy
            Its ``min_available_nodes`` and ``minimum_attr`` are lowered to ``needed`` for this
            call only when nodes are missing after the wait (so that Flower's own unbounded wait
            never blocks on them).
        grid : Grid
            The run's grid.
        server_round : int
            Current round (for messages).
        minimum_attr : str
            The strategy's sampling minimum: ``"min_train_nodes"`` or ``"min_evaluate_nodes"``.
        needed : int
            Fewest nodes the round can go on with.
        configure : callable
            ``() -> Iterable[Message]``: the strategy's own sampling.

        Returns
        -------
        tuple
            ``(instructions, connected)``; no instructions when fewer than ``needed`` nodes are
            connected after the wait.
        """
        wanted = max(int(strategy.min_available_nodes), int(getattr(strategy, minimum_attr)))
        connected = self.wait(grid, wanted, needed)
        if connected >= wanted:
            return list(configure()), connected
        if connected < needed:
            return [], connected
        if self.waited_s > 0:  # said once per loss: later rounds go on at once with the same nodes
            logger.warning("round %s: %d of %d nodes connected after waiting %gs for the missing ones (node-wait-s); "
                           "going on with the connected ones", server_round, connected, wanted, self.waited_s)
        saved = strategy.min_available_nodes, getattr(strategy, minimum_attr)
        strategy.min_available_nodes = needed
        setattr(strategy, minimum_attr, needed)
        try:
            return list(configure()), connected
        finally:
            strategy.min_available_nodes = saved[0]
            setattr(strategy, minimum_attr, saved[1])

    def configure(
        self, strategy: Any, grid: Any, min_valid: int, server_round: int, configure: Callable[[], Iterable[Message]]
    ) -> tuple[list[Message], list[int]]:
        """Run the strategy's training sampling ``configure()`` with a bounded wait for nodes.

        Parameters
        ----------
        strategy : flwr FedAvg-like strategy
            Its ``min_available_nodes`` / ``min_train_nodes`` are lowered for this call only
            when nodes are missing after the wait.
        grid : Grid
            The run's grid.
        min_valid : int
            Fewest nodes a round can go on with (``min_valid_replies``).
        server_round : int
            Current round (for messages).
        configure : callable
            ``() -> Iterable[Message]``: the strategy's own sampling.

        Returns
        -------
        tuple
            ``(instructions, ids of nodes seen in earlier rounds that are no longer connected)``.

        Raises
        ------
        RuntimeError
            When fewer than ``min_valid`` nodes are connected after the wait.
        """
        needed = max(1, min_valid)
        if self.timeout_s is None:
            messages = list(configure())
        else:
            messages, connected = self.sample(strategy, grid, server_round, "min_train_nodes", needed, configure)
            if connected < needed:
                raise RuntimeError(
                    f"round {server_round}: only {connected} nodes connected after waiting {self.timeout_s:g}s "
                    f"(node-wait-s), at least {needed} needed (min_valid_replies)"
                )
        now = _connected(grid)
        lost = sorted(self.seen - now)
        self.seen |= now
        return messages, lost

    def configure_evaluate(
        self, strategy: Any, grid: Any, server_round: int, configure: Callable[[], Iterable[Message]]
    ) -> list[Message]:
        """Run the strategy's evaluation sampling ``configure()`` with a bounded wait for nodes.

        Returns
        -------
        list of Message
            The instructions; none (federated evaluation skipped) when no node is connected after
            the wait.
        """
        if self.timeout_s is None:
            return list(configure())
        messages, connected = self.sample(strategy, grid, server_round, "min_evaluate_nodes", 1, configure)
        if connected == 0:
            logger.warning("round %s: no node connected, federated evaluation skipped", server_round)
        return messages


def _connected(grid: Any) -> set[int]:
    """Ids of the nodes connected now."""
    return {int(n) for n in grid.get_node_ids()}
