"""In-memory image data set that normalises (and optionally augments) on the fly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from fedfiot_flwr.extras import require

if TYPE_CHECKING:
    from torchvision.transforms import v2


def crop_flip_augmentation(size: int) -> v2.Compose:
    """Return the paper's training augmentation for ``size`` x ``size`` images.

    A random ``size`` crop of the image zero-padded by 4 pixels on each side, then a
    horizontal flip with probability 1/2 (paper, Appendix C.2). Randomness comes from
    torch's global generator, so it follows the training seed, not the partition seed.

    Raises
    ------
    ImportError
        Without torchvision (``pip install 'fedfiot-flwr[data]'``).
    """
    v2 = require("torchvision.transforms.v2", "torchvision", "data", "the crop-and-flip augmentation")
    return v2.Compose([v2.RandomCrop(size, padding=4), v2.RandomHorizontalFlip()])


class ArrayImageDataset(Dataset[tuple[torch.Tensor, int]]):
    """Images held as an integer tensor, normalised per channel when indexed.

    Parameters
    ----------
    images : torch.Tensor
        Integer pixels of shape ``(N, C, H, W)`` in ``[0, scale]``.
    targets : np.ndarray
        ``(N,)`` class labels.
    mean, std : Sequence[float]
        Per-channel statistics of the pixels divided by ``scale``.
    scale : float
        Largest pixel value (255 for 8-bit images, 16 for scikit-learn's digits).
    transform : callable, optional
        Applied to the ``[0, 1]`` float image before normalisation (so padding is black,
        as in the usual torchvision pipeline), e.g. :func:`crop_flip_augmentation`.

    Items are ``(float32 tensor C x H x W, int label)``. Keeping the pixels as integers
    costs a quarter of the memory of pre-normalised floats, which matters when several
    Flower ClientApps in one process share the cached data set.
    """

    def __init__(
        self,
        images: torch.Tensor,
        targets: np.ndarray,
        mean: Sequence[float],
        std: Sequence[float],
        scale: float = 255.0,
        transform: v2.Transform | v2.Compose | None = None,
    ) -> None:
        if images.ndim != 4:
            raise ValueError(f"images must have shape (N, C, H, W), got {tuple(images.shape)}")
        if len(targets) != images.shape[0]:
            raise ValueError(f"{images.shape[0]} images but {len(targets)} targets")
        channels = images.shape[1]
        if len(mean) != channels or len(std) != channels:
            raise ValueError(f"mean/std need {channels} entries, got {len(mean)} and {len(std)}")
        self.images = images
        self.targets = np.asarray(targets, dtype=np.int64)
        self.scale = float(scale)
        self.transform = transform
        self._mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self._std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        x = self.images[index].to(torch.float32).div_(self.scale)
        if self.transform is not None:
            x = self.transform(x)
        return (x - self._mean) / self._std, int(self.targets[index])

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, int]]:
        """Batched fetch used by ``DataLoader`` (one vectorised normalisation per batch)."""
        if self.transform is not None:
            return [self[i] for i in indices]
        x = self.images[indices].to(torch.float32).div_(self.scale)
        x = (x - self._mean) / self._std
        return list(zip(x.unbind(0), self.targets[indices].tolist(), strict=True))

    def with_transform(self, transform: v2.Transform | v2.Compose | None) -> ArrayImageDataset:
        """Return a view of the same pixels with another ``transform``."""
        return ArrayImageDataset(
            self.images,
            self.targets,
            self._mean.flatten().tolist(),
            self._std.flatten().tolist(),
            self.scale,
            transform,
        )
