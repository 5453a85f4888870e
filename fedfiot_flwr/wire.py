"""The FedFiOT wire format: what a client sends and how the server reads it back (numpy + flwr only).

Every reply is one Flower :class:`~flwr.app.RecordDict`. This module packs replies on the
client, and on the server unpacks and validates each reply exactly once; nothing here imports
torch, so the server decodes without it and the client packs without server code.

FedFiOT (and FedFisher with diagonal Fishers) replies hold exactly one ArrayRecord and one
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

  Codes and scales follow :mod:`fedfiot_flwr.quantize` (``l_q = 2**15 - 1``).
- ``"metrics"`` (:data:`METRICS_RECORD`): a MetricRecord with ``"num-examples"`` (int > 0)
  and the client's own training metrics, under the client's own names.

FedFisher (K-FAC) and RegMean replies add, in the same ArrayRecord, one Array per compressed
factor keyed ``"curvature/<module>/<factor>"`` (``A`` and ``G`` for K-FAC, ``gram`` for
RegMean; ``stype="fedfiot.psd8.v1"``, ``dtype="int8"``, ``shape=(n, r)``, ``data`` = ``r``
float32 column scales then the ``n r`` int8 codes, see :mod:`fedfiot_flwr.psd`), and a
ConfigRecord ``"curvature"`` with ``method`` (``"kfac"``/``"gram"``), ``fisher-kind``,
``layers``, ``weights``, ``biases`` (``""`` for none) and ``rank`` (``-1``: full rank).

Projects on Flower's legacy ``flwr.server.strategy`` API carry the same RecordDict inside a
``FitRes`` as one ``uint8`` array (:func:`reply_to_ndarrays`, :func:`fitres_to_reply`).

Full byte-level description: ``docs/wire-format.md``.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common import Code, FitRes, NDArrays, parameters_to_ndarrays
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

from fedfiot_flwr.psd import CompressedPSD, InputGram, KFACFactors, compress_psd, decompress_psd, rank_for_budget
from fedfiot_flwr.quantize import check_codes, dequantize, quantize
from fedfiot_flwr.reply_limits import (
    MAX_CURVATURE_MAGNITUDE,
    MAX_FISHER_MAGNITUDE,
    MAX_INTEGER_BUFFER,
    MAX_WEIGHT_MAGNITUDE,
    check_magnitude,
    finite_metric,
    parse_num_examples,
)

__all__ = [
    "ARRAYS_RECORD",
    "CURVATURE_RECORD",
    "FACTOR_PREFIX",
    "METRICS_RECORD",
    "NUM_EXAMPLES_KEY",
    "REPLY_KINDS",
    "STYPE_PSD8",
    "STYPE_WEIGHT",
    "STYPE_WEIGHT_FISHER",
    "ClientUpload",
    "CurvatureUpload",
    "check_upload_magnitudes",
    "content_bytes",
    "decode_reply",
    "fedavg_payload_bytes",
    "fedavg_reply",
    "fitres_to_reply",
    "ndarrays_to_reply",
    "pack_gram_reply",
    "pack_kfac_reply",
    "pack_reply",
    "payload_bytes",
    "reply_num_bytes",
    "reply_to_ndarrays",
    "unpack_curvature_reply",
    "unpack_reply",
]

ARRAYS_RECORD = "fedfiot"
METRICS_RECORD = "metrics"
NUM_EXAMPLES_KEY = "num-examples"
STYPE_WEIGHT_FISHER = "fedfiot.q16wf.v1"
STYPE_WEIGHT = "fedfiot.q16w.v1"
STYPE_PSD8 = "fedfiot.psd8.v1"
CURVATURE_RECORD = "curvature"
FACTOR_PREFIX = "curvature/"
CURVATURE_METHODS = ("kfac", "gram")
REPLY_KINDS = ("fisher", "kfac", "gram", "weights")
"""What a strategy can ask :func:`decode_reply` for: diagonal Fisher, K-FAC factors, input Grams,
or only the weights (any reply)."""
_NUMPY_STYPE = "numpy.ndarray"


# ------------------------------------------------------------------------------- records



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




@dataclass(frozen=True)
class CurvatureUpload:
    """A validated, dequantized FedFisher (K-FAC) or RegMean reply.

    Attributes
    ----------
    weights : dict[str, np.ndarray]
        Every state-dict entry (dequantized).
    num_examples : int
        The client's number of local examples.
    method : str
        ``"kfac"`` or ``"gram"``.
    fisher_kind : str or None
        ``"true"`` or ``"empirical"`` for K-FAC, ``None`` for RegMean.
    rank : int or None
        The shared rank cap the client used (``None``: full rank).
    factors : dict[str, KFACFactors]
        K-FAC factors per module (dense, rebuilt from the 8-bit low-rank codes).
    grams : dict[str, InputGram]
        RegMean Grams per module (dense, rebuilt).
    metrics : dict[str, float]
        The client's other metrics.
    """

    weights: dict[str, np.ndarray]
    num_examples: int
    method: str
    fisher_kind: str | None
    rank: int | None
    factors: dict[str, KFACFactors] = field(default_factory=dict)
    grams: dict[str, InputGram] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)




# ------------------------------------------------------------------------------- packing


def _to_numpy(x: Any) -> np.ndarray:
    """``x`` as a NumPy array (torch tensors are detached and moved to the CPU, without importing torch)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu().numpy()
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
        record[key] = int(value) if isinstance(value, (int, np.integer)) else float(value)
    return RecordDict({ARRAYS_RECORD: arrays, METRICS_RECORD: MetricRecord(record)})


