"""Server validation set + federated partition of the rest of the training set."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import numpy as np
from torch.utils.data import Dataset, Subset

from fedfiot_flwr.data.loaders import DatasetBundle
from fedfiot_flwr.data.partition import dirichlet_class_split, flwr_dirichlet_split

Scheme = Literal["fedfiot", "flwr-dirichlet"]
SCHEMES: tuple[str, ...] = ("fedfiot", "flwr-dirichlet")
# spawn_key of the validation draw; the partition draws use (attempt,) with attempt < 2**31.
_VALIDATION_KEY = (2**32 - 1,)


def split_indices(
    labels: np.ndarray,
    num_partitions: int = 6,
    alpha: float = 0.1,
    partition_seed: int = 0,
    validation_size: int = 500,
    scheme: Scheme = "fedfiot",
    min_partition_size: int = 1,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Draw the server validation indices, then partition the remaining indices.

    The validation set is a uniform random sample (without replacement) of
    ``validation_size`` training indices, drawn with a generator derived from
    ``partition_seed`` before partitioning; it is excluded from every client.

    Parameters
    ----------
    labels : np.ndarray
        ``(N,)`` training labels.
    num_partitions, alpha : int, float
        Number of clients and Dirichlet concentration.
    partition_seed : int
        Seed of both the validation draw and the partition; independent of any training seed.
    validation_size : int
        Number of held-out server validation examples (0 for none).
    scheme : {"fedfiot", "flwr-dirichlet"}
        ``"fedfiot"``: the paper's per-client ``Dir(alpha * 1_C)`` split
        (:func:`dirichlet_class_split`); ``"flwr-dirichlet"``: flwr-datasets' per-class
        ``Dir(alpha * 1_K)`` split (:func:`flwr_dirichlet_split`).
    min_partition_size : int
        Smallest acceptable client (default 1: no empty client).

    Returns
    -------
    validation_indices : np.ndarray
        Sorted ``int64`` indices into ``labels``.
    client_indices : list[np.ndarray]
        One sorted ``int64`` array of indices into ``labels`` per client.
    """
    labels = np.asarray(labels)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; choose one of {SCHEMES}")
    if not 0 <= validation_size < len(labels):
        raise ValueError(f"validation_size must be in [0, {len(labels)}), got {validation_size}")
    if not isinstance(partition_seed, (int, np.integer)) or partition_seed < 0:
        raise ValueError(f"partition_seed must be a non-negative integer, got {partition_seed!r}")
    rng = np.random.default_rng(np.random.SeedSequence(int(partition_seed), spawn_key=_VALIDATION_KEY))
    is_validation = np.zeros(len(labels), dtype=bool)
    is_validation[rng.choice(len(labels), size=validation_size, replace=False)] = True
    validation_indices = np.flatnonzero(is_validation).astype(np.int64)
    pool = np.flatnonzero(~is_validation).astype(np.int64)
    split_fn = dirichlet_class_split if scheme == "fedfiot" else flwr_dirichlet_split
    parts = split_fn(labels[pool], num_partitions, alpha, int(partition_seed), min_partition_size=min_partition_size)
    return validation_indices, [pool[p] for p in parts]


@dataclass(frozen=True, eq=False)
class FederatedSplit:
    """A data set cut into a server validation set, client partitions and the test set.

    Attributes
    ----------
    bundle : DatasetBundle
    validation : Subset
        Server validation set (subset of ``bundle.train_eval``: never augmented).
    clients : list[Subset]
        One training subset of ``bundle.train`` per client (augmented if the bundle is).
    client_indices : list[np.ndarray]
        Indices into the training set of each client.
    validation_indices : np.ndarray
        Indices into the training set of the validation set.
    test : Dataset
        The full balanced test set.
    alpha, partition_seed, scheme
        How the split was drawn.
    """

    bundle: DatasetBundle
    validation: Subset
    clients: list[Subset]
    client_indices: list[np.ndarray]
    validation_indices: np.ndarray
    test: Dataset
    alpha: float = float("nan")
    partition_seed: int = -1
    scheme: str = "fedfiot"

    @property
    def num_partitions(self) -> int:
        """Number of clients."""
        return len(self.client_indices)

    @property
    def client_sizes(self) -> list[int]:
        """Examples held by each client."""
        return [len(idx) for idx in self.client_indices]

    def client_eval(self, partition_id: int) -> Subset:
        """Client ``partition_id``'s examples without augmentation (for its Fisher, accuracy)."""
        return Subset(self.bundle.train_eval, self.client_indices[partition_id].tolist())

    def label_counts(self) -> np.ndarray:
        """``(num_partitions, num_classes)`` examples per client and class."""
        targets = self.bundle.train_targets
        return np.stack(
            [np.bincount(targets[idx], minlength=self.bundle.num_classes) for idx in self.client_indices]
        )


def federated_split(
    bundle: DatasetBundle,
    num_partitions: int = 6,
    alpha: float = 0.1,
    partition_seed: int = 0,
    validation_size: int = 500,
    scheme: Scheme = "fedfiot",
    min_partition_size: int = 1,
) -> FederatedSplit:
    """Hold out a server validation set and partition the rest of ``bundle.train``.

    See :func:`split_indices` for the arguments; the split depends only on the training
    labels and these arguments, so every method (and every training seed) sees the same
    clients and the same validation set. Results are cached per process (keyed by the
    bundle object, which :func:`load_dataset` caches too), so Flower ClientApps may call
    this on every message.

    Returns
    -------
    FederatedSplit
    """
    return _federated_split_cached(
        bundle, int(num_partitions), float(alpha), int(partition_seed), int(validation_size), scheme,
        int(min_partition_size),
    )  # fmt: skip


@functools.lru_cache(maxsize=32)
def _federated_split_cached(
    bundle: DatasetBundle,
    num_partitions: int,
    alpha: float,
    partition_seed: int,
    validation_size: int,
    scheme: Scheme,
    min_partition_size: int,
) -> FederatedSplit:
    validation_indices, client_indices = split_indices(
        bundle.train_targets,
        num_partitions=num_partitions,
        alpha=alpha,
        partition_seed=partition_seed,
        validation_size=validation_size,
        scheme=scheme,
        min_partition_size=min_partition_size,
    )
    assert bundle.train_eval is not None  # set by DatasetBundle.__post_init__
    return FederatedSplit(
        bundle=bundle,
        validation=Subset(bundle.train_eval, validation_indices.tolist()),
        clients=[Subset(bundle.train, idx.tolist()) for idx in client_indices],
        client_indices=client_indices,
        validation_indices=validation_indices,
        test=bundle.test,
        alpha=float(alpha),
        partition_seed=int(partition_seed),
        scheme=scheme,
    )
