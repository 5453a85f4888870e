"""The 16-bit weight and Fisher codec of a FedFiOT reply (numpy + flwr only).

Every float tensor is sent as int16 codes plus a float32 scale (:mod:`fedfiot_flwr.quantize`,
``l_q = 2**15 - 1``): a parameter as ``fedfiot.q16wf.v1`` (weight and Fisher), a floating-point
buffer as ``fedfiot.q16w.v1``; an integer buffer as Flower's plain ``Array(ndarray)``. Decoding
checks each scale against its bound of :mod:`fedfiot_flwr.reply_limits` together with the codes;
since no code exceeds ``l_q``, that check bounds every dequantized entry, so the decoded arrays
need no second pass.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from fedfiot_flwr.quantize import dequantize, quantize
from fedfiot_flwr.reply_limits import (
    MAX_FISHER_MAGNITUDE,
    MAX_INTEGER_BUFFER,
    MAX_WEIGHT_MAGNITUDE,
    finite_metric,
    parse_num_examples,
)
from fedfiot_flwr.wire.records import (
    ARRAYS_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
    NUMPY_STYPE,
    STYPE_WEIGHT,
    STYPE_WEIGHT_FISHER,
    ClientUpload,
)

__all__ = ["fedavg_reply", "pack_reply", "to_numpy", "unpack_reply"]


def to_numpy(x: Any) -> np.ndarray:
    """``x`` as a NumPy array (torch tensors are detached and moved to the CPU, without importing torch)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _encode(name: str, weight: np.ndarray, fisher: np.ndarray | None) -> Array:
    """One ``state_dict`` entry as an Array: 16-bit codes for a float tensor, as is otherwise."""
    shape = tuple(int(s) for s in weight.shape)
    if not np.issubdtype(weight.dtype, np.floating):
        if fisher is not None:
            raise ValueError(f"tensor {name!r}: a Fisher was given for a non-float tensor ({weight.dtype})")
        if not np.issubdtype(weight.dtype, np.integer):
            raise ValueError(f"tensor {name!r}: dtype {weight.dtype} cannot be sent; a tensor that is not "
                             "floating point must hold integers")
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
    state: Mapping[str, Any],
    fisher: Mapping[str, Any],
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
        On a Fisher key absent from ``state``, shape mismatches, non-finite weights, a tensor
        that is neither floating point nor integer (booleans included), a negative or
        non-finite Fisher, ``num_examples <= 0`` or non-numeric metrics.
    """
    extra = [k for k in fisher if k not in state]
    if extra:
        raise ValueError(f"pack_reply: Fisher entries {extra} are not in the state dict")
    if isinstance(num_examples, bool) or int(num_examples) != num_examples or int(num_examples) <= 0:
        raise ValueError(f"pack_reply: num_examples must be a positive integer, got {num_examples!r}")
    arrays = ArrayRecord()
    for name, value in state.items():
        f = fisher.get(name)
        arrays[name] = _encode(name, to_numpy(value), None if f is None else to_numpy(f).astype(np.float64))
    record: dict[str, int | float] = {NUM_EXAMPLES_KEY: int(num_examples)}
    for key, value in (metrics or {}).items():
        if key == NUM_EXAMPLES_KEY:
            raise ValueError(f"pack_reply: metrics must not contain {NUM_EXAMPLES_KEY!r}; pass num_examples")
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"pack_reply: metric {key!r} must be a number, got {value!r}")
        record[key] = int(value) if isinstance(value, (int, np.integer)) else float(value)
    return RecordDict({ARRAYS_RECORD: arrays, METRICS_RECORD: MetricRecord(record)})


def _decode(
    client: str, name: str, arr: Array, dtype: np.dtype, fisher_bound: float | None = MAX_FISHER_MAGNITUDE
) -> tuple[np.ndarray, np.ndarray | None]:
    """One tensor's weight (and Fisher), checked against every bound while it is decoded."""
    where = f"client {client}: tensor {name!r}"
    if not isinstance(arr, Array):
        raise ValueError(f"{where}: expected a flwr Array, got {type(arr).__name__}")
    shape = tuple(arr.shape)
    if any((not isinstance(s, int)) or s < 0 for s in shape):
        raise ValueError(f"{where}: bad shape {shape!r}")
    n = int(np.prod(shape, dtype=np.int64))
    if arr.stype == NUMPY_STYPE:
        try:
            value = arr.numpy()
        except Exception as err:  # noqa: BLE001 - any decoding failure is a bad reply
            raise ValueError(f"{where}: cannot decode the numpy array ({err})") from err
        if value.shape != shape:
            raise ValueError(f"{where}: array shape {value.shape} differs from its declared shape {shape}")
        if np.issubdtype(value.dtype, np.floating):
            raise ValueError(f"{where}: float tensors must be quantized (stype {STYPE_WEIGHT!r} or "
                             f"{STYPE_WEIGHT_FISHER!r}), got an unquantized {value.dtype} array")
        if not np.issubdtype(value.dtype, np.integer):  # booleans included: the merge averages numbers
            raise ValueError(f"{where}: unsupported dtype {value.dtype}, an unquantized buffer must hold integers")
        if value.size:
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
    limits = (MAX_WEIGHT_MAGNITUDE, fisher_bound)
    decoded: list[np.ndarray] = []
    for scale, c, what, limit in zip(scales, codes, ("weight", "Fisher"), limits):
        if what == "weight" and np.isfinite(scale) and scale > limit:  # a well-formed upload of diverged training
            raise ValueError(f"{where}: weights out of range, the largest |weight| {float(scale):g} exceeds the bound "
                             f"{limit:g}: the client's training most likely diverged (try a lower learning rate)")
        try:
            decoded.append(dequantize(c, scale, dtype=dtype, name=name, max_scale=limit))
        except ValueError as err:
            raise ValueError(f"{where}: bad {what} scale or codes: {err}") from err
    if with_fisher and codes[1].size and int(codes[1].min()) < 0:
        raise ValueError(f"{where}: negative Fisher codes")
    return decoded[0], (decoded[1] if with_fisher else None)


