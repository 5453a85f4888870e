"""Server-side refinement of a merged model on the server's own data (torch; no Flower).

After :func:`fedfiot_flwr.merge.merge` the server holds the merged weights, every client's
upload and, in one-shot FedFiOT, a small labelled validation set. This module runs the
models on that data and hands the linear algebra to :mod:`fedfiot_flwr.merge.refine`:

* :func:`refine_merged_model` -- the one entry point. It builds candidate models from the
  merge (REPAIR, least-squares refinement at several ridges, both, distillation fine-tuning
  from the best of them, and optionally each client on its own), fitting every candidate on
  ``fit_loader`` only, and returns the one with the best accuracy on ``select_loader``. By
  default the least-squares refits only choose where the fine-tuning starts
  (``RefineOptions.offer_starts``). The two loaders must hold disjoint examples:
  whatever fits parameters never selects. With ``RefineOptions.refit`` the chosen recipe is
  then fitted once more on both folds, after the choice.
* :func:`least_squares_refine` -- layer by layer (forward order), refit the merged layer
  so that the merged model's own inputs to it reproduce the mean of the aligned clients'
  outputs of that layer (pre-activations), with a ridge toward the merged weights.
* :func:`repair` -- layer by layer, rescale (and, with a bias, shift) each merged neuron so
  that its pre-activation mean/std match the aligned clients' average.
* :func:`recalibrate_batchnorm` -- recompute BatchNorm running statistics of a merged
  model on the fitting data (REPAIR for BN networks).

Clients are aligned to the merge's neuron order first (``permutations`` from
:class:`fedfiot_flwr.merge.MergeResult`), so "the mean of the clients' outputs" compares
the same neuron across clients. Fitting inputs may be augmented (random shifts, flips and
mixup of fitting images: unlabeled, so no label is needed): least squares needs no labels
and more rows than a layer's fan-in.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedfiot_flwr.batchnorm import has_batchnorm, recompute_batchnorm_statistics
from fedfiot_flwr.merge.refine import LayerMoments, NeuronStats, reconstruction_error, repair_rescale, ridge_refit
from fedfiot_flwr.merge.spec import PermutationSpec, apply_permutations
from fedfiot_flwr.task import split_batch

__all__ = [
    "RefineOptions",
    "RefineReport",
    "augment_inputs",
    "least_squares_refine",
    "layer_modules",
    "recalibrate_batchnorm",
    "refine_merged_model",
    "repair",
]

Model = dict[str, np.ndarray]
TARGET_WEIGHTS = ("uniform", "size", "label")
FINETUNE_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class RefineOptions:
    """Knobs of :func:`refine_merged_model`.

    Attributes
    ----------
    ridges : tuple[float, ...]
        Relative ridges of the least-squares candidates (one candidate each).
    repair : bool
        Also offer REPAIR alone and REPAIR followed by each least-squares candidate.
    client_candidates : bool
        Also offer each client's own model (so the result is never below the best client on
        the selection fold).
    augment_copies : int
        Augmented copies of every fitting example added to the fine-tuning rows (0: none);
        least squares and REPAIR use the fitting examples as they are.
    target_weights : {"uniform", "size", "label"}
        How the clients' layer outputs are averaged into the target: equally, by client size,
        or per fitting example by each client's probability of the example's label.
    seed : int
        Seed of the augmentation.
    keep_candidates : bool
        Keep every candidate model in the report (for measurements).
    finetune_epochs : int
        When > 0, also offer the merge (or the best least-squares / REPAIR candidate, when it
        scores better on the selection fold) fine-tuned on the fitting fold for this many
        epochs (:func:`distill_finetune`).
    checkpoint_every : int
        Every ``checkpoint_every``-th epoch's fine-tuning checkpoint is a candidate too, so the
        selection fold can stop early; 0 offers the last epoch's model only.
    finetune_lr : float
        SGD learning rate (momentum 0.9) of the fine-tuning.
    finetune_schedule : {"constant", "cosine"}
        The learning rate stays at ``finetune_lr``, or decays from it to 0 along a cosine over
        all ``finetune_epochs`` (per step), so that the last epoch's model has settled.
    offer_starts : bool
        With fine-tuning on, the least-squares / REPAIR candidates are scored on the selection
        fold to choose the fine-tuning's start; True also lets them be returned, False keeps
        them as starts only, so that the fine-tuned model competes with the merge and the clients.
        (Their selection scores are optimistic: the merge's knobs were chosen on the same fold.)
    distill_weight : float
        Weight of the distillation term (ensemble of the aligned clients' logits as teacher);
        ``1 - distill_weight`` goes to cross-entropy on the fitting fold's labels.
    temperature : float
        Distillation temperature.
    refit : bool
        After the selection fold has chosen a fitted candidate (least squares, REPAIR or a
        fine-tuning checkpoint), build that same recipe again (same ridge, same number of
        epochs) on both folds together and return the result, as a grid search refits its
        winner on all the data. The choice itself is made before the selection fold is fitted
        on; the merge and the client models are returned as they are.
    """

    ridges: tuple[float, ...] = (1e-2, 1e-1)
    repair: bool = False
    client_candidates: bool = True
    augment_copies: int = 8
    target_weights: str = "label"
    seed: int = 0
    keep_candidates: bool = False
    finetune_epochs: int = 20
    checkpoint_every: int = 0
    finetune_lr: float = 0.01
    finetune_schedule: str = "cosine"
    offer_starts: bool = False
    distill_weight: float = 0.5
    temperature: float = 2.0
    refit: bool = False


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


# --------------------------------------------------------------------------------- models


def _load(model: nn.Module, state: Mapping[str, np.ndarray]) -> nn.Module:
    ref = model.state_dict()
    missing = [k for k in ref if k not in state]
    if missing:
        raise ValueError(f"state lacks tensors {missing[:5]} of the model")
    model.load_state_dict({k: torch.as_tensor(np.asarray(state[k])).to(ref[k].dtype) for k in ref})
    return model


def _state(model: nn.Module) -> Model:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def layer_modules(model: nn.Module, example: torch.Tensor) -> list[tuple[str, nn.Module]]:
    """The model's ``nn.Linear`` / ``nn.Conv2d`` layers in the order the forward pass calls them.

    Raises
    ------
    ValueError
        For a grouped convolution or a layer called more than once per forward.
    """
    order: list[str] = []
    named = {n: m for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: order.append(n)) for n, m in named.items()]
    try:
        with torch.no_grad():
            model.eval()
            model(example[:1])
    finally:
        for h in handles:
            h.remove()
    if len(order) != len(set(order)):
        raise ValueError("refinement needs every Linear/Conv2d layer called once per forward")
    for n in order:
        if isinstance(named[n], nn.Conv2d) and named[n].groups != 1:
            raise ValueError(f"layer {n!r}: grouped convolutions are not supported by the refinement")
    return [(n, named[n]) for n in order]


def _rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A layer's input as least-squares rows ``(rows, fan_in [+1])`` (bias column last)."""
    if isinstance(module, nn.Conv2d):
        cols = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)  # (B, C*k*k, L)
        r = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    else:
        r = x.reshape(-1, x.shape[-1])
    if module.bias is not None:
        r = torch.cat([r, torch.ones(r.shape[0], 1, dtype=r.dtype)], dim=1)
    return r


def _out_rows(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """A layer's output as rows ``(rows, out)``, matching :func:`_rows`."""
    if isinstance(module, nn.Conv2d):
        return y.flatten(2).transpose(1, 2).reshape(-1, y.shape[1])
    return y.reshape(-1, y.shape[-1])


def _flat_weight(module: nn.Module) -> np.ndarray:
    w = module.weight.detach().double().reshape(module.weight.shape[0], -1).numpy()
    if module.bias is not None:
        w = np.concatenate([w, module.bias.detach().double().numpy()[:, None]], axis=1)
    return w


def _set_flat_weight(module: nn.Module, w: np.ndarray) -> None:
    with torch.no_grad():
        if module.bias is not None:
            module.bias.copy_(torch.as_tensor(w[:, -1]))
            w = w[:, :-1]
        module.weight.copy_(torch.as_tensor(w).reshape(module.weight.shape))


class _Capture:
    """Forward hooks recording chosen layers' inputs and outputs."""

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], inputs: bool, outputs: bool) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, mod in layers:
            def hook(m: nn.Module, a: tuple[Any, ...], o: torch.Tensor, name: str = name) -> None:
                if inputs:
                    self.inputs[name] = a[0].detach()
                if outputs:
                    self.outputs[name] = o.detach()
            self._handles.append(mod.register_forward_hook(hook))

    def close(self) -> None:
        for h in self._handles:
            h.remove()


