"""FedFisher's knobs, spelled once for the merge functions, the aggregator and the strategy.

Torch-free: the server imports it without loading FedFisher's optimiser
(:mod:`fedfiot_flwr.baselines.fedfisher`).

>>> FedFisherOptions("diag", steps=50).eval_every
100
>>> FedFisherOptions(fisher_scaling="sqrt")
Traceback (most recent call last):
...
ValueError: fisher_scaling must be 'size' or 'none', got 'sqrt'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fedfiot_flwr.options import FEDFISHER_VARIANTS, SERVER_FISHER_KINDS

__all__ = ["OPTIMIZERS", "FedFisherOptions"]

OPTIMIZERS = ("fedfisher", "adam")
"""``"fedfisher"``: the update of FedFisher's code (default); ``"adam"``: ``torch.optim.Adam``."""


def _check_optim(steps: int, lr: float, eval_every: int, damping: float) -> None:
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be positive, got {lr!r}")
    if int(eval_every) != eval_every or eval_every < 1:
        raise ValueError(f"eval_every must be a positive integer, got {eval_every!r}")
    if not (damping >= 0 and math.isfinite(damping)):
        raise ValueError(f"damping must be finite and >= 0, got {damping!r}")


@dataclass(frozen=True)
class FedFisherOptions:
    """FedFisher's knobs (validated when built).

    :func:`~fedfiot_flwr.baselines.fedfisher.fedfisher_kfac` and
    :func:`~fedfiot_flwr.baselines.fedfisher.fedfisher_diag` read the optimisation fields
    (``steps`` to ``damping``, and ``device``); ``variant``, ``fisher_kind`` and
    ``selection_metric`` are the aggregator's choices.

    Attributes
    ----------
    variant : {"kfac", "diag"}
        Kronecker-factored or diagonal Fishers.
    steps, lr, eval_every : int, float, int
        Optimisation steps, step size and checkpoint spacing (paper: 2000, 0.01, 100).
    optimizer : {"fedfisher", "adam"}
        FedFisher's own update rule or ``torch.optim.Adam``
        (see :mod:`fedfiot_flwr.baselines.fedfisher`).
    fisher_scaling : {"size", "none"}
        Client weights ``n_k / n`` or ``1 / K``.
    damping : float
        Added to every client's curvature.
    fisher_kind : {"true", "empirical"}, optional
        K-FAC replies declaring another kind are excluded.
    selection_metric : str
        Validation metric the best checkpoint is chosen on.
    device : torch.device or str, optional
        Where the optimisation runs (default: CUDA when available).
    """

    variant: str = "kfac"
    steps: int = 2000
    lr: float = 0.01
    eval_every: int = 100
    optimizer: str = "fedfisher"
    fisher_scaling: str = "size"
    damping: float = 0.0
    fisher_kind: str | None = None
    selection_metric: str = "accuracy"
    device: Any = None

    def __post_init__(self) -> None:
        if self.variant not in FEDFISHER_VARIANTS:
            raise ValueError(f"FedFisher variant must be one of {FEDFISHER_VARIANTS}, got {self.variant!r}")
        if self.fisher_kind is not None and self.fisher_kind not in SERVER_FISHER_KINDS:
            raise ValueError(f"fisher_kind must be one of {SERVER_FISHER_KINDS} or None, got {self.fisher_kind!r}")
        if self.fisher_scaling not in ("size", "none"):
            raise ValueError(f"fisher_scaling must be 'size' or 'none', got {self.fisher_scaling!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        _check_optim(self.steps, self.lr, self.eval_every, self.damping)
        for name, kind in (("steps", int), ("lr", float), ("eval_every", int), ("damping", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))
