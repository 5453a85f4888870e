"""Input validation for :func:`fedfiot_flwr.merge.merge`: every error names the client and tensor."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from numbers import Real

import numpy as np

from ..reply_limits import MAX_NUM_EXAMPLES

from fedfiot_flwr.options import AGGREGATIONS, BACKENDS, COST_DTYPES, MATCHINGS, MERGE_FALLBACKS




def _label(client_ids: Sequence[str], k: int) -> str:
    return f"client {client_ids[k]!r}"


def check_options(
    lam: float, rho: float, max_iters: int, matching: str, aggregation: str, fallback: str
) -> None:
    """Validate the scalar options of the merge."""
    if not (isinstance(lam, (int, float, np.floating)) and np.isfinite(lam) and lam > 0):
        raise ValueError(f"lam (damping) must be a finite number > 0, got {lam!r}")
    if not (isinstance(rho, (int, float, np.floating)) and np.isfinite(rho) and 0 < rho <= 1):
        raise ValueError(f"rho (tempering) must lie in (0, 1], got {rho!r}")
    if isinstance(max_iters, bool) or not isinstance(max_iters, (int, np.integer)) or max_iters < 1:
        raise ValueError(f"max_iters must be an integer >= 1, got {max_iters!r}")
    if matching not in MATCHINGS:
        raise ValueError(f"matching must be one of {MATCHINGS}, got {matching!r}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if fallback not in MERGE_FALLBACKS:
        raise ValueError(f"fallback must be one of {MERGE_FALLBACKS}, got {fallback!r}")


def check_speed_options(cost_dtype: str, backend: str, lap_solver: str) -> None:
    """Validate the merge's speed options (they never change what is computed, only how)."""
    from .lap import LAP_SOLVERS

    if cost_dtype not in COST_DTYPES:
        raise ValueError(f"cost_dtype must be one of {COST_DTYPES}, got {cost_dtype!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if lap_solver not in LAP_SOLVERS:
        raise ValueError(f"lap_solver must be one of {LAP_SOLVERS}, got {lap_solver!r}")


def check_models(
    models: Sequence[Mapping[str, np.ndarray]],
    fishers: Sequence[Mapping[str, np.ndarray]],
    buffers: Collection[str],
    client_ids: Sequence[str],
    *,
    checked: bool = False,
) -> dict[str, tuple[int, ...]]:
    """Check keys, shapes and values of the client models and Fishers; return the tensor shapes.

    Parameters
    ----------
    models, fishers : sequence of mapping of str to np.ndarray
        One state dict and one diagonal Fisher (parameters only) per client.
    buffers : collection of str
        Tensors without a Fisher.
    client_ids : sequence of str
        Named in every error.
    checked : bool
        The uploads were decoded by :func:`fedfiot_flwr.wire.decode_reply` and collected by
        :func:`fedfiot_flwr.server.uploads.collect_uploads`, which guarantee their shapes, dtypes
        and values: only the counts and the tensor names (against ``buffers``, the caller's own
        argument) are checked. ``False`` (direct callers): everything is.

    Returns
    -------
    dict[str, tuple[int, ...]]
        The first client's tensor shapes.
    """
    if len(models) == 0:
        raise ValueError("merge needs at least one client model")
    if len(fishers) != len(models):
        raise ValueError(f"got {len(models)} models but {len(fishers)} Fisher dicts")
    if len(client_ids) != len(models):
        raise ValueError(f"got {len(client_ids)} client ids for {len(models)} models")
    first = models[0]
    shapes = {name: tuple(np.shape(x)) for name, x in first.items()}
    unknown_buffers = set(buffers) - set(shapes)
    if unknown_buffers:
        raise ValueError(f"buffers {sorted(unknown_buffers)} are not tensors of {_label(client_ids, 0)}'s model")
    expected = set(shapes) - set(buffers)
    for k, (model, fisher) in enumerate(zip(models, fishers)):
        who = _label(client_ids, k)
        if set(model) != set(shapes):
            missing = sorted(set(shapes) - set(model))
            extra = sorted(set(model) - set(shapes))
            raise ValueError(f"{who}: model keys differ from client {client_ids[0]!r}'s: missing {missing}, extra {extra}")
        if set(fisher) != expected:
            missing = sorted(expected - set(fisher))
            extra = sorted(set(fisher) - expected)
            raise ValueError(
                f"{who}: Fisher keys do not match the model's parameters: missing {missing}, extra {extra} "
                "(declare tensors without a Fisher, such as BatchNorm running statistics, in buffers=)"
            )
        if not checked:
            _check_tensors(who, model, fisher, shapes)
    return shapes


def _check_tensors(
    who: str, model: Mapping[str, np.ndarray], fisher: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """One client's shapes and values: finite numbers, Fishers finite and non-negative."""
    for name, x in model.items():
        _check_array(f"{who}, tensor {name!r}", x, shapes[name],
                     "weights must be finite numbers (found NaN/inf or non-numeric)")
    for name, f in fisher.items():
        if np.any(_check_array(f"{who}, Fisher of tensor {name!r}", f, shapes[name]) < 0):
            raise ValueError(f"{who}, Fisher of tensor {name!r}: contains negative entries")


def _check_array(label: str, x: np.ndarray, shape: tuple[int, ...], nonfinite: str = "contains NaN or inf") -> np.ndarray:
    """``x`` as an array of ``shape`` holding finite numbers, or a ValueError starting with ``label``."""
    arr = np.asarray(x)
    if arr.shape != shape:
        raise ValueError(f"{label}: shape {arr.shape} differs from {shape}")
    if not np.issubdtype(arr.dtype, np.number) or not np.all(np.isfinite(arr)):
        raise ValueError(f"{label}: {nonfinite}")
    return arr


def check_num_examples(
    num_examples: Sequence[int] | None, n_clients: int, client_ids: Sequence[str], *, checked: bool = False
) -> None:
    """Check the client sizes (when given): real numbers in ``(0, MAX_NUM_EXAMPLES]``.

    Booleans, non-numbers and integers too large for a float are rejected before NumPy sees them.
    With ``checked`` (sizes parsed by the wire decoder) only their count is checked.
    """
    if num_examples is None:
        return
    if len(num_examples) != n_clients:
        raise ValueError(f"num_examples has {len(num_examples)} entries for {n_clients} clients")
    if checked:
        return
    for k, n in enumerate(num_examples):
        ok = isinstance(n, Real) and not isinstance(n, (bool, np.bool_))
        try:
            ok = ok and math.isfinite(float(n)) and 0 < float(n) <= MAX_NUM_EXAMPLES
        except OverflowError:
            ok = False
        if not ok:
            raise ValueError(f"{_label(client_ids, k)}: num_examples must be a number in (0, {MAX_NUM_EXAMPLES}], "
                             f"got {n!r}")


def check_reference_model(reference: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Check a reference model given as a dict (the broadcast model)."""
    if set(reference) != set(shapes):
        missing = sorted(set(shapes) - set(reference))
        raise ValueError(f"reference model: keys differ from the clients' (missing {missing})")
    for name, x in reference.items():
        _check_array(f"reference model, tensor {name!r}", x, shapes[name])