# --------------------------------------------------------------------------------- data


def augment_inputs(x: torch.Tensor, copies: int, generator: torch.Generator) -> torch.Tensor:
    """``x`` followed by ``copies`` label-preserving augmented copies.

    Images ``(B, C, H, W)``: a random shift of up to 2 pixels per copy and a horizontal flip of
    a random half of the examples; other inputs: Gaussian noise of 5% of the input's std.
    Copy ``j`` of example ``i`` is row ``(j + 1) * B + i`` and keeps example ``i``'s label.
    """
    if copies <= 0:
        return x
    out = [x]
    for _ in range(copies):
        z = x.clone()
        if z.ndim == 4:
            dx, dy = (int(v) for v in torch.randint(-2, 3, (2,), generator=generator))
            z = torch.roll(z, shifts=(dy, dx), dims=(2, 3))
            flip = torch.rand(z.shape[0], generator=generator) < 0.5
            z[flip] = z[flip].flip(3)
        else:
            z = z + 0.05 * float(x.std()) * torch.randn(z.shape, generator=generator)
        out.append(z)
    return torch.cat(out)


def _collect_fit(loader: Iterable[Any], copies: int, seed: int,
                 batch: int = 500) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The fitting rows (augmented) in batches, and their labels in the same batches."""
    xs, ys = [], []
    for b in loader:
        x, y = split_batch(b)
        xs.append(x.float())
        ys.append(y.long())
    if not xs:
        raise ValueError("the refinement's fitting loader yields no examples")
    x = augment_inputs(torch.cat(xs), copies, torch.Generator().manual_seed(seed))
    y = torch.cat(ys).repeat(1 + max(copies, 0))
    return list(torch.split(x, batch)), list(torch.split(y, batch))


# ----------------------------------------------------------------------------- statistics


def _example_weights(
    model: nn.Module, clients: Sequence[Model], batches: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
    mode: str, sizes: Sequence[float] | None,
) -> list[list[torch.Tensor]]:
    """Per client and batch, each row's weight in the target average (rows sum to 1 over clients).

    ``"uniform"``: 1/K; ``"size"``: n_k / n; ``"label"``: client k's probability of the row's
    true label, normalised over clients (a client is trusted where it knows the class: under
    a non-IID split a client's features of classes it never saw are noise).
    """
    k = len(clients)
    if mode == "uniform":
        return [[torch.full((len(x),), 1.0 / k) for x in batches] for _ in clients]
    if mode == "size":
        assert sizes is not None
        tot = float(sum(sizes))
        return [[torch.full((len(x),), float(n) / tot) for x in batches] for n in sizes]
    probs: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for client in clients:
            _load(model, client).eval()
            probs.append([torch.softmax(model(x), 1).gather(1, y[:, None]).squeeze(1) + 1e-3
                          for x, y in zip(batches, labels)])
    totals = [sum(p[i] for p in probs) for i in range(len(batches))]
    return [[p[i] / totals[i] for i in range(len(batches))] for p in probs]


def _client_targets(
    model: nn.Module, clients: Sequence[Model], weights: Sequence[Sequence[torch.Tensor]],
    layers: Sequence[tuple[str, nn.Module]], batches: Sequence[torch.Tensor],
) -> list[dict[str, torch.Tensor]]:
    """Per batch and layer, the weighted mean of the (aligned) clients' layer outputs (per-row weights)."""
    targets: list[dict[str, torch.Tensor]] = [{} for _ in batches]
    cap = _Capture(layers, inputs=False, outputs=True)
    try:
        with torch.no_grad():
            for client, wk in zip(clients, weights):
                _load(model, client).eval()
                for i, x in enumerate(batches):
                    model(x)
                    for name, _ in layers:
                        out = cap.outputs[name]
                        y = out * wk[i].reshape((-1,) + (1,) * (out.ndim - 1))
                        targets[i][name] = y if name not in targets[i] else targets[i][name] + y
    finally:
        cap.close()
    return targets


def _client_neuron_stats(
    model: nn.Module, clients: Sequence[Model], weights: Sequence[float], layers: Sequence[tuple[str, nn.Module]],
    batches: Sequence[torch.Tensor],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per layer, the weighted mean over clients of each neuron's pre-activation mean and std."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    cap = _Capture(layers, inputs=False, outputs=True)
    try:
        with torch.no_grad():
            for client, wk in zip(clients, weights):
                _load(model, client).eval()
                stats = {name: NeuronStats(mod.weight.shape[0]) for name, mod in layers}
                for x in batches:
                    model(x)
                    for name, mod in layers:
                        stats[name].add(_out_rows(mod, cap.outputs[name]).double().numpy())
                for name, s in stats.items():
                    m, sd = out.get(name, (0.0, 0.0))
                    out[name] = (m + wk * s.mean, sd + wk * s.std)
    finally:
        cap.close()
    return out


# ----------------------------------------------------------------------------- corrections


def repair(
    model: nn.Module, layers: Sequence[tuple[str, nn.Module]], batches: Sequence[torch.Tensor],
    targets: Mapping[str, tuple[np.ndarray, np.ndarray]], include_last: bool = False,
) -> None:
    """REPAIR in place: layer by layer, match each neuron's pre-activation mean/std to ``targets``.

    The merged model's statistics are measured on ``batches`` after the earlier layers were
    corrected (so each layer sees the inputs it will get). The last layer (logits) is left
    alone unless ``include_last``.
    """
    todo = list(layers) if include_last else list(layers)[:-1]
    model.eval()
    for name, mod in todo:
        cap = _Capture([(name, mod)], inputs=False, outputs=True)
        stats = NeuronStats(mod.weight.shape[0])
        try:
            with torch.no_grad():
                for x in batches:
                    model(x)
                    stats.add(_out_rows(mod, cap.outputs[name]).double().numpy())
        finally:
            cap.close()
        w, b = repair_rescale(mod.weight.detach().double().numpy(),
                              None if mod.bias is None else mod.bias.detach().double().numpy(),
                              stats, *targets[name])
        with torch.no_grad():
            mod.weight.copy_(torch.as_tensor(w))
            if b is not None:
                mod.bias.copy_(torch.as_tensor(b))


def least_squares_refine(
    model: nn.Module, layers: Sequence[tuple[str, nn.Module]], batches: Sequence[torch.Tensor],
    targets: Sequence[Mapping[str, torch.Tensor]], ridge: float,
) -> list[float]:
    """Least-squares refinement in place, layer by layer in forward order.

    For each layer, accumulate the merged model's inputs to it (after the earlier layers were
    refitted) against ``targets`` (the clients' mean outputs, per batch), then replace its
    weights by :func:`fedfiot_flwr.merge.refine.ridge_refit` with ``ridge``.

    Returns
    -------
    list[float]
        ``[before, after]`` reconstruction MSE of every layer on the fitting rows.
    """
    errors: list[float] = []
    model.eval()
    for name, mod in layers:
        w0 = _flat_weight(mod)
        moments = LayerMoments(w0.shape[1], w0.shape[0])
        cap = _Capture([(name, mod)], inputs=True, outputs=False)
        try:
            with torch.no_grad():
                for x, tgt in zip(batches, targets):
                    model(x)
                    moments.add(_rows(mod, cap.inputs[name]).double().numpy(),
                                _out_rows(mod, tgt[name]).double().numpy())
        finally:
            cap.close()
        w = ridge_refit(moments, w0, ridge)
        errors += [reconstruction_error(moments, w0), reconstruction_error(moments, w)]
        _set_flat_weight(mod, w)
    return errors


def recalibrate_batchnorm(model: nn.Module, batches: Sequence[torch.Tensor]) -> bool:
    """Recompute every BatchNorm's running mean/var on ``batches`` (cumulative average) and leave
    ``model`` in eval mode; False when it has no BatchNorm that tracks statistics.

    A thin wrapper of :func:`fedfiot_flwr.batchnorm.recompute_batchnorm_statistics`.
    """
    if not has_batchnorm(model):
        return False
    recompute_batchnorm_statistics(model, batches)
    model.eval()
    return True


def distill_finetune(
    model: nn.Module, batches: Sequence[torch.Tensor], labels: torch.Tensor, teacher: Sequence[torch.Tensor],
    options: RefineOptions, stop_after: int | None = None,
) -> Iterable[tuple[int, Model]]:
    """Fine-tune ``model`` in place on the fitting rows; yields ``(epoch, state)`` at its checkpoints.

    The checkpoints are every ``options.checkpoint_every``-th epoch and the last one. The
    learning-rate schedule always spans ``options.finetune_epochs``; ``stop_after`` ends the run
    after that many epochs (yielding that epoch's state), so a shorter run reproduces a prefix of
    the full one exactly.

    The loss is ``distill_weight * T^2 KL(softmax(teacher / T) || softmax(model / T))``
    (``teacher``: the clients' mean logits on the same rows) plus ``(1 - distill_weight)``
    times cross-entropy on ``labels`` (the first ``len(labels)`` rows; augmented copies keep
    their example's label). SGD with momentum 0.9, batch 50, gradient norm clipped at 5,
    rows reshuffled every epoch (seeded). Stops early (yielding nothing more) if the loss
    stops being finite.
    """
    x = torch.cat(list(batches))
    t = torch.cat(list(teacher))
    n_lab = labels.shape[0]
    if x.shape[0] < n_lab or t.shape[0] != x.shape[0]:
        raise ValueError(f"fine-tuning: {x.shape[0]} rows, {t.shape[0]} teacher rows, {n_lab} labels")
    has_label = torch.zeros(x.shape[0], dtype=torch.bool)
    has_label[:n_lab] = True
    y = torch.zeros(x.shape[0], dtype=torch.long)
    y[:n_lab] = labels
    opt = torch.optim.SGD(model.parameters(), lr=options.finetune_lr, momentum=0.9)
    steps_per_epoch = math.ceil(x.shape[0] / 50)
    schedule = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=options.finetune_epochs * steps_per_epoch)
                if options.finetune_schedule == "cosine" else None)
    gen = torch.Generator().manual_seed(options.seed + 1)
    temp, beta = options.temperature, options.distill_weight
    soft = torch.softmax(t / temp, dim=1)
    last = options.finetune_epochs if stop_after is None else min(stop_after, options.finetune_epochs)
    for epoch in range(1, last + 1):
        model.train()
        for idx in torch.split(torch.randperm(x.shape[0], generator=gen), 50):
            out = model(x[idx])
            kd = F.kl_div(F.log_softmax(out / temp, dim=1), soft[idx], reduction="batchmean") * temp * temp
            lab = has_label[idx]
            ce = F.cross_entropy(out[lab], y[idx][lab]) if bool(lab.any()) else out.sum() * 0.0
            loss = beta * kd + (1 - beta) * ce
            if not bool(torch.isfinite(loss)):
                return
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()
            if schedule is not None:
                schedule.step()
        model.eval()
        every = options.checkpoint_every
        if epoch == last or (every > 0 and epoch % every == 0):
            yield epoch, _state(model)


