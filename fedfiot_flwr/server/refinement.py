"""The server refinement of FedFiOT's default configuration, on the server's own labelled data.

:class:`ServerRefinement` splits the server's labelled examples once into two disjoint folds of
(nearly) equal size:

- the **selection fold** scores everything that is *chosen*: FedFiOT's merge knobs (the
  ``validate_fn`` the strategy selects on) and the refinement's returned candidate;
- the **fitting fold** is the only data that *sets parameters*: the least-squares refits and the
  distillation fine-tuning of :func:`fedfiot_flwr.server_refine.refine_merged_model`.

So no parameter is fitted on the examples that choose it. Nothing is uploaded for this: the
server runs the clients' own uploaded models on its data.

>>> split_folds(6, seed=0)
(array([2, 3, 5]), array([0, 1, 4]))
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from fedfiot_flwr.merge import PermutationSpec
from fedfiot_flwr.server_refine import RefineOptions, RefineReport, refine_merged_model
from fedfiot_flwr.validation import ValidateFn, make_validate_fn

__all__ = ["ServerRefinement", "fold_subsets", "split_folds"]

Model = dict[str, np.ndarray]


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


class ServerRefinement:
    """Refine every round's merge on a fitting fold; select on a disjoint selection fold.

    Parameters
    ----------
    model : nn.Module
        A module of the federation's architecture (copied; used as scratch space).
    data : Dataset
        The server's labelled examples, ``(input, label)`` items.
    options : RefineOptions
        Candidates and knobs of the refinement.
    spec : PermutationSpec, optional
        The merge's permutation spec (to put every client in the merge's neuron order).
    batch_size : int
        Batch size of both folds' loaders.
    fold_seed : int
        Seed of :func:`split_folds`.
    device : torch.device or str, optional
        Where the selection fold's ``validate_fn`` evaluates (default: CUDA when available).

    Attributes
    ----------
    fit_indices, select_indices : np.ndarray
        Positions of the two folds in ``data``.
    fit_loader, select_loader : DataLoader
        Loaders of the two folds (in position order, not shuffled).
    """

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
        self.options = options
        self.spec = spec
        fit, select = fold_subsets(data, fold_seed)
        self.fit_indices, self.select_indices = np.asarray(fit.indices), np.asarray(select.indices)
        self.fit_loader = DataLoader(fit, batch_size=batch_size)
        self.select_loader = DataLoader(select, batch_size=batch_size)
        self._scratch = copy.deepcopy(model).cpu()
        self._validate_fn = make_validate_fn(copy.deepcopy(model), self.select_loader, device)

    @property
    def validate_fn(self) -> ValidateFn:
        """``model dict -> {"accuracy", "loss"}`` on the selection fold only."""
        return self._validate_fn

    def __call__(
        self,
        merged: Mapping[str, np.ndarray],
        clients: Sequence[Mapping[str, np.ndarray]],
        permutations: Mapping[str, Sequence[np.ndarray]] | None = None,
        num_examples: Sequence[int] | None = None,
    ) -> tuple[Model, RefineReport]:
        """Refine ``merged`` (:func:`~fedfiot_flwr.server_refine.refine_merged_model` on the two folds).

        Parameters
        ----------
        merged : dict
            The round's merged model.
        clients : sequence of dict
            The valid uploads' (dequantized) models, in the merge's client order.
        permutations : dict, optional
            The merge's permutations (``MergeResult.permutations``) when the aligned merge was
            kept; ``None`` takes the clients as they are.
        num_examples : sequence of int, optional
            Client sizes.

        Returns
        -------
        tuple
            The returned model (the best candidate on the selection fold; the merge itself is one)
            and the report of every candidate.
        """
        return refine_merged_model(
            merged, clients, self._scratch, self.fit_loader, self.select_loader, spec=self.spec,
            permutations=permutations, num_examples=num_examples, options=self.options,
        )
