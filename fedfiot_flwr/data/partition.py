"""Dirichlet label splits: the paper's per-client scheme and flwr-datasets' per-class scheme.

The paper (Appendix C.1, as in FedFisher's code) draws ONE class-preference vector per
client, ``q_k ~ Dir(alpha * 1_C)``, and gives client ``k`` the fraction
``q_k[c] / sum_k' q_k'[c]`` of the examples of class ``c``. Client sizes are unequal and
a client's size depends on how many other clients favour the same classes.

flwr-datasets' :class:`~flwr_datasets.partitioner.DirichletPartitioner` draws ONE vector
per class over clients, ``p_c ~ Dir(alpha * 1_K)``, and gives client ``k`` the fraction
``p_c[k]`` of class ``c``. Both are offered; they produce different size and label
distributions for the same ``alpha``.

No empty client
---------------
In the per-client scheme a client's favourite class ``c*`` has ``q_k[c*] >= 1/C`` while
``sum_k' q_k'[c*] <= K``, so the client receives at least about ``n_{c*} / (C K)``
examples of it (minus one for rounding): with 10 classes and 6 clients that is about
100 examples per client on Fashion-MNIST even at ``alpha = 0.05`` (measured: 2000 draws,
smallest client never below 10 examples; median smallest client 4720). Small data sets
(scikit-learn's digits: about 85 examples per class after the validation hold-out) and
flwr-datasets' per-class scheme, whose clients can be empty, have no such bound. So a draw
is accepted only when every client gets at least ``min_partition_size`` examples; otherwise
the whole draw (all ``q_k``) is repeated with the next derived seed
``SeedSequence(seed, spawn_key=(attempt,))`` for ``attempt = 0, 1, ...``, and a
``ValueError`` is raised after ``max_attempts`` draws. The result is therefore a draw from
the Dirichlet scheme conditioned on that minimum size, and is a pure function of
``(labels, num_partitions, alpha, seed, min_partition_size)``: it uses its own generators
and never touches numpy's or torch's global random state, so it does not depend on (or
disturb) the training seed.
"""

from __future__ import annotations

import numpy as np

from fedfiot_flwr.extras import require


def _check_args(labels: np.ndarray, num_partitions: int, alpha: float, seed: int, min_partition_size: int) -> None:
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if not isinstance(num_partitions, (int, np.integer)) or num_partitions < 1:
        raise ValueError(f"num_partitions must be a positive integer, got {num_partitions!r}")
    if not np.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a positive finite number, got {alpha!r}")
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer (splits must be reproducible), got {seed!r}")
    if min_partition_size < 0:
        raise ValueError(f"min_partition_size must be >= 0, got {min_partition_size}")
    if num_partitions * max(min_partition_size, 1) > len(labels):
        raise ValueError(
            f"cannot give {num_partitions} partitions at least {max(min_partition_size, 1)} "
            f"example(s) each from {len(labels)} examples"
        )


def _split_once(
    class_of: np.ndarray, num_classes: int, num_partitions: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray] | None:
    """One draw of the per-client scheme; None when a class has no client weight at all."""
    q = rng.dirichlet(np.full(num_classes, alpha), size=num_partitions)  # (K, C)
    chunks: list[list[np.ndarray]] = [[] for _ in range(num_partitions)]
    for c in range(num_classes):
        members = np.flatnonzero(class_of == c)
        # Shuffle so a client's share of a class is a random subset, not a contiguous
        # run of a possibly ordered data set (CINIC-10 lists CIFAR images first).
        rng.shuffle(members)
        column = q[:, c]
        total = column.sum()
        if not np.isfinite(total) or total <= 0.0:  # all q_k[c] underflowed to 0
            return None
        bounds = np.rint(np.cumsum(column / total) * len(members)).astype(np.int64)
        bounds[-1] = len(members)
        for k, part in enumerate(np.split(members, bounds[:-1])):
            chunks[k].append(part)
    return [np.sort(np.concatenate(parts)).astype(np.int64) for parts in chunks]