def _accuracy(model: nn.Module, loader: Iterable[Any]) -> float:
    correct = seen = 0
    model.eval()
    with torch.no_grad():
        for b in loader:
            x, y = split_batch(b)
            correct += int((model(x.float()).argmax(1) == y).sum())
            seen += int(y.shape[0])
    if seen == 0:
        raise ValueError("the refinement's selection loader yields no examples")
    return correct / seen


# ----------------------------------------------------------------------------- entry point


@dataclass(frozen=True)
class _Recipe:
    """How a refined candidate is built from the merge: REPAIR, then least squares, then fine-tuning."""

    repair: bool = False
    ridge: float | None = None
    epochs: int = 0


@dataclass
class _FitData:
    """The rows a candidate is fitted on (one fold, or both folds for the refit)."""

    batches: list[torch.Tensor]
    targets: list[dict[str, torch.Tensor]]
    ft_batches: list[torch.Tensor]
    ft_labels: torch.Tensor
    teacher: list[torch.Tensor]
    stats: dict[str, tuple[np.ndarray, np.ndarray]] | None = None


def _fit_data(rows: Sequence[Any], model: nn.Module, aligned: Sequence[Model], layers: Sequence[tuple[str, nn.Module]],
              options: RefineOptions, num_examples: Sequence[int] | None) -> _FitData:
    """Everything fitted candidates need from ``rows``: layer targets and the fine-tuning teacher."""
    batches, labels = _collect_fit(rows, 0, options.seed)
    row_weights = _example_weights(model, aligned, batches, labels, options.target_weights, num_examples)
    targets = _client_targets(model, aligned, row_weights, layers, batches)
    ft_batches, ft_labels = batches, labels
    teacher: list[torch.Tensor] = []
    if options.finetune_epochs > 0:
        # Fine-tuning rows: the fitting rows plus their augmented copies; teacher = the
        # label-weighted (or plain) mean of the aligned clients' logits on the same rows.
        ft_batches, ft_labels = _collect_fit(rows, options.augment_copies, options.seed)
        ft_weights = _example_weights(model, aligned, ft_batches, ft_labels, options.target_weights, num_examples)
        teacher = [t[layers[-1][0]] for t in _client_targets(model, aligned, ft_weights, layers[-1:], ft_batches)]
    return _FitData(batches, targets, ft_batches, torch.cat(ft_labels), teacher)


