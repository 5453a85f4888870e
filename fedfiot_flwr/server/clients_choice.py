"""The clients' choice between a round's merge and FedAvg of the same uploads, in Flower's evaluation step.

Without server data the server cannot tell whether its curvature-weighted merge beats the plain
average of the same uploads; the clients can. :class:`ClientsChoice` sends every node sampled
for the round's evaluation the two models as two ordinary evaluate messages (the second carries
FedAvg of the same uploads and ``fedfiot-candidate = "fedavg"`` in its config), pairs the
answers by node, and compares the example-weighted accuracy (or, without one, loss) of the nodes
that scored both (:func:`~fedfiot_flwr.options.client_score_key`,
:func:`~fedfiot_flwr.options.merge_kept_by_clients`). Any client's evaluate handler answers
them: nothing new runs on the client, and there is no extra round trip.

After FedAvg has won ``handover_after`` rounds in a row the choice hands over: the next rounds
are FedAvg and the clients skip the curvature pass, until a probe round asks for the curvature
again (:func:`~fedfiot_flwr.options.handover_window`); the merge winning it ends the hand-overs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedfiot_flwr.options import CANDIDATE_CONFIG_KEY, client_score_key, handover_window, merge_kept_by_clients

__all__ = ["ChoiceScores", "ClientsChoice"]

MetricsAggregation = Callable[[list[RecordDict], str], MetricRecord | None]


@dataclass(frozen=True)
class ChoiceScores:
    """What the clients' evaluation said of one round's two models.

    Attributes
    ----------
    merge_score, fedavg_score : float
        Example-weighted mean of ``key`` for the merge and for FedAvg of the same uploads, over the
        nodes that scored both.
    nodes, examples : int
        How many nodes scored both, and their examples.
    key : str
        The metric compared (:func:`~fedfiot_flwr.options.client_score_key`).
    higher_is_better : bool
        Whether ``key`` is an accuracy (else a loss).
    """

    merge_score: float
    fedavg_score: float
    nodes: int
    examples: int
    key: str
    higher_is_better: bool

    @property
    def kept_merge(self) -> bool:
        """Whether the merge goes on (:func:`~fedfiot_flwr.options.merge_kept_by_clients`)."""
        return merge_kept_by_clients(self.merge_score, self.fedavg_score, self.higher_is_better)

    def metrics(self) -> dict[str, float | int]:
        """The round's server metrics of the choice."""
        return {"clients-kept-merge": int(self.kept_merge), "clients-merge-score": self.merge_score,
                "clients-fedavg-score": self.fedavg_score, "clients-choice-nodes": self.nodes}

    def record(self) -> dict[str, Any]:
        """The round report's entry: the scores and which model went on."""
        return {**asdict(self), "kept": "merge" if self.kept_merge else "fedavg"}

    def sentence(self) -> str:
        """The choice in words, for the round's log line."""
        kept = "the merge goes on" if self.kept_merge else "FedAvg of the same uploads goes on"
        return (f"{kept} ({self.key} {self.merge_score:.4f} for the merge, {self.fedavg_score:.4f} for FedAvg, "
                f"on {self.examples} examples of {self.nodes} nodes)")


