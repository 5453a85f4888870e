"""The refinement's options, torch-free and validated when they are built.

>>> RefineOptions().finetune_epochs
20
>>> RefineOptions(finetune_schedule="cosin")
Traceback (most recent call last):
...
ValueError: RefineOptions.finetune_schedule must be one of ('constant', 'cosine'), got 'cosin'
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

__all__ = ["FINETUNE_SCHEDULES", "TARGET_WEIGHTS", "RefineOptions"]

TargetWeights = Literal["uniform", "size", "label"]
FinetuneSchedule = Literal["constant", "cosine"]
TARGET_WEIGHTS: tuple[str, ...] = get_args(TargetWeights)
FINETUNE_SCHEDULES: tuple[str, ...] = get_args(FinetuneSchedule)


def _require(ok: bool, field: str, rule: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"RefineOptions.{field} must be {rule}, got {value!r}")


@dataclass(frozen=True)
class RefineOptions:
    """Knobs of the server refinement (:func:`fedfiot_flwr.refine.refine_merged_model`).

    The refinement builds candidates from the aggregated model on the server's *fitting* fold and
    returns the one with the best accuracy on a disjoint *selection* fold; the aggregated model
    itself and (by default) each client's model are candidates, so it never returns a model that
    scores below them on that fold.

    Attributes
    ----------
    ridges : tuple[float, ...]
        Relative ridges (> 0) of the least-squares refits (one candidate each).
    repair : bool
        Also build REPAIR alone and REPAIR followed by each least-squares refit.
    client_candidates : bool
        Also offer each client's own model.
    augment_copies : int
        Augmented copies (>= 0) of every fitting example added to the fine-tuning rows.
    target_weights : {"uniform", "size", "label"}
        How the clients' layer outputs are averaged into the refits' target: equally, by client
        size, or per example by each client's probability of the example's label.
    seed : int
        Seed of the augmentation and of the fine-tuning's shuffling.
    keep_candidates : bool
        Keep every candidate model in the report (for measurements; costs memory).
    finetune_epochs : int
        Epochs (>= 0) of distillation fine-tuning on the fitting fold, started from the aggregated
        model or the least-squares / REPAIR candidate that scores best on the selection fold;
        0 turns fine-tuning off.
    checkpoint_every : int
        Every ``checkpoint_every``-th epoch's model is a candidate too (0: the last epoch only).
    finetune_lr : float
        SGD learning rate (> 0, momentum 0.9) of the fine-tuning.
    finetune_schedule : {"constant", "cosine"}
        Constant learning rate, or a cosine decay to 0 over all ``finetune_epochs``.
    finetune_batch : int
        Rows (>= 1) of each fine-tuning step.
    offer_starts : bool
        With fine-tuning on, whether the least-squares / REPAIR candidates may also be returned
        (False: they only choose where fine-tuning starts).
    distill_weight : float
        Weight in [0, 1] of the distillation term (teacher: the clients' mean logits);
        ``1 - distill_weight`` goes to cross-entropy on the fitting fold's labels.
    temperature : float
        Distillation temperature (> 0).
    refit : bool
        After the choice, build the chosen recipe again on both folds together.
    fisher_anchor : tuple[float, ...]
        Strengths (> 0) of the Fisher anchor: each adds a fine-tuning run from the same start
        whose loss also holds the clients' Laplace approximations, ``strength / 2 * sum_k
        (n_k / n) * sum_c F_k[c] (theta_c - w_k[c])^2`` over the (aligned) clients' weights
        ``w_k`` and diagonal Fishers ``F_k`` (:class:`fedfiot_flwr.refine.finetune.FisherAnchor`).
        Strength 1 is the posterior of the clients' and the server's data; larger trusts the
        clients more. The runs need the clients' Fishers: without them (``fishers=None``) they
        are skipped. Empty: off.
    reference : bool
        Run the reference implementation, which returns the same model up to rounding at a
        higher cost (for measurements): separate forward passes for the label weights, the
        layer targets and the teacher, each refit's sums computed afresh, whole forward
        passes, the default memory layout (not channels-last), gradient tracking switched off
        by ``torch.no_grad`` rather than ``torch.inference_mode``.
    """

    ridges: tuple[float, ...] = (1e-2, 1e-1)
    repair: bool = False
    client_candidates: bool = True
    augment_copies: int = 8
    target_weights: TargetWeights = "label"
    seed: int = 0
    keep_candidates: bool = False
    finetune_epochs: int = 20
    checkpoint_every: int = 0
    finetune_lr: float = 0.01
    finetune_schedule: FinetuneSchedule = "cosine"
    finetune_batch: int = 50
    offer_starts: bool = False
    distill_weight: float = 0.5
    temperature: float = 2.0
    refit: bool = False
    fisher_anchor: tuple[float, ...] = (1.0, 3.0, 10.0)
    reference: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "ridges", tuple(float(r) for r in self.ridges))
        _require(all(math.isfinite(r) and r > 0 for r in self.ridges), "ridges", "a tuple of finite values > 0",
                 self.ridges)
        object.__setattr__(self, "fisher_anchor", tuple(float(r) for r in self.fisher_anchor))
        _require(all(math.isfinite(r) and r > 0 for r in self.fisher_anchor), "fisher_anchor",
                 "a tuple of finite values > 0", self.fisher_anchor)
        for name in ("augment_copies", "finetune_epochs", "checkpoint_every", "seed"):
            value = getattr(self, name)
            _require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name,
                     "an integer >= 0", value)
        _require(isinstance(self.finetune_batch, int) and not isinstance(self.finetune_batch, bool)
                 and self.finetune_batch >= 1, "finetune_batch", "an integer >= 1", self.finetune_batch)
        _require(self.target_weights in TARGET_WEIGHTS, "target_weights", f"one of {TARGET_WEIGHTS}",
                 self.target_weights)
        _require(self.finetune_schedule in FINETUNE_SCHEDULES, "finetune_schedule", f"one of {FINETUNE_SCHEDULES}",
                 self.finetune_schedule)
        _require(isinstance(self.finetune_lr, (int, float)) and math.isfinite(self.finetune_lr)
                 and self.finetune_lr > 0, "finetune_lr", "a finite number > 0", self.finetune_lr)
        _require(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                 and self.temperature > 0, "temperature", "a finite number > 0", self.temperature)
        _require(isinstance(self.distill_weight, (int, float)) and 0.0 <= self.distill_weight <= 1.0,
                 "distill_weight", "a number in [0, 1]", self.distill_weight)
        for name in ("repair", "client_candidates", "keep_candidates", "offer_starts", "refit", "reference"):
            _require(isinstance(getattr(self, name), bool), name, "True or False", getattr(self, name))

    def describe(self) -> str:
        """What the refinement trains, in words (for the strategy's start-up line)."""
        parts = []
        if self.finetune_epochs > 0:
            parts.append(f"{self.finetune_epochs} epochs of distillation fine-tuning "
                         f"({self.finetune_schedule} learning rate from {self.finetune_lr:g}"
                         f"{f', {self.augment_copies} augmented copies of each example' if self.augment_copies else ''})")
            if self.fisher_anchor:
                parts.append("the same with the clients' Fisher anchor (strength "
                             + ", ".join(f"{r:g}" for r in self.fisher_anchor) + ")")
        if self.ridges:
            parts.append("least-squares refits of each layer (ridge " + ", ".join(f"{r:g}" for r in self.ridges)
                         + ")" + (" as starts only" if self.finetune_epochs > 0 and not self.offer_starts else ""))
        if self.repair:
            parts.append("REPAIR")
        return "; ".join(parts) if parts else "no fitted candidate (selection among the inputs only)"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
