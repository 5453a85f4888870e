"""Server-side validation for the common torch case: a held-out loader scores candidate merges.

FedFiOT chooses between merges on validation data when the server has some. The strategies take
a framework-neutral ``validate_fn``: ``model dict (name -> np.ndarray) -> metrics``.
:func:`make_validate_fn` builds one from a torch model and a DataLoader::

    held_out = Subset(trainset, range(500))    # examples no client trains on and no evaluation reports on
    validate_fn = make_validate_fn(Net(), DataLoader(held_out, batch_size=256))
    strategy = FedFiOT(model=Net(), validate_fn=validate_fn)

The function it returns holds the loader's examples once as tensors on the device and scores them
in fixed chunks of ``chunk_size`` examples, hardest first: on its first call it orders the fold by
that model's errors and per-example loss, once and for all (``hard_first``). Besides ``validate_fn(model)`` it offers
``validate_fn.validate_bounded(model, metric, threshold, maximize)``, which the sweep of
:func:`fedfiot_flwr.server.selection.sweep_candidates` uses to stop scoring a candidate as soon as it
provably cannot beat ``threshold`` (an exact race: the chosen model and its metrics are those of a
full scoring).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedfiot_flwr.batches import resolve_device, split_batch

__all__ = ["DEFAULT_CHUNK_SIZE", "SelectionScorer", "ValidateFn", "make_validate_fn"]

ValidateFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, float]]
"""``model dict -> metrics``; the metric the strategy selects on is ``"accuracy"`` by default."""

DEFAULT_CHUNK_SIZE = 50
"""Examples per forward pass of :class:`SelectionScorer`: the granularity at which a race can stop."""

Chunk = tuple[torch.Tensor, torch.Tensor]


def _read_fold(loader: Iterable[Any], device: torch.device) -> list[Chunk]:
    """The loader's ``(inputs, labels)`` batches, on ``device``."""
    batches = [split_batch(b) for b in loader]
    if not batches:
        raise ValueError("make_validate_fn: the loader yielded no examples")
    return [(x.to(device), y.to(device)) for x, y in batches]


def _rechunk(batches: list[Chunk], chunk_size: int | None, order: torch.Tensor | None = None) -> list[Chunk]:
    """``batches`` as one fold taken in ``order`` (default: as given), cut into chunks of ``chunk_size``.

    ``chunk_size=None`` or examples of different shapes (they cannot share a tensor): the batches as given.
    """
    if chunk_size is None or len({tuple(x.shape[1:]) for x, _ in batches}) != 1:
        return batches
    xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
    if order is not None:
        xs, ys = xs[order.to(xs.device)], ys[order.to(ys.device)]
    return list(zip(torch.split(xs, chunk_size), torch.split(ys, chunk_size)))


def _cannot_win(metric: str, maximize: bool, threshold: float, correct: int, loss_sum: float, seen: int,
                total: int) -> bool:
    """Whether a model whose first ``seen`` of ``total`` examples gave ``correct`` hits and ``loss_sum``
    provably ends at or behind ``threshold`` (a tie does not win, see :mod:`fedfiot_flwr.choose`).

    Accuracy can at most gain every remaining example; a mean cross-entropy (never negative) can at
    least stay at its partial sum. No other metric is bounded.

    >>> _cannot_win("accuracy", True, 0.5, correct=1, loss_sum=9.0, seen=6, total=10)
    True
    >>> _cannot_win("accuracy", True, 0.5, correct=2, loss_sum=9.0, seen=6, total=10)
    False
    >>> _cannot_win("loss", False, 0.8, correct=0, loss_sum=8.0, seen=6, total=10)
    True
    """
    if math.isnan(threshold):
        return False
    if metric == "accuracy" and maximize:
        return (correct + (total - seen)) / total <= threshold
    if metric == "loss" and not maximize:
        return loss_sum / total >= threshold
    return False


