"""Replies of the FedFisher (K-FAC) and RegMean clients as Flower RecordDicts.

A reply is :func:`fedfiot_flwr.client.pack_reply`'s reply without a Fisher (every float
tensor as 16-bit weight codes, ``stype="fedfiot.q16w.v1"``, 2 bytes per entry plus a 4-byte
scale), with two additions, so it still holds exactly one ArrayRecord and one MetricRecord
(the shape Flower's strategies check):

- one Array per compressed factor in the same ArrayRecord ``"fedfiot"``, keyed
  ``"curvature/<module>/<factor>"`` (factor ``A`` and ``G`` for K-FAC, ``gram`` for RegMean):
  ``stype="fedfiot.psd8.v1"``, ``dtype="int8"``, ``shape=(n, r)``, ``data`` = ``r``
  little-endian float32 column scales, then the ``n r`` int8 codes (C order): ``n r + 4 r``
  bytes (see :func:`fedfiot_flwr.curvature.compress_psd`);
- a ConfigRecord ``"curvature"``: ``method`` (``"kfac"`` or ``"gram"``), ``fisher-kind``
  (``"true"`` / ``"empirical"``; ``"none"`` for RegMean: Flower's ``count_bytes`` rejects an
  empty string), ``layers`` (module names),
  ``weights`` and ``biases`` (state-dict keys; ``""`` for no bias) and ``rank`` (the shared
  rank cap, ``-1`` for full rank).

FedFisher (diag) needs no new format: it is FedFiOT's reply (weights and diagonal Fisher,
both 16-bit), :func:`fedfiot_flwr.client.pack_reply` / ``unpack_reply``.

``rank="fedavg"`` picks the largest shared rank that keeps the array payload within
FedAvg's float32 upload of the same model (``4`` bytes per float entry), as the paper's
C.2 does ("compressed ... so the upload stays near FedAvg's").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedfiot_flwr.client import ARRAYS_RECORD, pack_reply, unpack_reply
from fedfiot_flwr.curvature import (
    CompressedPSD,
    InputGram,
    KFACFactors,
    compress_psd,
    decompress_psd,
    rank_for_budget,
)

__all__ = [
    "CURVATURE_RECORD",
    "FACTOR_PREFIX",
    "STYPE_PSD8",
    "CurvatureUpload",
    "fedavg_payload_bytes",
    "pack_gram_reply",
    "pack_kfac_reply",
    "payload_bytes",
    "unpack_curvature_reply",
]

CURVATURE_RECORD = "curvature"
FACTOR_PREFIX = "curvature/"
STYPE_PSD8 = "fedfiot.psd8.v1"
METHODS = ("kfac", "gram")


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


# ----------------------------------------------------------------------------- byte counts


def _numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def fedavg_payload_bytes(state: Mapping[str, Any]) -> int:
    """Array payload of FedAvg's float32 upload: 4 bytes per float entry (others as-is)."""
    total = 0
    for value in state.values():
        arr = _numpy(value)
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


# --------------------------------------------------------------------------------- packing


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


# ------------------------------------------------------------------------------- unpacking


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
    if method not in METHODS:
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
