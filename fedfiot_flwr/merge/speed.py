"""How the merge engine computes a merge: its speed options, validated once, in one object.

None of these options changes the paper's algorithm. Each is exact, except that float32 cost
matrices (and a different solver or ``certify``) may break near-ties, or exact ties, between
assignments differently; ``lap_threads`` and ``stack_bytes`` are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .parallel import check_lap_threads
from .validate import check_speed_options

__all__ = ["MergeSpeed"]


@dataclass(frozen=True)
class MergeSpeed:
    """The merge engine's execution options (:func:`fedfiot_flwr.merge.merge`'s ``speed``).

    Parameters
    ----------
    cost_dtype : {"float64", "float32"}
        Precision of the cost-matrix GEMMs (about 2x faster in float32; assignments can differ
        only between near-equal costs). Aggregation and objectives are always float64.
    lap_solver : {"scipy", "lapjv", "lapjv-avx", "auto"}
        Exact assignment solver (:func:`fedfiot_flwr.merge.lap.assign`; the LAPJV ones need the
        ``fast`` extra, ``"auto"`` takes the fastest installed one for wide layers).
    lap_threads : int, optional
        Threads that solve one inner iteration's K assignment problems of a layer concurrently
        (:mod:`fedfiot_flwr.merge.parallel`). ``None``: one per core, at most K, for layers of at
        least 256 neurons when the solver releases the GIL; ``1``: sequential. Bit-identical.
    certify : bool
        Try each client's previous assignment (the identity in iteration 1) before the solver and
        keep it when it is certified optimal (:mod:`fedfiot_flwr.merge.certify`). Exact: results
        can differ from ``certify=False`` only between assignments of equal cost.
    backend : {"numpy", "torch"}
        Where cost GEMMs and aggregation gathers run; ``"torch"`` uses ``device``.
    device : str, optional
        torch device for ``backend="torch"``; ``"auto"``: CUDA when available, else the CPU.
    stack_bytes : int
        Memory budget of one permutation's stacked client data; above it, clients are streamed
        (reloaded from the uploads on each use: less memory, more time). Bit-identical.

    Examples
    --------
    >>> MergeSpeed(cost_dtype="float32", certify=True).lap_solver
    'scipy'
    >>> MergeSpeed(lap_solver="greedy")
    Traceback (most recent call last):
    ...
    ValueError: lap_solver must be one of ('scipy', 'lapjv', 'lapjv-avx', 'auto'), got 'greedy'
    """

    cost_dtype: str = "float64"
    lap_solver: str = "scipy"
    lap_threads: int | None = None
    certify: bool = False
    backend: str = "numpy"
    device: str | None = "auto"
    stack_bytes: int = 2**31

    def __post_init__(self) -> None:
        check_speed_options(self.cost_dtype, self.backend, self.lap_solver)
        check_lap_threads(self.lap_threads)
        if not isinstance(self.certify, (bool, np.bool_)):
            raise ValueError(f"certify must be True or False, got {self.certify!r}")
        if isinstance(self.stack_bytes, bool) or not isinstance(self.stack_bytes, (int, np.integer)) \
                or self.stack_bytes < 0:
            raise ValueError(f"stack_bytes must be an integer >= 0, got {self.stack_bytes!r}")
