"""Client side of FedFiOT: turn a locally trained torch model into a reply.

In your own ClientApp, train with your own loop, then make the reply with one call::

    metrics = {"train_loss": train_loss}                      # your names, passed through
    content = fisher_reply(model, trainloader, metrics)       # diagonal Fisher + 16-bit packing
    return Message(content=content, reply_to=msg)

:func:`fisher_reply` computes the model's empirical diagonal Fisher over ``trainloader`` and
packs weights and Fisher with :func:`fedfiot_flwr.wire.pack_reply`. :func:`curvature_reply`
does the same for the baselines' uploads (K-FAC factors, input Grams). :func:`train_and_pack`
is this project's own ClientApp step: it trains with this package's trainer
(:func:`fedfiot_flwr.task.train`: SGD with momentum and a cosine schedule), then packs;
:func:`train_round` is the same step returning, next to the reply, the float32 weights and
Fisher it packed and the time of training and of the Fisher pass (a :class:`ClientRound`).

This module imports the wire format and the client-side maths only, never server code.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from flwr.app import RecordDict
from torch import nn

from fedfiot_flwr.batches import resolve_device
from fedfiot_flwr.fisher import FISHER_KINDS, diagonal_fisher
from fedfiot_flwr.options import CURVATURE_CONFIG_KEY, CURVATURES, FISHER_CONFIG_KEY, GRAM_CURVATURES
from fedfiot_flwr.task import split_batch, train
from fedfiot_flwr.wire import (  # re-exported: the client half of the wire format
    ARRAYS_RECORD,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
    STYPE_WEIGHT,
    STYPE_WEIGHT_FISHER,
    ClientUpload,
    fedavg_reply,
    pack_gram_reply,
    pack_kfac_reply,
    pack_reply,
    unpack_reply,
)
from fedfiot_flwr.wire.q16 import to_numpy

__all__ = [
    "ARRAYS_RECORD",
    "METRICS_RECORD",
    "NUM_EXAMPLES_KEY",
    "STYPE_WEIGHT",
    "STYPE_WEIGHT_FISHER",
    "UPLOAD_KINDS",
    "ClientRound",
    "ClientUpload",
    "curvature_reply",
    "fedavg_reply",
    "fisher_reply",
    "pack_reply",
    "train_and_pack",
    "train_round",
    "unpack_reply",
]

UPLOAD_KINDS = ("fedfiot", "fedfisher-diag", "fedfisher-kfac", "regmean")
"""What :func:`curvature_reply` can send: one per server strategy."""


def _device(device: torch.device | str | None) -> torch.device:
    return resolve_device(device)


def count_examples(loader: Iterable[Any]) -> int:
    """``len(loader.dataset)`` when the loader has a sized dataset, else the examples counted batch by batch."""
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and hasattr(dataset, "__len__"):
        return len(dataset)
    return sum(int(split_batch(b)[1].shape[0]) for b in loader)


@dataclass(frozen=True)
class ClientRound:
    """A FedFiOT reply with what it was made from.

    Attributes
    ----------
    reply : RecordDict
        The packed 16-bit reply, as the client sends it.
    weights : dict[str, np.ndarray]
        The model's ``state_dict()`` as packed, before quantization (float32 weights, integer
        buffers as they are), copied to the CPU.
    fisher : dict[str, np.ndarray]
        The diagonal Fisher as packed, before quantization (empty for a Gram reply).
    train_seconds, fisher_seconds : float
        Wall time of local training (0 when the caller trained) and of the Fisher (or Gram) pass.
    """

    reply: RecordDict
    weights: dict[str, np.ndarray]
    fisher: dict[str, np.ndarray]
    train_seconds: float
    fisher_seconds: float


def _fisher_round(
    model: nn.Module,
    loader: Iterable[Any],
    metrics: Mapping[str, float] | None,
    num_examples: int | None,
    fisher_kind: str,
    device: torch.device | str | None,
    progress: bool | None,
    wanted: bool = True,
    curvature: str = "diagonal",
) -> ClientRound:
    """Diagonal Fisher of ``model`` over ``loader`` (skipped when not ``wanted``), then 16-bit packing; with
    ``curvature="gram"`` the input Grams in its place, 8-bit low rank within FedAvg's bytes (see :func:`fisher_reply`)."""
    if fisher_kind not in FISHER_KINDS:
        raise ValueError(f"fisher_kind must be one of {FISHER_KINDS}, got {fisher_kind!r}")
    extra = dict(metrics or {})
    if NUM_EXAMPLES_KEY in extra:  # Flower's usual metrics dict already carries the size
        sent = extra.pop(NUM_EXAMPLES_KEY)
        num_examples = int(sent) if num_examples is None else num_examples
    if wanted and curvature in GRAM_CURVATURES:
        return _gram_round(model, loader, extra, num_examples, device, outputs=curvature == "kfac")
    start = time.perf_counter()
    if wanted:
        fisher = diagonal_fisher(model, loader, fisher_kind, device=_device(device), progress=progress)
    else:
        fisher = {}
    seconds = time.perf_counter() - start
    n = count_examples(loader) if num_examples is None else int(num_examples)
    weights = {k: to_numpy(v).copy() for k, v in model.state_dict().items()}
    fisher_np = {k: to_numpy(v) for k, v in fisher.items()}
    return ClientRound(pack_reply(weights, fisher_np, n, extra), weights, fisher_np, 0.0, seconds)


