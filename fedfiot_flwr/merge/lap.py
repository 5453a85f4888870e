"""Exact linear assignment: scipy's solver, or one of two optional Jonker-Volgenant (LAPJV) packages.

Every solver is exact (it finds a minimum-cost assignment); two can differ only between
assignments of equal cost.

=============  ===========================  ==============================  =================
``solver``     package                      speed on a dense 4096 x 4096    releases the GIL
=============  ===========================  ==============================  =================
``"scipy"``    scipy (the reference)        1x                              yes
``"lapjv"``    ``lap`` (``fast`` extra)     about 1.4x (float64 costs)      no
``"lapjv-avx"`` ``lapjv`` (``fast`` extra)  about 1.4x float64, 10x float32  yes
=============  ===========================  ==============================  =================

``"auto"`` takes the fastest installed package for layers of at least :data:`AUTO_MIN_SIZE`
neurons and scipy below (where every solver takes milliseconds). The ``lapjv`` package builds
from source (it needs a C++ compiler); ``pip install "fedfiot-flwr[fast]"`` installs both.
"""

from __future__ import annotations

from functools import cache
from importlib.util import find_spec

import numpy as np
from scipy.optimize import linear_sum_assignment

from fedfiot_flwr.extras import require
from fedfiot_flwr.options import LAP_SOLVERS

__all__ = ["AUTO_MIN_SIZE", "LAP_SOLVERS", "assign", "installed", "lapjv_available", "resolve_solver"]

AUTO_MIN_SIZE = 512
"""From this many neurons on, ``"auto"`` uses an installed LAPJV package instead of scipy."""

_PACKAGES = {"lapjv": "lap", "lapjv-avx": "lapjv"}
"""The importable package behind each optional solver."""


@cache  # looked up once per process: "auto" resolves on every assignment
def installed(solver: str) -> bool:
    """Whether ``solver``'s package is importable (scipy always is).

    >>> installed("scipy")
    True
    """
    return solver == "scipy" or find_spec(_PACKAGES[solver]) is not None


def lapjv_available() -> bool:
    """Whether the optional ``lap`` package is installed."""
    return installed("lapjv")


def resolve_solver(solver: str, size: int) -> str:
    """The concrete solver ``solver`` stands for on a ``size x size`` cost matrix.

    Parameters
    ----------
    solver : {"scipy", "lapjv", "lapjv-avx", "auto"}
        As passed to :func:`assign`.
    size : int
        Rows of the cost matrix.

    Returns
    -------
    str
        ``solver`` itself, or for ``"auto"`` the fastest installed one: ``"lapjv-avx"``, then
        ``"lapjv"``, when ``size >=`` :data:`AUTO_MIN_SIZE`, else ``"scipy"``.

    Examples
    --------
    >>> resolve_solver("auto", 8), resolve_solver("lapjv", 8)
    ('scipy', 'lapjv')
    """
    if solver not in LAP_SOLVERS:
        raise ValueError(f"lap_solver must be one of {LAP_SOLVERS}, got {solver!r}")
    if solver != "auto":
        return solver
    if size >= AUTO_MIN_SIZE:
        for fast in ("lapjv-avx", "lapjv"):
            if installed(fast):
                return fast
    return "scipy"


def assign(cost: np.ndarray, solver: str = "scipy", single: bool = False) -> np.ndarray:
    """Exact minimum-cost assignment; returns ``p`` with global neuron ``i`` <- client neuron ``p[i]``.

    Parameters
    ----------
    cost : np.ndarray
        Square ``(m, m)`` cost matrix (float64 or float32; a LAPJV solver works in the
        matrix's own precision).
    solver : {"scipy", "lapjv", "lapjv-avx", "auto"}
        See the module's table; ``"auto"``: :func:`resolve_solver`.
    single : bool
        The matrix holds float32-accurate values (e.g. from float32 GEMMs) in float64: a solver
        that can work in float32 (``"lapjv-avx"``, about 2.5x faster there) may. Other solvers
        ignore it.

    Returns
    -------
    np.ndarray
        ``int64`` permutation of ``range(m)``. A LAPJV answer that is not a permutation (it
        never was in this project's tests) is replaced by scipy's, so a faulty build cannot
        produce a wrong merge.

    Examples
    --------
    >>> assign(np.array([[5., 1.], [1., 5.]])).tolist()
    [1, 0]
    """
    solver = resolve_solver(solver, cost.shape[0])
    if solver == "lapjv":
        lap = require("lap", "lap", "fast", "lap_solver='lapjv'")
        _, x, _ = lap.lapjv(np.ascontiguousarray(cost), extend_cost=False)
        return _permutation_or_scipy(x, cost)
    if solver == "lapjv-avx":
        lapjv = require("lapjv", "lapjv", "fast", "lap_solver='lapjv-avx'")
        matrix = np.ascontiguousarray(cost)
        if single and matrix.dtype == np.float64:
            matrix = matrix.astype(np.float32)
        x, _, _ = lapjv.lapjv(matrix, force_doubles=matrix.dtype == np.float64)
        return _permutation_or_scipy(x, cost)
    return _scipy(cost)


def _scipy(cost: np.ndarray) -> np.ndarray:
    rows, cols = linear_sum_assignment(cost)
    p = np.empty(cost.shape[0], dtype=np.int64)
    p[rows] = cols
    return p


def _permutation_or_scipy(x: np.ndarray, cost: np.ndarray) -> np.ndarray:
    p = np.asarray(x, dtype=np.int64)
    m = cost.shape[0]
    if p.shape == (m,) and np.array_equal(np.sort(p), np.arange(m)):
        return p
    return _scipy(cost)
