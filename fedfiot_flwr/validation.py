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

from fedfiot_flwr.batches import evaluate

__all__ = ["ValidateFn", "make_validate_fn"]

ValidateFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, float]]
"""``model dict -> metrics``; the metric the strategy selects on is ``"accuracy"`` by default."""


def make_validate_fn(
    model: nn.Module, loader: Iterable[Any], device: torch.device | str | None = None
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

    Returns
    -------
    callable
        ``model dict -> {"accuracy": ..., "loss": ...}`` (mean cross-entropy).
    """

    def validate(weights: Mapping[str, np.ndarray]) -> dict[str, float]:
        state = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()}
        model.load_state_dict(state)
        loss, accuracy = evaluate(model, loader, device=device)
        return {"accuracy": float(accuracy), "loss": float(loss)}

    return validate
