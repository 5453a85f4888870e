"""Cost matrices, assignment and aggregation for one layer (pure numpy/scipy).

Shapes: global layer ``w`` is ``(m, d)``; a client's layer ``w_k`` and damped Fisher ``f_k``
are ``(m, d)`` with incoming coordinates already in the global order. All matrices are built
with matrix products, so memory is O(m*d + m*m) per client, never O(m*m*d).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment


def fisher_cost_matrix(w: np.ndarray, w_k: np.ndarray, f_k: np.ndarray) -> np.ndarray:
    """Fisher-weighted matching cost ``C[i, j] = sum_c f_k[j, c] (w[i, c] - w_k[j, c])**2``.

    Computed as ``(w*w) @ f_k.T - 2 w @ (f_k*w_k).T + rowsum(f_k*w_k**2)``.

    Examples
    --------
    >>> fisher_cost_matrix(np.array([[0.], [4.], [8.]]), np.array([[10.], [2.], [6.]]),
    ...                    np.array([[1.], [1.], [3.]])).tolist()
    [[100.0, 4.0, 108.0], [36.0, 4.0, 12.0], [4.0, 36.0, 12.0]]
    """
    fw = f_k * w_k
    return (w * w) @ f_k.T - 2.0 * (w @ fw.T) + np.einsum("jc,jc->j", fw, w_k)[None, :]


def fisher_cost_matrices(
    w: np.ndarray, layers: Sequence[np.ndarray], fishers: Sequence[np.ndarray], max_bytes: int = 2**28
) -> Iterator[np.ndarray]:
    """:func:`fisher_cost_matrix` for several clients, yielded one by one.

    Clients are stacked into one GEMM against the shared ``w`` (``[w*w, w] @ [f_k, -2 f_k*w_k]^T``),
    in groups whose products stay under ``max_bytes``: the same arithmetic as one client at a time
    with fewer, larger BLAS calls, and never an ``m*m*d`` broadcast.
    """
    m = w.shape[0]
    left = np.concatenate([w * w, w], axis=1)
    group = max(1, max_bytes // (8 * m * m))
    for first in range(0, len(layers), group):
        chunk = list(zip(layers[first:first + group], fishers[first:first + group]))
        right = np.concatenate([np.concatenate([f, -2.0 * f * x], axis=1) for x, f in chunk], axis=0)
        product = left @ right.T
        for k, (x, f) in enumerate(chunk):
            yield product[:, k * m:(k + 1) * m] + np.einsum("jc,jc,jc->j", f, x, x)[None, :]


def euclidean_cost_matrix(w: np.ndarray, w_k: np.ndarray) -> np.ndarray:
    """Squared Euclidean matching cost ``C[i, j] = ||w[i] - w_k[j]||**2`` (unit weights).

    >>> euclidean_cost_matrix(np.array([[0.], [4.]]), np.array([[1.], [4.]])).tolist()
    [[1.0, 16.0], [9.0, 0.0]]
    """
    return np.einsum("ic,ic->i", w, w)[:, None] - 2.0 * (w @ w_k.T) + np.einsum("jc,jc->j", w_k, w_k)[None, :]


def euclidean_cost_matrices(
    w: np.ndarray, layers: Sequence[np.ndarray], max_bytes: int = 2**28
) -> Iterator[np.ndarray]:
    """:func:`euclidean_cost_matrix` for several clients, stacked into few GEMMs (see
    :func:`fisher_cost_matrices`)."""
    m = w.shape[0]
    row_norms = np.einsum("ic,ic->i", w, w)[:, None]
    group = max(1, max_bytes // (8 * m * m))
    for first in range(0, len(layers), group):
        chunk = layers[first:first + group]
        product = w @ np.concatenate(chunk, axis=0).T
        for k, x in enumerate(chunk):
            yield row_norms - 2.0 * product[:, k * m:(k + 1) * m] + np.einsum("jc,jc->j", x, x)[None, :]


def assign(cost: np.ndarray) -> np.ndarray:
    """Exact minimum-cost assignment; returns ``p`` with global neuron ``i`` <- client neuron ``p[i]``.

    >>> assign(np.array([[5., 1.], [1., 5.]])).tolist()
    [1, 0]
    """
    rows, cols = linear_sum_assignment(cost)
    p = np.empty(cost.shape[0], dtype=np.int64)
    p[rows] = cols
    return p


def aggregate(
    layers: Sequence[np.ndarray], weights: Sequence[np.ndarray] | None, client_weights: Sequence[float] | None = None
) -> np.ndarray:
    """Weighted average of aligned client layers.

    Parameters
    ----------
    layers : sequence of arrays of one shape
        Aligned client tensors.
    weights : sequence of arrays of that shape, or None
        Elementwise weights (the damped Fisher); ``None`` for scalar weights.
    client_weights : sequence of float, optional
        Scalar weight per client (uniform when ``None``); used when ``weights`` is ``None``.

    >>> aggregate([np.array([0., 4.]), np.array([2., 6.])], [np.array([3., 1.]), np.array([1., 3.])]).tolist()
    [0.5, 5.5]
    """
    if weights is not None:
        num = np.zeros_like(layers[0], dtype=np.float64)
        den = np.zeros_like(layers[0], dtype=np.float64)
        for x, f in zip(layers, weights):
            num += f * x
            den += f
        return num / den
    cw = np.ones(len(layers)) if client_weights is None else np.asarray(client_weights, dtype=np.float64)
    cw = cw / cw.sum()
    out = np.zeros_like(layers[0], dtype=np.float64)
    for x, c in zip(layers, cw):
        out += c * x
    return out
