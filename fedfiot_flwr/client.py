"""What a FedFiOT client sends, and how the server reads it back.

A reply is one Flower :class:`~flwr.app.RecordDict` with exactly one ArrayRecord and one
MetricRecord (the shape Flower's own strategies check for):

- ``"fedfiot"`` (:data:`ARRAYS_RECORD`): one :class:`~flwr.app.Array` per ``state_dict``
  entry, keyed by its name, in ``state_dict`` order;

  - a parameter: ``stype="fedfiot.q16wf.v1"``, ``dtype="int16"``, ``shape`` = the tensor's
    shape, ``data`` = little-endian float32 weight scale, float32 Fisher scale, then the
    int16 weight codes and the int16 Fisher codes (both C order): ``8 + 4 n`` bytes;
  - a floating-point buffer (BatchNorm running statistics; no Fisher):
    ``stype="fedfiot.q16w.v1"``, ``data`` = float32 scale then int16 codes: ``4 + 2 n`` bytes;
  - any other buffer (``num_batches_tracked``): a plain ``Array(ndarray)``
    (``stype="numpy.ndarray"``), unquantized.

  Codes and scales follow :mod:`fedfiot_flwr.quantize` (eq. 107, ``l_q = 2**15 - 1``).
- ``"metrics"`` (:data:`METRICS_RECORD`): a MetricRecord with ``"num-examples"`` (int > 0)
  and the training metrics (``"train-loss"``, ``"train-accuracy"``, ...).

Packing the scales next to their codes, without NumPy's 128-byte ``.npy`` header, keeps the
array payload at ``32 d + 64 L`` bits plus the key names: smaller than Flower's float32
FedAvg reply of the same model, whose every Array carries an ``.npy`` header.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from torch import nn

from fedfiot_flwr.fisher import diagonal_fisher
from fedfiot_flwr.quantize import check_codes, dequantize, quantize
from fedfiot_flwr.reply_limits import (
    MAX_FISHER_MAGNITUDE,
    MAX_INTEGER_BUFFER,
    MAX_WEIGHT_MAGNITUDE,
    finite_metric,
    parse_num_examples,
)
from fedfiot_flwr.task import split_batch, train

__all__ = [
    "ARRAYS_RECORD",
    "METRICS_RECORD",
    "NUM_EXAMPLES_KEY",
    "STYPE_WEIGHT",
    "STYPE_WEIGHT_FISHER",
    "ClientUpload",
    "fedavg_reply",
    "pack_reply",
    "reply_num_bytes",
    "train_and_pack",
    "unpack_reply",
]

ARRAYS_RECORD = "fedfiot"
METRICS_RECORD = "metrics"
NUM_EXAMPLES_KEY = "num-examples"
STYPE_WEIGHT_FISHER = "fedfiot.q16wf.v1"
STYPE_WEIGHT = "fedfiot.q16w.v1"
_NUMPY_STYPE = "numpy.ndarray"


@dataclass(frozen=True)
class ClientUpload:
    """A validated, dequantized client reply.

    Attributes
    ----------
    weights : dict[str, np.ndarray]
        Every ``state_dict`` entry: dequantized parameters and float buffers, non-float
        buffers as sent.
    fisher : dict[str, np.ndarray]
        Dequantized diagonal Fisher of the parameters only (non-negative).
    num_examples : int
        The client's number of local examples (> 0).
    metrics : dict[str, float]
        The scalar metrics of the MetricRecord other than ``num-examples``.
    """

    weights: dict[str, np.ndarray]
    fisher: dict[str, np.ndarray]
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def buffers(self) -> list[str]:
        """Names of the entries without a Fisher (pass them to the merge as ``buffers=``)."""
        return [n for n in self.weights if n not in self.fisher]


# ------------------------------------------------------------------------------- packing


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _encode(name: str, weight: np.ndarray, fisher: np.ndarray | None) -> Array:
    shape = tuple(int(s) for s in weight.shape)
    if not np.issubdtype(weight.dtype, np.floating):
        if fisher is not None:
            raise ValueError(f"tensor {name!r}: a Fisher was given for a non-float tensor ({weight.dtype})")
        return Array(weight.copy(order="C"))  # (np.ascontiguousarray would make 0-d arrays 1-d)
    w_codes, w_scale = quantize(weight, name)
    if fisher is None:
        data = struct.pack("<f", float(w_scale)) + w_codes.astype("<i2").tobytes()
        return Array(dtype="int16", shape=shape, stype=STYPE_WEIGHT, data=data)
    if fisher.shape != weight.shape:
        raise ValueError(f"tensor {name!r}: Fisher shape {fisher.shape} differs from weight shape {weight.shape}")
    if not np.all(np.isfinite(fisher)) or (fisher.size and float(np.min(fisher)) < 0.0):
        raise ValueError(f"tensor {name!r}: the Fisher must be finite and non-negative")
    f_codes, f_scale = quantize(fisher, f"{name} (Fisher)")
    data = (
        struct.pack("<ff", float(w_scale), float(f_scale))
        + w_codes.astype("<i2").tobytes()
        + f_codes.astype("<i2").tobytes()
    )
    return Array(dtype="int16", shape=shape, stype=STYPE_WEIGHT_FISHER, data=data)


def pack_reply(
    state: Mapping[str, np.ndarray | torch.Tensor],
    fisher: Mapping[str, np.ndarray | torch.Tensor],
    num_examples: int,
    metrics: Mapping[str, float] | None = None,
) -> RecordDict:
    """Quantize a trained model and its Fisher into a FedFiOT reply.

    Parameters
    ----------
    state : Mapping[str, array]
        The model's ``state_dict()`` (torch tensors or NumPy arrays).
    fisher : Mapping[str, array]
        Diagonal Fisher of the parameters (a subset of ``state``'s keys, same shapes);
        float entries of ``state`` without a Fisher are sent as buffers.
    num_examples : int
        Number of local examples (> 0); sent as ``"num-examples"``.
    metrics : Mapping[str, float], optional
        Extra scalar metrics (e.g. ``train-loss``, ``train-accuracy``).

    Returns
    -------
    RecordDict
        ``{"fedfiot": ArrayRecord, "metrics": MetricRecord}`` (see the module docstring).

    Raises
    ------
    ValueError
        On a Fisher key absent from ``state``, shape mismatches, non-finite weights,
        a negative or non-finite Fisher, ``num_examples <= 0`` or non-numeric metrics.
    """
    extra = [k for k in fisher if k not in state]
    if extra:
        raise ValueError(f"pack_reply: Fisher entries {extra} are not in the state dict")
    if isinstance(num_examples, bool) or int(num_examples) != num_examples or int(num_examples) <= 0:
        raise ValueError(f"pack_reply: num_examples must be a positive integer, got {num_examples!r}")
    arrays = ArrayRecord()
    for name, value in state.items():
        f = fisher.get(name)
        arrays[name] = _encode(name, _to_numpy(value), None if f is None else _to_numpy(f).astype(np.float64))
    record: dict[str, int | float] = {NUM_EXAMPLES_KEY: int(num_examples)}
    for key, value in (metrics or {}).items():
        if key == NUM_EXAMPLES_KEY:
            raise ValueError(f"pack_reply: metrics must not contain {NUM_EXAMPLES_KEY!r}; pass num_examples")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"pack_reply: metric {key!r} must be a number, got {value!r}")
        record[key] = float(value)
    return RecordDict({ARRAYS_RECORD: arrays, METRICS_RECORD: MetricRecord(record)})


# ----------------------------------------------------------------------------- unpacking


def _decode(
    client: str, name: str, arr: Array, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray | None]:
    where = f"client {client}: tensor {name!r}"
    if not isinstance(arr, Array):
        raise ValueError(f"{where}: expected a flwr Array, got {type(arr).__name__}")
    shape = tuple(arr.shape)
    if any((not isinstance(s, int)) or s < 0 for s in shape):
        raise ValueError(f"{where}: bad shape {shape!r}")
    n = int(np.prod(shape, dtype=np.int64))
    if arr.stype == _NUMPY_STYPE:
        try:
            value = arr.numpy()
        except Exception as err:  # noqa: BLE001 - any decoding failure is a bad reply
            raise ValueError(f"{where}: cannot decode the numpy array ({err})") from err
        if value.shape != shape:
            raise ValueError(f"{where}: array shape {value.shape} differs from its declared shape {shape}")
        if np.issubdtype(value.dtype, np.floating):
            raise ValueError(f"{where}: float tensors must be quantized (stype {STYPE_WEIGHT!r} or "
                             f"{STYPE_WEIGHT_FISHER!r}), got an unquantized {value.dtype} array")
        if not np.issubdtype(value.dtype, np.integer) and value.dtype != np.bool_:
            raise ValueError(f"{where}: unsupported dtype {value.dtype}")
        if value.size and np.issubdtype(value.dtype, np.integer):
            largest = max(abs(int(value.min())), abs(int(value.max())))
            if largest > MAX_INTEGER_BUFFER:
                raise ValueError(f"{where}: integer entries up to {largest} exceed {MAX_INTEGER_BUFFER}")
        return value, None
    if arr.stype not in (STYPE_WEIGHT, STYPE_WEIGHT_FISHER):
        raise ValueError(f"{where}: unknown stype {arr.stype!r}")
    if arr.dtype != "int16":
        raise ValueError(f"{where}: dtype {arr.dtype!r}, expected 'int16'")
    with_fisher = arr.stype == STYPE_WEIGHT_FISHER
    header = 8 if with_fisher else 4
    expected = header + (4 if with_fisher else 2) * n
    if len(arr.data) != expected:
        raise ValueError(f"{where}: {len(arr.data)} data bytes, expected {expected} for shape {shape}")
    scales = np.frombuffer(arr.data, dtype="<f4", count=header // 4)
    codes = np.frombuffer(arr.data, dtype="<i2", offset=header).reshape((2 if with_fisher else 1, *shape))
    limits = (MAX_WEIGHT_MAGNITUDE, MAX_FISHER_MAGNITUDE)
    for scale, c, what, limit in zip(scales, codes, ("weight", "Fisher"), limits):
        try:
            check_codes(c, float(scale), name, max_scale=limit)
        except ValueError as err:
            raise ValueError(f"{where}: bad {what} scale or codes: {err}") from err
    if with_fisher and codes[1].size and int(codes[1].min()) < 0:
        raise ValueError(f"{where}: negative Fisher codes")
    weight = dequantize(codes[0], scales[0], dtype=dtype, name=name)
    fisher = dequantize(codes[1], scales[1], dtype=dtype, name=name) if with_fisher else None
    return weight, fisher


def unpack_reply(
    content: RecordDict,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    client: str = "?",
    *,
    parameters: Collection[str] | None = None,
    dtype: np.dtype | type = np.float32,
) -> ClientUpload:
    """Validate and dequantize a FedFiOT reply (the inverse of :func:`pack_reply`).

    Parameters
    ----------
    content : RecordDict
        The reply's content.
    expected_shapes : Mapping[str, tuple[int, ...]], optional
        The model's ``state_dict`` shapes; when given, keys and shapes must match exactly.
    client : str
        Client identifier used in error messages.
    parameters : Collection[str], optional
        Names that must carry a Fisher (the model's parameters); the others must not.
    dtype : numpy dtype
        dtype of the dequantized weights and Fisher (float32 by default).

    Returns
    -------
    ClientUpload

    Raises
    ------
    ValueError
        Naming the client and tensor, on: a missing record, missing or extra keys,
        a wrong shape, dtype, stype or byte length, codes out of range, a scale that is not
        finite or exceeds its bound (:mod:`fedfiot_flwr.reply_limits`), a negative Fisher, an
        integer buffer beyond its bound, or ``num-examples`` missing or not an integer in
        ``[1, MAX_NUM_EXAMPLES]``. Metrics that are not finite numbers are dropped; records other
        than :data:`ARRAYS_RECORD` and :data:`METRICS_RECORD` are ignored.
    """
    if not isinstance(content, RecordDict):
        raise ValueError(f"client {client}: reply content is a {type(content).__name__}, not a RecordDict")
    arrays = content.get(ARRAYS_RECORD)
    if not isinstance(arrays, ArrayRecord):
        raise ValueError(f"client {client}: reply has no ArrayRecord {ARRAYS_RECORD!r} "
                         f"(records: {sorted(content.keys())})")
    metrics_rec = content.get(METRICS_RECORD)
    if not isinstance(metrics_rec, MetricRecord):
        raise ValueError(f"client {client}: reply has no MetricRecord {METRICS_RECORD!r} "
                         f"(records: {sorted(content.keys())})")
    # Records other than these two are ignored: never read, whatever their type or content.
    if expected_shapes is not None:
        missing = [k for k in expected_shapes if k not in arrays]
        extra = [k for k in arrays if k not in expected_shapes]
        if missing or extra:
            raise ValueError(f"client {client}: reply tensors differ from the model's: missing {missing}, extra {extra}")
    weights: dict[str, np.ndarray] = {}
    fisher: dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        w, f = _decode(client, name, arr, np.dtype(dtype))
        if expected_shapes is not None and tuple(w.shape) != tuple(expected_shapes[name]):
            raise ValueError(f"client {client}: tensor {name!r} has shape {tuple(w.shape)}, "
                             f"expected {tuple(expected_shapes[name])}")
        if parameters is not None and (f is not None) != (name in parameters):
            raise ValueError(f"client {client}: tensor {name!r} " + (
                "is a parameter but carries no Fisher" if name in parameters else "carries a Fisher but is not a parameter"
            ))
        weights[name] = w
        if f is not None:
            fisher[name] = f
    if parameters is not None:
        absent = [p for p in parameters if p not in arrays]
        if absent:
            raise ValueError(f"client {client}: reply lacks parameters {absent}")
    if NUM_EXAMPLES_KEY not in metrics_rec:
        raise ValueError(f"client {client}: MetricRecord {METRICS_RECORD!r} has no {NUM_EXAMPLES_KEY!r}")
    num_examples = parse_num_examples(metrics_rec[NUM_EXAMPLES_KEY], f"client {client}")
    # Other metrics are only reported, never merged: keep the finite numbers, drop the rest.
    metrics = {k: m for k, v in metrics_rec.items() if k != NUM_EXAMPLES_KEY and (m := finite_metric(v)) is not None}
    return ClientUpload(weights=weights, fisher=fisher, num_examples=num_examples, metrics=metrics)


# ------------------------------------------------------------------------------- helpers


def fedavg_reply(
    state: Mapping[str, np.ndarray | torch.Tensor], num_examples: int, metrics: Mapping[str, float] | None = None
) -> RecordDict:
    """The float32 FedAvg reply of the same model (Flower's default layout), for size comparisons."""
    arrays = ArrayRecord()
    for name, value in state.items():
        v = _to_numpy(value)
        arrays[name] = Array(v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v)
    record: dict[str, int | float] = {NUM_EXAMPLES_KEY: int(num_examples)}
    record.update({k: float(v) for k, v in (metrics or {}).items()})
    return RecordDict({"arrays": arrays, METRICS_RECORD: MetricRecord(record)})


def reply_num_bytes(content: RecordDict, arrays_only: bool = False) -> int:
    """Bytes of a reply as Flower counts them (``count_bytes()`` summed over its records)."""
    records = content.array_records.values() if arrays_only else content.values()
    return int(sum(r.count_bytes() for r in records))


def _num_examples(loader: Iterable[Any]) -> int:
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        return len(dataset)
    return sum(int(split_batch(b)[1].shape[0]) for b in loader)


def train_and_pack(
    model: nn.Module,
    trainloader: Iterable[Any],
    epochs: int,
    *,
    fisher_kind: str = "empirical",
    device: torch.device | str | None = None,
    fisherloader: Iterable[Any] | None = None,
    num_examples: int | None = None,
    progress: bool | None = None,
    **train_kwargs: Any,
) -> RecordDict:
    """Train locally, compute the diagonal Fisher and pack the reply: a client round.

    Parameters
    ----------
    model : nn.Module
        The broadcast model, trained in place.
    trainloader : Iterable
        Training batches (may augment).
    epochs : int
        Local epochs.
    fisher_kind : str
        ``"empirical"`` (FedFiOT) or ``"true"`` (FedFisher).
    device : torch.device or str, optional
        Defaults to CUDA when available.
    fisherloader : Iterable, optional
        The same local examples without augmentation for the Fisher pass (e.g. over
        ``DatasetBundle.train_eval``); defaults to ``trainloader``.
    num_examples : int, optional
        Local data set size; defaults to ``len(fisherloader.dataset)`` (or a count).
    progress : bool, optional
        tqdm bars; ``None`` shows them only on a terminal.
    **train_kwargs
        Passed to :func:`fedfiot_flwr.task.train` (``lr``, ``momentum``, ``weight_decay``,
        ``augment``).

    Returns
    -------
    RecordDict
        The reply content (see :func:`pack_reply`).
    """
    metrics = train(model, trainloader, epochs, device=device, progress=progress, **train_kwargs)
    loader = trainloader if fisherloader is None else fisherloader
    fisher = diagonal_fisher(model, loader, fisher_kind, device=device, progress=progress)
    n = _num_examples(loader) if num_examples is None else int(num_examples)
    return pack_reply(model.state_dict(), fisher, n, metrics)
