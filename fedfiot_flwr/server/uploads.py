"""One round's replies, decoded once: valid uploads in reply order, and what was excluded and why.

Every reply is decoded and validated exactly once (:func:`fedfiot_flwr.wire.decode_reply`); a
node's second reply in a round is excluded as a duplicate; replies whose curvature layers differ
from the first valid one are excluded. Nothing here imports torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import RecordDict

from fedfiot_flwr.baselines.averaging import size_weighted_average
from fedfiot_flwr.psd import InputGram, KFACFactors
from fedfiot_flwr.reply_limits import MAX_FISHER_MAGNITUDE
from fedfiot_flwr.wire import ClientUpload, CurvatureUpload, content_bytes, decode_reply, payload_bytes, reply_layout

__all__ = ["DUPLICATE_REASON", "CollectedUploads", "FirstReplies", "Rejection", "TooFewValidReplies", "collect_uploads",
           "majority_layout", "require_enough"]

DUPLICATE_REASON = "duplicate reply: only the node's first reply of the round counts"


class FirstReplies:
    """One round's one-reply-per-node rule: a node's first reply counts, every later one is a duplicate.

    The one implementation of the rule: both strategy shells apply it in arrival order to every
    reply (content, error replies and failures alike), :func:`collect_uploads` to the replies it
    is given.

    Examples
    --------
    >>> first = FirstReplies()
    >>> first.duplicate("7"), first.duplicate("8"), first.duplicate("7") == DUPLICATE_REASON
    (None, None, True)
    >>> first.duplicate("8", "failure: timeout")
    "duplicate reply: only the node's first reply of the round counts (failure: timeout)"
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def duplicate(self, node: str, reason: str | None = None) -> str | None:
        """Why ``node``'s reply is excluded as a duplicate, or ``None`` for its first reply.

        Parameters
        ----------
        node : str
            The node the reply answers for.
        reason : str, optional
            What else was wrong with the reply (a failure), added to the duplicate's reason.

        Returns
        -------
        str or None
            :data:`DUPLICATE_REASON` (with ``reason`` in parentheses) when ``node`` already replied
            this round; ``None`` otherwise, and ``node`` has now replied.
        """
        if node in self._seen:
            return DUPLICATE_REASON if reason is None else f"{DUPLICATE_REASON} ({reason})"
        self._seen.add(node)
        return None


@dataclass
class Rejection:
    """A reply that was excluded from the merge, and why (the reason names the tensor)."""

    client: str
    reason: str


@dataclass
class CollectedUploads:
    """The valid uploads of one round, in reply order, plus what was excluded.

    Attributes
    ----------
    client_ids : list[str]
        One id per valid upload (the Flower node id as a string).
    weights : list[dict[str, np.ndarray]]
        Dequantized weights of the valid uploads (every state-dict entry).
    fishers : list[dict[str, np.ndarray]]
        Dequantized diagonal Fishers (parameters only); empty for curvature replies.
    factors, grams : list[dict]
        K-FAC factors / RegMean input Grams per valid upload (empty for Fisher replies).
    fisher_kinds, ranks : list
        What each curvature upload declares (Fisher kind, rank cap; ``None`` when absent).
    num_examples : list[int]
        Local training-set sizes of the valid uploads.
    metrics : list[dict[str, float]]
        The clients' own training metrics, under their own names.
    contents : list[RecordDict]
        The valid replies as received (for Flower's metric aggregation).
    rejections : list[Rejection]
        Excluded replies with the reason.
    bytes_received : int
        Array payload bytes of every reply received (valid or not).
    bytes_per_client, curvature_bytes_per_client : dict[str, int]
        Payload bytes per replying client, and the part of it that is curvature factors.
    """

    client_ids: list[str] = field(default_factory=list)
    weights: list[dict[str, np.ndarray]] = field(default_factory=list)
    fishers: list[dict[str, np.ndarray]] = field(default_factory=list)
    factors: list[dict[str, KFACFactors]] = field(default_factory=list)
    grams: list[dict[str, InputGram]] = field(default_factory=list)
    fisher_kinds: list[str | None] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    num_examples: list[int] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    contents: list[RecordDict] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    bytes_received: int = 0
    bytes_per_client: dict[str, int] = field(default_factory=dict)
    curvature_bytes_per_client: dict[str, int] = field(default_factory=dict)

    def fedavg(self) -> dict[str, np.ndarray]:
        """FedAvg of the valid uploads, ``sum_k n_k W_k / sum_k n_k``, summed in client-id order so
        that the order the replies arrived in cannot change a bit."""
        order = sorted(range(len(self.client_ids)), key=lambda i: str(self.client_ids[i]))
        return size_weighted_average([self.weights[i] for i in order], [self.num_examples[i] for i in order])

    def __len__(self) -> int:
        return len(self.client_ids)


