"""Data sets, Dirichlet label partitions, the server validation set and partition summaries.

>>> from fedfiot_flwr.data import load_dataset, federated_split
>>> bundle = load_dataset("digits")
>>> split = federated_split(bundle, num_partitions=6, alpha=0.1, partition_seed=0, validation_size=500)

Everything here comes with the ``data`` extra (torchvision, scikit-learn, flwr-datasets,
datasets; :func:`save_partition_heatmap` also needs ``plots``). Names are imported lazily, from
the submodule that defines them, so ``import fedfiot_flwr.data`` needs none of them and each
name needs only what its own submodule imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedfiot_flwr.lazy import lazy_getattr

if TYPE_CHECKING:
    from fedfiot_flwr.data.arrays import ArrayImageDataset, crop_flip_augmentation
    from fedfiot_flwr.data.flwr_partitioner import ClassProportionDirichletPartitioner
    from fedfiot_flwr.data.loaders import (
        DATASET_NAMES,
        DatasetBundle,
        DatasetUnavailableError,
        canonical_name,
        clear_dataset_cache,
        default_data_root,
        load_dataset,
        read_idx,
    )
    from fedfiot_flwr.data.partition import dirichlet_class_split, flwr_dirichlet_split
    from fedfiot_flwr.data.split import SCHEMES, FederatedSplit, federated_split, split_indices
    from fedfiot_flwr.data.summary import partition_counts, partition_table, save_partition_heatmap

_LAZY = {
    "ArrayImageDataset": "arrays",
    "crop_flip_augmentation": "arrays",
    "ClassProportionDirichletPartitioner": "flwr_partitioner",
    "DATASET_NAMES": "loaders",
    "DatasetBundle": "loaders",
    "DatasetUnavailableError": "loaders",
    "canonical_name": "loaders",
    "clear_dataset_cache": "loaders",
    "default_data_root": "loaders",
    "load_dataset": "loaders",
    "read_idx": "loaders",
    "dirichlet_class_split": "partition",
    "flwr_dirichlet_split": "partition",
    "SCHEMES": "split",
    "FederatedSplit": "split",
    "federated_split": "split",
    "split_indices": "split",
    "partition_counts": "summary",
    "partition_table": "summary",
    "save_partition_heatmap": "summary",
}

__all__ = [
    "DATASET_NAMES",
    "SCHEMES",
    "ArrayImageDataset",
    "ClassProportionDirichletPartitioner",
    "DatasetBundle",
    "DatasetUnavailableError",
    "FederatedSplit",
    "canonical_name",
    "clear_dataset_cache",
    "crop_flip_augmentation",
    "default_data_root",
    "dirichlet_class_split",
    "federated_split",
    "flwr_dirichlet_split",
    "load_dataset",
    "partition_counts",
    "partition_table",
    "read_idx",
    "save_partition_heatmap",
    "split_indices",
]


__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