def _gram_round(model: nn.Module, loader: Iterable[Any], metrics: Mapping[str, float], num_examples: int | None,
                device: torch.device | str | None, outputs: bool = False) -> ClientRound:
    """The input Grams of ``model``'s Linear and Conv2d layers over ``loader`` (one forward pass; with ``outputs``
    also a backward pass for each layer's output factor), packed."""
    from fedfiot_flwr.curvature import input_grams

    start = time.perf_counter()
    grams = input_grams(model, loader, device=_device(device), convolutions=True, sample=True, outputs=outputs)
    seconds = time.perf_counter() - start
    n = count_examples(loader) if num_examples is None else int(num_examples)
    weights = {k: to_numpy(v).copy() for k, v in model.state_dict().items()}
    return ClientRound(pack_gram_reply(weights, grams, n, rank="fedavg", metrics=metrics), weights, {}, 0.0, seconds)


def _curvature_wanted(config: Mapping[str, Any] | None) -> str:
    """The curvature a round's train config asks for (the diagonal Fisher unless it names another)."""
    curvature = str((config or {}).get(CURVATURE_CONFIG_KEY, "diagonal"))
    if curvature not in CURVATURES:
        raise ValueError(f"the train config's {CURVATURE_CONFIG_KEY!r} is {curvature!r}; this client knows {CURVATURES}")
    return curvature


