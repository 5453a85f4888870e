"""Dirichlet label splits, the server validation hold-out and the flwr-datasets Partitioner."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch
from torch.utils.data import Subset

from fedfiot_flwr.data import (
    ClassProportionDirichletPartitioner,
    FederatedSplit,
    clear_dataset_cache,
    dirichlet_class_split,
    federated_split,
    flwr_dirichlet_split,
    load_dataset,
    split_indices,
)

DIGITS_LABELS = np.repeat(np.arange(10), 135)[:1347]  # digits' training-set size, 10 classes
FMNIST_LABELS = np.repeat(np.arange(10), 6000)  # Fashion-MNIST's training labels


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    merged = np.concatenate(parts)
    assert merged.dtype == np.int64
    np.testing.assert_array_equal(np.sort(merged), np.arange(n))  # each index exactly once


def _mean_label_entropy(parts: list[np.ndarray], labels: np.ndarray) -> float:
    """Mean over clients of the entropy (nats) of the client's label distribution."""
    entropies = []
    for p in parts:
        freq = np.bincount(labels[p], minlength=10) / len(p)
        freq = freq[freq > 0]
        entropies.append(float(-(freq * np.log(freq)).sum()))
    return float(np.mean(entropies))


@pytest.mark.parametrize("n", [37, 1347])
def test_every_example_assigned_exactly_once(n: int) -> None:
    labels = np.random.default_rng(0).integers(0, 10, size=n)
    for alpha in (0.05, 0.5, 100.0):
        _assert_exact_cover(dirichlet_class_split(labels, 6, alpha, seed=3), n)
    _assert_exact_cover(flwr_dirichlet_split(labels, 3, 0.5, seed=3), n)


def test_split_follows_the_per_client_dirichlet_formula() -> None:
    """Counts match q_k[c] / sum_k' q_k'[c] * n_c (within rounding), not a per-class draw."""
    labels = np.random.default_rng(1).permutation(FMNIST_LABELS[::3])
    seed, k, alpha = 11, 6, 0.3
    parts = dirichlet_class_split(labels, k, alpha, seed)
    # first attempt's generator, as documented: SeedSequence(seed, spawn_key=(0,))
    q = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,))).dirichlet(np.full(10, alpha), size=k)
    counts = np.stack([np.bincount(labels[p], minlength=10) for p in parts])
    expected = q / q.sum(axis=0, keepdims=True) * np.bincount(labels, minlength=10)
    assert np.all(np.abs(counts - expected) <= 1.0 + 1e-9)


def test_same_seed_same_split_and_independent_of_global_rng() -> None:
    labels = FMNIST_LABELS[::7]
    np.random.seed(123)
    torch.manual_seed(123)
    first = dirichlet_class_split(labels, 6, 0.1, seed=5)
    state = np.random.get_state()[1].copy()
    np.random.seed(999)
    torch.manual_seed(999)
    second = dirichlet_class_split(labels, 6, 0.1, seed=5)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    np.random.seed(123)
    dirichlet_class_split(labels, 6, 0.1, seed=5)
    np.testing.assert_array_equal(np.random.get_state()[1], state)  # global state untouched
    other = dirichlet_class_split(labels, 6, 0.1, seed=6)
    assert any(len(a) != len(b) or not np.array_equal(a, b) for a, b in zip(first, other, strict=True))
    flwr_a = flwr_dirichlet_split(labels[:600], 4, 0.3, seed=2)
    flwr_b = flwr_dirichlet_split(labels[:600], 4, 0.3, seed=2)
    for a, b in zip(flwr_a, flwr_b, strict=True):
        np.testing.assert_array_equal(a, b)


def test_smaller_alpha_concentrates_label_distributions() -> None:
    labels = FMNIST_LABELS[::10]
    seeds = range(20)
    entropy = {
        alpha: np.mean([_mean_label_entropy(dirichlet_class_split(labels, 6, alpha, s), labels) for s in seeds])
        for alpha in (0.05, 0.2, 1.0, 10.0)
    }
    # measured (20 partition seeds, K=6): 0.89, 1.38, 1.99, 2.27 nats (uniform: log 10 = 2.30)
    assert entropy[0.05] < entropy[0.2] < entropy[1.0] < entropy[10.0]
    assert entropy[0.05] < 1.1 and entropy[10.0] > 2.1
    flwr_entropy = {
        alpha: np.mean([_mean_label_entropy(flwr_dirichlet_split(labels[::5], 6, alpha, s), labels[::5])
                        for s in range(5)])
        for alpha in (0.1, 10.0)
    }  # fmt: skip
    assert flwr_entropy[0.1] < flwr_entropy[10.0]


@pytest.mark.parametrize("labels", [DIGITS_LABELS, FMNIST_LABELS], ids=["digits", "fashion-mnist"])
def test_no_empty_client_at_alpha_005(labels: np.ndarray) -> None:
    for seed in range(30):
        validation, clients = split_indices(labels, num_partitions=6, alpha=0.05, partition_seed=seed)
        assert min(len(c) for c in clients) >= 1
        _assert_exact_cover([validation, *clients], len(labels))


