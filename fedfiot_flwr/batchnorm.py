"""Recompute BatchNorm running statistics of a merged model on server data.

A merge averages the clients' BatchNorm running means and variances (permuted with their
channels, weighted by ``num_examples``; ``num_batches_tracked`` is rounded). Those averages are
not the statistics of the merged weights' own activations, so a merged BN model is usually
better after one pass over a few server batches in training mode with cumulative averaging
(REPAIR/"reset BN" in the model-merging literature). :func:`batchnorm_recalibration` wraps this
as the strategy's ``bn_recalibration`` hook.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

_BN = nn.modules.batchnorm._BatchNorm


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` has a BatchNorm layer that tracks running statistics."""
    return any(isinstance(m, _BN) and m.track_running_stats for m in model.modules())


def _inputs(batch: Any) -> Any:
    if isinstance(batch, Mapping):
        for key in ("img", "image", "x", "input", "inputs"):
            if key in batch:
                return batch[key]
        raise ValueError(f"batch dict has no input key among img/image/x/input/inputs: {sorted(batch)}")
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


@torch.no_grad()
def recompute_batchnorm_statistics(
    model: nn.Module, loader: Iterable[Any], max_batches: int | None = None
) -> nn.Module:
    """Reset every BatchNorm's running statistics and re-estimate them on ``loader``.

    Parameters
    ----------
    model : nn.Module
        Modified in place; its train/eval mode and the BN momenta are restored afterwards.
    loader : iterable
        Batches ``(x, y)``, ``x`` or ``{"img": x, ...}``.
    max_batches : int, optional
        Stop after this many batches.

    Returns
    -------
    nn.Module
        ``model``, with running statistics equal to the (cumulative) mean over the batches.

    Raises
    ------
    ValueError
        If the loader yields no batch (the statistics would be left reset).
    """
    norms = [m for m in model.modules() if isinstance(m, _BN) and m.track_running_stats]
    if not norms:
        return model
    was_training = model.training
    momenta = [m.momentum for m in norms]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative moving average: every batch counts the same
    model.train()
    seen = 0
    try:
        for batch in loader:
            if max_batches is not None and seen >= max_batches:
                break
            model(_inputs(batch).to(device))
            seen += 1
    finally:
        for m, momentum in zip(norms, momenta):
            m.momentum = momentum
        model.train(was_training)
    if seen == 0:
        raise ValueError("recompute_batchnorm_statistics: the loader yielded no batch")
    return model


def batchnorm_recalibration(
    model: nn.Module, loader: Iterable[Any], max_batches: int | None = None
) -> Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]:
    """A ``merged model dict -> model dict`` hook that recomputes BN statistics on ``loader``.

    The returned function loads the merged weights into ``model`` (strictly), calls
    :func:`recompute_batchnorm_statistics` and returns the full state dict with every tensor's
    shape and dtype as given. Pass it as ``FedFiOT(bn_recalibration=...)``.
    """

    def recalibrate(merged: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = model.state_dict()
        model.load_state_dict(
            {k: torch.as_tensor(np.asarray(v)).to(state[k].dtype).reshape(state[k].shape) for k, v in merged.items()}
        )
        recompute_batchnorm_statistics(model, loader, max_batches)
        fresh = model.state_dict()
        return {k: fresh[k].detach().cpu().numpy().astype(np.asarray(v).dtype).reshape(np.shape(v))
                for k, v in merged.items()}

    return recalibrate