def fisher_reply(
    model: nn.Module,
    loader: Iterable[Any],
    metrics: Mapping[str, float] | None = None,
    *,
    num_examples: int | None = None,
    fisher_kind: str = "empirical",
    device: torch.device | str | None = None,
    config: Mapping[str, Any] | None = None,
) -> RecordDict:
    """The FedFiOT reply of a model you trained yourself: diagonal Fisher, then 16-bit packing.

    Parameters
    ----------
    model : nn.Module
        The locally trained model (left unchanged).
    loader : Iterable
        The client's training examples, ``(inputs, labels)`` batches or dicts with the keys
        :func:`fedfiot_flwr.task.split_batch` knows (``img``/``image``/``x`` and
        ``label``/``y``). Pass them without augmentation when you can.
    metrics : mapping of str to float, optional
        Your training metrics; sent under your own names, unchanged. A ``"num-examples"`` entry
        (Flower's usual key) is used as ``num_examples``.
    num_examples : int, optional
        Local data-set size (the merge weights clients by it); default: ``metrics["num-examples"]``,
        else ``len(loader.dataset)``.
    fisher_kind : {"empirical", "true", "sampled"}
        ``"empirical"`` (observed labels, FedFiOT's choice), ``"true"`` (expectation over the
        model's predictions, C backward vectors per example) or ``"sampled"`` (one label per
        example drawn from the model's predictions: the true Fisher's estimate at the empirical
        one's cost). All three are the same bytes on the wire.
    device : torch.device or str, optional
        Where the Fisher pass runs (default: CUDA when available).
    config : mapping, optional
        The round's train config (``msg.content["config"]``). When the server says it will not use
        the Fisher this round (:data:`~fedfiot_flwr.options.FISHER_CONFIG_KEY` false, e.g. after
        the default's Fisher rounds) the pass is skipped and only the 16-bit weights are sent. When it
        names the Gram curvature (:data:`~fedfiot_flwr.options.CURVATURE_CONFIG_KEY` ``"gram"``), the
        reply carries the input Grams of the Linear and Conv2d layers in place of the Fisher (one
        forward pass, each batch's Gram estimated from a random subset of its rows that costs at
        most the layer's forward pass; 8-bit low rank, within FedAvg's float32 bytes). ``"kfac"``
        adds each layer's diagonal output factor (one backward pass; ``d_out`` floats per layer, the
        Grams' rank chosen so that the reply still fits FedAvg's bytes).

    Returns
    -------
    RecordDict
        The reply content (see :mod:`fedfiot_flwr.wire`).
    """
    return _fisher_round(model, loader, metrics, num_examples, fisher_kind, device, False, _fisher_wanted(config),
                         _curvature_wanted(config)).reply


def _fisher_wanted(config: Mapping[str, Any] | None) -> bool:
    """Whether a round's train config asks for the Fisher (yes unless it says no)."""
    return bool((config or {}).get(FISHER_CONFIG_KEY, True))


def curvature_reply(
    strategy: str,
    model: nn.Module,
    loader: Iterable[Any],
    *,
    num_examples: int | None = None,
    metrics: Mapping[str, float] | None = None,
    fisher_kind: str | None = None,
    rank: int | str | None = "fedavg",
    device: torch.device | str | None = None,
) -> RecordDict:
    """The reply a client of ``strategy`` sends for its trained ``model``.

    Parameters
    ----------
    strategy : str
        ``"fedfiot"`` or ``"fedfisher-diag"`` (16-bit weights and diagonal Fisher),
        ``"fedfisher-kfac"`` (16-bit weights and 8-bit low-rank K-FAC factors) or
        ``"regmean"`` (16-bit weights and 8-bit low-rank input Grams of the Linear layers).
    model : nn.Module
        The locally trained model.
    loader : Iterable
        The client's examples once, without augmentation (curvature pass).
    num_examples : int, optional
        Local data-set size; defaults to ``len(loader.dataset)``.
    metrics : mapping of str to float, optional
        Training metrics to send along.
    fisher_kind : str, optional
        ``"true"`` or ``"empirical"``; default ``"empirical"`` for FedFiOT and ``"true"`` for
        FedFisher. Ignored by RegMean.
    rank : int, None or "fedavg"
        Shared rank cap of the curvature factors (``"fedavg"``: stay within FedAvg's upload).
    device : torch.device or str, optional
        Where the curvature is computed (default: CUDA when available).

    Returns
    -------
    RecordDict

    Raises
    ------
    ValueError
        For an unknown ``strategy`` or ``fisher_kind``.
    ImportError
        For ``"fedfisher-kfac"`` or ``"regmean"`` without ``curvlinops-for-pytorch``
        (``pip install 'fedfiot-flwr[baselines]'``).
    """
    from fedfiot_flwr.curvature import input_grams, kfac_factors

    if strategy not in UPLOAD_KINDS:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {UPLOAD_KINDS}")
    kind = fisher_kind or ("empirical" if strategy == "fedfiot" else "true")
    if kind not in FISHER_KINDS:
        raise ValueError(f"unknown Fisher kind {fisher_kind!r}; choose one of {FISHER_KINDS}")
    dev = _device(device)
    if num_examples is None:
        if getattr(loader, "dataset", None) is None:
            raise ValueError("curvature_reply: pass num_examples for a loader without a dataset")
    n = count_examples(loader) if num_examples is None else int(num_examples)
    if strategy in ("fedfiot", "fedfisher-diag"):
        return fisher_reply(model, loader, metrics, num_examples=n, fisher_kind=kind, device=dev)
    state = model.state_dict()
    if strategy == "fedfisher-kfac":
        factors = kfac_factors(model, loader, kind, device=dev)
        return pack_kfac_reply(state, factors, n, fisher_kind=kind, rank=rank, metrics=metrics)
    return pack_gram_reply(state, input_grams(model, loader, device=dev), n, rank=rank, metrics=metrics)