class ClientsChoice:
    """Pairs a round's evaluate messages, compares the two models' losses and keeps the hand-over state.

    Parameters
    ----------
    handover_after : int
        FedAvg wins in a row after which the next rounds are FedAvg.
    reprobe_after : int or None
        How long the first hand-over lasts (``None``: for good); each further one in a row lasts twice
        as long as the one before.
    arrayrecord_key, configrecord_key, weighted_by_key : str
        The strategy's names for the model, the config and the example count (Flower's ``FedAvg``).
    aggregate_metrics : callable
        ``(contents, weighted_by_key) -> MetricRecord``: the strategy's ``evaluate_metrics_aggr_fn``.
    """

    def __init__(self, handover_after: int, reprobe_after: int | None, arrayrecord_key: str, configrecord_key: str,
                 weighted_by_key: str, aggregate_metrics: MetricsAggregation) -> None:
        self.handover_after = int(handover_after)
        self.reprobe_after = reprobe_after
        self.keys = (arrayrecord_key, configrecord_key, weighted_by_key)
        self.aggregate_metrics = aggregate_metrics
        self.fedavg_streak = 0
        """Rounds in a row that FedAvg won."""
        self.window: tuple[int, int | None] | None = None
        """The latest hand-over's FedAvg rounds, ``(first, resume)`` (``resume`` ``None``: for good)."""
        self.rounds: dict[int, ChoiceScores] = {}
        """Per round, what the clients' evaluation said."""
        self._pending: tuple[int, list[Message], list[Message]] | None = None

    def pair(self, server_round: int, messages: Iterable[Message], fedavg: ArrayRecord) -> list[Message]:
        """``messages`` (the merge, one per sampled node) and, for each, the same node's message with ``fedavg``."""
        merge = list(messages)
        arrays_key, config_key, _ = self.keys
        twins = []
        for msg in merge:
            config = ConfigRecord({**msg.content[config_key], CANDIDATE_CONFIG_KEY: "fedavg"})
            twins.append(Message(content=RecordDict({arrays_key: fedavg, config_key: config}),
                                 dst_node_id=msg.metadata.dst_node_id, message_type=msg.metadata.message_type))
        self._pending = (server_round, merge, twins)
        return merge + twins

    def pending(self, server_round: int) -> bool:
        """Whether this round's evaluation carries both models."""
        return self._pending is not None and self._pending[0] == server_round

    def split(self, replies: Iterable[Message]) -> tuple[list[Message], list[Message]]:
        """This round's replies as ``(merge's, FedAvg's)``, each in node order, the nodes that answered both
        without an error; a reply to neither message is dropped."""
        assert self._pending is not None
        _, merge, twins = self._pending
        self._pending = None
        by_id = {m.metadata.reply_to_message_id: m for m in replies}
        pairs = []
        for a, b in zip(merge, twins):
            ra, rb = by_id.get(a.metadata.message_id), by_id.get(b.metadata.message_id)
            if ra is not None and rb is not None and not ra.has_error() and not rb.has_error():
                pairs.append((ra, rb))
        return [a for a, _ in pairs], [b for _, b in pairs]

    def decide(self, server_round: int, merge: Sequence[Message], fedavg: Sequence[Message]) -> ChoiceScores | None:
        """Compare the two models on the paired replies and update the hand-over count.

        ``None`` (and no change to the count) when no node scored both or the replies carry neither an
        accuracy nor a loss.
        """
        if not merge:
            return None
        _, _, weight_key = self.keys
        try:
            ours = self.aggregate_metrics([m.content for m in merge], weight_key)
            theirs = self.aggregate_metrics([m.content for m in fedavg], weight_key)
        except (KeyError, TypeError, ValueError):
            return None
        found = client_score_key(dict(ours or {}))
        if found is None or theirs is None or found[0] not in theirs:
            return None
        key, higher = found
        examples = sum(int(_first_count(m.content, weight_key)) for m in merge)
        scores = ChoiceScores(float(ours[key]), float(theirs[key]), len(merge), examples, key, higher)  # type: ignore[index, arg-type]
        self.rounds[server_round] = scores
        self.fedavg_streak = 0 if scores.kept_merge else self.fedavg_streak + 1
        return scores

    def hand_over(self, server_round: int) -> tuple[int, int | None] | None:
        """The FedAvg rounds that follow round ``server_round``'s choice, ``(first, resume)``, or ``None``
        when the curvature goes on: FedAvg has won ``handover_after`` rounds in a row (a probe round
        FedAvg wins counts as one more hand-over, a round the merge wins resets both counts)."""
        if self.fedavg_streak < self.handover_after:
            return None
        self.window = handover_window(server_round, self.handovers, self.reprobe_after)
        return self.window

    @property
    def handovers(self) -> int:
        """Hand-overs in a row so far: the first comes with the ``handover_after``-th FedAvg win, and every
        later round the clients choose in is a probe round."""
        return max(0, self.fedavg_streak - self.handover_after + 1)

    def handover_sentence(self) -> str:
        """Why the latest hand-over happened and how long it lasts, in words."""
        assert self.window is not None
        why = (f"FedAvg won the clients' evaluation {self.handover_after} rounds in a row" if self.handovers == 1
               else f"FedAvg also won the probe round {self.window[0] - 1}")
        return why + ("" if self.window[1] is None else f"; round {self.window[1]} asks for the curvature again")

    def state(self) -> dict[str, Any]:
        """JSON-ready state a resumed run needs."""
        return {"fedavg_streak": self.fedavg_streak, "window": None if self.window is None else list(self.window),
                "rounds": {str(r): asdict(s) for r, s in self.rounds.items()}}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back :meth:`state`."""
        self.fedavg_streak = int(state.get("fedavg_streak", 0))
        window = state.get("window")
        self.window = None if window is None else (int(window[0]), None if window[1] is None else int(window[1]))
        self.rounds = {int(r): ChoiceScores(**s) for r, s in dict(state.get("rounds", {})).items()}


def _first_count(content: RecordDict, key: str) -> float:
    """The example count ``key`` of a reply's metric record (0 when absent)."""
    for record in content.metric_records.values():
        if key in record:
            value = record[key]
            return float(value) if np.isscalar(value) else 0.0
    return 0.0