def dirichlet_class_split(
    labels: np.ndarray,
    num_partitions: int,
    alpha: float,
    seed: int,
    min_partition_size: int = 1,
    max_attempts: int = 100,
) -> list[np.ndarray]:
    """Split example indices among clients with the paper's per-client Dirichlet scheme.

    Each client ``k`` draws ``q_k ~ Dir(alpha * 1_C)`` over the ``C`` classes present in
    ``labels``; the (shuffled) examples of class ``c`` are cut into consecutive chunks of
    sizes ``round(cumsum_k q_k[c] / sum_k' q_k'[c] * n_c)``, chunk ``k`` going to client ``k``.
    Draws leaving a client with fewer than ``min_partition_size`` examples are redrawn with
    derived seeds (see the module docstring).

    Parameters
    ----------
    labels : np.ndarray
        ``(N,)`` class label of each example (any values; classes are ``np.unique(labels)``).
    num_partitions : int
        Number of clients ``K``.
    alpha : float
        Dirichlet concentration; smaller means more concentrated label distributions.
    seed : int
        Partition seed (non-negative); the split is a pure function of the arguments.
    min_partition_size : int
        Smallest acceptable client size (default 1: no empty client).
    max_attempts : int
        Draws to try before giving up.

    Returns
    -------
    list[np.ndarray]
        ``K`` sorted ``int64`` arrays of positions into ``labels``; together they hold
        every position exactly once.

    Raises
    ------
    ValueError
        Bad arguments, or no acceptable draw within ``max_attempts``.
    """
    labels = np.asarray(labels)
    _check_args(labels, num_partitions, alpha, seed, min_partition_size)
    classes, class_of = np.unique(labels, return_inverse=True)
    sizes: list[int] = []
    for attempt in range(max_attempts):
        rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(attempt,)))
        parts = _split_once(class_of, len(classes), int(num_partitions), float(alpha), rng)
        if parts is None:
            continue
        sizes = [len(p) for p in parts]
        if min(sizes) >= max(min_partition_size, 1):
            return parts
    raise ValueError(
        f"no Dirichlet draw (alpha={alpha}, seed={seed}) gave all {num_partitions} clients at "
        f"least {max(min_partition_size, 1)} examples in {max_attempts} attempts (last sizes: "
        f"{sizes}); raise alpha, lower min_partition_size or use fewer clients"
    )


def flwr_dirichlet_split(
    labels: np.ndarray,
    num_partitions: int,
    alpha: float,
    seed: int,
    min_partition_size: int = 1,
    self_balancing: bool = False,
) -> list[np.ndarray]:
    """Split indices with flwr-datasets' per-class ``DirichletPartitioner``.

    Each class ``c`` draws ``p_c ~ Dir(alpha * 1_K)`` over clients and client ``k`` gets
    the fraction ``p_c[k]`` of it (Yurochkin et al. 2019). The labels are wrapped in a
    ``datasets.Dataset`` and handed to the partitioner unchanged except for a seeded
    shuffle of the example order beforehand, so that a client's share of a class is a
    random subset rather than a contiguous run. flwr-datasets redraws up to 10 times
    when a client is below ``min_partition_size`` and then raises ``ValueError``.

    Returns
    -------
    list[np.ndarray]
        ``K`` sorted ``int64`` arrays of positions into ``labels``.

    Raises
    ------
    ImportError
        Without flwr-datasets or datasets (``pip install 'fedfiot-flwr[data]'``).
    """
    import warnings

    purpose = "flwr_dirichlet_split (flwr-datasets' DirichletPartitioner)"
    HFDataset = require("datasets", "datasets", "data", purpose).Dataset
    DirichletPartitioner = require("flwr_datasets.partitioner", "flwr-datasets", "data", purpose).DirichletPartitioner

    labels = np.asarray(labels)
    _check_args(labels, num_partitions, alpha, seed, min_partition_size)
    order = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(2**31,))).permutation(len(labels))
    hf = HFDataset.from_dict({"label": labels[order].tolist(), "position": order.tolist()})
    partitioner = DirichletPartitioner(
        num_partitions=int(num_partitions),
        partition_by="label",
        alpha=float(alpha),
        min_partition_size=max(min_partition_size, 1),
        self_balancing=self_balancing,
        shuffle=True,
        seed=int(seed),
    )
    partitioner.dataset = hf
    with warnings.catch_warnings():  # it warns on every redraw; the final outcome is what matters
        warnings.simplefilter("ignore", UserWarning)
        parts = [partitioner.load_partition(k)["position"] for k in range(int(num_partitions))]
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
