"""Certified warm-started assignment: skip the LAP solver when a hinted assignment is optimal.

In the alignment's inner loop the assignment of the previous iteration (or, for clients trained
from a shared initialisation, the identity) is usually already optimal for the new cost matrix.
:func:`certify_assignment` proves this without solving: an assignment ``p`` (row ``i`` ->
column ``p[i]``) of a square cost matrix ``C`` is optimal iff there are dual potentials ``u, v``
with ``C[i, j] >= u[i] + v[j]`` everywhere and equality on ``p`` (LP duality). Taking
``u[i] = C[i, p[i]] - v[p[i]]``, such ``v`` exist iff the graph on columns with arcs
``p[i] -> j`` of length ``C[i, j] - C[i, p[i]]`` has no negative cycle; ``v`` is then its
shortest-path distance from a virtual source, found by a Bellman-Ford relaxation that only
revisits columns whose distance decreased. Each sweep costs O(changed * m); the relaxation
gives up (and the caller solves exactly) after a few sweeps' worth of work.

A certified hint is a minimum-cost assignment of the given matrix: it can differ from the
solver's answer only between assignments of equal cost (as two exact solvers can).
"""

from __future__ import annotations

import numpy as np

from .lap import assign

# Below these sizes the solver is about as fast as the certificate: solve directly.
MIN_SIZE = {"scipy": 128, "lapjv": 512, "lapjv-avx": 512, "auto": 512}
# Relaxation budget: total row-visits, in multiples of m (one full sweep = m rows).
DEFAULT_MAX_WORK = 6
# Give up at once when more than this fraction of the columns is improved in the first sweep
# (the hint is then far from optimal and the solver is cheaper than the relaxation).
DEFAULT_MAX_VIOLATED = 0.25


def certify_assignment(
    cost: np.ndarray,
    p: np.ndarray,
    *,
    max_work: float = DEFAULT_MAX_WORK,
    max_violated: float = DEFAULT_MAX_VIOLATED,
) -> bool:
    """Whether the assignment ``p`` is provably a minimum-cost assignment of ``cost``.

    Parameters
    ----------
    cost : np.ndarray
        Square ``(m, m)`` cost matrix.
    p : np.ndarray
        A permutation: row ``i`` is assigned column ``p[i]``.
    max_work : float
        Relaxation budget in full sweeps (``m * m`` arc visits each); beyond it: False.
    max_violated : float
        Give up when more than this fraction of columns improves in the first sweep.

    Returns
    -------
    bool
        True when dual potentials proving optimality were found; False when ``p`` is not optimal
        or the budget ran out (the caller then solves exactly).

    Examples
    --------
    >>> c = np.array([[1., 5., 9.], [4., 2., 8.], [7., 6., 3.]])
    >>> certify_assignment(c, np.array([0, 1, 2])), certify_assignment(c, np.array([1, 0, 2]))
    (True, False)
    >>> # Not row-wise minimal, still optimal (needs non-zero potentials):
    >>> certify_assignment(np.array([[1., 0.], [3., 1.]]), np.array([0, 1]), max_violated=1.0)
    True
    """
    m = cost.shape[0]
    if m <= 1:
        return True
    p = np.asarray(p)
    owner = np.empty(m, dtype=np.int64)  # owner[k]: the row assigned column k
    owner[p] = np.arange(m)
    chosen = cost[np.arange(m), p]
    if (chosen <= cost.min(axis=1)).all():
        return True  # every row's assigned column is its minimum (no temporary matrix needed)
    # Arc k -> j (k = p[i]) has length cost[i, j] - cost[i, k]; distances v start at 0.
    v = (cost - chosen[:, None]).min(axis=0)  # the first sweep: v_j = min_i (cost[i, j] - chosen[i])
    v = np.minimum(v, 0.0)
    changed = np.flatnonzero(v < 0)
    if changed.size == 0:
        return True  # no arc is negative: v = 0 proves optimality
    if changed.size > max_violated * m:
        return False
    work = m  # arc visits so far, in rows of m
    while changed.size:
        work += changed.size
        if work > max_work * m:
            return False
        rows = owner[changed]
        # Relax the arcs out of the changed columns: v_j <- min(v_j, v_k + cost[i, j] - chosen[i]).
        cand = (cost[rows] - (chosen[rows] - v[changed])[:, None]).min(axis=0)
        improved = cand < v  # a negative cycle keeps improving until the budget ends it
        v = np.where(improved, cand, v)
        changed = np.flatnonzero(improved)
    return True


def assign_with_hint(cost: np.ndarray, hint: np.ndarray | None, solver: str = "scipy",
                     single: bool = False) -> tuple[np.ndarray, bool]:
    """Minimum-cost assignment, trying ``hint`` first.

    Parameters
    ----------
    cost : np.ndarray
        Square cost matrix.
    hint : np.ndarray or None
        A candidate assignment (row ``i`` -> column ``hint[i]``), e.g. the previous iteration's.
    solver : str
        Exact solver used when the hint is not certified, or the matrix is smaller than
        ``MIN_SIZE[solver]`` (see :func:`fedfiot_flwr.merge.lap.assign`).
    single : bool
        Passed to the solver: ``cost`` is only float32-accurate (the hint is certified on
        ``cost`` as given).

    Returns
    -------
    tuple[np.ndarray, bool]
        The assignment and whether it is the certified hint (True) or the solver's (False).

    Examples
    --------
    >>> cost = np.ones((128, 128)) - np.eye(128)
    >>> p, hinted = assign_with_hint(cost, np.arange(128))
    >>> p[:3].tolist(), hinted
    ([0, 1, 2], True)
    """
    if hint is not None and cost.shape[0] >= MIN_SIZE.get(solver, 128) and certify_assignment(cost, hint):
        return np.asarray(hint, dtype=np.int64), True
    return assign(cost, solver, single), False
