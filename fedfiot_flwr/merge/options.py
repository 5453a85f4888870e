"""What the merge engine computes: the algorithm's options, validated once, in one frozen object.

:class:`MergeOptions` holds the choices that change the merged model (tempering, damping,
iterations, reference, matching, aggregation, identity rule, Fisher scaling);
:class:`~fedfiot_flwr.merge.speed.MergeSpeed` holds those that only change how it is computed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Real

import numpy as np

from fedfiot_flwr.options import CURVATURES, DEFAULT_KFAC_DAMPING, DEFAULT_LAM, DEFAULT_MAX_ITERS, DEFAULT_RHO, FISHER_SCALINGS, GRAM_CURVATURES, GRAM_SCALINGS

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
    curvature : {"diagonal", "gram", "kfac"}
        The layer curvature of the objective: the diagonal Fisher (tempered and damped with ``rho``
        and ``lam``; the paper), the clients' input Grams (:mod:`fedfiot_flwr.merge.gram`), or the input
        Grams with each unit weighted by its output factor (K-FAC with a diagonal output factor). With
        either Gram form ``matching`` is ``"fisher"`` (the curvature-weighted cost) or ``"none"``,
        ``aggregation`` is ``"fisher"``, and ``rho``, ``lam`` and ``fisher_scaling`` are not used.
    gram_alpha : float
        The Gram's off-diagonal scaling in ``[0, 1]`` (RegMean's alpha; 1: the least-squares fit).
    gram_ridge : float
        Relative ridge ``>= 0`` added to the Gram's diagonal, times its mean diagonal entry.
    gram_scaling : {"size", "none"}
        A client's Gram times its share of the examples (RegMean's), or as uploaded.
    gram_rcond : float
        Relative cut-off of the pseudo-inverse of a layer's summed Grams (singular sums are
        solved as RegMean solves them: the solution nearest the size-weighted average).
    kfac_damping : float
        ``"kfac"`` only: ``delta > 0`` of a unit's weight ``(g / mean(g) + delta) / (1 + delta)``
        (:func:`fedfiot_flwr.merge.gram.row_weights`); large values give the Gram curvature's merge.

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
    curvature: str = "diagonal"
    gram_alpha: float = 1.0
    gram_ridge: float = 0.0
    gram_scaling: str = "size"
    gram_rcond: float = 1e-10
    kfac_damping: float = DEFAULT_KFAC_DAMPING

    def __post_init__(self) -> None:
        check_options(self.lam, self.rho, self.max_iters, self.matching, self.aggregation, self.fallback)
        if self.fisher_scaling not in FISHER_SCALINGS:
            raise ValueError(f"fisher_scaling must be one of {FISHER_SCALINGS}, got {self.fisher_scaling!r}")
        if self.curvature not in CURVATURES:
            raise ValueError(f"curvature must be one of {CURVATURES}, got {self.curvature!r}")
        if not (isinstance(self.gram_alpha, Real) and 0.0 <= self.gram_alpha <= 1.0):
            raise ValueError(f"gram_alpha must lie in [0, 1], got {self.gram_alpha!r}")
        if not (isinstance(self.gram_ridge, Real) and 0.0 <= self.gram_ridge < float("inf")):
            raise ValueError(f"gram_ridge must be a finite number >= 0, got {self.gram_ridge!r}")
        if not (isinstance(self.gram_rcond, Real) and 0.0 <= self.gram_rcond < 1.0):
            raise ValueError(f"gram_rcond must lie in [0, 1), got {self.gram_rcond!r}")
        if self.gram_scaling not in GRAM_SCALINGS:
            raise ValueError(f"gram_scaling must be one of {GRAM_SCALINGS}, got {self.gram_scaling!r}")
        if not (isinstance(self.kfac_damping, Real) and 0.0 < self.kfac_damping < float("inf")):
            raise ValueError(f"kfac_damping must be a finite number > 0, got {self.kfac_damping!r}")
        if self.curvature in GRAM_CURVATURES and (self.matching == "euclidean" or self.aggregation != "fisher"):
            raise ValueError("the Gram curvature weighs both steps: matching must be 'fisher' or 'none' and "
                             f"aggregation 'fisher', got matching={self.matching!r}, aggregation={self.aggregation!r}")
