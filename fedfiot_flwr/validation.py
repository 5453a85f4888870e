"""Server-side validation for the common torch case: a held-out loader scores candidate merges.

FedFiOT chooses between merges on validation data when the server has some. The strategies take
a framework-neutral ``validate_fn``: ``model dict (name -> np.ndarray) -> metrics``.
:func:`make_validate_fn` builds one from a torch model and a DataLoader::

    held_out = Subset(trainset, range(500))    # examples no client trains on and no evaluation reports on
    validate_fn = make_validate_fn(Net(), DataLoader(held_out, batch_size=256))
    strategy = FedFiOT(model=Net(), validate_fn=validate_fn)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfiot_flwr.batches import evaluate, split_batch

__all__ = ["ValidateFn", "make_validate_fn"]

ValidateFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, float]]
"""``model dict -> metrics``; the metric the strategy selects on is ``"accuracy"`` by default."""


def make_validate_fn(
    model: nn.Module, loader: Iterable[Any], device: torch.device | str | None = None, *,
    cache_batches: bool = False,
) -> ValidateFn:
    """A ``validate_fn`` that loads a model dict into ``model`` and scores it on ``loader``.

    Parameters
    ----------
    model : nn.Module
        A classifier of the federation's architecture (its weights are overwritten on every call).
    loader : Iterable
        Held-out ``(inputs, labels)`` batches (or dicts, see :func:`fedfiot_flwr.task.split_batch`).
    device : torch.device or str, optional
        Where to evaluate (default: CUDA when available).
    cache_batches : bool
        Read ``loader`` once and score every model on those tensors (for a fixed, unshuffled,
        unaugmented held-out set: the same scores without re-collating it for every candidate).

    Returns
    -------
    callable
        ``model dict -> {"accuracy": ..., "loss": ...}`` (mean cross-entropy).
    """
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def validate(weights: Mapping[str, np.ndarray]) -> dict[str, float]:
        nonlocal batches
        state = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()}
        model.load_state_dict(state)
        if cache_batches and batches is None:
            batches = [split_batch(b) for b in loader]
        loss, accuracy = evaluate(model, batches if batches is not None else loader, device=device)
        return {"accuracy": float(accuracy), "loss": float(loss)}

    return validate
