"""Summaries of a partition: examples per client and class, as a table and a heat map."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedfiot_flwr.data.split import FederatedSplit
from fedfiot_flwr.extras import require

PartitionLike = FederatedSplit | Sequence[np.ndarray]


def partition_counts(partition: PartitionLike, num_classes: int | None = None) -> np.ndarray:
    """Count examples per client and class.

    Parameters
    ----------
    partition : FederatedSplit or sequence of np.ndarray
        A split, or one array of labels per client.
    num_classes : int, optional
        Number of classes; default: the bundle's, or ``max label + 1``.

    Returns
    -------
    np.ndarray
        ``(num_clients, num_classes)`` ``int64`` counts.
    """
    if isinstance(partition, FederatedSplit):
        counts = partition.label_counts()
        if num_classes is not None and num_classes != counts.shape[1]:
            raise ValueError(f"num_classes={num_classes} but the split's data set has {counts.shape[1]} classes")
        return counts
    labels = [np.asarray(lab, dtype=np.int64).ravel() for lab in partition]
    if not labels:
        raise ValueError("partition has no clients")
    for k, lab in enumerate(labels):
        if lab.size and lab.min() < 0:
            raise ValueError(f"client {k} has negative labels")
    largest = max((int(lab.max()) for lab in labels if lab.size), default=-1)
    if num_classes is None:
        num_classes = largest + 1
    elif largest >= num_classes:
        raise ValueError(f"label {largest} found but num_classes={num_classes}")
    return np.stack([np.bincount(lab, minlength=num_classes) for lab in labels]).astype(np.int64)


def partition_table(
    partition: PartitionLike, num_classes: int | None = None, class_names: Sequence[str] | None = None
) -> str:
    """Markdown table of examples per client (rows) and class (columns), with totals.

    Parameters
    ----------
    partition : FederatedSplit or sequence of np.ndarray
        A split, or one array of labels per client.
    num_classes : int, optional
        See :func:`partition_counts`.
    class_names : sequence of str, optional
        Column headers (default: the class indices).

    Returns
    -------
    str
        The table; the last column is each client's size and the last row each class's total.
    """
    counts = partition_counts(partition, num_classes)
    names = [str(c) for c in range(counts.shape[1])] if class_names is None else [str(n) for n in class_names]
    if len(names) != counts.shape[1]:
        raise ValueError(f"{len(names)} class names for {counts.shape[1]} classes")
    header = ["client", *names, "total"]
    rows = [[str(k), *(str(v) for v in row), str(int(row.sum()))] for k, row in enumerate(counts)]
    rows.append(["total", *(str(int(v)) for v in counts.sum(axis=0)), str(int(counts.sum()))])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def save_partition_heatmap(
    partition: PartitionLike,
    path: str | os.PathLike[str],
    num_classes: int | None = None,
    class_names: Sequence[str] | None = None,
    title: str | None = None,
) -> Path:
    """Save a heat map of examples per client and class (annotated with the counts).

    Uses matplotlib's object API with the Agg canvas, so it needs no display and leaves
    pyplot's global state alone. The format follows the file suffix (png, pdf, svg...).

    Parameters
    ----------
    partition : FederatedSplit or sequence of np.ndarray
        A split, or one array of labels per client.
    path : str or PathLike
        Output file; parent directories are created.
    num_classes, class_names
        See :func:`partition_table`.
    title : str, optional
        Figure title (default: derived from the split when there is one).

    Returns
    -------
    Path
        ``path``.

    Raises
    ------
    ImportError
        Without matplotlib (``pip install 'fedfiot-flwr[plots]'``).
    """
    purpose = "save_partition_heatmap"
    FigureCanvasAgg = require("matplotlib.backends.backend_agg", "matplotlib", "plots", purpose).FigureCanvasAgg
    Figure = require("matplotlib.figure", "matplotlib", "plots", purpose).Figure

    counts = partition_counts(partition, num_classes)
    num_clients, n_cls = counts.shape
    names = [str(c) for c in range(n_cls)] if class_names is None else [str(n) for n in class_names]
    if len(names) != n_cls:
        raise ValueError(f"{len(names)} class names for {n_cls} classes")
    if title is None and isinstance(partition, FederatedSplit):
        title = (
            f"{partition.bundle.name}: {num_clients} clients, alpha={partition.alpha:g}, "
            f"seed={partition.partition_seed}, {partition.scheme}"
        )

    fig = Figure(figsize=(1.0 + 0.6 * n_cls, 1.2 + 0.45 * num_clients), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(counts, cmap="viridis", aspect="auto")
    fig.colorbar(image, ax=ax, label="examples")
    ax.set_xticks(range(n_cls), names, rotation=45 if max(map(len, names)) > 2 else 0, ha="right")
    ax.set_yticks(range(num_clients), [f"{k} (n={int(s)})" for k, s in enumerate(counts.sum(axis=1))])
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if title:
        ax.set_title(title, fontsize=9)
    threshold = counts.max() / 2 if counts.size else 0
    for k in range(num_clients):
        for c in range(n_cls):
            ax.text(
                c, k, str(int(counts[k, c])), ha="center", va="center", fontsize=7,
                color="black" if counts[k, c] > threshold else "white",
            )  # fmt: skip
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    return out
