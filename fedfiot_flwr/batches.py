"""Batches and evaluation shared by the client and the server: no training, no Flower.

:func:`split_batch` reads ``(inputs, labels)`` from a data-loader batch (a tuple, or a dict in
flwr-datasets style); :func:`evaluate` gives a classifier's loss and accuracy on a loader.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["IMAGE_KEYS", "LABEL_KEYS", "default_device", "evaluate", "resolve_device", "split_batch"]

IMAGE_KEYS = ("img", "image", "pixel_values", "x", "inputs")
LABEL_KEYS = ("label", "labels", "fine_label", "y", "target")


def default_device() -> torch.device:
    """CUDA when available, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device``; ``None``: :func:`default_device`."""
    return default_device() if device is None else torch.device(device)


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(inputs, labels)`` of one data-loader batch.

    Parameters
    ----------
    batch : tuple, list or Mapping
        ``(x, y, ...)`` or a dict holding one of :data:`IMAGE_KEYS` and one of
        :data:`LABEL_KEYS` (e.g. flwr-datasets' ``{"img": ..., "label": ...}``).

    Raises
    ------
    ValueError
        If the batch has neither form.
    """
    if isinstance(batch, Mapping):
        x = next((batch[k] for k in IMAGE_KEYS if k in batch), None)
        y = next((batch[k] for k in LABEL_KEYS if k in batch), None)
        if x is None or y is None:
            raise ValueError(
                f"batch dict has keys {sorted(batch)}; expected one of {IMAGE_KEYS} and one of {LABEL_KEYS}"
            )
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        x, y = batch[0], batch[1]
    else:
        raise ValueError(f"cannot split a batch of type {type(batch).__name__} into (inputs, labels)")
    return torch.as_tensor(x), torch.as_tensor(y)


def evaluate(
    model: nn.Module, loader: Iterable[Any], device: torch.device | str | None = None
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``loader``, in eval mode.

    Parameters
    ----------
    model : nn.Module
        Classifier returning logits; moved to ``device``. Its train/eval mode is restored.
    loader : Iterable
        Yields ``(x, y)`` batches (or dicts, see :func:`split_batch`).
    device : torch.device or str, optional
        Defaults to CUDA when available, else the CPU.

    Returns
    -------
    tuple[float, float]
        ``(loss, accuracy)``.

    Raises
    ------
    ValueError
        If the loader yields no examples.
    """
    dev = resolve_device(device)
    was_training = model.training
    model.to(dev)
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    try:
        with torch.inference_mode():
            for batch in loader:
                x, y = split_batch(batch)
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                logits = model(x)
                loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(1) == y).sum())
                seen += int(y.shape[0])
    finally:
        model.train(was_training)
    if seen == 0:
        raise ValueError("evaluate: the loader yielded no examples")
    return loss_sum / seen, correct / seen
