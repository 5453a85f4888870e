"""Local training and evaluation as in the paper (Appendix C.2).

``train`` runs SGD (momentum 0.9, weight decay 2e-3, lr 0.02) with the learning rate
cosine-annealed over the local epochs (``CosineAnnealingLR(T_max=epochs)`` stepped once per
epoch), on cross-entropy. The paper's random 32x32 crop with 4-pixel padding and horizontal
flip is applied by :func:`fedfiot_flwr.data.load_dataset` (``augment=True``) per example;
for loaders that yield plain tensors, ``train(..., augment=True)`` applies the same
augmentation per batch on the device (:func:`random_crop_flip`). Batches may be ``(x, y)``
pairs or dicts (flwr-datasets style, see :func:`split_batch`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedfiot_flwr.batches import IMAGE_KEYS, LABEL_KEYS, default_device, evaluate, split_batch
from fedfiot_flwr.batches import resolve_device as _resolve_device
from fedfiot_flwr.progress import progress_bar

__all__ = [
    "IMAGE_KEYS",
    "LABEL_KEYS",
    "default_device",
    "evaluate",
    "random_crop_flip",
    "split_batch",
    "train",
]


def random_crop_flip(x: torch.Tensor, padding: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random crop of the zero-padded images and a random horizontal flip, per example.

    Parameters
    ----------
    x : torch.Tensor
        Batch of shape ``(B, C, H, W)``. Padding adds zeros to this tensor, so on normalised
        inputs the border is the mean colour (torchvision's pipeline pads before normalising).
    padding : int
        Pixels of padding on every side.
    generator : torch.Generator, optional
        Source of randomness (on ``x``'s device); torch's global RNG by default.

    Returns
    -------
    torch.Tensor
        Augmented batch of ``x``'s shape.
    """
    if x.dim() != 4:
        raise ValueError(f"random_crop_flip expects (B, C, H, W) images, got shape {tuple(x.shape)}")
    b, c, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    dev = x.device
    top = torch.randint(0, 2 * padding + 1, (b,), device=dev, generator=generator)
    left = torch.randint(0, 2 * padding + 1, (b,), device=dev, generator=generator)
    rows = (top[:, None] + torch.arange(h, device=dev))[:, None, :, None]
    cols = (left[:, None] + torch.arange(w, device=dev))[:, None, None, :]
    flip = torch.rand(b, device=dev, generator=generator) < 0.5
    cols = torch.where(flip[:, None, None, None], cols.flip(-1), cols)
    batch_idx = torch.arange(b, device=dev)[:, None, None, None]
    chan_idx = torch.arange(c, device=dev)[None, :, None, None]
    return padded[batch_idx, chan_idx, rows, cols]


def train(
    model: nn.Module,
    trainloader: Iterable[Any],
    epochs: int,
    lr: float = 0.02,
    momentum: float = 0.9,
    weight_decay: float = 2e-3,
    device: torch.device | str | None = None,
    progress: bool | None = None,
    augment: bool = False,
) -> dict[str, float]:
    """Train ``model`` in place for ``epochs`` local epochs (paper, Appendix C.2).

    Parameters
    ----------
    model : nn.Module
        Classifier returning logits; moved to ``device`` and left there, in training mode.
    trainloader : Iterable
        Yields ``(x, y)`` batches (or dicts, see :func:`split_batch`); the paper uses batch 64.
    epochs : int
        Number of local epochs (>= 1); the cosine schedule spans them.
    lr, momentum, weight_decay : float
        SGD hyperparameters (initial learning rate of the cosine schedule).
    device : torch.device or str, optional
        Defaults to CUDA when available, else the CPU.
    progress : bool, optional
        Show a tqdm bar over epochs (the ``progress`` extra); ``None`` shows it only on a
        terminal and only when tqdm is installed.
    augment : bool
        Apply :func:`random_crop_flip` to every batch (leave False when the data set
        already augments, as ``load_dataset(augment=True)`` does).

    Returns
    -------
    dict[str, float]
        ``"train-loss"`` (mean cross-entropy) and ``"train-accuracy"`` of the last epoch,
        measured on the fly while training.

    Raises
    ------
    ValueError
        For ``epochs < 1`` or a loader that yields no examples.
    """
    if int(epochs) < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs!r}")
    dev = _resolve_device(device)
    model.to(dev)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=int(epochs))
    bar = progress_bar(range(int(epochs)), progress, desc="local epochs", unit="epoch", leave=False)
    loss_sum, correct, seen = 0.0, 0, 0
    for _ in bar:
        loss_sum, correct, seen = 0.0, 0, 0
        for batch in trainloader:
            x, y = split_batch(batch)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            if augment:
                x = random_crop_flip(x)
            optimizer.zero_grad(set_to_none=True)
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            optimizer.step()
            n = int(y.shape[0])
            loss_sum += float(loss.detach()) * n
            correct += int((logits.detach().argmax(1) == y).sum())
            seen += n
        if seen == 0:
            raise ValueError("train: the training loader yielded no examples")
        scheduler.step()
        bar.set_postfix(loss=f"{loss_sum / seen:.4f}", acc=f"{correct / seen:.3f}")
    bar.close()
    return {"train-loss": loss_sum / seen, "train-accuracy": correct / seen}