def refine_merged_model(
    merged: Mapping[str, np.ndarray],
    clients: Sequence[Mapping[str, np.ndarray]],
    model: nn.Module,
    fit_loader: Iterable[Any],
    select_loader: Iterable[Any],
    spec: PermutationSpec | None = None,
    permutations: Mapping[str, Sequence[np.ndarray]] | None = None,
    num_examples: Sequence[int] | None = None,
    options: RefineOptions = RefineOptions(),
    log: Callable[[str], None] | None = None,
) -> tuple[Model, RefineReport]:
    """Refine a merged model on server data and return the best candidate on the selection fold.

    Parameters
    ----------
    merged : dict[str, np.ndarray]
        The merged model (state-dict keys of ``model``).
    clients : sequence of dict
        The clients' uploaded models (dequantized), in the merge's client order.
    model : nn.Module
        A module of the architecture (its weights are overwritten; used as scratch).
    fit_loader, select_loader : iterable of (x, y) batches
        Disjoint folds of the server's data: the first fits every candidate's parameters,
        the second only scores the candidates (and, with ``options.refit``, joins the
        first for the chosen recipe's final fit, after the choice is made).
    spec, permutations : optional
        The merge's permutation spec and ``MergeResult.permutations`` (client ``k``'s
        permutation of each hidden layer); without them the clients are taken as they are
        (identity alignment).
    num_examples : sequence of int, optional
        Client sizes (for ``options.target_weights == "size"``).
    options : RefineOptions
        Candidates and data knobs.
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
        On missing tensors, permutations that do not match ``clients``, empty folds or
        non-finite activations (the message names the client or layer).
    """
    start = time.perf_counter()
    if not clients:
        raise ValueError("refine_merged_model needs at least one client model")
    if options.target_weights not in TARGET_WEIGHTS:
        raise ValueError(f"target_weights must be one of {TARGET_WEIGHTS}, got {options.target_weights!r}")
    if options.finetune_schedule not in FINETUNE_SCHEDULES:
        raise ValueError(f"finetune_schedule must be one of {FINETUNE_SCHEDULES}, got {options.finetune_schedule!r}")
    if options.checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be >= 0, got {options.checkpoint_every}")
    aligned: list[Model] = []
    for k, c in enumerate(clients):
        missing = [n for n in merged if n not in c]
        if missing:
            raise ValueError(f"client {k}: upload lacks tensors {missing[:5]}")
        if permutations and spec is not None:
            perms = {}
            for p, per_client in permutations.items():
                if len(per_client) != len(clients):
                    raise ValueError(f"permutation {p!r} has {len(per_client)} entries for {len(clients)} clients")
                perms[p] = np.asarray(per_client[k])
            aligned.append(apply_permutations(dict(c), spec, perms))
        else:
            aligned.append({n: np.asarray(v) for n, v in c.items()})
    if options.target_weights == "size" and (num_examples is None or len(num_examples) != len(clients)):
        raise ValueError("target_weights='size' needs num_examples for every client")
    weights = [1.0 / len(clients)] * len(clients)  # REPAIR's statistics: plain client average
    if options.target_weights == "size":
        weights = [float(n) / float(sum(num_examples)) for n in num_examples]  # type: ignore[arg-type]

    fit_rows = list(fit_loader)
    if not fit_rows:
        raise ValueError("the refinement's fitting loader yields no examples")
    layers = layer_modules(model, split_batch(fit_rows[0])[0].float())
    data = _fit_data(fit_rows, model, aligned, layers, options, num_examples)
    select_rows = list(select_loader)
    select_batches = [(x.float(), y) for x, y in map(split_batch, select_rows)]
    report = RefineReport(chosen="merged", fit_examples=sum(len(b) for b in data.batches),
                          select_examples=sum(len(y) for _, y in select_batches))
    # REPAIR's client statistics need their own forward passes: a second copy of the module,
    # so that the candidate being built is not overwritten; computed once per data, on first use.
    model_scratch = copy.deepcopy(model)
    layers_scratch = [(n, dict(model_scratch.named_modules())[n]) for n, _ in layers]

    def build(recipe: _Recipe, on: _FitData, label: str | None = None) -> Iterable[tuple[int, Model]]:
        """``(epochs, state)`` of the recipe on ``on``: the state before fine-tuning, then its checkpoints."""
        _load(model, merged)
        recalibrate_batchnorm(model, on.batches)
        if recipe.repair:
            if on.stats is None:
                on.stats = _client_neuron_stats(model_scratch, aligned, weights, layers_scratch, on.batches)
            repair(model, layers, on.batches, on.stats)
            recalibrate_batchnorm(model, on.batches)
        if recipe.ridge is not None:
            errors = least_squares_refine(model, layers, on.batches, on.targets, recipe.ridge)
            if label is not None:
                report.fit_errors[label] = errors
            recalibrate_batchnorm(model, on.batches)
        yield 0, _state(model)
        if recipe.epochs > 0:
            yield from distill_finetune(model, on.ft_batches, on.ft_labels, on.teacher, options,
                                        stop_after=recipe.epochs)

    recipes: dict[str, _Recipe] = {"repair": _Recipe(repair=True)} if options.repair else {}
    for r in options.ridges:
        recipes[f"ls-r{r:g}"] = _Recipe(ridge=r)
        if options.repair:
            recipes[f"repair+ls-r{r:g}"] = _Recipe(repair=True, ridge=r)

    best: tuple[float, str, Model] = (-math.inf, "", {})

    def offer(name: str, state: Model) -> None:
        nonlocal best
        if report.selection_accuracy[name] > best[0]:
            best = (report.selection_accuracy[name], name, state)

    def consider(name: str, state: Model, offered: bool = True) -> None:
        acc = _accuracy(_load(model, state), select_batches)
        report.selection_accuracy[name] = acc
        if options.keep_candidates:
            report.candidates[name] = state
        if log:
            log(f"    refine candidate {name:18s} selection acc {100 * acc:5.1f}%" + ("" if offered else " (start only)"))
        if offered:
            offer(name, state)

    consider("merged", dict(merged))
    offer_starts = options.offer_starts or options.finetune_epochs <= 0
    for name, recipe in recipes.items():
        consider(name, next(iter(build(recipe, data, name)))[1], offered=offer_starts)
    if options.finetune_epochs > 0:
        # One start: the merge or the best least-squares/REPAIR candidate, whichever scores
        # better on the selection fold; its checkpoints are candidates.
        start_name = max(recipes, key=lambda n: report.selection_accuracy[n], default="merged")
        if report.selection_accuracy.get(start_name, -1.0) <= report.selection_accuracy["merged"]:
            start_name = "merged"
        start_recipe = replace(recipes.get(start_name, _Recipe()), epochs=options.finetune_epochs)
        tuned = False
        for epoch, state in build(start_recipe, data):
            if epoch == 0:
                start_state = state  # the start itself, before any step
            else:
                name = f"ft{epoch}({start_name})"
                recipes[name] = replace(start_recipe, epochs=epoch)
                consider(name, state)
                tuned = True
        if not tuned and not offer_starts and start_name != "merged":
            # The fine-tuning diverged at once: the best start (the merge is already offered) competes after all.
            offer(start_name, start_state)
    if options.client_candidates:
        for k, c in enumerate(clients):
            consider(f"client-{k}", {n: np.asarray(v) for n, v in c.items()})
    report.chosen, chosen_model = best[1], best[2]
    if options.refit and report.chosen in recipes:
        # The choice is made; refit its recipe on both folds (as a grid search refits its winner).
        both = _fit_data(fit_rows + select_rows, model, aligned, layers, options, num_examples)
        recipe = recipes[report.chosen]
        for epoch, state in build(recipe, both):
            if epoch == recipe.epochs:
                chosen_model = state
                report.refit_examples = sum(len(b) for b in both.batches)
    report.seconds = time.perf_counter() - start
    dtypes = {k: np.asarray(v).dtype for k, v in merged.items()}
    return {k: np.asarray(v).astype(dtypes[k]) for k, v in chosen_model.items()}, report
