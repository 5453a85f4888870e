"""Data sets, Dirichlet label partitions, the server validation set and partition summaries.

>>> from fedfiot_flwr.data import load_dataset, federated_split
>>> bundle = load_dataset("digits")
>>> split = federated_split(bundle, num_partitions=6, alpha=0.1, partition_seed=0, validation_size=500)
"""

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
