"""Framework-neutral helpers shared by the Message-API strategy and its legacy twin.

Everything here works on plain ``(client id, RecordDict)`` pairs and numpy dicts, so the
``flwr.serverapp`` strategy (:mod:`fedfiot_flwr.strategy`) and the ``flwr.server`` strategy
(:mod:`fedfiot_flwr.legacy`) unpack, validate and exclude replies with one code path.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Message, RecordDict

from .merge import PermutationSpec, spec_from_module
from .merge.validate import check_models
from .reply_limits import (
    MAX_FISHER_MAGNITUDE,
    MAX_INTEGER_BUFFER,
    MAX_WEIGHT_MAGNITUDE,
    check_magnitude,
    parse_num_examples,
)

if TYPE_CHECKING:  # torch is only needed when a model is given
    import torch

logger = logging.getLogger("fedfiot_flwr")


@dataclass
class Rejection:
    """A reply that was excluded from the merge, and why."""

    client: str
    reason: str


@dataclass
class CollectedUploads:
    """The valid uploads of one round, in reply order, plus what was excluded.

    Attributes
    ----------
    client_ids : list[str]
        One id per valid upload (the Flower node id as a string).
    weights, fishers : list[dict[str, np.ndarray]]
        Dequantized weights and (parameter-only) Fishers of the valid uploads.
    num_examples : list[int]
        Local training-set sizes of the valid uploads.
    metrics : list[dict[str, Any]]
        The clients' own training metrics.
    rejections : list[Rejection]
        Excluded replies with the reason.
    bytes_received : int
        Payload bytes of every reply received (valid or not).
    bytes_per_client : dict[str, int]
        Payload bytes per replying client.
    """

    client_ids: list[str] = field(default_factory=list)
    weights: list[dict[str, np.ndarray]] = field(default_factory=list)
    fishers: list[dict[str, np.ndarray]] = field(default_factory=list)
    num_examples: list[int] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    bytes_received: int = 0
    bytes_per_client: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.client_ids)


def content_bytes(content: RecordDict) -> int:
    """Payload bytes of a reply: the serialized size of all its ArrayRecords.

    Parameters
    ----------
    content : RecordDict
        A reply's content.

    Returns
    -------
    int
        Sum of ``len(array.data)`` over every Array of every ArrayRecord.
    """
    return int(sum(len(arr.data) for rec in content.array_records.values() for arr in rec.values()))


def validate_upload(
    client: str,
    weights: Mapping[str, np.ndarray],
    fisher: Mapping[str, np.ndarray],
    num_examples: int,
    expected_shapes: Mapping[str, tuple[int, ...]],
    buffers: Collection[str],
) -> None:
    """Check one dequantized upload against the broadcast model's layout.

    Parameters
    ----------
    client : str
        Client id used in error messages.
    weights, fisher : mapping of str to np.ndarray
        The upload's weights (every state_dict entry) and Fisher (parameters only).
    num_examples : int
        The upload's training-set size.
    expected_shapes : mapping of str to tuple of int
        Names and shapes of the global model (the broadcast arrays).
    buffers : collection of str
        State-dict entries without a Fisher (BatchNorm running statistics).

    Raises
    ------
    ValueError
        On missing/extra tensors, wrong shapes, non-finite weights, a missing, NaN, infinite or
        negative Fisher entry, a weight, Fisher or integer buffer beyond its bound, or a
        ``num_examples`` that is not an integer in ``[1, MAX_NUM_EXAMPLES]``
        (:mod:`fedfiot_flwr.reply_limits`); the message names the client and the tensor.
    """
    parse_num_examples(num_examples, f"client {client!r}")
    missing = sorted(set(expected_shapes) - set(weights))
    extra = sorted(set(weights) - set(expected_shapes))
    if missing or extra:
        raise ValueError(f"client {client!r}: weight tensors differ from the global model: missing {missing}, extra {extra}")
    for name, shape in expected_shapes.items():
        got = tuple(np.shape(weights[name]))
        if got != tuple(shape):
            raise ValueError(f"client {client!r}, tensor {name!r}: shape {got} differs from the global model's {tuple(shape)}")
    # The merge engine's own validator covers Fisher keys, shapes, NaN/inf and sign.
    check_models([weights], [fisher], [b for b in buffers if b in weights], [client])
    check_upload_magnitudes(client, weights, fisher)


def check_upload_magnitudes(client: str, weights: Mapping[str, np.ndarray], fisher: Mapping[str, np.ndarray]) -> None:
    """Check every tensor of an upload against the bounds of :mod:`fedfiot_flwr.reply_limits`.

    Raises
    ------
    ValueError
        When a float weight exceeds ``MAX_WEIGHT_MAGNITUDE``, an integer buffer
        ``MAX_INTEGER_BUFFER`` or a Fisher entry ``MAX_FISHER_MAGNITUDE`` (or any is NaN).
    """
    for name, value in weights.items():
        arr = np.asarray(value)
        if arr.size == 0:
            continue
        if np.issubdtype(arr.dtype, np.integer):
            largest = max(abs(int(arr.min())), abs(int(arr.max())))
            if largest > MAX_INTEGER_BUFFER:
                raise ValueError(f"client {client!r}, tensor {name!r}: integer entries up to {largest} "
                                 f"exceed {MAX_INTEGER_BUFFER}")
        else:
            check_magnitude(float(np.max(np.abs(arr))), MAX_WEIGHT_MAGNITUDE, f"client {client!r}, tensor {name!r}")
    for name, value in fisher.items():
        arr = np.asarray(value)
        if arr.size:
            check_magnitude(float(np.max(np.abs(arr))), MAX_FISHER_MAGNITUDE,
                            f"client {client!r}, Fisher of tensor {name!r}")


def record_bytes(out: Any, client: str, content: Any) -> None:
    """Add a reply's payload bytes to ``out.bytes_received`` / ``out.bytes_per_client``.

    A record that cannot be measured counts as 0 bytes: a malformed reply must not stop the round.
    """
    try:
        nbytes = content_bytes(content)
    except Exception:  # noqa: BLE001
        nbytes = 0
    out.bytes_received += nbytes
    out.bytes_per_client[client] = out.bytes_per_client.get(client, 0) + nbytes


DUPLICATE_REASON = "duplicate reply: only the node's first reply of the round counts"


def reply_node_id(msg: Message, sent_to: Mapping[str, int] | None = None) -> str:
    """The id of the node a reply belongs to.

    A reply is attributed to the destination of the instruction it answers (looked up by its
    ``reply_to_message_id`` in ``sent_to``), because an error reply the SuperLink writes for a
    node it lost carries the SuperLink's id as its source. Without the instruction, the reply's
    ``src_node_id`` is used.

    Parameters
    ----------
    msg : Message
        A reply.
    sent_to : mapping of str to int, optional
        Instruction message id -> destination node id, for this round's instructions.
    """
    if sent_to:
        node = sent_to.get(msg.metadata.reply_to_message_id)
        if node is not None:
            return str(node)
    return str(msg.metadata.src_node_id)


def instruction_destinations(messages: Iterable[Message]) -> dict[str, int]:
    """``{message id: destination node id}`` of pushed instructions (ids are set on push)."""
    return {m.metadata.message_id: int(m.metadata.dst_node_id) for m in messages if m.metadata.message_id}


def split_replies(
    replies: Iterable[Message], sent_to: Mapping[str, int] | None = None
) -> tuple[list[tuple[str, RecordDict]], list[tuple[str, str]]]:
    """Sort one round's replies into contents and failures, keeping each node's first reply.

    Parameters
    ----------
    replies : iterable of Message
        The round's replies in arrival order.
    sent_to : mapping of str to int, optional
        Instruction message id -> destination node id (see :func:`reply_node_id`).

    Returns
    -------
    tuple
        ``(valid (node id, content) pairs, (node id, reason) of error replies and duplicates)``.
    """
    good: list[tuple[str, RecordDict]] = []
    errors: list[tuple[str, str]] = []
    seen: set[str] = set()
    for msg in replies:
        node = reply_node_id(msg, sent_to)
        if node in seen:
            errors.append((node, DUPLICATE_REASON))
        elif msg.has_error():
            errors.append((node, f"error reply: {msg.error.reason} (code {msg.error.code})"))
        else:
            good.append((node, msg.content))
        seen.add(node)
    return good, errors


def majority_layout(uploads: Iterable[Any]) -> dict[str, tuple[int, ...]] | None:
    """The tensor names and shapes most uploads share (ties: the earliest); ``None`` for none.

    Used only when the server has no broadcast model to check the layout against, so that one
    malformed upload cannot impose its layout on the others.
    """
    counts: Counter[tuple[tuple[str, tuple[int, ...], bool], ...]] = Counter()
    first: dict[tuple[tuple[str, tuple[int, ...], bool], ...], dict[str, tuple[int, ...]]] = {}
    for up in uploads:
        shapes = {k: tuple(np.shape(v)) for k, v in up.weights.items()}
        signature = tuple(sorted((k, s, k in up.fisher) for k, s in shapes.items()))
        counts[signature] += 1
        first.setdefault(signature, shapes)
    if not counts:
        return None
    best = max(counts.values())
    return next(first[sig] for sig in first if counts[sig] == best)


def collect_uploads(
    replies: Iterable[tuple[str, RecordDict]],
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    buffers: Collection[str] = (),
    errors: Iterable[tuple[str, str]] = (),
) -> CollectedUploads:
    """Unpack, dequantize and validate replies; exclude (and log) the broken ones.

    Parameters
    ----------
    replies : iterable of (client id, RecordDict)
        Reply contents with the id of the node that sent them.
    expected_shapes : mapping of str to tuple of int, optional
        Names and shapes of the broadcast model; every upload must match them. ``None`` takes
        the layout most decodable uploads share (:func:`majority_layout`).
    buffers : collection of str
        State-dict entries that carry no Fisher.
    errors : iterable of (client id, reason)
        Replies that already failed before unpacking (Flower error replies, undecodable
        payloads); recorded as rejections with the reason as given.

    Returns
    -------
    CollectedUploads
        Valid uploads in reply order and the rejections with their reasons. Only a client's
        first reply counts; later ones are excluded as duplicates. Any failure while reading a
        reply excludes that reply only.
    """
    from .client import unpack_reply  # lazy: the client module imports torch

    out = CollectedUploads()
    for client, reason in errors:
        out.rejections.append(Rejection(str(client), str(reason)))
        logger.debug("FedFiOT: excluding client %s: %s", client, reason)

    def reject(client: str, exc: BaseException) -> None:
        reason = str(exc) or type(exc).__name__
        out.rejections.append(Rejection(client, reason))
        logger.debug("FedFiOT: excluding client %s: %s", client, reason)

    decoded: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for client, content in replies:
        client = str(client)
        record_bytes(out, client, content)
        if client in seen:
            reject(client, ValueError(DUPLICATE_REASON))
            continue
        seen.add(client)
        try:
            decoded.append((client, unpack_reply(
                content,
                expected_shapes=None if expected_shapes is None else dict(expected_shapes),
                client=client,
                parameters=None if expected_shapes is None else [k for k in expected_shapes if k not in buffers],
            )))
        except Exception as exc:  # noqa: BLE001 - an untrusted reply excludes itself, never the round
            reject(client, exc)
    if expected_shapes is None:
        expected_shapes = majority_layout(up for _, up in decoded)
    for client, upload in decoded:
        try:
            validate_upload(client, upload.weights, upload.fisher, upload.num_examples, expected_shapes or {}, buffers)
        except Exception as exc:  # noqa: BLE001
            reject(client, exc)
            continue
        out.client_ids.append(client)
        out.weights.append({k: np.asarray(v) for k, v in upload.weights.items()})
        out.fishers.append({k: np.asarray(v) for k, v in upload.fisher.items()})
        out.num_examples.append(int(upload.num_examples))
        out.metrics.append(dict(upload.metrics))
    return out


def require_enough(collected: CollectedUploads, min_valid: int, server_round: int) -> None:
    """Raise a clear error when too few valid replies remain for the merge.

    Raises
    ------
    RuntimeError
        If fewer than ``min_valid`` uploads passed validation; lists every excluded client.
    """
    if len(collected) >= max(1, min_valid):
        return
    details = "; ".join(f"client {r.client}: {r.reason}" for r in collected.rejections) or "no replies"
    raise RuntimeError(
        f"FedFiOT round {server_round}: only {len(collected)} valid replies, at least {max(1, min_valid)} "
        f"needed (min_valid_replies). Excluded: {details}"
    )


def resolve_spec(
    spec: PermutationSpec | None, model: torch.nn.Module | None
) -> tuple[PermutationSpec | None, tuple[str, ...]]:
    """Return the permutation spec and the buffer names (state_dict entries that are not parameters).

    Parameters
    ----------
    spec : PermutationSpec, optional
        An explicit spec; wins over ``model``.
    model : torch.nn.Module, optional
        A model to derive the spec from (:func:`fedfiot_flwr.merge.spec_from_module`) and to read
        its buffers from.

    Returns
    -------
    tuple
        ``(spec or None, buffer names)``.
    """
    buffers: tuple[str, ...] = ()
    if model is not None:
        params = {n for n, _ in model.named_parameters()}
        buffers = tuple(n for n in model.state_dict() if n not in params)
        if spec is None:
            spec = spec_from_module(model)
    return spec, buffers


def aggregate_client_metrics(metrics: Sequence[Mapping[str, Any]], weights: Sequence[int]) -> dict[str, float]:
    """Example-weighted mean of the numeric scalar metrics every client reported.

    Parameters
    ----------
    metrics : sequence of mapping
        One metrics dict per client.
    weights : sequence of int
        One weight (number of examples) per client.

    Returns
    -------
    dict[str, float]
        Keys present (and numeric) in every client's metrics, except ``num-examples``.
    """
    if not metrics:
        return {}
    keys = set.intersection(*(set(m) for m in metrics)) - {"num-examples"}
    total = float(sum(weights)) or 1.0
    out: dict[str, float] = {}
    for key in sorted(keys):
        values = [m[key] for m in metrics]
        if all(isinstance(v, (int, float, np.number)) and not isinstance(v, bool) for v in values):
            out[key] = float(sum(float(v) * w for v, w in zip(values, weights)) / total)
    return out


def parse_float_list(text: str | Sequence[float], name: str) -> tuple[float, ...]:
    """Parse ``"0.2,0.3"`` (a run-config string) or a sequence into a tuple of floats.

    Raises
    ------
    ValueError
        Naming the config key when an entry is not a number or the list is empty.
    """
    items = [s.strip() for s in text.split(",") if s.strip()] if isinstance(text, str) else list(text)
    try:
        values = tuple(float(x) for x in items)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise ValueError(f"{name}: expected at least one value, got {text!r}")
    return values


def parse_str_list(text: str | Sequence[str], name: str) -> tuple[str, ...]:
    """Parse ``"largest,broadcast"`` (a run-config string) or a sequence into a tuple of str."""
    items = [s.strip() for s in text.split(",") if s.strip()] if isinstance(text, str) else [str(x) for x in text]
    if not items:
        raise ValueError(f"{name}: expected at least one value, got {text!r}")
    return tuple(items)


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