def collect_uploads(
    replies: Iterable[tuple[str, RecordDict]],
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    buffers: Collection[str] = (),
    errors: Iterable[tuple[str, str]] = (),
    *,
    kind: str = "fisher",
    fisher_kind: str | None = None,
    fisher_bound: float | None = MAX_FISHER_MAGNITUDE,
) -> CollectedUploads:
    """Decode and validate each reply once; exclude (with the reason) the broken and the duplicated.

    Parameters
    ----------
    replies : iterable of (client id, RecordDict)
        Reply contents with the node they answer for, in arrival order.
    expected_shapes : mapping of str to tuple of int, optional
        Names and shapes of the broadcast model; every upload must match them. ``None`` takes
        the layout most decodable uploads share (:func:`majority_layout`).
    buffers : collection of str
        State-dict entries that carry no Fisher.
    errors : iterable of (client id, reason)
        Replies that failed before decoding (Flower error replies, duplicates found by the caller);
        recorded as rejections. Duplicates among ``replies`` are found here: a client's first
        reply counts.
    kind : {"fisher", "kfac", "gram", "weights"}
        What the strategy merges (see :func:`fedfiot_flwr.wire.decode_reply`).
    fisher_kind : str, optional
        K-FAC only: the Fisher kind every reply must declare.
    fisher_bound : float or None
        Largest accepted diagonal Fisher entry: :data:`~fedfiot_flwr.reply_limits.MAX_FISHER_MAGNITUDE`
        where the Fishers are merged as uploaded, ``None`` (any finite value) where the merge caps
        them (:func:`fedfiot_flwr.reply_limits.fisher_bound_for`).

    Returns
    -------
    CollectedUploads
        Valid uploads in reply order and the rejections with their reasons.
    """
    out = CollectedUploads()
    first = FirstReplies()
    for client, reason in errors:
        out.rejections.append(Rejection(str(client), str(reason)))
    shapes = None if expected_shapes is None else dict(expected_shapes)
    decoded: list[tuple[str, RecordDict, ClientUpload | CurvatureUpload]] = []
    for client, content in replies:
        client = str(client)
        nbytes = content_bytes(content)
        out.bytes_received += nbytes
        out.bytes_per_client[client] = out.bytes_per_client.get(client, 0) + nbytes
        duplicate = first.duplicate(client)
        if duplicate is not None:
            out.rejections.append(Rejection(client, duplicate))
            continue
        try:
            decoded.append((client, content, decode_reply(content, kind, client=client, expected_shapes=shapes,
                                                          buffers=buffers, fisher_kind=fisher_kind,
                                                          fisher_bound=fisher_bound)))
        except Exception as exc:  # noqa: BLE001 - an untrusted reply excludes itself, never the round
            out.rejections.append(Rejection(client, str(exc) or type(exc).__name__))
    majority = majority_layout(up for _, _, up in decoded) if shapes is None else None
    layout: tuple[Any, ...] | None = None
    for client, content, up in decoded:
        try:
            if majority is not None and _signature(up) != majority:
                raise ValueError(f"client {client}: tensor names, shapes or Fishers differ from the layout most "
                                 "replies share")
            this_layout = reply_layout(up)
            if layout is not None and this_layout != layout:
                raise ValueError(f"client {client}: curvature layers {[s[0] for s in this_layout]} differ from the "
                                 f"other clients' {[s[0] for s in layout]}")
        except ValueError as exc:
            out.rejections.append(Rejection(client, str(exc)))
            continue
        layout = this_layout
        out.client_ids.append(client)
        out.weights.append(dict(up.weights))
        out.num_examples.append(int(up.num_examples))
        out.metrics.append(dict(up.metrics))
        out.contents.append(content)
        if isinstance(up, ClientUpload):
            out.fishers.append(dict(up.fisher))
        else:
            out.factors.append(dict(up.factors))
            out.grams.append(dict(up.grams))
            out.fisher_kinds.append(up.fisher_kind)
            out.ranks.append(up.rank)
            out.curvature_bytes_per_client[client] = payload_bytes(content)["curvature"]
    return out


Signature = tuple[tuple[str, tuple[int, ...], bool], ...]


def _signature(upload: ClientUpload | CurvatureUpload) -> Signature:
    fisher = upload.fisher if isinstance(upload, ClientUpload) else {}
    return tuple(sorted((k, tuple(np.shape(v)), k in fisher) for k, v in upload.weights.items()))


def majority_layout(uploads: Iterable[ClientUpload | CurvatureUpload]) -> Signature | None:
    """The tensor names, shapes and Fisher presence most uploads share (ties: the earliest).

    Used only when the server has no broadcast model to check the layout against, so that one
    malformed upload cannot impose its layout on the others.
    """
    counts: Counter[Signature] = Counter()
    for up in uploads:
        counts[_signature(up)] += 1
    if not counts:
        return None
    best = max(counts.values())
    return next(sig for sig, c in counts.items() if c == best)


class TooFewValidReplies(RuntimeError):
    """A round ended with fewer valid replies than it needs; the message lists every excluded client."""


def require_enough(collected: CollectedUploads, min_valid: int, server_round: int, label: str = "FedFiOT") -> None:
    """Raise a clear error when too few valid replies remain for the merge.

    Raises
    ------
    TooFewValidReplies
        If fewer than ``min_valid`` uploads passed validation; lists every excluded client.
    """
    if len(collected) >= max(1, min_valid):
        return
    details = "; ".join(f"client {r.client}: {r.reason}" for r in collected.rejections) or "no replies"
    raise TooFewValidReplies(
        f"{label} round {server_round}: only {len(collected)} valid replies, at least {max(1, min_valid)} "
        f"needed (min_valid_replies). Excluded: {details}"
    )


def weighted_mean_metrics(metrics: Sequence[Mapping[str, Any]], weights: Sequence[int]) -> dict[str, float]:
    """Example-weighted mean of the numeric scalar metrics every client reported (names unchanged)."""
    if not metrics:
        return {}
    keys = set.intersection(*(set(m) for m in metrics))
    total = float(sum(weights)) or 1.0
    out: dict[str, float] = {}
    for key in sorted(keys):
        values = [m[key] for m in metrics]
        if all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in values):
            out[key] = float(sum(float(v) * w for v, w in zip(values, weights)) / total)
    return out
