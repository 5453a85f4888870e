"""The paper's Dirichlet label split as a flwr-datasets ``Partitioner`` (the ``data`` extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from fedfiot_flwr.data.partition import dirichlet_class_split
from fedfiot_flwr.extras import require

if TYPE_CHECKING:
    import datasets
    from flwr_datasets.partitioner import Partitioner
else:  # the base class: needed when this module is imported
    Partitioner = require(
        "flwr_datasets.partitioner", "flwr-datasets", "data", "ClassProportionDirichletPartitioner"
    ).Partitioner


class ClassProportionDirichletPartitioner(Partitioner):
    """Per-client Dirichlet label split (FedFiOT / FedFisher), for ``FederatedDataset``.

    Each client ``k`` draws ``q_k ~ Dir(alpha * 1_C)`` and receives the fraction
    ``q_k[c] / sum_k' q_k'[c]`` of the examples of class ``c``. Unlike flwr-datasets'
    ``DirichletPartitioner`` (one ``Dir(alpha * 1_K)`` draw per class), client sizes follow
    from the class preferences. Draws leaving a client with fewer than
    ``min_partition_size`` examples are redrawn with derived seeds; see
    :func:`fedfiot_flwr.data.partition.dirichlet_class_split`.

    Parameters
    ----------
    num_partitions : int
        Number of clients.
    alpha : float
        Dirichlet concentration (paper: 0.2, 0.1, 0.05).
    seed : int
        Partition seed; the split depends only on it and the label column.
    partition_by : str
        Name of the label column.
    min_partition_size : int
        Smallest acceptable partition (default 1: no empty partition).
    max_attempts : int
        Dirichlet draws to try before raising ``ValueError``.

    Examples
    --------
    >>> from flwr_datasets import FederatedDataset
    >>> partitioner = ClassProportionDirichletPartitioner(num_partitions=6, alpha=0.1, seed=0)
    >>> fds = FederatedDataset(dataset="uoft-cs/cifar10", partitioners={"train": partitioner})
    >>> fds.load_partition(0)  # doctest: +SKIP
    """

    def __init__(
        self,
        num_partitions: int,
        alpha: float,
        seed: int = 42,
        partition_by: str = "label",
        min_partition_size: int = 1,
        max_attempts: int = 100,
    ) -> None:
        super().__init__()
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
        if not alpha > 0:
            raise ValueError(f"alpha must be > 0, got {alpha}")
        self._num_partitions = int(num_partitions)
        self._alpha = float(alpha)
        self._seed = int(seed)
        self._partition_by = partition_by
        self._min_partition_size = int(min_partition_size)
        self._max_attempts = int(max_attempts)
        self._indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        """Total number of partitions."""
        return self._num_partitions

    @property
    def partition_indices(self) -> list[np.ndarray]:
        """Row indices of the assigned dataset held by each partition (computed once)."""
        if self._indices is None:
            if self._partition_by not in self.dataset.column_names:
                raise ValueError(
                    f"label column {self._partition_by!r} not in the dataset's columns {self.dataset.column_names}"
                )
            labels = np.asarray(self.dataset.with_format("numpy")[self._partition_by])
            self._indices = dirichlet_class_split(
                labels,
                self._num_partitions,
                self._alpha,
                self._seed,
                min_partition_size=self._min_partition_size,
                max_attempts=self._max_attempts,
            )
        return self._indices

    def load_partition(self, partition_id: int) -> datasets.Dataset:
        """Return partition ``partition_id`` (``0 <= partition_id < num_partitions``)."""
        if not 0 <= partition_id < self._num_partitions:
            raise ValueError(f"partition_id must be in [0, {self._num_partitions}), got {partition_id}")
        return self.dataset.select(self.partition_indices[partition_id])
