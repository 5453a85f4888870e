"""The compressed-PSD curvature codec: FedFisher (K-FAC) and RegMean replies (numpy + flwr only).

A curvature reply is a FedFiOT reply without Fishers (:mod:`fedfiot_flwr.wire.q16`) plus, in the
same ArrayRecord, one ``fedfiot.psd8.v1`` Array per factor keyed ``curvature/<module>/<factor>``
(``A`` and ``G`` for K-FAC, ``gram`` for the Gram replies: ``r`` float32 column scales, then ``n r`` int8
codes, see :mod:`fedfiot_flwr.psd`), for the K-FAC curvature's Gram replies one ``fedfiot.f32.v1`` Array
``curvature/<module>/output`` per layer (its ``d_out`` output factors, little-endian float32), and a
ConfigRecord ``"curvature"`` describing the layers (``outputs``: whether the output factors are there).
Decoding checks every factor against :data:`~fedfiot_flwr.reply_limits.MAX_CURVATURE_MAGNITUDE`
as it rebuilds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedfiot_flwr.psd import CompressedPSD, InputGram, KFACFactors, compress_psd, psd_root, rank_for_budget
from fedfiot_flwr.reply_limits import MAX_CURVATURE_MAGNITUDE, check_magnitude
from fedfiot_flwr.wire.q16 import pack_reply, unpack_reply
from fedfiot_flwr.wire.records import (
    ARRAYS_RECORD,
    CURVATURE_METHODS,
    CURVATURE_RECORD,
    FACTOR_PREFIX,
    OUTPUT_FACTOR,
    STYPE_F32,
    STYPE_PSD8,
    CurvatureUpload,
)
from fedfiot_flwr.wire.sizes import fedavg_payload_bytes, payload_bytes

__all__ = ["pack_gram_reply", "pack_kfac_reply", "unpack_curvature_reply"]


def _encode_psd(c: CompressedPSD) -> Array:
    """A compressed factor as an Array: column scales, then the codes."""
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
    outputs: Mapping[str, np.ndarray] | None = None,
) -> RecordDict:
    """The weights without a Fisher plus every layer's compressed factors (and float32 output factors) and their
    description."""
    content = pack_reply(state, {}, num_examples, metrics)
    arrays = content[ARRAYS_RECORD]
    for module, output in (outputs or {}).items():
        values = np.ascontiguousarray(output, dtype="<f4").reshape(-1)
        arrays[f"{FACTOR_PREFIX}{module}/{OUTPUT_FACTOR}"] = Array(dtype="float32", shape=(values.size,),
                                                                   stype=STYPE_F32, data=values.tobytes())
    if isinstance(rank, str):
        if rank != "fedavg":
            raise ValueError(f"rank must be an int, None or 'fedavg', got {rank!r}")
        budget = fedavg_payload_bytes(state) - payload_bytes(content)["total"]  # the weights and any output factors
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
            "outputs": bool(outputs),
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
    """Gram reply (RegMean's, and FedFiOT's Gram and K-FAC curvatures): 16-bit weights plus each layer's 8-bit
    low-rank input Gram (Linear layers; Conv2d layers over their unfolded patches) and, where the Grams carry
    one (``InputGram.output``), its float32 output factor (then every layer must carry one).

    Parameters are as in :func:`pack_kfac_reply` (``grams`` from
    :func:`fedfiot_flwr.curvature.input_grams`); with ``rank="fedavg"`` the output factors' bytes come out of
    the Grams' budget.
    """
    if not grams:
        raise ValueError("pack_gram_reply: no Gram matrices")
    with_output = [m for m, g in grams.items() if g.output is not None]
    if with_output and len(with_output) != len(grams):
        raise ValueError(f"pack_gram_reply: output factors for {with_output} only, not for every Gram layer")
    layers = {m: (g.weight, g.bias, {"gram": g.gram}) for m, g in grams.items()}
    outputs = {m: np.asarray(grams[m].output) for m in with_output}
    return _pack(state, num_examples, metrics, "gram", "none", layers, rank, outputs)


def _decode_psd(client: str, key: str, arr: Array) -> tuple[np.ndarray, np.ndarray]:
    """One factor, rebuilt to a dense ``n x n`` matrix and checked against its bound; and its
    ``(n, r)`` root (the dense matrix is ``root @ root.T``)."""
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
        root = psd_root(CompressedPSD(codes, scales), name=key)
    except ValueError as err:
        raise ValueError(f"client {client}: {err}") from err
    mat = root @ root.T
    # A PSD matrix has no entry larger than its largest diagonal one (Cauchy-Schwarz); float32
    # scales keep every product finite in float64, so this bounds the whole factor.
    check_magnitude(float(mat.diagonal().max()) if n else 0.0, MAX_CURVATURE_MAGNITUDE, where)
    return mat, root


def _decode_output(client: str, key: str, arrays: ArrayRecord, d_out: int, wname: str) -> np.ndarray:
    """One layer's output factor: float32, one finite entry in ``[0, MAX_CURVATURE_MAGNITUDE]`` per unit."""
    where = f"client {client}: output factor {key!r}"
    arr = arrays[key]
    if (not isinstance(arr, Array) or arr.stype != STYPE_F32 or arr.dtype != "float32"
            or tuple(arr.shape) != (d_out,) or len(arr.data) != 4 * d_out):
        raise ValueError(f"{where}: expected {4 * d_out} bytes of {d_out} float32 values (stype {STYPE_F32!r}) for "
                         f"tensor {wname!r}, got {getattr(arr, 'stype', type(arr).__name__)} "
                         f"{tuple(getattr(arr, 'shape', ()))}")
    out = np.frombuffer(arr.data, dtype="<f4").astype(np.float64)
    if not np.all(np.isfinite(out)) or np.any(out < 0):
        raise ValueError(f"{where}: has NaN, inf or negative entries")
    check_magnitude(float(out.max()) if out.size else 0.0, MAX_CURVATURE_MAGNITUDE, where)
    return out


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
        a factor whose size does not fit its layer, one with an entry above
        :data:`~fedfiot_flwr.reply_limits.MAX_CURVATURE_MAGNITUDE`, or anything
        :func:`~fedfiot_flwr.wire.unpack_reply` rejects.
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
        with_outputs = bool(meta.get("outputs", False))
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
    if with_outputs and method != "gram":
        raise ValueError(f"client {client}: output factors come with Gram replies only, not {method!r}")
    expected_keys = {f"{FACTOR_PREFIX}{m}/{w}" for m in layers for w in (*names, *[OUTPUT_FACTOR] * with_outputs)}
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
        if method == "gram" and w.ndim not in (2, 4):
            raise ValueError(f"client {client}: Gram layer {module!r} has a {w.ndim}-D weight, expected a Linear or "
                             "Conv2d one")
        sizes = {"A": int(np.prod(w.shape[1:])) + (bias is not None), "G": int(w.shape[0])}
        sizes["gram"] = sizes["A"]
        mats, roots = {}, {}
        for what in names:
            key = f"{FACTOR_PREFIX}{module}/{what}"
            mat, roots[what] = _decode_psd(client, key, arrays[key])
            if mat.shape[0] != sizes[what]:
                raise ValueError(f"client {client}: factor {key!r} is {mat.shape[0]}x{mat.shape[0]}, "
                                 f"expected {sizes[what]}x{sizes[what]} for tensor {wname!r}")
            mats[what] = mat
        if method == "kfac":
            factors[module] = KFACFactors(wname, bias, mats["A"], mats["G"], A_root=roots["A"], G_root=roots["G"])
        else:
            output = _decode_output(client, f"{FACTOR_PREFIX}{module}/{OUTPUT_FACTOR}", arrays, w.shape[0], wname) \
                if with_outputs else None
            grams[module] = InputGram(wname, bias, mats["gram"], output)
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
