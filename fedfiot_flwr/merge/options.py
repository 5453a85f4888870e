"""What the merge engine computes: the algorithm's options, validated once, in one frozen object.

:class:`MergeOptions` holds the choices that change the merged model (tempering, damping,
iterations, reference, matching, aggregation, identity rule, Fisher scaling);
:class:`~fedfiot_flwr.merge.speed.MergeSpeed` holds those that only change how it is computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedfiot_flwr.options import DEFAULT_LAM, DEFAULT_MAX_ITERS, DEFAULT_RHO, FISHER_SCALINGS

from .validate import check_options

__all__ = ["MergeOptions"]


@dataclass(frozen=True)
class MergeOptions:
    """The merge algorithm's options (see :func:`fedfiot_flwr.merge.merge`).

    Parameters
    ----------
    lam : float
        Damping ``lambda > 0`` added after tempering.
    rho : float
        Tempering exponent in ``(0, 1]``: the merge uses ``F**rho + lam``.
    max_iters : int
        Inner iterations ``S`` per permutation (early stop when alignments repeat).
    reference : int, "largest" or dict
        Initial global layer ``w[0]``: a client index, the client with most examples, or a model.
    matching : {"fisher", "euclidean", "none"}
        Alignment cost: Fisher-weighted, unit-weighted, or no alignment (identity).
    aggregation : {"fisher", "uniform", "size"}
        Fisher-weighted, uniform, or ``num_examples``-weighted averaging.
    fallback : {"objective", "none"}
        ``"objective"``: the paper's identity rule; ``"none"``: always keep the aligned merge.
    fisher_scaling : {"none", "size", "normalized", "normalized-size"}
        Per-client rescaling of the raw Fisher before tempering (``"none"``: the paper).

    Examples
    --------
    >>> MergeOptions(rho=1.0).lam
    0.0001
    >>> MergeOptions(rho=1.5)
    Traceback (most recent call last):
    ...
    ValueError: rho (tempering) must lie in (0, 1], got 1.5
    """

    lam: float = DEFAULT_LAM
    rho: float = DEFAULT_RHO
    max_iters: int = DEFAULT_MAX_ITERS
    reference: int | str | Mapping[str, np.ndarray] = "largest"
    matching: str = "fisher"
    aggregation: str = "fisher"
    fallback: str = "objective"
    fisher_scaling: str = "none"

    def __post_init__(self) -> None:
        check_options(self.lam, self.rho, self.max_iters, self.matching, self.aggregation, self.fallback)
        if self.fisher_scaling not in FISHER_SCALINGS:
            raise ValueError(f"fisher_scaling must be one of {FISHER_SCALINGS}, got {self.fisher_scaling!r}")
