"""The few-round benchmark's data reduction and its FedAvg yardstick."""

from __future__ import annotations

import numpy as np

from benchmarks import few_round
from fedfiot_flwr.app_config import AppConfig


def test_keep_fraction_keeps_each_clients_label_skew() -> None:
    split = AppConfig(dataset="digits", num_partitions=4, alpha=0.1, validation_size=100).split()
    kept = few_round.keep_fraction(split, 0.25, seed=0)
    assert kept.validation_indices is split.validation_indices and kept.test is split.test
    for full, part, subset in zip(split.client_indices, kept.client_indices, kept.clients):
        assert set(part) <= set(full) and len(part) == max(1, round(0.25 * len(full)))
        assert len(subset) == len(part)
        labels_full = set(split.bundle.train_targets[full])
        assert set(split.bundle.train_targets[part]) <= labels_full
    assert few_round.keep_fraction(split, 1.0, seed=0) is split


def _fedavg(accuracies: list[float], seed: int = 0) -> list[dict]:
    return [{"init": "shared", "seed": seed, "method": "fedavg", "round": r, "test_accuracy": a}
            for r, a in enumerate(accuracies, start=1)]


def test_rounds_to_reach_is_the_first_fedavg_round_at_or_above() -> None:
    recs = _fedavg([0.4, 0.6, 0.55, 0.7]) + _fedavg([0.9, 0.9, 0.9, 0.9], seed=1)
    assert few_round.rounds_to_reach(recs, "shared", 0, 0.6) == 2
    assert few_round.rounds_to_reach(recs, "shared", 0, 0.65) == 4
    assert few_round.rounds_to_reach(recs, "shared", 0, 0.71) is None
    assert few_round.rounds_to_reach(recs, "shared", 1, 0.6) == 1
    assert np.isclose(few_round.mean_curve(recs, "shared", "fedavg", 2)[0][0], 65.0)
