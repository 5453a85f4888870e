"""The refinement's one entry point, :func:`refine_merged_model`: candidates fitted on one fold, chosen on another.

From the aggregated model it builds candidates (least-squares refits at several ridges, REPAIR,
both, distillation fine-tuning from the best of them, and optionally each client on its own),
fits each on the fitting rows only, and returns the one with the best accuracy on the selection
rows. By default the least-squares refits only choose where fine-tuning starts
(``RefineOptions.offer_starts``). The two folds must hold disjoint examples: whatever fits
parameters never selects. With ``RefineOptions.refit`` the chosen recipe is fitted once more on
both folds, after the choice.

Clients are put in the aggregated model's neuron order first (``permutations``, e.g.
:attr:`fedfiot_flwr.merge.MergeResult.permutations`); an aggregator that does not align passes
none and the clients are taken as they are.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfiot_flwr.batches import split_batch
from fedfiot_flwr.choose import BestSoFar, best_index
from fedfiot_flwr.merge.spec import PermutationSpec, apply_permutations
from fedfiot_flwr.refine.finetune import distill_finetune, laplace_anchor
from fedfiot_flwr.refine.linalg import LayerMoments
from fedfiot_flwr.refine.ops import (
    channels_last,
    client_neuron_stats,
    client_outputs,
    client_targets,
    collect_fit,
    example_weights,
    fit_batches,
    layer_modules,
    least_squares_refine,
    load_state,
    model_device,
    model_state,
    recalibrate_batchnorm,
    repair,
)
from fedfiot_flwr.refine.options import RefineOptions
from fedfiot_flwr.options import Model

__all__ = ["ClientModels", "Folds", "RefineReport", "align_clients", "refine_merged_model"]



@dataclass
class RefineReport:
    """What :func:`refine_merged_model` tried and chose.

    Attributes
    ----------
    chosen : str
        Name of the returned candidate (``"merged"``, ``"repair"``, ``"ls-r0.01"``,
        ``"repair+ls-r0.01"``, ``"client-3"``...).
    selection_accuracy : dict[str, float]
        Accuracy of every candidate on the selection fold.
    fit_errors : dict[str, list[float]]
        Per least-squares candidate, each layer's reconstruction MSE on the fitting rows
        before and after its refit (``[before, after]`` per layer, flattened).
    fit_examples, select_examples : int
        Examples in each fold (fitting rows before augmentation).
    refit_examples : int
        Examples the returned candidate was refitted on (both folds; 0 when not refitted).
    seconds : float
        Wall time of the whole refinement (all candidates).
    candidates : dict[str, dict]
        Every candidate model, with ``options.keep_candidates`` (else empty).
    """

    chosen: str
    selection_accuracy: dict[str, float] = field(default_factory=dict)
    fit_errors: dict[str, list[float]] = field(default_factory=dict)
    fit_examples: int = 0
    select_examples: int = 0
    refit_examples: int = 0
    seconds: float = 0.0
    candidates: dict[str, Model] = field(default_factory=dict)


def _accuracy(model: nn.Module, loader: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """``model``'s accuracy on ``(x, y)`` batches, channels-last under ``torch.inference_mode``."""
    if not loader:
        raise ValueError("the refinement's selection loader yields no examples")
    with channels_last(model, loader[0][0]) as layout, torch.inference_mode():
        return _count_accuracy(model, [(layout(x), y) for x, y in loader])


