"""Distillation fine-tuning of a merged model on the server's fitting rows."""

from __future__ import annotations

import math
import contextlib
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedfiot_flwr.refine.ops import channels_last, model_state
from fedfiot_flwr.refine.options import RefineOptions
from fedfiot_flwr.options import Model

__all__ = ["distill_finetune"]


def distill_finetune(
    model: nn.Module, batches: Sequence[torch.Tensor], labels: torch.Tensor, teacher: Sequence[torch.Tensor],
    options: RefineOptions, stop_after: int | None = None, reference: bool = False,
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
    nothing more) if the loss stops being finite. Image batches train channels-last
    (:func:`~fedfiot_flwr.refine.ops.channels_last`: the same steps up to rounding);
    ``reference`` keeps the default memory layout.
    """
    x = torch.cat(list(batches))
    t = torch.cat(list(teacher))
    n_lab = labels.shape[0]
    if x.shape[0] < n_lab or t.shape[0] != x.shape[0]:
        raise ValueError(f"fine-tuning: {x.shape[0]} rows, {t.shape[0]} teacher rows, {n_lab} labels")
    has_label = torch.zeros(x.shape[0], dtype=torch.bool)
    has_label[:n_lab] = True
    y = torch.zeros(x.shape[0], dtype=torch.long)
    y[:n_lab] = labels
    opt = torch.optim.SGD(model.parameters(), lr=options.finetune_lr, momentum=0.9)
    batch = options.finetune_batch
    steps_per_epoch = math.ceil(x.shape[0] / batch)
    schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=options.finetune_epochs * steps_per_epoch)
                if options.finetune_schedule == "cosine" else None)
    gen = torch.Generator().manual_seed(options.seed + 1)
    temp, beta = options.temperature, options.distill_weight
    soft = torch.softmax(t / temp, dim=1)
    last = options.finetune_epochs if stop_after is None else min(stop_after, options.finetune_epochs)
    with contextlib.nullcontext(lambda v: v) if reference else channels_last(model, x) as layout:
        for epoch in range(1, last + 1):
            model.train()
            for idx in torch.split(torch.randperm(x.shape[0], generator=gen), batch):
                out = model(layout(x[idx]))
                kd = F.kl_div(F.log_softmax(out / temp, dim=1), soft[idx], reduction="batchmean") * temp * temp
                lab = has_label[idx]
                ce = F.cross_entropy(out[lab], y[idx][lab]) if bool(lab.any()) else out.sum() * 0.0
                loss = beta * kd + (1 - beta) * ce
                if not bool(torch.isfinite(loss)):
                    return
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                opt.step()
                if schedule is not None:
                    schedule.step()
            model.eval()
            every = options.checkpoint_every
            if epoch == last or (every > 0 and epoch % every == 0):
                yield epoch, model_state(model)
