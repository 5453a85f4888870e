"""Input checks and FedAvg, the size-weighted average, shared by every method (no Flower).

:func:`size_weighted_average` is the package's one FedAvg: the strategies' FedAvg, the FedAvg
baseline and candidate of FedFiOT's selection, and the starting point of FedFisher and RegMean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedfiot_flwr.merge.dtypes import cast_average

__all__ = ["check_clients", "client_weights", "size_weighted_average"]


def check_clients(
    models: Sequence[Mapping[str, np.ndarray]],
    num_examples: Sequence[int],
    client_ids: Sequence[str] | None = None,
    *,
    checked: bool = False,
) -> list[str]:
    """Validate the client models and sizes of a merge; return the client ids.

    The checks guard direct callers of the baselines; uploads that came over the wire were
    validated when they were decoded (:func:`fedfiot_flwr.wire.decode_reply`).

    Parameters
    ----------
    models : sequence of mapping of str to np.ndarray
        One state dict per client (same keys and shapes, finite float tensors).
    num_examples : sequence of int
        Positive local data-set sizes, one per client.
    client_ids : sequence of str, optional
        Names used in error messages (default ``"0"``, ``"1"``, ...).
    checked : bool
        The uploads come from :func:`fedfiot_flwr.server.uploads.collect_uploads`: only the
        counts and the tensor names are checked, not the sizes, shapes or values again.

    Returns
    -------
    list[str]
        The client ids.

    Raises
    ------
    ValueError
        On no clients, mismatched lengths, differing keys or shapes, non-finite float
        tensors or a non-positive size; the message names the client and tensor.
    """
    if len(models) == 0:
        raise ValueError("merge: no client models")
    ids = [str(i) for i in range(len(models))] if client_ids is None else [str(c) for c in client_ids]
    if len(ids) != len(models) or len(num_examples) != len(models):
        raise ValueError(
            f"merge: {len(models)} models, {len(num_examples)} num_examples and {len(ids)} client ids"
        )
    ref = models[0]
    for cid, model, n in zip(ids, models, num_examples):
        if set(model) != set(ref):
            raise ValueError(
                f"client {cid}: tensors differ from client {ids[0]}'s: missing {sorted(set(ref) - set(model))}, "
                f"extra {sorted(set(model) - set(ref))}"
            )
        if checked:
            continue
        if isinstance(n, bool) or int(n) != n or int(n) <= 0:
            raise ValueError(f"client {cid}: num_examples must be a positive integer, got {n!r}")
        for name, value in model.items():
            arr = np.asarray(value)
            if arr.shape != np.shape(ref[name]):
                raise ValueError(f"client {cid}, tensor {name!r}: shape {arr.shape} differs from {np.shape(ref[name])}")
            if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
                raise ValueError(f"client {cid}, tensor {name!r}: NaN or infinite values")
    return ids


def check_curvature_replies(
    ids: Sequence[str],
    models: Sequence[Mapping[str, np.ndarray]],
    replies: Sequence[Mapping[str, Any]],
    method: str,
    check_layer: Callable[[str, Any, Mapping[str, np.ndarray]], None] | None,
) -> list[str]:
    """The layers of the clients' curvature replies (K-FAC factors, RegMean Grams), checked once for every method.

    Every client must send the same layers, with the same weight and bias names, naming tensors of
    its model; ``check_layer(where, entry, model)`` then checks one entry's matrices (``None``:
    the uploads were decoded and checked already, so only counts and names are).

    Parameters
    ----------
    ids, models, replies : sequence
        Per client: its id, its model and its ``{layer: entry}`` (entries have ``weight`` and ``bias``).
    method : str
        ``"fedfisher_kfac"`` or ``"regmean"``: names the method in messages.
    check_layer : callable or None
        ``(where, entry, model) -> None``, raising ``ValueError`` prefixed with ``where``
        (``"client 2, layer 'fc'"``).

    Raises
    ------
    ValueError
        Naming the client and the layer.
    """
    what = {"fedfisher_kfac": ("factor", "K-FAC"), "regmean": ("Gram", "RegMean")}[method]
    if len(replies) != len(models):
        raise ValueError(f"{method}: {len(replies)} {what[0]} sets for {len(models)} models")
    layers = list(replies[0])
    if not layers and method == "fedfisher_kfac":
        raise ValueError(f"client {ids[0]}: no K-FAC factors")
    for cid, entries, model in zip(ids, replies, models):
        if list(entries) != layers:
            raise ValueError(f"client {cid}: {what[1]} layers {list(entries)} differ from client {ids[0]}'s {layers}")
        for layer in layers:
            entry, ref = entries[layer], replies[0][layer]
            if (entry.weight, entry.bias) != (ref.weight, ref.bias):
                raise ValueError(f"client {cid}, layer {layer!r}: weight/bias names differ from client {ids[0]}'s")
            for name in (entry.weight, entry.bias):
                if name is not None and name not in model:
                    raise ValueError(f"client {cid}, layer {layer!r}: tensor {name!r} is not in the model")
            if check_layer is not None:
                check_layer(f"client {cid}, layer {layer!r}", entry, model)
    return layers


def check_square(where: str, matrix: Any, size: int) -> None:
    """``matrix`` is a finite ``(size, size)`` array.

    Raises
    ------
    ValueError
        ``{where} has shape (4, 4), expected (5, 5)`` or ``{where} has NaN or infinite values``.
    """
    m = np.asarray(matrix)
    if m.shape != (size, size):
        raise ValueError(f"{where} has shape {m.shape}, expected {(size, size)}")
    if not np.all(np.isfinite(m)):
        raise ValueError(f"{where} has NaN or infinite values")


def client_weights(num_examples: Sequence[int], scaling: str) -> np.ndarray:
    """Per-client weights ``c_k`` summing to one.

    Parameters
    ----------
    num_examples : sequence of int
        Local data-set sizes.
    scaling : str
        ``"size"`` (``n_k / n``, FedFisher's code) or ``"none"`` (``1 / K``).

    Returns
    -------
    np.ndarray
        float64 weights.

    Raises
    ------
    ValueError
        For an unknown ``scaling``.
    """
    n = np.asarray(num_examples, dtype=np.float64)
    if scaling == "size":
        return n / n.sum()
    if scaling == "none":
        return np.full(len(n), 1.0 / len(n))
    raise ValueError(f"unknown scaling {scaling!r}; choose 'size' or 'none'")


def size_weighted_average(
    models: Sequence[Mapping[str, np.ndarray]], num_examples: Sequence[int]
) -> dict[str, np.ndarray]:
    """FedAvg: ``sum_k n_k W_k / sum_k n_k`` per tensor (float64 accumulation).

    Float and integer tensors come back in the first model's dtype by the merge engine's rule
    (:func:`fedfiot_flwr.merge.dtypes.cast_average`): integer tensors (``num_batches_tracked``)
    take the weighted mean rounded to the nearest integer. Other tensors (booleans) take the
    first client's value.

    Parameters
    ----------
    models : sequence of mapping of str to np.ndarray
        Client state dicts (already checked by :func:`check_clients`).
    num_examples : sequence of int
        Local data-set sizes.

    Returns
    -------
    dict[str, np.ndarray]
        The averaged state dict, in the first model's key order.
    """
    w = client_weights(num_examples, "size")
    out: dict[str, np.ndarray] = {}
    for name, first in models[0].items():
        first = np.asarray(first)
        if not (np.issubdtype(first.dtype, np.floating) or np.issubdtype(first.dtype, np.integer)):
            out[name] = first.copy()
            continue
        # first + sum_k w_k (x_k - first): exactly ``first`` when every client sends it.
        base = first.astype(np.float64)
        acc = base + sum(wk * (np.asarray(m[name], dtype=np.float64) - base) for wk, m in zip(w, models))
        out[name] = np.asarray(cast_average(np.asarray(acc), first.dtype))
    return out