def unpack_reply(
    content: RecordDict,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    client: str = "?",
    *,
    parameters: Collection[str] | None = None,
    dtype: np.dtype | type = np.float32,
    fisher_bound: float | None = MAX_FISHER_MAGNITUDE,
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
    fisher_bound : float or None
        Largest accepted Fisher scale (:data:`~fedfiot_flwr.reply_limits.MAX_FISHER_MAGNITUDE`
        by default); ``None`` accepts any finite scale, for a server that caps the Fishers
        (:func:`fedfiot_flwr.reply_limits.fisher_bound_for`).

    Returns
    -------
    ClientUpload
        Since no code exceeds ``l_q``, each checked scale bounds its tensor: every float entry is
        finite and within :data:`~fedfiot_flwr.reply_limits.MAX_WEIGHT_MAGNITUDE`, every Fisher
        entry in ``[0, fisher_bound]``.

    Raises
    ------
    ValueError
        Naming the client and tensor, on: a missing record, missing or extra keys, a wrong
        shape, dtype (an unquantized buffer must hold integers), stype or byte length, codes out
        of range, a scale that is not
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
    if expected_shapes is not None:
        missing = [k for k in expected_shapes if k not in arrays]
        extra = [k for k in arrays if k not in expected_shapes]
        if missing or extra:
            raise ValueError(f"client {client}: reply tensors differ from the model's: missing {missing}, extra {extra}")
    weights: dict[str, np.ndarray] = {}
    fisher: dict[str, np.ndarray] = {}
    for name, arr in arrays.items():
        w, f = _decode(client, name, arr, np.dtype(dtype), fisher_bound)
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


def fedavg_reply(
    state: Mapping[str, Any], num_examples: int, metrics: Mapping[str, float] | None = None
) -> RecordDict:
    """The float32 FedAvg reply of the same model (Flower's default layout), for size comparisons.

    Parameters
    ----------
    state : Mapping[str, array]
        The model's ``state_dict()`` (torch tensors or NumPy arrays).
    num_examples : int
        Number of local examples.
    metrics : Mapping[str, float], optional
        Extra scalar metrics.

    Returns
    -------
    RecordDict
        ``{"arrays": ArrayRecord, "metrics": MetricRecord}``, float entries as float32.
    """
    arrays = ArrayRecord()
    for name, value in state.items():
        v = to_numpy(value)
        arrays[name] = Array(v.astype(np.float32) if np.issubdtype(v.dtype, np.floating) else v)
    record: dict[str, int | float] = {NUM_EXAMPLES_KEY: int(num_examples)}
    record.update({k: float(v) for k, v in (metrics or {}).items()})
    return RecordDict({"arrays": arrays, METRICS_RECORD: MetricRecord(record)})
