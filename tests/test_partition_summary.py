"""Partition summaries: counts table (markdown) and heat-map image."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from fedfiot_flwr.data import federated_split, load_dataset, partition_counts, partition_table, save_partition_heatmap

LABELS = [np.array([0, 0, 2, 2, 2]), np.array([1]), np.array([0, 1, 2, 3])]


def _parse(table: str) -> tuple[list[str], list[list[str]]]:
    lines = table.splitlines()
    assert lines[1].startswith("|---:")
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    return rows[0], rows[2:]


def test_counts_from_label_arrays() -> None:
    counts = partition_counts(LABELS)
    np.testing.assert_array_equal(counts, [[2, 0, 3, 0], [0, 1, 0, 0], [1, 1, 1, 1]])
    assert partition_counts(LABELS, num_classes=6).shape == (3, 6)
    with pytest.raises(ValueError, match="label 3 found but num_classes=3"):
        partition_counts(LABELS, num_classes=3)
    with pytest.raises(ValueError, match="client 1 has negative labels"):
        partition_counts([np.array([0]), np.array([-1])])


def test_markdown_table_with_totals() -> None:
    header, rows = _parse(partition_table(LABELS, num_classes=4, class_names=["a", "b", "c", "d"]))
    assert header == ["client", "a", "b", "c", "d", "total"]
    assert rows[0] == ["0", "2", "0", "3", "0", "5"]
    assert rows[1] == ["1", "0", "1", "0", "0", "1"]
    assert rows[-1] == ["total", "3", "2", "4", "1", "10"]
    with pytest.raises(ValueError, match="2 class names for 4 classes"):
        partition_table(LABELS, class_names=["a", "b"])


def test_table_and_heatmap_of_a_split(tmp_path: Path) -> None:
    bundle = load_dataset("digits")
    split = federated_split(bundle, num_partitions=6, alpha=0.1, partition_seed=0, validation_size=500)
    header, rows = _parse(partition_table(split))
    assert len(header) == 12 and len(rows) == 7
    assert [int(r[-1]) for r in rows[:-1]] == split.client_sizes
    assert int(rows[-1][-1]) == len(bundle.train) - 500
    per_client = [bundle.train_targets[idx] for idx in split.client_indices]
    np.testing.assert_array_equal(partition_counts(split), partition_counts(per_client, num_classes=10))

    path = save_partition_heatmap(split, tmp_path / "figs" / "digits.png")
    assert path == tmp_path / "figs" / "digits.png"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300
    assert image[..., :3].std() > 0.05  # not a blank canvas
    svg = save_partition_heatmap(LABELS, tmp_path / "labels.svg", class_names=list("abcd"), title="toy")
    text = svg.read_text()
    assert text.startswith("<?xml") and "toy" in text
