"""Cost matrices and aggregation for one layer (pure numpy; the assignment is :mod:`.lap`'s).

Shapes: global layer ``w`` is ``(m, d)``; a client's layer ``w_k`` and damped Fisher ``f_k``
are ``(m, d)`` with incoming coordinates already in the global order. All matrices are built
with matrix products, so memory is O(m*d + m*m) per client, never O(m*m*d).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Sequence

import numpy as np

from fedfiot_flwr.options import COST_DTYPES

from .backend import Backend, NumpyBackend


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


def objective_from_moments(value: np.ndarray, num: np.ndarray, den: np.ndarray, const: float) -> float:
    """``sum_k sum f_k (value - x_k)**2`` expanded, ``const + <den * value - 2 num, value>``.

    >>> objective_from_moments(np.array([1.]), np.array([4.]), np.array([2.]), 10.0)
    4.0
    """
    return max(0.0, const + float(np.vdot(den * value - 2.0 * num, value)))


ClientLoader = Callable[[int], tuple[np.ndarray, np.ndarray]]


def _power_of_two_above(f: np.ndarray, fx: np.ndarray) -> float:
    """The smallest power of two ``>= max(|f|, |fx|)`` (1.0 for all-zero inputs): dividing by it
    brings a float32 cost-GEMM input to at most 1 without rounding.

    >>> _power_of_two_above(np.array([3.0]), np.array([-0.5]))
    4.0
    """
    peak = max(float(np.max(np.abs(f))) if f.size else 0.0, float(np.max(np.abs(fx))) if fx.size else 0.0)
    if not peak > 0.0:
        return 1.0
    mantissa, exponent = math.frexp(peak)  # peak = mantissa * 2**exponent, mantissa in [0.5, 1)
    return math.ldexp(1.0, exponent - 1) if mantissa == 0.5 else math.ldexp(1.0, exponent)


def _runs(group: range, skip: Collection[int]) -> Iterator[range]:
    """Split ``group`` into contiguous runs of clients not in ``skip``, with an empty range in
    place of each skipped client (so that the caller yields in client order).

    >>> [(r.start, r.stop) for r in _runs(range(0, 5), {1, 2})]
    [(0, 1), (1, 1), (2, 2), (3, 5)]
    """
    start = group.start
    for k in group:
        if k in skip:
            if k > start:
                yield range(start, k)
            yield range(k, k)
            start = k + 1
    if start < group.stop:
        yield range(start, group.stop)


class ClientLayers:
    """One permutation's client layers and damped Fishers, prepared once per alignment.

    Holds, per client ``k``, the cost-GEMM input ``[f_k, f_k*w_k]`` (``(m, 2d)``) and the row
    constants ``sum_c f_k w_k**2``, so that every inner iteration only builds the left factor
    ``[w*w, -2 w]`` from the current global layer. With ``stack=False`` nothing is kept: each
    use reloads the client through ``load`` (memory O(m*d) instead of O(K*m*d); for many
    clients or very wide layers).

    Parameters
    ----------
    load : callable
        ``k -> (w_k, f_k)``: client ``k``'s layer and damped Fisher, ``(m, d)`` float64, incoming
        coordinates already in the global order; new arrays on every call (they are reused in place).
    n_clients : int
        Number of clients ``K``.
    keep_layers : bool
        Also keep ``w_k`` (needed by the Euclidean cost and the scalar averages).
    stack : bool
        Keep every client's data (fast) or reload on each use (streaming).
    cost_dtype : {"float64", "float32"}
        Precision of the cost GEMMs; aggregation and objectives stay float64. In float32 each
        client's ``[f_k, f_k*w_k]`` is scaled by a power of two so that its largest entry is at
        most 1, and its cost product is scaled back in float64: the float32 GEMM cannot overflow
        whatever the Fisher's magnitude, and below float32's range the scaling is exact (the
        costs are those of the unscaled GEMM).
    backend : NumpyBackend or TorchBackend
        Where the cost GEMMs and gathers run.
    max_bytes : int
        Largest cost product of one GEMM (clients are grouped under it).
    """

    def __init__(
        self,
        load: ClientLoader,
        n_clients: int,
        *,
        keep_layers: bool = False,
        stack: bool = True,
        cost_dtype: str = "float64",
        backend: Backend | None = None,
        max_bytes: int = 2**26,
    ) -> None:
        if cost_dtype not in COST_DTYPES:
            raise ValueError(f"cost_dtype must be one of {COST_DTYPES}, got {cost_dtype!r}")
        self.load, self.n_clients, self.keep_layers = load, n_clients, keep_layers
        self.cost_dtype, self.max_bytes = cost_dtype, max_bytes
        self.backend = backend if backend is not None else NumpyBackend()
        self.stacked = stack
        self.const = 0.0  # sum_k sum f_k w_k**2: invariant under alignment
        self._exact = self._cost = self._layers = None  # stacked: (K*m, 2d), (K*m, 2d), (K*m, d)
        self._row_const: list[np.ndarray] = []
        self._col_norms: list[np.ndarray] = []
        self._cost_scale: list[float] = []  # float32 costs: per client, the power of two undone after the GEMM
        be = self.backend
        for k in range(n_clients):
            x, f = load(k)
            if not stack:  # only the constant: f * x in place, no more arrays
                self.const += float(np.vdot(np.multiply(f, x, out=f), x))
                del x, f
                continue
            fx = f * x
            self.const += float(np.vdot(fx, x))
            m, d = x.shape
            if self._exact is None:
                self._exact = be.empty((n_clients * m, 2 * d), "float64")
                if keep_layers:
                    self._layers = be.empty((n_clients * m, d), "float64")
            rows = slice(k * m, (k + 1) * m)
            self._exact[rows, :d] = be.asarray(f, "float64")
            self._exact[rows, d:] = be.asarray(fx, "float64")
            self._row_const.append(np.einsum("jc,jc,jc->j", f, x, x))
            if cost_dtype != "float64":
                self._cost_scale.append(_power_of_two_above(f, fx))
            if keep_layers:
                self._layers[rows] = be.asarray(x, "float64")
                self._col_norms.append(np.einsum("jc,jc->j", x, x))
            del x, f, fx
        if stack and self._exact is not None:
            if cost_dtype == "float64":
                self._cost = self._exact
            else:
                m = self._exact.shape[0] // n_clients
                self._cost = be.empty(tuple(self._exact.shape), cost_dtype)
                for k, scale in enumerate(self._cost_scale):
                    rows = slice(k * m, (k + 1) * m)
                    self._cost[rows] = be.asarray(self._exact[rows] * (1.0 / scale), cost_dtype)

    def _client(self, k: int, m: int) -> tuple:
        """Stacked client ``k``: ``(exact [f, fx], w_k or None, row constants, column norms)``."""
        rows = slice(k * m, (k + 1) * m)
        layer = self._layers[rows] if self.keep_layers else None
        norms = self._col_norms[k] if self.keep_layers else None
        return self._exact[rows], layer, self._row_const[k], norms

    def _streamed_cost_input(self, k: int, fisher: bool) -> tuple:
        """Streamed client ``k``: its Fisher cost-GEMM input, row constants and the scale to undo
        after the GEMM (see ``cost_dtype``), or (``fisher=False``) ``w_k`` and its column norms."""
        x, f = self.load(k)
        m, d = x.shape
        if not fisher:
            return self.backend.asarray(x, self.cost_dtype), np.einsum("jc,jc->j", x, x)
        const = np.einsum("jc,jc,jc->j", f, x, x)
        np.multiply(f, x, out=x)
        scale = 1.0 if self.cost_dtype == "float64" else _power_of_two_above(f, x)
        right = np.empty((m, 2 * d), dtype=self.cost_dtype)
        right[:, :d] = f if scale == 1.0 else f * (1.0 / scale)
        right[:, d:] = x if scale == 1.0 else x * (1.0 / scale)
        return self.backend.asarray(right, self.cost_dtype), const, scale

    def _groups(self, m: int) -> Iterator[range]:
        group = max(1, self.max_bytes // (8 * m * m)) if self.stacked else 1
        for first in range(0, self.n_clients, group):
            yield range(first, min(self.n_clients, first + group))

    def fisher_costs(self, w: np.ndarray, skip: Collection[int] = ()) -> Iterator[np.ndarray | None]:
        """:func:`fisher_cost_matrix` of every client against ``w``, yielded one by one
        (``None``, and no arithmetic, for the clients in ``skip``)."""
        be, m = self.backend, w.shape[0]
        left = be.asarray(np.concatenate([w * w, -2.0 * w], axis=1), self.cost_dtype)
        for group in self._groups(m):
            for run in _runs(group, skip):
                if not run:
                    yield None
                    continue
                if self.stacked:
                    right, consts = self._cost[run.start * m:run.stop * m], [self._row_const[k] for k in run]
                    scales = [self._cost_scale[k] for k in run] if self._cost_scale else [1.0] * len(run)
                else:
                    right, const, scale = self._streamed_cost_input(run.start, fisher=True)
                    consts, scales = [const], [scale]
                product = be.to_numpy(be.matmul_t(left, right))
                for i, (const, scale) in enumerate(zip(consts, scales)):
                    block = product[:, i * m:(i + 1) * m]
                    if scale != 1.0:
                        block = block.astype(np.float64) * scale
                    yield block + const[None, :]

    def costs(self, w: np.ndarray, skip: Collection[int] = ()) -> Iterator[np.ndarray | None]:
        """The curvature protocol's costs: :meth:`fisher_costs`."""
        return self.fisher_costs(w, skip)

    def solve(self, perms: Sequence[np.ndarray], num: np.ndarray, den: np.ndarray) -> np.ndarray:
        """The Fisher-weighted layer of the aligned clients, ``num / den`` (from :meth:`moments`)."""
        return num / den

    def objective(self, value: np.ndarray, num: np.ndarray, den: np.ndarray) -> float:
        """``sum_k sum f_k (value - x_k)**2`` from the moments: one pass instead of K."""
        return objective_from_moments(value, num, den, self.const)

    def euclidean_costs(self, w: np.ndarray) -> Iterator[np.ndarray]:
        """:func:`euclidean_cost_matrix` of every client against ``w``, yielded one by one."""
        if not self.keep_layers:
            raise ValueError("euclidean_costs needs the client layers (keep_layers=True)")
        be, m = self.backend, w.shape[0]
        row_norms = np.einsum("ic,ic->i", w, w)[:, None]
        left = be.asarray(w, self.cost_dtype)
        for group in self._groups(m):
            if self.stacked:
                layers = self._layers[group.start * m:group.stop * m]
                right = layers if self.cost_dtype == "float64" else be.asarray(layers, self.cost_dtype)
                norms = [self._col_norms[k] for k in group]
            else:
                right, norm = self._streamed_cost_input(group.start, fisher=False)
                norms = [norm]
            product = be.to_numpy(be.matmul_t(left, right))
            for i, norm in enumerate(norms):
                yield row_norms - 2.0 * product[:, i * m:(i + 1) * m] + norm[None, :]

    def moments(self, perms: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """``sum_k f_k[p_k] * w_k[p_k]`` and ``sum_k f_k[p_k]`` of the aligned clients (float64)."""
        be = self.backend
        m = len(perms[0])
        if not self.stacked:  # f[p] * x[p] == (f * x)[p]: one client at a time, no (m, 2d) copies
            num = den = None
            for k, p in enumerate(perms):
                x, f = self.load(k)
                np.multiply(f, x, out=x)
                fx, fp = x[p], f[p]
                num = fx if num is None else np.add(num, fx, out=num)
                den = fp if den is None else np.add(den, fp, out=den)
            return num, den
        total = None
        for k, p in enumerate(perms):
            rows = be.take_rows(self._client(k, m)[0], p)
            total = rows if total is None else total + rows
        out = be.to_numpy(total)
        d = out.shape[1] // 2
        return out[:, d:], out[:, :d]

    def average(self, perms: Sequence[np.ndarray], client_weights: Sequence[float] | None) -> np.ndarray:
        """Scalar-weighted average of the aligned client layers (uniform when no weights)."""
        if not self.keep_layers:
            raise ValueError("average needs the client layers (keep_layers=True)")
        be = self.backend
        cw = np.ones(len(perms)) if client_weights is None else np.asarray(client_weights, dtype=np.float64)
        cw = cw / cw.sum()
        out, m = None, len(perms[0])
        for k, p in enumerate(perms):
            layer = self._client(k, m)[1] if self.stacked else self.backend.asarray(self.load(k)[0], "float64")
            term = be.take_rows(layer, p) * float(cw[k])
            out = term if out is None else out + term
        return be.to_numpy(out)

