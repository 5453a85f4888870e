"""Bounded waiting for the federation's nodes before each round's sampling."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message

__all__ = ["NodeWaiter"]

logger = logging.getLogger("flwr")


@dataclass
class NodeWaiter:
    """Sampling that waits a bounded time for the federation's nodes, then goes on with those left.

    Flower's sampling waits without a timeout until ``min_available_nodes`` nodes are connected,
    so a SuperNode lost in round ``r`` would stop every later round. Before a round is sampled,
    :meth:`configure` waits up to ``timeout_s`` for the strategy's minimum; if fewer nodes are
    connected by then, the round samples the nodes that are (at least ``min_valid`` of them, else
    it fails with a clear error).

    Attributes
    ----------
    timeout_s : float or None
        Seconds to wait for the missing nodes; ``None`` keeps Flower's unbounded wait.
    seen : set of int
        Every node id connected when an earlier round was sampled.
    """

    timeout_s: float | None = None
    poll_s: float = 1.0
    seen: set[int] = field(default_factory=set)

    def configure(
        self, strategy: Any, grid: Any, min_valid: int, server_round: int, configure: Any
    ) -> tuple[list[Message], list[int]]:
        """Run ``configure()`` (the strategy's sampling) with a bounded wait for nodes.

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
        wanted = max(int(strategy.min_available_nodes), int(strategy.min_train_nodes))
        if self.timeout_s is None:
            messages = list(configure())
        else:
            deadline = time.monotonic() + self.timeout_s
            while len(list(grid.get_node_ids())) < wanted and time.monotonic() < deadline:
                time.sleep(self.poll_s)
            connected = len(list(grid.get_node_ids()))
            if connected >= wanted:
                messages = list(configure())
            elif connected < max(1, min_valid):
                raise RuntimeError(
                    f"round {server_round}: only {connected} nodes connected after waiting {self.timeout_s:g}s "
                    f"(node-wait-s), at least {max(1, min_valid)} needed (min_valid_replies)"
                )
            else:
                logger.warning("round %s: %d of %d nodes connected after %gs; going on with them",
                               server_round, connected, wanted, self.timeout_s)
                saved = strategy.min_available_nodes, strategy.min_train_nodes
                strategy.min_available_nodes = strategy.min_train_nodes = max(1, min_valid)
                try:
                    messages = list(configure())
                finally:
                    strategy.min_available_nodes, strategy.min_train_nodes = saved
        now = {int(n) for n in grid.get_node_ids()}
        lost = sorted(self.seen - now)
        self.seen |= now
        return messages, lost