class SelectionScorer:
    """A ``validate_fn`` on a held-out fold kept on the device, scored in fixed chunks.

    Parameters
    ----------
    model : nn.Module
        A classifier of the federation's architecture (its weights are overwritten on every call).
    loader : Iterable
        Held-out ``(inputs, labels)`` batches (or dicts, see :func:`fedfiot_flwr.task.split_batch`);
        read once, on the first call.
    device : torch.device or str, optional
        Where to evaluate (default: CUDA when available).
    chunk_size : int, optional
        Examples per forward pass (``None``: the loader's own batches, in its order).
    hard_first : bool
        On the first call, order the fold by that model: its errors first, each group by
        per-example cross-entropy, highest first; and keep that order: a race then meets a poor
        candidate's errors early.

    Calling it gives ``{"accuracy", "loss"}`` (mean cross-entropy) on the whole fold; the same
    chunks, in the same order, are summed by :meth:`validate_bounded`, so a model it scores to the
    end gets bit-identical metrics. The order is fixed once, before the first metrics are returned.
    """

    def __init__(self, model: nn.Module, loader: Iterable[Any], device: torch.device | str | None = None,
                 chunk_size: int | None = DEFAULT_CHUNK_SIZE, hard_first: bool = True) -> None:
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive integer or None, got {chunk_size!r}")
        self.model = model
        self.loader = loader
        self.device = resolve_device(device)
        self.chunk_size = chunk_size
        self.hard_first = hard_first
        self._chunks: list[Chunk] | None = None
        self._total = 0

    def chunks(self, order_by_loaded_model: bool = False) -> list[Chunk]:
        """The fold's ``(inputs, labels)`` chunks on the device, fixed on first use.

        On first use the loader is read; with ``hard_first`` and ``order_by_loaded_model`` (the
        first model scored is loaded), the fold is ordered by that model's errors first, each group
        by per-example loss, highest first.
        """
        if self._chunks is None:
            batches = _read_fold(self.loader, self.device)
            order = None
            if self.hard_first and order_by_loaded_model and self.chunk_size is not None:
                with self._evaluating():
                    logits = [(self.model(x), y) for x, y in batches]
                    losses = torch.cat([F.cross_entropy(z, y, reduction="none") for z, y in logits]).cpu()
                    hits = torch.cat([z.argmax(1) == y for z, y in logits]).cpu()
                order = torch.argsort(-losses, stable=True)
                order = order[torch.argsort(hits[order].to(torch.int8), stable=True)]  # its errors first
            self._chunks = _rechunk(batches, self.chunk_size, order)
            self._total = sum(int(y.shape[0]) for _, y in self._chunks)
        return self._chunks

    @contextlib.contextmanager
    def _evaluating(self) -> Iterator[None]:
        """The loaded model in eval mode under ``torch.inference_mode``; its mode restored after."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                yield
        finally:
            self.model.train(was_training)

    def _load(self, weights: Mapping[str, np.ndarray]) -> None:
        state = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in weights.items()}
        self.model.load_state_dict(state)
        self.model.to(self.device)

    def _scan(self, weights: Mapping[str, np.ndarray],
              stop: Callable[[int, float, int, int], bool] | None) -> dict[str, float] | None:
        """Score chunk after chunk; ``None`` as soon as ``stop(correct, loss_sum, seen, total)`` holds."""
        self._load(weights)
        chunks = self.chunks(order_by_loaded_model=True)
        loss_sum, correct, seen = 0.0, 0, 0
        with self._evaluating():
            for i, (x, y) in enumerate(chunks):
                logits = self.model(x)
                loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(1) == y).sum())
                seen += int(y.shape[0])
                if stop is not None and i + 1 < len(chunks) and stop(correct, loss_sum, seen, self._total):
                    return None
        return {"accuracy": float(correct / seen), "loss": float(loss_sum / seen)}

    def __call__(self, weights: Mapping[str, np.ndarray]) -> dict[str, float]:
        """``{"accuracy", "loss"}`` of ``weights`` on the whole fold."""
        out = self._scan(weights, None)
        assert out is not None  # no stopping rule: scored to the end
        return out

    def validate_bounded(self, weights: Mapping[str, np.ndarray], metric: str, threshold: float,
                         maximize: bool) -> dict[str, float] | None:
        """The metrics of ``weights``, or ``None`` once its ``metric`` provably cannot beat ``threshold``.

        Parameters
        ----------
        weights : dict[str, np.ndarray]
            The model to score.
        metric : str
            The metric the caller selects on; only ``"accuracy"`` (maximised) and ``"loss"``
            (minimised, never negative) are bounded, any other is scored to the end.
        threshold : float
            The best fully scored rival's value; a NaN threshold scores to the end.
        maximize : bool
            Whether higher is better.

        Returns
        -------
        dict[str, float] or None
            The full metrics (exactly those of ``self(weights)``) unless the model was cut:
            its final ``metric`` would have been at or behind ``threshold``, which never wins a
            tie-to-the-earlier choice against an earlier candidate.
        """
        def stop(correct: int, loss_sum: float, seen: int, total: int) -> bool:
            # A negative or NaN partial loss voids the loss bound: score to the end.
            if metric == "loss" and not loss_sum >= 0.0:
                return False
            return _cannot_win(metric, maximize, float(threshold), correct, loss_sum, seen, total)

        return self._scan(weights, stop)


def make_validate_fn(
    model: nn.Module, loader: Iterable[Any], device: torch.device | str | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE, hard_first: bool = True,
) -> SelectionScorer:
    """A ``validate_fn`` that loads a model dict into ``model`` and scores it on ``loader``.

    Parameters
    ----------
    model : nn.Module
        A classifier of the federation's architecture (its weights are overwritten on every call).
    loader : Iterable
        Held-out ``(inputs, labels)`` batches (or dicts, see :func:`fedfiot_flwr.task.split_batch`).
        Read once, on the first call, and kept on ``device`` (a fixed fold: a loader that shuffles
        or augments is read as it yields the first time).
    device : torch.device or str, optional
        Where to evaluate (default: CUDA when available).
    chunk_size : int, optional
        Examples per forward pass, the granularity at which the sweep's race can stop scoring a
        candidate that cannot be chosen (``None``: the loader's own batches, in its order).
    hard_first : bool
        Order the fold once, on the first call, by that model's errors first and per-example loss,
        highest first (with ``chunk_size``): the race then cuts a poor candidate after fewer examples. Every
        model is scored on the same fixed chunks afterwards; ``False``: the loader's order.

    Returns
    -------
    SelectionScorer
        ``model dict -> {"accuracy": ..., "loss": ...}`` (mean cross-entropy), with
        :meth:`SelectionScorer.validate_bounded` for the sweep.
    """
    return SelectionScorer(model, loader, device, chunk_size, hard_first)
