"""The clients' assignments of one alignment step, solved in parallel threads.

Within one inner iteration of a layer's alignment every client's assignment problem depends only
on the current global layer and that client's own cost matrix: the K problems are independent.
:func:`solve_in_order` solves them in a thread pool while the calling thread builds the next cost
matrix (a BLAS GEMM, which releases the GIL too), and hands the results back **in client order**,
so that every sum the caller accumulates is added in the same order as without threads: the
assignments, objectives and merged model are bit-identical to the sequential ones.

Threads pay only for a solver that releases the GIL while it works: scipy's
:func:`~scipy.optimize.linear_sum_assignment` does (two 2500 x 2500 problems take half the wall
time on two threads), and so does the ``lapjv`` package's (``"lapjv-avx"``); the ``lap`` package's LAPJV
(``"lapjv"``) does not (its solves would run one at a time). :func:`lap_workers` therefore threads
only the GIL-free solvers' problems by default, and only from
:data:`MIN_PARALLEL_SIZE` neurons on, where a solve is long enough to outweigh the hand-off.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from .lap import resolve_solver

__all__ = ["MIN_PARALLEL_SIZE", "check_lap_threads", "lap_workers", "releases_gil", "solve_in_order"]

MIN_PARALLEL_SIZE = 256
"""Below this layer width the default (``lap_threads=None``) solves the clients one after another."""

Solve = Callable[[np.ndarray, np.ndarray], np.ndarray]


def check_lap_threads(lap_threads: int | None) -> None:
    """Validate ``lap_threads``: ``None`` (automatic) or an integer ``>= 1``.

    >>> check_lap_threads(None), check_lap_threads(2)
    (None, None)
    """
    if lap_threads is None:
        return
    if isinstance(lap_threads, bool) or not isinstance(lap_threads, (int, np.integer)) or lap_threads < 1:
        raise ValueError(f"lap_threads must be None (automatic) or an integer >= 1, got {lap_threads!r}")


def releases_gil(solver: str, size: int) -> bool:
    """Whether ``solver`` (as :func:`fedfiot_flwr.merge.lap.assign` resolves it for a
    ``size x size`` matrix) releases the GIL while it solves.

    >>> releases_gil("scipy", 4096), releases_gil("lapjv", 4096), releases_gil("lapjv-avx", 4096)
    (True, False, True)
    """
    return resolve_solver(solver, size) != "lapjv"


def lap_workers(lap_threads: int | None, size: int, n_clients: int, solver: str) -> int:
    """Threads to solve one alignment step's ``n_clients`` assignments of ``size`` neurons with.

    Parameters
    ----------
    lap_threads : int or None
        ``None``: automatic, ``min(n_clients, cores)`` threads (the cores this process may run
        on) when ``size >=``
        :data:`MIN_PARALLEL_SIZE` and the solver releases the GIL (:func:`releases_gil`), else 1.
        An integer: that many threads (at most ``n_clients``), whatever the size and solver.
    size : int
        Neurons of the layer (the cost matrices are ``size x size``).
    n_clients : int
        Number of clients ``K`` (one assignment each).
    solver : {"scipy", "lapjv", "lapjv-avx", "auto"}
        The assignment solver.

    Returns
    -------
    int
        ``1`` means sequential (no pool).

    Examples
    --------
    >>> lap_workers(None, 64, 6, "scipy"), lap_workers(3, 64, 6, "scipy"), lap_workers(8, 64, 6, "lapjv")
    (1, 3, 6)
    """
    check_lap_threads(lap_threads)
    if lap_threads is None:
        if size < MIN_PARALLEL_SIZE or not releases_gil(solver, size):
            return 1
        lap_threads = _cpu_count()
    return max(1, min(int(lap_threads), n_clients))


def _cpu_count() -> int:
    """Cores this process may run on (its CPU affinity where the platform has one)."""
    if hasattr(os, "process_cpu_count"):  # Python 3.13+
        return os.process_cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def solve_in_order(
    costs: Iterable[np.ndarray | None],
    hints: Sequence[np.ndarray],
    solve: Solve,
    pool: ThreadPoolExecutor | None,
    in_flight: int = 1,
) -> Iterator[tuple[np.ndarray | None, np.ndarray | None]]:
    """Solve each client's cost matrix, yielding ``(cost, assignment)`` in client order.

    Parameters
    ----------
    costs : iterable of np.ndarray or None
        Client ``k``'s cost matrix at position ``k`` (``None``: nothing to solve; yielded as
        ``(None, None)``). Read lazily: with a pool, the next matrix is built while earlier ones
        are solved.
    hints : sequence of np.ndarray
        Client ``k``'s hint (its previous assignment), passed to ``solve`` with its cost.
    solve : callable
        ``(cost, hint) -> assignment``; must not modify ``cost`` or ``hint``.
    pool : ThreadPoolExecutor or None
        ``None``: solve in the calling thread, one client after another. A pool: the problems
        are solved in its threads, and results still come back in client order.
    in_flight : int
        With a pool, the most problems submitted and not yet handed back beyond which the next
        cost matrix is not read (its thread count: every thread stays busy while the next
        matrix is built, and about ``in_flight + 2`` cost matrices are alive, not ``K``).

    Yields
    ------
    tuple of (np.ndarray or None, np.ndarray or None)
        The cost matrix and its assignment.

    Examples
    --------
    >>> costs = [np.array([[5., 1.], [1., 5.]]), None, np.eye(2)]
    >>> solve = lambda c, h: np.argmin(c, axis=1)
    >>> with ThreadPoolExecutor(2) as pool:
    ...     [None if p is None else p.tolist() for _, p in solve_in_order(costs, [None] * 3, solve, pool, 2)]
    [[1, 0], None, [1, 0]]
    """
    if pool is None:
        for k, cost in enumerate(costs):
            yield cost, None if cost is None else solve(cost, hints[k])
        return
    limit = max(1, int(in_flight))
    pending: deque[tuple[np.ndarray | None, Future | None]] = deque()
    running = 0
    for k, cost in enumerate(costs):
        future = None if cost is None else pool.submit(solve, cost, hints[k])
        pending.append((cost, future))
        running += future is not None
        while running > limit or (pending and pending[0][1] is None):
            done, future = pending.popleft()
            running -= future is not None
            yield done, None if future is None else future.result()
    while pending:
        done, future = pending.popleft()
        yield done, None if future is None else future.result()
