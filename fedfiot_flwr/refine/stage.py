"""The server refinement as a post-merge stage any aggregator's model can go through.

:class:`RefinementStage` splits the server's labelled examples once into two disjoint folds of
(nearly) equal size:

- the **selection fold** scores everything that is *chosen*: FedFiOT's merge knobs (the
  ``validate_fn`` the strategy selects on) and the refinement's returned candidate;
- the **fitting fold** is the only data that *sets parameters*: the least-squares refits and the
  distillation fine-tuning of :func:`fedfiot_flwr.refine.refine_merged_model`.

So no parameter is fitted on the examples that choose it. Nothing is uploaded for this: the
server runs the clients' own uploaded models on its data.

>>> split_folds(6, seed=0)
(array([2, 3, 5]), array([0, 1, 4]))
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import replace
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from fedfiot_flwr.batches import resolve_device
from fedfiot_flwr.merge import PermutationSpec
from fedfiot_flwr.refine.candidates import ClientModels, Folds, RefineReport, refine_merged_model
from fedfiot_flwr.refine.options import RefineOptions
from fedfiot_flwr.refine.base import StageResult
from fedfiot_flwr.validation import ValidateFn, make_validate_fn
from fedfiot_flwr.options import Model

__all__ = ["RefinementStage", "describe_candidate", "fold_subsets", "split_folds"]

logger = logging.getLogger("flwr")


def split_folds(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint ``(fitting, selection)`` positions into ``n`` examples: a seeded half/half split.

    Parameters
    ----------
    n : int
        Number of labelled server examples (at least 2).
    seed : int
        Seed of the split (the same seed gives the same folds).

    Returns
    -------
    tuple of np.ndarray
        Sorted positions of the fitting fold (``n // 2`` of them) and of the selection fold.
    """
    if n < 2:
        raise ValueError(f"the server refinement needs at least 2 labelled examples, got {n}")
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[: n // 2]), np.sort(order[n // 2:])


def fold_subsets(data: Dataset[Any], seed: int = 0) -> tuple[Subset[Any], Subset[Any]]:
    r"""``data``'s fitting and selection folds (:func:`split_folds`) as ``Subset``\ s."""
    fit, select = split_folds(len(data), seed)  # type: ignore[arg-type]
    return Subset(data, fit.tolist()), Subset(data, select.tolist())


def describe_candidate(name: str, fit_examples: int, client_ids: Sequence[str] = ()) -> str:
    """A refinement candidate's name in plain words.

    >>> describe_candidate("ft20(ls-r0.1)", 250)
    'the aggregated model refitted by least squares (ridge 0.1), then fine-tuned for 20 epochs on 250 server examples'
    >>> describe_candidate("client-1", 250, ["7", "9"])
    "client 9's own model"
    >>> describe_candidate("ft20a3(merged)", 250)
    "the aggregated model fine-tuned for 20 epochs on 250 server examples with the clients' Fisher anchor (strength 3)"
    """
    tuned = re.fullmatch(r"ft(\d+)(?:a([^(]+))?\((.+)\)", name)
    if tuned:
        start = describe_candidate(tuned.group(3), fit_examples, client_ids)
        start = start.removesuffix(f" on {fit_examples} server examples")
        joiner = ", then" if start != "the aggregated model" else ""
        anchor = f" with the clients' Fisher anchor (strength {tuned.group(2)})" if tuned.group(2) else ""
        return f"{start}{joiner} fine-tuned for {tuned.group(1)} epochs on {fit_examples} server examples{anchor}"
    if name == "merged":
        return "the aggregated model"
    client = re.fullmatch(r"client-(\d+)", name)
    if client:
        k = int(client.group(1))
        return f"client {client_ids[k] if k < len(client_ids) else k}'s own model"
    steps = []
    for part in name.split("+"):
        if part == "repair":
            steps.append("REPAIR-rescaled")
        elif part.startswith("ls-r"):
            steps.append(f"refitted by least squares (ridge {part[4:]})")
        else:
            steps.append(part)
    return "the aggregated model " + ", then ".join(steps) + f" on {fit_examples} server examples"


class RefinementStage:
    """Refine every round's aggregated model on a fitting fold; choose on a disjoint selection fold.

    A post-merge stage (:class:`fedfiot_flwr.refine.base.PostMergeStage`): the same for
    every aggregator. An aligning aggregator passes its permutations, so that the clients'
    layer outputs are averaged neuron by neuron in the merge's order.

    Parameters
    ----------
    model : nn.Module
        A module of the federation's architecture (copied; used as scratch space).
    data : Dataset
        The server's labelled examples, ``(input, label)`` items.
    options : RefineOptions
        Candidates and knobs of the refinement.
    spec : PermutationSpec, optional
        The aggregator's permutation spec (needed to apply its permutations to the clients).
    batch_size : int
        Batch size of both folds' loaders.
    fold_seed : int
        Seed of :func:`split_folds`.
    device : torch.device or str, optional
        Where the refinement runs and the selection fold's ``validate_fn`` evaluates (default:
        CUDA when available, else the CPU).

    Attributes
    ----------
    fit_indices, select_indices : np.ndarray
        Positions of the two folds in ``data``.
    fit_loader, select_loader : DataLoader
        Loaders of the two folds (in position order, not shuffled).
    """

    label = "server refinement"
    progress: Callable[[str], None] | None = staticmethod(lambda line: logger.info("%s", line.strip()))
    """Where each candidate's progress line goes (``None``: nowhere); Flower's log by default."""

    def __init__(
        self,
        model: nn.Module,
        data: Dataset[Any],
        options: RefineOptions = RefineOptions(),
        *,
        spec: PermutationSpec | None = None,
        batch_size: int = 500,
        fold_seed: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(options, RefineOptions):
            raise TypeError(f"refine must be a RefineOptions, got {type(options).__name__}")
        self.options = options
        self.spec = spec
        fit, select = fold_subsets(data, fold_seed)
        self.fit_indices, self.select_indices = np.asarray(fit.indices), np.asarray(select.indices)
        self.fit_loader = DataLoader(fit, batch_size=batch_size)
        self.select_loader = DataLoader(select, batch_size=batch_size)
        self._scratch = copy.deepcopy(model).to(resolve_device(device))
        self._validate_fn = make_validate_fn(copy.deepcopy(model), self.select_loader, device)

    @property
    def validate_fn(self) -> ValidateFn:
        """``model dict -> {"accuracy", "loss"}`` on the selection fold only."""
        return self._validate_fn

    def describe(self) -> str:
        """What the stage trains on what, in words."""
        return (f"{len(self.fit_indices)} fitting examples train {self.options.describe()}; "
                f"{len(self.select_indices)} selection examples choose the returned model (the aggregated "
                "model and each client's are candidates too)")

    def refine(
        self,
        merged: Mapping[str, np.ndarray],
        clients: Sequence[Mapping[str, np.ndarray]],
        permutations: Mapping[str, Sequence[np.ndarray]] | None = None,
        num_examples: Sequence[int] | None = None,
        fishers: Sequence[Mapping[str, np.ndarray]] | None = None,
    ) -> tuple[Model, RefineReport]:
        """:func:`~fedfiot_flwr.refine.refine_merged_model` on the two folds."""
        return self._refine(merged, clients, permutations, num_examples, fishers, self.options)

    def _refine(self, merged: Mapping[str, np.ndarray], clients: Sequence[Mapping[str, np.ndarray]],
                permutations: Mapping[str, Sequence[np.ndarray]] | None, num_examples: Sequence[int] | None,
                fishers: Sequence[Mapping[str, np.ndarray]] | None, options: RefineOptions) -> tuple[Model, RefineReport]:
        return refine_merged_model(
            merged, ClientModels(clients, self.spec, permutations, num_examples, fishers), self._scratch,
            Folds(self.fit_loader, self.select_loader), options, log=self.progress,
        )

    def __call__(
        self,
        model: Mapping[str, np.ndarray],
        clients: Sequence[Mapping[str, np.ndarray]],
        permutations: Mapping[str, Sequence[np.ndarray]] | None,
        num_examples: Sequence[int],
        client_ids: Sequence[str] = (),
        *,
        fishers: Sequence[Mapping[str, np.ndarray]] = (),
    ) -> StageResult:
        """Refine ``model``; the result names the returned candidate in plain words.

        Parameters
        ----------
        model : dict
            The round's aggregated model.
        clients : sequence of dict
            The valid uploads' (dequantized) models, in the aggregator's client order.
        permutations : dict, optional
            The aggregator's permutations of the clients (``None``: taken as they are).
        num_examples : sequence of int
            Client sizes.
        client_ids : sequence of str
            Client names (for the plain-words description).
        fishers : sequence of dict
            The clients' uploaded diagonal Fishers (for ``options.fisher_anchor``). When the
            anchor is asked for and a client has none, the round runs without the anchored
            candidates and says so in the log.

        Returns
        -------
        StageResult
            ``metrics["selection-fold-accuracy"]`` is the returned model's accuracy on the
            examples that chose it: optimistic, not a test score.
        """
        options = self.options
        if options.fisher_anchor and (len(fishers) != len(clients) or not all(fishers)):
            logger.warning("server refinement: the Fisher anchor needs every client's Fisher (%d of %d "
                           "uploads carry one); this round's fine-tuning runs without it",
                           sum(bool(f) for f in fishers), len(clients))
            options = replace(options, fisher_anchor=())
        out, rep = self._refine(model, clients, permutations, num_examples, fishers or None, options)
        returned = describe_candidate(rep.chosen, rep.fit_examples, [str(c) for c in client_ids])
        metrics = {
            "refine-seconds": float(rep.seconds),
            "selection-fold-accuracy": float(rep.selection_accuracy[rep.chosen]),
            "refine-kept-input": rep.chosen == "merged",
            "refine-returned-client": rep.chosen.startswith("client-"),
        }
        record = {"chosen": rep.chosen, "returned": returned, "selection_accuracy": rep.selection_accuracy,
                  "fit_examples": rep.fit_examples, "select_examples": rep.select_examples,
                  "refit_examples": rep.refit_examples, "seconds": rep.seconds}
        return StageResult(out, returned, metrics, record, rep.seconds)