def train_and_pack(model: nn.Module, trainloader: Iterable[Any], epochs: int, **options: Any) -> RecordDict:
    """This project's client round: train with OUR trainer, then :func:`fisher_reply`.

    Uses :func:`fedfiot_flwr.task.train` (SGD with momentum, cosine schedule; metrics
    ``train-loss``/``train-accuracy``). In your own app keep your own training loop and call
    :func:`fisher_reply` instead. ``options`` are :func:`train_round`'s keyword parameters.

    Returns
    -------
    RecordDict
        The reply content: :attr:`ClientRound.reply` of :func:`train_round`.
    """
    return train_round(model, trainloader, epochs, **options).reply


def train_round(
    model: nn.Module,
    trainloader: Iterable[Any],
    epochs: int,
    *,
    fisher_kind: str = "empirical",
    device: torch.device | str | None = None,
    fisherloader: Iterable[Any] | None = None,
    num_examples: int | None = None,
    progress: bool | None = None,
    config: Mapping[str, Any] | None = None,
    **train_kwargs: Any,
) -> ClientRound:
    """This project's client round (:func:`train_and_pack`), with the unquantized weights and Fisher
    it packs and the time of each step.

    Parameters
    ----------
    model : nn.Module
        The broadcast model, trained in place.
    trainloader : Iterable
        Training batches (may augment).
    epochs : int
        Local epochs.
    fisher_kind : str
        ``"empirical"`` (FedFiOT) or ``"true"`` (FedFisher).
    device : torch.device or str, optional
        Defaults to CUDA when available.
    fisherloader : Iterable, optional
        The same local examples without augmentation for the Fisher pass; defaults to
        ``trainloader``.
    num_examples : int, optional
        Local data set size; defaults to ``len(fisherloader.dataset)`` (or a count).
    progress : bool, optional
        tqdm bars; ``None`` shows them only on a terminal, and only with tqdm installed.
    config : mapping, optional
        The round's train config; the Fisher pass is skipped when it says the server will not use it
        (see :func:`fisher_reply`).
    **train_kwargs
        Passed to :func:`fedfiot_flwr.task.train` (``lr``, ``momentum``, ``weight_decay``,
        ``augment``).

    Returns
    -------
    ClientRound
        The reply, the float32 weights and Fisher it packs, training and Fisher seconds.
    """
    start = time.perf_counter()
    metrics = train(model, trainloader, epochs, device=device, progress=progress, **train_kwargs)
    train_seconds = time.perf_counter() - start
    loader = trainloader if fisherloader is None else fisherloader
    packed = _fisher_round(model, loader, metrics, num_examples, fisher_kind, device, progress, _fisher_wanted(config),
                           _curvature_wanted(config))
    return replace(packed, train_seconds=train_seconds)