# ----------------------------------------------------------------- unpacking FedFiOT replies


def _decode(
    client: str, name: str, arr: Array, dtype: np.dtype, fisher_bound: float | None = MAX_FISHER_MAGNITUDE
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
    limits = (MAX_WEIGHT_MAGNITUDE, fisher_bound)
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



# ---------------------------------------------------------------------------- byte counts



def fedavg_reply(
    state: Mapping[str, Any], num_examples: int, metrics: Mapping[str, float] | None = None
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


def fedavg_payload_bytes(state: Mapping[str, Any]) -> int:
    """Array payload of FedAvg's float32 upload: 4 bytes per float entry (others as-is)."""
    total = 0
    for value in state.values():
        arr = _to_numpy(value)
        total += 4 * arr.size if np.issubdtype(arr.dtype, np.floating) else arr.nbytes
    return int(total)


def payload_bytes(content: RecordDict) -> dict[str, int]:
    """Array payload of a reply, split into weights and curvature factors.

    Returns
    -------
    dict[str, int]
        ``{"weights": ..., "curvature": ..., "total": ...}``: sums of ``len(array.data)``.
    """
    weights = curvature = 0
    for rec in content.array_records.values():
        for key, arr in rec.items():
            if key.startswith(FACTOR_PREFIX):
                curvature += len(arr.data)
            else:
                weights += len(arr.data)
    return {"weights": weights, "curvature": curvature, "total": weights + curvature}



def content_bytes(content: Any) -> int:
    """Payload bytes of a reply: ``len(array.data)`` summed over every Array of every ArrayRecord.

    Anything that cannot be measured counts as 0 bytes: a malformed reply must not stop the round.
    """
    try:
        return int(sum(len(arr.data) for rec in content.array_records.values() for arr in rec.values()))
    except Exception:  # noqa: BLE001
        return 0


# ------------------------------------------------------------------------ curvature replies



def _encode_psd(c: CompressedPSD) -> Array:
    data = c.scales.astype("<f4").tobytes() + c.codes.astype(np.int8).tobytes()
    return Array(dtype="int8", shape=(c.size, c.rank), stype=STYPE_PSD8, data=data)


def _pack(
    state: Mapping[str, Any],
    num_examples: int,
    metrics: Mapping[str, float] | None,
    method: str,
    fisher_kind: str,
    layers: Mapping[str, tuple[str, str | None, dict[str, np.ndarray]]],
    rank: int | str | None,
) -> RecordDict:
    content = pack_reply(state, {}, num_examples, metrics)
    arrays = content[ARRAYS_RECORD]
    if isinstance(rank, str):
        if rank != "fedavg":
            raise ValueError(f"rank must be an int, None or 'fedavg', got {rank!r}")
        budget = fedavg_payload_bytes(state) - payload_bytes(content)["weights"]
        sizes = [m.shape[0] for _, _, mats in layers.values() for m in mats.values()]
        rank = rank_for_budget(sizes, budget)
    elif rank is not None and (int(rank) != rank or rank < 1):
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    for module, (_, _, mats) in layers.items():
        for what, mat in mats.items():
            key = f"{FACTOR_PREFIX}{module}/{what}"
            if key in arrays:
                raise ValueError(f"factor key {key!r} collides with a state-dict entry")
            arrays[key] = _encode_psd(compress_psd(mat, rank, f"{module} {what}"))
    content[CURVATURE_RECORD] = ConfigRecord(
        {
            "method": method,
            "fisher-kind": fisher_kind,
            "layers": list(layers),
            "weights": [w for w, _, _ in layers.values()],
            "biases": ["" if b is None else b for _, b, _ in layers.values()],
            "rank": -1 if rank is None else int(rank),
        }
    )
    return content


def pack_kfac_reply(
    state: Mapping[str, Any],
    factors: Mapping[str, KFACFactors],
    num_examples: int,
    *,
    fisher_kind: str,
    rank: int | str | None = "fedavg",
    metrics: Mapping[str, float] | None = None,
) -> RecordDict:
    """FedFisher (K-FAC) reply: 16-bit weights plus 8-bit low-rank ``A`` and ``G``.

    Parameters
    ----------
    state : mapping of str to array
        The trained model's ``state_dict()``.
    factors : mapping of str to KFACFactors
        :func:`fedfiot_flwr.curvature.kfac_factors`' output.
    num_examples : int
        Local data-set size (> 0).
    fisher_kind : str
        The label choice the factors were computed with (recorded for the server).
    rank : int, None or "fedavg"
        Shared rank cap; ``None`` keeps full rank; ``"fedavg"`` fits FedAvg's upload.
    metrics : mapping of str to float, optional
        Training metrics.

    Returns
    -------
    RecordDict

    Raises
    ------
    ValueError
        On a bad rank, an empty factor set or anything :func:`pack_reply` rejects.
    """
    if not factors:
        raise ValueError("pack_kfac_reply: no K-FAC factors")
    layers = {m: (f.weight, f.bias, {"A": f.A, "G": f.G}) for m, f in factors.items()}
    return _pack(state, num_examples, metrics, "kfac", str(fisher_kind), layers, rank)


def pack_gram_reply(
    state: Mapping[str, Any],
    grams: Mapping[str, InputGram],
    num_examples: int,
    *,
    rank: int | str | None = "fedavg",
    metrics: Mapping[str, float] | None = None,
) -> RecordDict:
    """RegMean reply: 16-bit weights plus each Linear layer's 8-bit low-rank Gram.

    Parameters are as in :func:`pack_kfac_reply` (``grams`` from
    :func:`fedfiot_flwr.curvature.input_grams`).
    """
    if not grams:
        raise ValueError("pack_gram_reply: no Gram matrices")
    layers = {m: (g.weight, g.bias, {"gram": g.gram}) for m, g in grams.items()}
    return _pack(state, num_examples, metrics, "gram", "none", layers, rank)



def _decode_psd(client: str, key: str, arr: Array) -> np.ndarray:
    where = f"client {client}: factor {key!r}"
    if not isinstance(arr, Array) or arr.stype != STYPE_PSD8 or arr.dtype != "int8":
        raise ValueError(f"{where}: expected an int8 Array with stype {STYPE_PSD8!r}")
    shape = tuple(arr.shape)
    if len(shape) != 2 or any((not isinstance(s, int)) or s < 0 for s in shape):
        raise ValueError(f"{where}: bad shape {shape!r}")
    n, r = shape
    if len(arr.data) != 4 * r + n * r:
        raise ValueError(f"{where}: {len(arr.data)} data bytes, expected {4 * r + n * r} for shape {shape}")
    scales = np.frombuffer(arr.data, dtype="<f4", count=r).astype(np.float32)
    codes = np.frombuffer(arr.data, dtype=np.int8, offset=4 * r).reshape(n, r)
    try:
        return decompress_psd(CompressedPSD(codes, scales), name=key)
    except ValueError as err:
        raise ValueError(f"client {client}: {err}") from err


def unpack_curvature_reply(
    content: RecordDict,
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    client: str = "?",
    *,
    dtype: np.dtype | type = np.float32,
) -> CurvatureUpload:
    """Validate and dequantize a reply of :func:`pack_kfac_reply` or :func:`pack_gram_reply`.

    Parameters
    ----------
    content : RecordDict
        The reply's content.
    expected_shapes : mapping of str to tuple of int, optional
        The model's state-dict shapes; weights must match them exactly.
    client : str
        Client id for error messages.
    dtype : numpy dtype
        dtype of the dequantized weights (factors are float64).

    Returns
    -------
    CurvatureUpload

    Raises
    ------
    ValueError
        Naming the client and tensor/factor, on a missing record or key, a malformed factor,
        a factor whose size does not fit its layer, or anything :func:`unpack_reply` rejects.
    """
    if not isinstance(content, RecordDict):
        raise ValueError(f"client {client}: reply content is a {type(content).__name__}, not a RecordDict")
    meta = content.get(CURVATURE_RECORD)
    arrays = content.get(ARRAYS_RECORD)
    if not isinstance(meta, ConfigRecord) or not isinstance(arrays, ArrayRecord):
        raise ValueError(f"client {client}: reply lacks the ConfigRecord {CURVATURE_RECORD!r} or the ArrayRecord "
                         f"{ARRAYS_RECORD!r} (records: {sorted(content.keys())})")
    try:
        method = str(meta["method"])
        fisher_kind = str(meta["fisher-kind"])
        layers = [str(x) for x in meta["layers"]]
        wnames = [str(x) for x in meta["weights"]]
        bnames = [str(x) for x in meta["biases"]]
        rank = int(meta["rank"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"client {client}: malformed {CURVATURE_RECORD!r} record ({err!r})") from err
    if method not in CURVATURE_METHODS:
        raise ValueError(f"client {client}: unknown curvature method {method!r}")
    if not (len(layers) == len(wnames) == len(bnames)) or not layers:
        raise ValueError(f"client {client}: {CURVATURE_RECORD!r} lists {len(layers)} layers, "
                         f"{len(wnames)} weights and {len(bnames)} biases")
    plain = ArrayRecord({k: v for k, v in arrays.items() if not k.startswith(FACTOR_PREFIX)})
    rest = {k: v for k, v in content.items() if k not in (ARRAYS_RECORD, CURVATURE_RECORD)}
    base = unpack_reply(RecordDict({ARRAYS_RECORD: plain, **rest}), expected_shapes, client, dtype=dtype)
    names = ("A", "G") if method == "kfac" else ("gram",)
    expected_keys = {f"{FACTOR_PREFIX}{m}/{w}" for m in layers for w in names}
    got_keys = {k for k in arrays if k.startswith(FACTOR_PREFIX)}
    if got_keys != expected_keys:
        raise ValueError(f"client {client}: factor arrays differ from the listed layers: "
                         f"missing {sorted(expected_keys - got_keys)}, extra {sorted(got_keys - expected_keys)}")
    factors: dict[str, KFACFactors] = {}
    grams: dict[str, InputGram] = {}
    for module, wname, bname in zip(layers, wnames, bnames):
        bias = bname or None
        for name in (wname, bias):
            if name is not None and name not in base.weights:
                raise ValueError(f"client {client}: layer {module!r} names tensor {name!r}, which is not in the reply")
        w = base.weights[wname]
        if method == "gram" and w.ndim != 2:
            raise ValueError(f"client {client}: RegMean layer {module!r} has a {w.ndim}-D weight, expected a Linear one")
        sizes = {"A": int(np.prod(w.shape[1:])) + (bias is not None), "G": int(w.shape[0])}
        sizes["gram"] = sizes["A"]
        mats = {}
        for what in names:
            key = f"{FACTOR_PREFIX}{module}/{what}"
            mat = _decode_psd(client, key, arrays[key])
            if mat.shape[0] != sizes[what]:
                raise ValueError(f"client {client}: factor {key!r} is {mat.shape[0]}x{mat.shape[0]}, "
                                 f"expected {sizes[what]}x{sizes[what]} for tensor {wname!r}")
            mats[what] = mat
        if method == "kfac":
            factors[module] = KFACFactors(wname, bias, mats["A"], mats["G"])
        else:
            grams[module] = InputGram(wname, bias, mats["gram"])
    return CurvatureUpload(
        weights=base.weights,
        num_examples=base.num_examples,
        method=method,
        fisher_kind=None if fisher_kind in ("", "none") else fisher_kind,
        rank=None if rank < 0 else rank,
        factors=factors,
        grams=grams,
        metrics=base.metrics,
    )


# ------------------------------------------------------------------- one decode per reply


def check_upload_magnitudes(
    client: str,
    weights: Mapping[str, np.ndarray],
    fisher: Mapping[str, np.ndarray],
    fisher_bound: float | None = MAX_FISHER_MAGNITUDE,
) -> None:
    """Check every dequantized tensor against the bounds of :mod:`fedfiot_flwr.reply_limits`.

    Parameters
    ----------
    client : str
        Who sent the tensors (named in every error).
    weights, fisher : mapping of str to np.ndarray
        The dequantized weights (and buffers) and diagonal Fishers.
    fisher_bound : float or None
        Largest accepted Fisher entry; ``None``: any finite one (a server that caps the Fishers,
        :func:`fedfiot_flwr.reply_limits.fisher_bound_for`).

    Raises
    ------
    ValueError
        When a float weight is not finite or exceeds ``MAX_WEIGHT_MAGNITUDE``, an integer buffer
        exceeds ``MAX_INTEGER_BUFFER``, or a Fisher entry is not finite, negative or above
        ``fisher_bound``; the message names the client and the tensor.
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
        elif np.issubdtype(arr.dtype, np.floating):
            check_magnitude(float(np.max(np.abs(arr))), MAX_WEIGHT_MAGNITUDE, f"client {client!r}, tensor {name!r}")
    for name, value in fisher.items():
        arr = np.asarray(value)
        if arr.size:
            if float(np.min(arr)) < 0:
                raise ValueError(f"client {client!r}, Fisher of tensor {name!r}: contains negative entries")
            check_magnitude(float(np.max(np.abs(arr))), fisher_bound,
                            f"client {client!r}, Fisher of tensor {name!r}")


def reply_layout(upload: ClientUpload | CurvatureUpload) -> tuple[tuple[str, str, str | None], ...]:
    """The curvature layers an upload carries (``()`` for a diagonal-Fisher reply).

    Replies of one round must agree on it: the server merges layer by layer.
    """
    if isinstance(upload, ClientUpload):
        return ()
    layers: Mapping[str, KFACFactors | InputGram] = upload.factors if upload.method == "kfac" else upload.grams
    return tuple((name, f.weight, f.bias) for name, f in layers.items())


def decode_reply(
    content: RecordDict,
    kind: str,
    *,
    client: str,
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    buffers: Collection[str] = (),
    fisher_kind: str | None = None,
    fisher_bound: float | None = MAX_FISHER_MAGNITUDE,
) -> ClientUpload | CurvatureUpload:
    """Unpack, dequantize and validate one reply, once, for a strategy that needs ``kind``.

    Parameters
    ----------
    content : RecordDict
        The reply's content.
    kind : {"fisher", "kfac", "gram", "weights"}
        What the strategy merges: diagonal Fishers (FedFiOT, FedFisher diag), K-FAC factors,
        input Grams (RegMean), or only the weights of any of these replies.
    client : str
        Who sent it (named in every error).
    expected_shapes : mapping of str to tuple of int, optional
        The broadcast model's state-dict shapes; names and shapes must match exactly.
    buffers : collection of str
        State-dict entries that carry no Fisher (BatchNorm statistics).
    fisher_kind : str, optional
        K-FAC only: the Fisher kind the factors must declare.
    fisher_bound : float or None
        Largest accepted diagonal Fisher entry. The default,
        :data:`~fedfiot_flwr.reply_limits.MAX_FISHER_MAGNITUDE`, is for a server that merges the
        Fishers as uploaded; ``None`` accepts any finite Fisher, for a server that caps them
        (:func:`fedfiot_flwr.reply_limits.fisher_bound_for`). Non-finite and negative Fishers are
        always rejected.

    Returns
    -------
    ClientUpload or CurvatureUpload
        ``ClientUpload`` for ``"fisher"`` (and ``"weights"`` on a FedFiOT reply), else
        ``CurvatureUpload``.

    Raises
    ------
    ValueError
        Naming the client and the tensor or factor, on anything malformed.
    """
    if kind not in REPLY_KINDS:
        raise ValueError(f"unknown reply kind {kind!r}; choose one of {REPLY_KINDS}")
    curvature = isinstance(content, RecordDict) and CURVATURE_RECORD in content
    if kind == "fisher" or (kind == "weights" and not curvature):
        parameters = None
        if expected_shapes is not None and kind == "fisher":
            parameters = [k for k in expected_shapes if k not in buffers]
        up = unpack_reply(content, expected_shapes, client, parameters=parameters, fisher_bound=fisher_bound)
        check_upload_magnitudes(client, up.weights, up.fisher, fisher_bound)
        if kind == "fisher" and not up.fisher:
            raise ValueError(f"client {client}: reply carries no Fisher")
        return up
    cup = unpack_curvature_reply(content, expected_shapes, client)
    if kind != "weights" and cup.method != kind:
        raise ValueError(f"client {client}: sent a {cup.method!r} upload, this strategy needs {kind!r}")
    if fisher_kind is not None and kind == "kfac" and cup.fisher_kind != fisher_kind:
        raise ValueError(f"client {client}: K-FAC factors of the {cup.fisher_kind!r} Fisher, "
                         f"this strategy expects {fisher_kind!r}")
    check_upload_magnitudes(client, cup.weights, {})
    for name, mats in reply_layout_items(cup):
        for what, mat in mats:
            if not np.all(np.isfinite(mat)):
                raise ValueError(f"client {client}: factor {FACTOR_PREFIX}{name}/{what} has NaN or infinite values")
            if mat.size:
                check_magnitude(float(np.max(np.abs(mat))), MAX_CURVATURE_MAGNITUDE,
                                f"client {client}: factor {FACTOR_PREFIX}{name}/{what}")
    return cup


def reply_layout_items(upload: CurvatureUpload) -> list[tuple[str, list[tuple[str, np.ndarray]]]]:
    """``[(module, [(factor name, matrix), ...]), ...]`` of a curvature upload."""
    if upload.method == "kfac":
        return [(m, [("A", f.A), ("G", f.G)]) for m, f in upload.factors.items()]
    return [(m, [("gram", g.gram)]) for m, g in upload.grams.items()]


# ------------------------------------------------------------- the legacy FitRes envelope


def reply_to_ndarrays(content: RecordDict) -> NDArrays:
    """Serialize a reply RecordDict into the one-array payload of a legacy ``FitRes``.

    Parameters
    ----------
    content : RecordDict
        A reply built by :func:`pack_reply` (or a curvature reply).

    Returns
    -------
    list of np.ndarray
        A single ``uint8`` array holding Flower's protobuf serialization of ``content``.
    """
    blob = recorddict_to_proto(content).SerializeToString()
    return [np.frombuffer(blob, dtype=np.uint8).copy()]


def ndarrays_to_reply(ndarrays: NDArrays, client: str = "?") -> RecordDict:
    """Inverse of :func:`reply_to_ndarrays`.

    Raises
    ------
    ValueError
        If the payload is not exactly one uint8 array holding a serialized RecordDict.
    """
    if len(ndarrays) != 1 or np.asarray(ndarrays[0]).dtype != np.uint8:
        raise ValueError(
            f"client {client!r}: a FedFiOT legacy FitRes must carry exactly one uint8 array "
            f"(reply_to_ndarrays), got {len(ndarrays)} array(s) of dtype "
            f"{sorted({str(np.asarray(a).dtype) for a in ndarrays})}"
        )
    try:
        proto = ProtoRecordDict.FromString(np.asarray(ndarrays[0]).tobytes())
        return recorddict_from_proto(proto)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise ValueError(f"client {client!r}: undecodable FedFiOT legacy payload: {exc}") from exc


def fitres_to_reply(fit_res: FitRes, client: str = "?") -> RecordDict:
    """Decode the RecordDict a FedFiOT legacy client put into its ``FitRes``.

    Raises
    ------
    ValueError
        If the FitRes reports a failure or its parameters are not a FedFiOT payload.
    """
    if fit_res.status.code != Code.OK:
        raise ValueError(f"client {client!r}: FitRes status {fit_res.status.code.name}: {fit_res.status.message}")
    try:
        ndarrays = parameters_to_ndarrays(fit_res.parameters)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"client {client!r}: undecodable FitRes parameters: {exc}") from exc
    return ndarrays_to_reply(ndarrays, client)
