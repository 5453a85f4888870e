"""Distillation fine-tuning of a merged model on the server's fitting rows."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

import torch
import torch.nn.functional as F
from torch import nn

from fedfiot_flwr.refine.ops import channels_last, model_state
from fedfiot_flwr.refine.options import RefineOptions
from fedfiot_flwr.options import Model

__all__ = ["FisherAnchor", "distill_finetune", "laplace_anchor"]


@dataclass(frozen=True)
class FisherAnchor:
    r"""The clients' Laplace approximations as a penalty on the fine-tuned weights.

    .. math::
        R(\theta) = \frac{\gamma}{2} \sum_c P_c (\theta_c - m_c)^2,
        \qquad P = \sum_k \frac{n_k}{n} F_k, \qquad m = P^{-1} \sum_k \frac{n_k}{n} F_k w_k

    with :math:`w_k, F_k` client :math:`k`'s (aligned) weights and diagonal Fisher and :math:`n`
    the fitting rows: up to a constant, :math:`\gamma \sum_k \frac{n_k}{2n} \sum_c F_{k,c}
    (\theta_c - w_{k,c})^2`, the clients' log-likelihoods per fitting example. With
    :math:`\gamma = 1` the fine-tuning minimises the server's loss plus that: a MAP estimate of
    the model given every client's data and the server's.

    Attributes
    ----------
    center, precision : dict[str, torch.Tensor]
        :math:`m` and :math:`P` per parameter name.
    strength : float
        :math:`\gamma`.
    """

    center: Mapping[str, torch.Tensor]
    precision: Mapping[str, torch.Tensor]
    strength: float

    def to(self, device: torch.device) -> FisherAnchor:
        """The same anchor with its tensors on ``device`` (moved once, not at every step)."""
        return FisherAnchor({k: v.to(device) for k, v in self.center.items()},
                            {k: v.to(device) for k, v in self.precision.items()}, self.strength)

    def penalty(self, model: nn.Module) -> torch.Tensor:
        """:math:`R(\theta)` at ``model``'s parameters (on the anchor's device)."""
        terms = [(self.precision[name] * (p - self.center[name]) ** 2).sum()
                 for name, p in model.named_parameters() if name in self.precision]
        return 0.5 * self.strength * torch.stack(terms).sum() if terms else torch.zeros(())


def laplace_anchor(weights: Sequence[Mapping[str, np.ndarray]], fishers: Sequence[Mapping[str, np.ndarray]],
                   num_examples: Sequence[int], rows: int, strength: float) -> FisherAnchor:
    """:class:`FisherAnchor` of the clients' (aligned) ``weights`` and ``fishers`` for ``rows`` fitting rows.

    Every tensor that has a Fisher is anchored; entries no client's Fisher covers (all zero)
    get precision 0 and are free.

    >>> a = laplace_anchor([{"w": np.array([0.0, 4.0])}, {"w": np.array([2.0, 8.0])}],
    ...                    [{"w": np.array([1.0, 0.0])}, {"w": np.array([3.0, 0.0])}], [10, 10], 10, 1.0)
    >>> a.center["w"].tolist(), a.precision["w"].tolist()
    ([1.5, 0.0], [4.0, 0.0])
    """
    if not (len(weights) == len(fishers) == len(num_examples)) or not weights:
        raise ValueError(f"the Fisher anchor needs one Fisher and size per client: {len(weights)} clients, "
                         f"{len(fishers)} Fishers, {len(num_examples)} sizes")
    if rows < 1 or not (math.isfinite(strength) and strength > 0):
        raise ValueError(f"the Fisher anchor needs rows >= 1 and a finite strength > 0, got {rows}, {strength}")
    center: dict[str, torch.Tensor] = {}
    precision: dict[str, torch.Tensor] = {}
    for name in fishers[0]:
        p = np.zeros(np.shape(fishers[0][name]), dtype=np.float64)
        pw = np.zeros_like(p)
        for k, (w, f) in enumerate(zip(weights, fishers)):
            fk = np.asarray(f[name], dtype=np.float64)
            if fk.shape != p.shape or not np.all(np.isfinite(fk)) or (fk < 0).any():
                raise ValueError(f"client {k}: Fisher {name!r} is not a finite, non-negative {p.shape} array")
            s = float(num_examples[k]) / rows
            p += s * fk
            pw += s * fk * np.asarray(w[name], dtype=np.float64)
        m = np.divide(pw, p, out=np.zeros_like(p), where=p > 0)
        center[name] = torch.as_tensor(m, dtype=torch.float32)
        precision[name] = torch.as_tensor(p, dtype=torch.float32)
    return FisherAnchor(center, precision, float(strength))


def distill_finetune(
    model: nn.Module, batches: Sequence[torch.Tensor], labels: torch.Tensor, teacher: Sequence[torch.Tensor],
    options: RefineOptions, stop_after: int | None = None, reference: bool = False,
    anchor: FisherAnchor | None = None,
) -> Iterable[tuple[int, Model]]:
    """Fine-tune ``model`` in place on the fitting rows; yields ``(epoch, state)`` at its checkpoints.

    The checkpoints are every ``options.checkpoint_every``-th epoch and the last one. The
    learning-rate schedule always spans ``options.finetune_epochs``; ``stop_after`` ends the run
    after that many epochs (yielding that epoch's state), so a shorter run reproduces a prefix of
    the full one exactly.

    The loss is ``distill_weight * T^2 KL(softmax(teacher / T) || softmax(model / T))``
    (``teacher``: the clients' mean logits on the same rows) plus ``(1 - distill_weight)``
    times cross-entropy on ``labels`` (the first ``len(labels)`` rows; augmented copies keep
    their example's label). SGD with momentum 0.9, batches of ``options.finetune_batch`` rows,
    gradient norm clipped at 5, rows reshuffled every epoch (seeded). Stops early (yielding
    nothing more) after an epoch in which the loss stopped being finite. Image batches train channels-last
    (:func:`~fedfiot_flwr.refine.ops.channels_last`: the same steps up to rounding);
    ``reference`` keeps the default memory layout. An ``anchor`` adds its penalty
    (:class:`FisherAnchor`) to every step's loss.
    """
    x = torch.cat(list(batches))
    t = torch.cat(list(teacher))
    n_lab = labels.shape[0]
    if x.shape[0] < n_lab or t.shape[0] != x.shape[0]:
        raise ValueError(f"fine-tuning: {x.shape[0]} rows, {t.shape[0]} teacher rows, {n_lab} labels")
    y = torch.zeros(x.shape[0], dtype=torch.long)
    y[:n_lab] = labels.cpu()
    opt = torch.optim.SGD(model.parameters(), lr=options.finetune_lr, momentum=0.9)
    batch = options.finetune_batch
    steps_per_epoch = math.ceil(x.shape[0] / batch)
    schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=options.finetune_epochs * steps_per_epoch)
                if options.finetune_schedule == "cosine" else None)
    gen = torch.Generator().manual_seed(options.seed + 1)
    temp, beta = options.temperature, options.distill_weight
    soft = torch.softmax(t / temp, dim=1)
    if anchor is not None:
        anchor = anchor.to(next(model.parameters()).device)
    last = options.finetune_epochs if stop_after is None else min(stop_after, options.finetune_epochs)
    with contextlib.nullcontext(lambda v: v) if reference else channels_last(model, x) as layout:
        for epoch in range(1, last + 1):
            model.train()
            finite = torch.ones((), dtype=torch.bool, device=x.device)
            # The order and each batch's labelled rows are found on the CPU (the same steps on
            # every device) and moved; nothing in a step waits for the device.
            for idx in torch.split(torch.randperm(x.shape[0], generator=gen), batch):
                labelled = torch.nonzero(idx < n_lab).flatten()
                rows, lab = idx.to(x.device, non_blocking=True), labelled.to(x.device, non_blocking=True)
                out = model(layout(x[rows]))
                kd = F.kl_div(F.log_softmax(out / temp, dim=1), soft[rows], reduction="batchmean") * temp * temp
                ce = (F.cross_entropy(out.index_select(0, lab), y[idx[labelled]].to(x.device, non_blocking=True))
                      if labelled.numel() else out.sum() * 0.0)
                loss = beta * kd + (1 - beta) * ce
                if anchor is not None:
                    loss = loss + anchor.penalty(model)
                finite &= torch.isfinite(loss)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                if schedule is not None:
                    schedule.step()
            if not bool(finite):  # a non-finite loss this epoch: no more checkpoints
                return
            model.eval()
            every = options.checkpoint_every
            if epoch == last or (every > 0 and epoch % every == 0):
                yield epoch, model_state(model)