def test_min_partition_size_resamples_then_raises() -> None:
    labels = DIGITS_LABELS[:300]
    parts = dirichlet_class_split(labels, 6, 0.05, seed=0, min_partition_size=20)
    assert min(len(p) for p in parts) >= 20
    # the first draw for this seed is smaller than 20 somewhere, so the guarantee came from a redraw
    first = dirichlet_class_split(labels, 6, 0.05, seed=0, max_attempts=1)
    assert min(len(p) for p in first) < 20
    with pytest.raises(ValueError, match="in 3 attempts"):
        dirichlet_class_split(labels, 6, 0.01, seed=0, min_partition_size=50, max_attempts=3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": float("nan")}, "alpha"),
        ({"num_partitions": 0}, "num_partitions"),
        ({"seed": -1}, "seed"),
        ({"num_partitions": 400}, "cannot give 400 partitions"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"num_partitions": 6, "alpha": 0.1, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        dirichlet_class_split(DIGITS_LABELS[:300], **args)


def test_validation_hold_out_is_never_assigned() -> None:
    labels = FMNIST_LABELS
    for scheme in ("fedfiot", "flwr-dirichlet"):
        validation, clients = split_indices(labels[:3000], 6, 0.2, partition_seed=4, validation_size=500, scheme=scheme)
        assert len(validation) == 500 and len(np.unique(validation)) == 500
        assigned = np.concatenate(clients)
        assert np.intersect1d(validation, assigned).size == 0
        _assert_exact_cover([validation, *clients], 3000)
    # the hold-out depends on the partition seed only, not on alpha, K or the scheme
    v1, _ = split_indices(labels, 6, 0.1, partition_seed=4)
    v2, _ = split_indices(labels, 3, 5.0, partition_seed=4)
    np.testing.assert_array_equal(v1, v2)
    v3, _ = split_indices(labels, 6, 0.1, partition_seed=5)
    assert not np.array_equal(v1, v3)
    with pytest.raises(ValueError, match="validation_size"):
        split_indices(labels[:100], validation_size=100)
    with pytest.raises(ValueError, match="unknown partition scheme"):
        split_indices(labels, scheme="iid")  # type: ignore[arg-type]


def test_federated_split_on_digits() -> None:
    bundle = load_dataset("digits")
    split = federated_split(bundle, num_partitions=6, alpha=0.1, partition_seed=0, validation_size=500)
    assert isinstance(split, FederatedSplit) and split.num_partitions == 6
    assert isinstance(split.validation, Subset) and split.validation.dataset is bundle.train_eval
    assert all(isinstance(c, Subset) and c.dataset is bundle.train for c in split.clients)
    assert split.test is bundle.test
    _assert_exact_cover([split.validation_indices, *split.client_indices], len(bundle.train))
    assert sum(split.client_sizes) + len(split.validation) == len(bundle.train)
    k = int(np.argmax(split.client_sizes))
    x, y = split.clients[k][3]
    assert y == bundle.train_targets[split.client_indices[k][3]] and x.shape == (1, 8, 8)
    torch.testing.assert_close(split.client_eval(k)[3][0], x)
    counts = split.label_counts()
    assert counts.shape == (6, 10) and counts.sum() == len(bundle.train) - 500
    assert federated_split(bundle, 6, 0.1, partition_seed=0, validation_size=500) is split  # cached
    clear_dataset_cache()
    reloaded = load_dataset("digits")
    assert reloaded is not bundle
    fresh = federated_split(reloaded, 6, 0.1, partition_seed=0, validation_size=500)
    assert fresh is not split
    for a, b in zip(split.client_indices, fresh.client_indices, strict=True):
        np.testing.assert_array_equal(a, b)
    flwr = federated_split(bundle, 6, 0.1, partition_seed=0, validation_size=500, scheme="flwr-dirichlet")
    np.testing.assert_array_equal(flwr.validation_indices, split.validation_indices)
    assert sum(flwr.client_sizes) == sum(split.client_sizes)


def test_partitioner_on_a_hugging_face_dataset() -> None:
    labels = np.random.default_rng(7).integers(0, 10, size=2000)
    hf = datasets.Dataset.from_dict({"x": np.arange(2000).tolist(), "label": labels.tolist()})
    partitioner = ClassProportionDirichletPartitioner(num_partitions=5, alpha=0.1, seed=8)
    assert partitioner.num_partitions == 5
    partitioner.dataset = hf
    parts = [partitioner.load_partition(i) for i in range(5)]
    expected = dirichlet_class_split(labels, 5, 0.1, seed=8)
    for part, idx in zip(parts, expected, strict=True):
        np.testing.assert_array_equal(np.asarray(part["x"]), idx)
        np.testing.assert_array_equal(np.asarray(part["label"]), labels[idx])
    assert sum(len(p) for p in parts) == 2000
    with pytest.raises(ValueError, match="partition_id"):
        partitioner.load_partition(5)
    other = ClassProportionDirichletPartitioner(num_partitions=5, alpha=0.1, seed=8, partition_by="y")
    other.dataset = hf
    with pytest.raises(ValueError, match="label column 'y'"):
        other.load_partition(0)
