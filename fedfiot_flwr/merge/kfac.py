"""K-FAC with a diagonal output factor: the Gram curvature with each unit weighted by its output gradients.

With ``MergeOptions(curvature="kfac")`` client k's curvature of layer l is ``A_kl ⊗ diag(h_kl)``: ``A_kl`` the
Gram curvature's (:mod:`fedfiot_flwr.merge.gram`) and ``h_kl`` one weight per output unit,
:func:`row_weights` of the uploaded output factor ``g_kl`` (per unit, the mean squared loss gradient with
respect to its pre-activation). The objective is

``J(W, pi) = sum_k sum_l sum_i h_kl,i (W_l,i - (P w)_kl,i) A_kl (W_l,i - (P w)_kl,i)^T``,

and both steps minimise one permutation group's terms exactly:

* the alignment's cost of global unit ``i`` and client unit ``j`` is the Gram cost times the client unit's
  weight, ``h_kl,j (W_l,i - w_kl,j) A_kl (W_l,i - w_kl,j)^T``;
* the aggregation is one closed form per row, ``W_l,i S_l,i = R_l,i`` with ``S_l,i = sum_k h_kl,i A_kl`` and
  ``R_l,i = sum_k h_kl,i (P w A)_kl,i`` (the aligned clients' weights), of all solutions the one closest to the
  size-weighted average, as for the Gram curvature.

Every ``h > 0`` (``delta > 0``), so each row's ``S_l,i`` has the null space of ``S_l = sum_k A_kl``: each row is
solved in the range of ``S_l``, ``r`` directions, as an ``r x r`` positive definite system. That is one
``O(r^3)`` solve per row where the Gram curvature needs one pseudo-inverse per layer, which is why this
curvature's merge costs more.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence

import numpy as np
import scipy.linalg

__all__ = ["KFACLayers", "project", "range_basis", "row_weights", "unit_weighted_solution"]

#: Bytes of one block of stacked per-row systems (the rows are solved in blocks of this size).
BLOCK_BYTES = 128 * 2**20


def row_weights(output: np.ndarray, damping: float) -> np.ndarray:
    """K-FAC's unit weights from a layer's output factor ``g``: ``(g / mean(g) + delta) / (1 + delta)``.

    Normalised to mean 1, the factor only moves weight between a layer's units; a client's total weight stays
    its Gram's (its share of the examples), so a client with larger gradients (a worse fit) or an inflated
    factor does not outweigh the others. An all-zero factor weighs every unit 1.

    >>> row_weights(np.array([0., 1., 3.]), 1.0).tolist()
    [0.5, 0.875, 1.625]
    """
    g = np.asarray(output, dtype=np.float64)
    mean = float(g.mean()) if g.size else 0.0
    if mean <= 0.0:
        return np.ones_like(g)
    return (g / mean + damping) / (1.0 + damping)


def range_basis(s: np.ndarray, rcond: float = 1e-10) -> np.ndarray:
    """An orthonormal basis ``(d, r)`` of the range of the symmetrised ``s``: the eigenvectors whose eigenvalues
    exceed ``rcond`` times the largest in magnitude (the directions :func:`~fedfiot_flwr.merge.gram.psd_pinv`
    keeps).

    >>> range_basis(np.diag([4.0, 1e-12])).tolist()
    [[1.0], [0.0]]
    """
    values, vectors = np.linalg.eigh((s + s.T) / 2.0)
    top = float(np.max(np.abs(values))) if values.size else 0.0
    return vectors[:, np.abs(values) > rcond * top]


def project(curvatures: Sequence[np.ndarray], basis: np.ndarray) -> np.ndarray:
    """``(K, r, r)``: every ``U^T A_k U`` (what :func:`unit_weighted_solution` solves with)."""
    return np.stack([basis.T @ a @ basis for a in curvatures])


def unit_weighted_solution(w_avg: np.ndarray, r: np.ndarray, curvatures: Sequence[np.ndarray], weights: np.ndarray,
                           basis: np.ndarray, projected: np.ndarray | None = None) -> np.ndarray:
    """Per row ``i``, the ``W_i`` with ``W_i S_i = R_i`` closest to ``w_avg_i``, ``S_i = sum_k weights[k, i] A_k``.

    ``basis`` spans the range of ``sum_k A_k`` (:func:`range_basis`), which is every ``S_i``'s range when the
    weights are positive: ``W_i = w_avg_i + y_i U^T`` with ``y_i (U^T S_i U) = (R_i - w_avg_i S_i) U``.
    ``projected`` is :func:`project` of the same curvatures and basis, when the caller keeps it.

    >>> a = [np.eye(2), np.diag([1.0, 3.0])]
    >>> w = unit_weighted_solution(np.zeros((1, 2)), np.array([[2.0, 4.0]]), a, np.ones((2, 1)), np.eye(2))
    >>> np.round(w, 12).tolist()
    [[1.0, 1.0]]
    """
    u = basis
    if projected is None:
        projected = project(curvatures, u)
    rank = u.shape[1]
    avg_u = w_avg @ u
    rhs = r @ u
    for k, pa in enumerate(projected):  # A_k U = U (U^T A_k U): A_k's range lies in the sum's
        rhs -= weights[k][:, None] * (avg_u @ pa)
    y = np.empty_like(rhs)
    block = max(1, BLOCK_BYTES // max(1, 8 * rank * rank))
    flat = projected.reshape(len(curvatures), -1)
    for start in range(0, rhs.shape[0], block):
        rows = slice(start, start + block)
        systems = (weights[:, rows].T @ flat).reshape(-1, rank, rank)  # one GEMM: S_i's for the block's rows
        for i, system in enumerate(systems):
            y[start + i] = _solve_definite(system, rhs[start + i])
    return w_avg + y @ u.T


def _solve_definite(system: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """``y`` with ``y S = rhs`` for a symmetric ``S`` positive definite on paper: Cholesky, or LU where the
    directions kept near the cut-off leave it only semi-definite in floating point."""
    try:
        factor = scipy.linalg.cho_factor(system, lower=True, check_finite=False)
    except np.linalg.LinAlgError:
        return np.linalg.solve(system, rhs)
    return scipy.linalg.cho_solve(factor, rhs, check_finite=False)


def row_terms(w: np.ndarray, mats: Sequence[np.ndarray], curvatures: Sequence[np.ndarray],
              weights: Sequence[np.ndarray]) -> float:
    """``sum_k sum_i weights[k][i] (w - m_k)_i A_k (w - m_k)_i^T``: a layer's terms of J."""
    return float(sum(np.dot(h, np.einsum("ic,ic->i", (w - m) @ a, w - m)) for m, a, h in zip(mats, curvatures, weights)))