def _reference_accuracy(model: nn.Module, loader: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """:func:`_accuracy` under ``torch.no_grad`` (the reference implementation)."""
    with torch.no_grad():
        return _count_accuracy(model, loader)


def _count_accuracy(model: nn.Module, loader: Iterable[Any]) -> float:
    correct = seen = 0
    model.eval()
    for b in loader:
        x, y = split_batch(b)
        correct += int((model(x.float()).argmax(1) == y).sum())
        seen += int(y.shape[0])
    if seen == 0:
        raise ValueError("the refinement's selection loader yields no examples")
    return correct / seen


# ----------------------------------------------------------------------------- entry point


def align_clients(models: Sequence[Mapping[str, np.ndarray]], spec: PermutationSpec | None,
                  permutations: Mapping[str, Sequence[np.ndarray]] | None) -> list[Model]:
    """Each client's tensors (weights, or a Fisher of the same layout) in the merge's neuron order.

    ``permutations[p][k]`` is client ``k``'s permutation of hidden layer ``p``; without
    permutations (or a spec) the clients are returned as they are.

    Raises
    ------
    ValueError
        When a permutation does not have one entry per client.
    """
    if not permutations or spec is None:
        return [{n: np.asarray(v) for n, v in m.items()} for m in models]
    for p, per_client in permutations.items():
        if len(per_client) != len(models):
            raise ValueError(f"permutation {p!r} has {len(per_client)} entries for {len(models)} clients")
    return [apply_permutations(dict(m), spec, {p: np.asarray(pc[k]) for p, pc in permutations.items()})
            for k, m in enumerate(models)]


@dataclass(frozen=True)
class _Recipe:
    """How a refined candidate is built from the merge: REPAIR, then least squares, then fine-tuning."""

    repair: bool = False
    ridge: float | None = None
    epochs: int = 0
    anchor: float | None = None


@dataclass
class _FitData:
    """The rows a candidate is fitted on (one fold, or both folds for the refit)."""

    batches: list[torch.Tensor]
    targets: list[dict[str, torch.Tensor]]
    ft_batches: list[torch.Tensor]
    ft_labels: torch.Tensor
    teacher: list[torch.Tensor]
    stats: dict[str, tuple[np.ndarray, np.ndarray]] | None = None
    first_moments: dict[str, LayerMoments] | None = None


def to_model_device(model: nn.Module, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` moved to where ``model`` runs (rows are built on the CPU, then moved once)."""
    dev = model_device(model)
    return [t.to(dev) for t in tensors]


def _fit_data(rows: Sequence[Any], model: nn.Module, aligned: Sequence[Model], layers: Sequence[tuple[str, nn.Module]],
              options: RefineOptions, num_examples: Sequence[int] | None, reference: bool = False) -> _FitData:
    """Everything fitted candidates need from ``rows``: layer targets and the fine-tuning teacher.

    One forward pass per client and row gives the label weights, the layer targets and the
    teacher (:func:`~fedfiot_flwr.refine.ops.client_outputs`); ``reference`` runs the
    separate passes of :func:`_reference_fit_data` instead.
    """
    if reference:
        return _reference_fit_data(rows, model, aligned, layers, options, num_examples)
    tune = options.finetune_epochs > 0
    batches, labels, n_base = fit_batches(rows, options.augment_copies if tune else 0, options.seed)
    batches, labels = to_model_device(model, batches), to_model_device(model, labels)
    outs = client_outputs(model, aligned, batches, labels, layers, options.target_weights, num_examples, n_base, tune)
    return _FitData(batches[:n_base], outs.targets, batches, torch.cat(labels), outs.teacher, first_moments={})


def _reference_fit_data(rows: Sequence[Any], model: nn.Module, aligned: Sequence[Model],
                        layers: Sequence[tuple[str, nn.Module]], options: RefineOptions,
                        num_examples: Sequence[int] | None) -> _FitData:
    """:func:`_fit_data` by separate passes: label weights, then targets, on the examples and again on all rows."""
    batches, labels = (to_model_device(model, t) for t in collect_fit(rows, 0, options.seed))
    row_weights = example_weights(model, aligned, batches, labels, options.target_weights, num_examples)
    targets = client_targets(model, aligned, row_weights, layers, batches)
    ft_batches, ft_labels = batches, labels
    teacher: list[torch.Tensor] = []
    if options.finetune_epochs > 0:
        # Fine-tuning rows: the fitting rows plus their augmented copies; teacher = the
        # label-weighted (or plain) mean of the aligned clients' logits on the same rows.
        ft_batches, ft_labels = (to_model_device(model, t) for t in collect_fit(rows, options.augment_copies, options.seed))
        ft_weights = example_weights(model, aligned, ft_batches, ft_labels, options.target_weights, num_examples)
        teacher = [t[layers[-1][0]] for t in client_targets(model, aligned, ft_weights, layers[-1:], ft_batches)]
    return _FitData(batches, targets, ft_batches, torch.cat(ft_labels), teacher)


@dataclass(frozen=True)
class ClientModels:
    """The clients a merged model was built from, and how to put them in its neuron order.

    Attributes
    ----------
    models : sequence of dict
        The clients' uploaded models (dequantized), in the merge's client order.
    spec : PermutationSpec, optional
        The merge's permutation spec.
    permutations : dict, optional
        ``MergeResult.permutations`` (client ``k``'s permutation of each hidden layer); without
        them (or a spec) the clients are taken as they are (identity alignment).
    num_examples : sequence of int, optional
        Client sizes (for ``RefineOptions.target_weights == "size"`` and the Fisher anchor).
    fishers : sequence of dict, optional
        The clients' diagonal Fishers (dequantized, in ``models``' order and layout), put in the
        merge's order with their clients, for ``RefineOptions.fisher_anchor``; without them the
        anchored fine-tuning runs are skipped.
    """

    models: Sequence[Mapping[str, np.ndarray]]
    spec: PermutationSpec | None = None
    permutations: Mapping[str, Sequence[np.ndarray]] | None = None
    num_examples: Sequence[int] | None = None
    fishers: Sequence[Mapping[str, np.ndarray]] | None = None


@dataclass(frozen=True)
class Folds:
    """Two disjoint folds of the server's data, each an iterable of ``(x, y)`` batches.

    Attributes
    ----------
    fit : iterable
        Fits every candidate's parameters.
    select : iterable
        Only scores the candidates (and, with ``RefineOptions.refit``, joins ``fit`` for the
        chosen recipe's final fit, after the choice is made).
    """

    fit: Iterable[Any]
    select: Iterable[Any]


@dataclass
class _Inputs:
    """The checked, aligned inputs of one refinement."""

    aligned: list[Model]
    aligned_fishers: list[Model]
    anchor_strengths: tuple[float, ...]
    weights: list[float]


def _check_inputs(merged: Mapping[str, np.ndarray], clients: ClientModels, options: RefineOptions,
                  log: Callable[[str], None] | None) -> _Inputs:
    """Check the clients against ``merged`` and ``options``; put them (and their Fishers) in the merge's order."""
    models, num_examples, fishers = clients.models, clients.num_examples, clients.fishers
    if not models:
        raise ValueError("refine_merged_model needs at least one client model")
    for k, c in enumerate(models):
        missing = [n for n in merged if n not in c]
        if missing:
            raise ValueError(f"client {k}: upload lacks tensors {missing[:5]}")
    aligned = align_clients(models, clients.spec, clients.permutations)
    if options.target_weights == "size" and (num_examples is None or len(num_examples) != len(models)):
        raise ValueError("target_weights='size' needs num_examples for every client")
    aligned_fishers: list[Model] = []
    anchor_strengths = options.fisher_anchor if fishers is not None and options.finetune_epochs > 0 else ()
    if options.fisher_anchor and fishers is None and log:
        log("    refine: no client Fishers given, so no Fisher-anchored fine-tuning")
    if anchor_strengths:
        assert fishers is not None
        if len(fishers) != len(models) or num_examples is None or len(num_examples) != len(models):
            raise ValueError("RefineOptions.fisher_anchor needs every client's Fisher and size: "
                             f"{len(fishers)} Fishers, {0 if num_examples is None else len(num_examples)} sizes "
                             f"for {len(models)} clients")
        empty = [k for k, f in enumerate(fishers) if not f]
        if empty:
            raise ValueError(f"client {empty[0]}: no Fisher for the Fisher anchor")
        aligned_fishers = align_clients(fishers, clients.spec, clients.permutations)
    weights = [1.0 / len(models)] * len(models)  # REPAIR's statistics: plain client average
    if options.target_weights == "size":
        assert num_examples is not None
        weights = [float(n) / float(sum(num_examples)) for n in num_examples]
    return _Inputs(aligned, aligned_fishers, anchor_strengths, weights)


class _Refinement:
    """One refinement's state: builds candidates from the merge and keeps the best on the selection fold."""

    def __init__(self, merged: Mapping[str, np.ndarray], clients: ClientModels, model: nn.Module,
                 options: RefineOptions, log: Callable[[str], None] | None) -> None:
        self.merged, self.clients, self.model, self.options, self.log = merged, clients, model, options, log
        self.inputs = _check_inputs(merged, clients, options, log)
        self.report = RefineReport(chosen="merged")
        self.recipes: dict[str, _Recipe] = {"repair": _Recipe(repair=True)} if options.repair else {}
        for r in options.ridges:
            self.recipes[f"ls-r{r:g}"] = _Recipe(ridge=r)
            if options.repair:
                self.recipes[f"repair+ls-r{r:g}"] = _Recipe(repair=True, ridge=r)
        # Offered in order: the merge, the starts, the fine-tuning checkpoints, the clients; ties
        # keep the earlier (simpler) candidate (fedfiot_flwr.choose).
        self.best: BestSoFar[tuple[str, Model]] = BestSoFar()
        self.select_batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fit_data(self, rows: Sequence[Any]) -> _FitData:
        """The fitting data of ``rows`` (the layers are found on the first call)."""
        first = not hasattr(self, "layers")
        if first:
            self.layers = layer_modules(self.model, split_batch(rows[0])[0].to(model_device(self.model)).float())
        data = _fit_data(rows, self.model, self.inputs.aligned, self.layers, self.options, self.clients.num_examples,
                         self.options.reference)
        if first:
            # REPAIR's client statistics need their own forward passes: a second copy of the module,
            # so that the candidate being built is not overwritten; computed once per data, on first use.
            self.model_scratch = copy.deepcopy(self.model)
            modules = dict(self.model_scratch.named_modules())
            self.layers_scratch = [(n, modules[n]) for n, _ in self.layers]
        return data

    def build(self, recipe: _Recipe, on: _FitData, label: str | None = None) -> Iterable[tuple[int, Model]]:
        """``(epochs, state)`` of the recipe on ``on``: the state before fine-tuning, then its checkpoints."""
        model, layers, reference = self.model, self.layers, self.options.reference
        load_state(model, self.merged)
        recalibrate_batchnorm(model, on.batches)
        if recipe.repair:
            if on.stats is None:
                on.stats = client_neuron_stats(self.model_scratch, self.inputs.aligned, self.inputs.weights,
                                               self.layers_scratch, on.batches)
            repair(model, layers, on.batches, on.stats)
            recalibrate_batchnorm(model, on.batches)
        if recipe.ridge is not None:
            errors = least_squares_refine(model, layers, on.batches, on.targets, recipe.ridge, on.first_moments,
                                          reference=reference)
            if label is not None:
                self.report.fit_errors[label] = errors
            recalibrate_batchnorm(model, on.batches)
        yield 0, model_state(model)
        if recipe.epochs > 0:
            anchor = None if recipe.anchor is None else laplace_anchor(
                self.inputs.aligned, self.inputs.aligned_fishers, self.clients.num_examples,  # type: ignore[arg-type]
                sum(len(b) for b in on.batches), recipe.anchor)
            yield from distill_finetune(model, on.ft_batches, on.ft_labels, on.teacher, self.options,
                                        stop_after=recipe.epochs, reference=reference, anchor=anchor)

    def offer(self, name: str, state: Model) -> None:
        """Let ``state``, already scored, compete for the returned model."""
        self.best.offer(self.report.selection_accuracy[name], (name, state))

    def consider(self, name: str, state: Model, offered: bool = True) -> None:
        """Score ``state`` on the selection fold; offer it unless it is a start only."""
        score = _reference_accuracy if self.options.reference else _accuracy
        acc = score(load_state(self.model, state), self.select_batches)
        self.report.selection_accuracy[name] = acc
        if self.options.keep_candidates:
            self.report.candidates[name] = state
        if self.log:
            self.log(f"    refine candidate {name:18s} selection acc {100 * acc:5.1f}%"
                     + ("" if offered else " (start only)"))
        if offered:
            self.offer(name, state)

    def finetune(self, data: _FitData, offer_starts: bool) -> None:
        """Fine-tune from the best start (plain, then with each Fisher anchor); its checkpoints are candidates."""
        # One start: the merge or the best least-squares/REPAIR candidate, whichever scores
        # better on the selection fold.
        options, recipes = self.options, self.recipes
        starts = ["merged", *recipes]
        start_name = starts[best_index([self.report.selection_accuracy[n] for n in starts])]
        start_recipe = replace(recipes.get(start_name, _Recipe()), epochs=options.finetune_epochs)
        if self.log:
            self.log(f"    refine: fine-tuning {start_name} for {options.finetune_epochs} epochs on "
                     f"{sum(len(b) for b in data.ft_batches)} rows")
        tuned = False
        for epoch, state in self.build(start_recipe, data):
            if epoch == 0:
                start_state = state  # the start itself, before any step
            else:
                name = f"ft{epoch}({start_name})"
                recipes[name] = replace(start_recipe, epochs=epoch)
                self.consider(name, state)
                tuned = True
        if not tuned and not offer_starts and start_name != "merged":
            # The fine-tuning diverged at once: the best start (the merge is already offered) competes after all.
            self.offer(start_name, start_state)
        for strength in self.inputs.anchor_strengths:
            # The same run from the same start with the clients' Laplace penalty in the loss.
            anchored = replace(start_recipe, anchor=strength)
            for epoch, state in self.build(anchored, data):
                if epoch > 0:
                    name = f"ft{epoch}a{strength:g}({start_name})"
                    recipes[name] = replace(anchored, epochs=epoch)
                    self.consider(name, state)

    def run(self, folds: Folds) -> tuple[Model, RefineReport]:
        """Every candidate, scored; the best one (refitted on both folds with ``options.refit``)."""
        options, report = self.options, self.report
        fit_rows = list(folds.fit)
        if not fit_rows:
            raise ValueError("the refinement's fitting loader yields no examples")
        data = self.fit_data(fit_rows)
        select_rows = list(folds.select)
        dev = model_device(self.model)
        self.select_batches = [(x.to(dev).float(), y.to(dev)) for x, y in map(split_batch, select_rows)]
        report.fit_examples = sum(len(b) for b in data.batches)
        report.select_examples = sum(len(y) for _, y in self.select_batches)

        self.consider("merged", dict(self.merged))
        offer_starts = options.offer_starts or options.finetune_epochs <= 0
        for name, recipe in list(self.recipes.items()):
            self.consider(name, next(iter(self.build(recipe, data, name)))[1], offered=offer_starts)
        if options.finetune_epochs > 0:
            self.finetune(data, offer_starts)
        if options.client_candidates:
            for k, c in enumerate(self.clients.models):
                self.consider(f"client-{k}", {n: np.asarray(v) for n, v in c.items()})
        report.chosen, chosen_model = self.best.item
        if options.refit and report.chosen in self.recipes:
            # The choice is made; refit its recipe on both folds (as a grid search refits its winner).
            both = self.fit_data(fit_rows + select_rows)
            recipe = self.recipes[report.chosen]
            for epoch, state in self.build(recipe, both):
                if epoch == recipe.epochs:
                    chosen_model = state
                    report.refit_examples = sum(len(b) for b in both.batches)
        return chosen_model, report


def refine_merged_model(
    merged: Mapping[str, np.ndarray],
    clients: ClientModels | Sequence[Mapping[str, np.ndarray]],
    model: nn.Module,
    folds: Folds,
    options: RefineOptions = RefineOptions(),
    log: Callable[[str], None] | None = None,
) -> tuple[Model, RefineReport]:
    """Refine a merged model on server data and return the best candidate on the selection fold.

    Parameters
    ----------
    merged : dict[str, np.ndarray]
        The merged model (state-dict keys of ``model``).
    clients : ClientModels or sequence of dict
        The clients the merge was built from, with the merge's permutations of them, their
        sizes and Fishers (:class:`ClientModels`); a plain sequence of models is taken as
        ``ClientModels(models)``, the clients as they are.
    model : nn.Module
        A module of the architecture (its weights are overwritten; used as scratch). The
        refinement runs on its device (a CUDA module: every forward pass, the least-squares
        products and the fine-tuning on the GPU); the rows are built on the CPU, then moved.
    folds : Folds
        Disjoint folds of the server's data: ``folds.fit`` fits every candidate's parameters,
        ``folds.select`` only scores the candidates.
    options : RefineOptions
        Candidates and data knobs (``options.reference`` runs the slower reference passes).
    log : callable, optional
        Progress lines.

    Returns
    -------
    tuple
        ``(model dict, RefineReport)``; the merge itself is a candidate, so a refinement that
        does not help on the selection fold is not applied.

    Raises
    ------
    ValueError
        On missing tensors, permutations that do not match the clients, empty folds or
        non-finite activations (the message names the client or layer).
    """
    start = time.perf_counter()
    if not isinstance(clients, ClientModels):
        clients = ClientModels(clients)
    chosen_model, report = _Refinement(merged, clients, model, options, log).run(folds)
    report.seconds = time.perf_counter() - start
    dtypes = {k: np.asarray(v).dtype for k, v in merged.items()}
    return {k: np.asarray(v).astype(dtypes[k]) for k, v in chosen_model.items()}, report