class KFACLayers:
    """One permutation group's layers under K-FAC with a diagonal output factor (the engine's curvature protocol:
    ``costs``, ``moments``, ``solve``, ``objective``, as :class:`~fedfiot_flwr.merge.gram.GramLayers`).

    Parameters
    ----------
    views : sequence of sequence of (np.ndarray, np.ndarray)
        Per client, per member layer, ``(m_kl, A_kl)`` with the inputs in the global order and the rows in the
        client's own.
    units : sequence of sequence of np.ndarray
        Per client, per member layer, the unit weights ``h_kl`` (:func:`row_weights`) in the client's row order.
    shares : np.ndarray
        The clients' shares of the examples (the size-weighted average the closed form stays near).
    basis : callable
        ``S_l -> U_l``, the range basis of a member's summed Grams (:func:`range_basis`, or a memo of it).
    """

    def __init__(self, views: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], units: Sequence[Sequence[np.ndarray]],
                 shares: np.ndarray, basis: Callable[[np.ndarray], np.ndarray]) -> None:
        self.n_clients, self.shares = len(views), shares
        self.layers = [[m for m, _ in vk] for vk in views]
        self.curvatures = [[a for _, a in vk] for vk in views]
        self.units = [list(uk) for uk in units]
        self.weighted = [[m @ a for m, a in vk] for vk in views]
        self.row_const = [[np.einsum("jc,jc->j", ma, m) for ma, (m, _) in zip(wk, vk)]
                          for wk, vk in zip(self.weighted, views)]
        self.const = float(sum(float(np.dot(h, rc)) for hk, rk in zip(self.units, self.row_const)
                               for h, rc in zip(hk, rk)))
        members = len(views[0])
        self.basis = [basis(sum(self.curvatures[k][i] for k in range(self.n_clients))) for i in range(members)]
        # U^T A U does not change while this group aligns: once per member, not once per solve
        self.projected = [project([self.curvatures[k][i] for k in range(self.n_clients)], self.basis[i])
                          for i in range(members)]

    def _quadratic(self, w: Sequence[np.ndarray], k: int) -> list[np.ndarray]:
        """Per member, ``w_l,i A_kl w_l,i^T`` for every global row ``i``."""
        return [np.einsum("ic,ic->i", wl @ a, wl) for wl, a in zip(w, self.curvatures[k])]

    def costs(self, w: Sequence[np.ndarray], skip: Collection[int] = ()) -> Iterator[np.ndarray | None]:
        """Per client, ``C[i, j] = sum_l h_kl,j (w_l,i - m_kl,j) A_kl (w_l,i - m_kl,j)^T`` (``None`` in ``skip``)."""
        for k in range(self.n_clients):
            if k in skip:
                yield None
                continue
            cost = np.zeros((w[0].shape[0], self.layers[k][0].shape[0]))
            for wl, quad, ma, rc, h in zip(w, self._quadratic(w, k), self.weighted[k], self.row_const[k], self.units[k]):
                cost += (quad[:, None] - 2.0 * (wl @ ma.T) + rc[None, :]) * h[None, :]
            yield cost

    def moments(self, perms: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per member, ``R_l`` (rows ``sum_k h_kl,p_k(i) (m_kl A_kl)[p_k(i)]``) and the aligned weights ``(K, m)``."""
        members = range(len(self.basis))
        weights = [np.stack([self.units[k][i][p] for k, p in enumerate(perms)]) for i in members]
        num = [sum(weights[i][k][:, None] * self.weighted[k][i][p] for k, p in enumerate(perms)) for i in members]
        return num, weights

    def solve(self, perms: Sequence[np.ndarray], num: Sequence[np.ndarray], den: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per member, every row's closed form nearest the size-weighted average of the aligned clients."""
        out = []
        for i, (r, h) in enumerate(zip(num, den)):
            w_avg = sum(c * self.layers[k][i][p] for k, (c, p) in enumerate(zip(self.shares, perms)))
            out.append(unit_weighted_solution(w_avg, r, [self.curvatures[k][i] for k in range(self.n_clients)], h,
                                              self.basis[i], self.projected[i]))
        return out

    def objective(self, w: Sequence[np.ndarray], num: Sequence[np.ndarray], den: Sequence[np.ndarray]) -> float:
        """The group's terms of J at ``w``, expanded: ``const + sum_l sum_i w_l,i S_l,i w_l,i^T - 2 R_l,i w_l,i``."""
        total = self.const
        for k in range(self.n_clients):
            total += sum(float(np.dot(h[k], quad)) for h, quad in zip(den, self._quadratic(w, k)))
        total -= 2.0 * sum(float(np.vdot(r, wl)) for wl, r in zip(w, num))
        return max(0.0, total)
