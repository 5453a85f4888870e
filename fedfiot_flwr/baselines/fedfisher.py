"""FedFisher (Jhunjhunwala, Wang, Joshi, AISTATS 2024) server merge: diagonal and K-FAC.

As in the FedFiOT paper's C.2: start from the size-weighted average of the client models
and minimise

    J(W) = sum_k c_k (W - W_k)^T F_k (W - W_k)

with Adam (2000 steps, learning rate 0.01), evaluating every 100 steps on the server's
validation set and returning the checkpoint with the best score.

- ``fedfisher_diag``: ``F_k`` is a diagonal Fisher (one entry per parameter), so
  ``J = sum_k c_k sum_i F_k[i] (W[i] - W_k[i])**2``. Tensors without a Fisher (buffers)
  stay at the size-weighted average.
- ``fedfisher_kfac``: ``F_k`` is block diagonal with one Kronecker-factored block per
  Linear/Conv2d layer, and the block's quadratic form is evaluated without building the
  Kronecker product: ``vec(dW)^T (A ⊗ G) vec(dW) = tr(G dW A dW^T)``, ``dW = [W b] - [W_k
  b_k]`` (bias folded in as the last column, matching the factors of
  :mod:`fedfiot_flwr.curvature`). Tensors outside a factored layer stay at the average.

``c_k`` is ``n_k / n`` (``fisher_scaling="size"``, what FedFisher's code does by scaling
each client's Fisher by its data share) or ``1 / K`` (``"none"``). An optional
``damping`` adds ``damping * ||W - W_k||^2`` to every client's term.

Choices (documented because the paper leaves them open):

- the optimiser (``optimizer="fedfisher"``, default) is the Adam-like update of FedFisher's
  code, fed the same gradient ``g = sum_k c_k F_k (W - W_k)`` (half the gradient of ``J``):
  ``m <- g + 0.9 m``, ``v <- g**2 + 0.99 v``, ``W <- W - lr m / sqrt(v + 0.01)`` for K-FAC
  and ``W - lr m / (sqrt(v) + 0.01)`` for the diagonal variant. It is not scale invariant:
  for small gradients it is plain gradient descent, so directions the Fisher barely
  constrains stay near the average. ``optimizer="adam"`` uses ``torch.optim.Adam`` (its
  defaults), which is scale invariant and, measured on digits, runs to the (poorly
  conditioned) minimiser of the K-FAC objective within a few hundred steps, so its
  validation accuracy peaks at the first checkpoint and then falls;
- checkpoints are scored at step 0 (the size-weighted average), every ``eval_every``
  steps and after the last step; the best score wins under :mod:`fedfiot_flwr.choose` (a NaN
  score never wins, ties go to the earlier step); without ``evaluate`` the last iterate is
  returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fedfiot_flwr.batches import resolve_device
from fedfiot_flwr.baselines.averaging import check_clients, client_weights, size_weighted_average
from fedfiot_flwr.choose import BestSoFar
from fedfiot_flwr.psd import KFACFactors, layer_matrix
from fedfiot_flwr.options import Model

__all__ = [
    "OPTIMIZERS",
    "FedFisherResult",
    "fedfisher_diag",
    "fedfisher_kfac",
    "kfac_quadratic",
]

OPTIMIZERS = ("fedfisher", "adam")
"""``"fedfisher"``: the update of FedFisher's code (default); ``"adam"``: ``torch.optim.Adam``."""

Evaluate = Callable[[Model], float]


@dataclass
class FedFisherResult:
    """Outcome of a FedFisher merge.

    Attributes
    ----------
    model : dict[str, np.ndarray]
        The selected checkpoint (every tensor of the client models).
    initial_model : dict[str, np.ndarray]
        The size-weighted average the optimisation started from.
    variant : str
        ``"diag"`` or ``"kfac"``.
    best_step : int
        Adam steps taken by the selected checkpoint (0 = the average).
    best_score : float or None
        Its validation score (``None`` without ``evaluate``; NaN when no checkpoint scored a
        number, and then ``best_step`` is 0).
    history : list of dict
        ``{"step", "objective", "score"}`` at every checkpoint (score NaN without
        ``evaluate``).
    seconds : float
        Wall-clock time of the merge.
    """

    model: Model
    initial_model: Model
    variant: str
    best_step: int
    best_score: float | None
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0


def kfac_quadratic(delta: np.ndarray, A: np.ndarray, G: np.ndarray) -> float:
    """``vec(dW)^T (A ⊗ G) vec(dW) = tr(G dW A dW^T)`` (``vec`` stacks columns).

    Parameters
    ----------
    delta : np.ndarray
        ``(d_out, d_in)`` difference ``dW`` (bias folded in as a column when ``A`` covers it).
    A : np.ndarray
        ``(d_in, d_in)`` input factor.
    G : np.ndarray
        ``(d_out, d_out)`` output-gradient factor.

    Returns
    -------
    float
    """
    d = np.asarray(delta, dtype=np.float64)
    return float(np.sum(d * (np.asarray(G, dtype=np.float64) @ d @ np.asarray(A, dtype=np.float64))))


def _resolve(device: torch.device | str | None) -> torch.device:
    return resolve_device(device)


def _check_optim(steps: int, lr: float, eval_every: int, damping: float, optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {OPTIMIZERS}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    if not (lr > 0 and np.isfinite(lr)):
        raise ValueError(f"lr must be positive, got {lr!r}")
    if int(eval_every) != eval_every or eval_every < 1:
        raise ValueError(f"eval_every must be a positive integer, got {eval_every!r}")
    if not (damping >= 0 and np.isfinite(damping)):
        raise ValueError(f"damping must be finite and >= 0, got {damping!r}")


class _FedFisherUpdate:
    """FedFisher's own Adam-like update (``one_shot_fisher_kfac`` / ``_diag`` of its code).

    ``m <- g + 0.9 m``, ``v <- g**2 + 0.99 v`` (no ``(1 - beta)`` factors, no bias
    correction), then ``W <- W - lr m / sqrt(v + 0.01)`` (K-FAC) or
    ``W <- W - lr m / (sqrt(v) + 0.01)`` (diagonal). Unlike Adam it is not invariant to the
    scale of ``g``: for gradients well below 0.01 it is gradient descent with step
    ``~100 lr``, which keeps weakly constrained directions near the average.
    """

    def __init__(self, params: dict[str, torch.Tensor], lr: float, variant: str) -> None:
        self.params, self.lr, self.variant = params, lr, variant
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for name, p in self.params.items():
            g = grads[name]
            self.m[name].mul_(0.9).add_(g)
            self.v[name].mul_(0.99).addcmul_(g, g)
            if self.variant == "kfac":
                denom = torch.sqrt(self.v[name] + 0.01)
            else:
                denom = torch.sqrt(self.v[name]) + 0.01
            p.addcdiv_(self.m[name], denom, value=-self.lr)


class _TorchAdam:
    """``torch.optim.Adam`` with its defaults, fed the closed-form gradient."""

    def __init__(self, params: dict[str, torch.Tensor], lr: float) -> None:
        self.params = params
        for p in params.values():
            p.requires_grad_(True)
        self.opt = torch.optim.Adam(list(params.values()), lr=lr)

    def step(self, grads: dict[str, torch.Tensor]) -> None:
        for name, p in self.params.items():
            p.grad = grads[name]
        self.opt.step()


def _optimise(
    start: dict[str, torch.Tensor],
    gradient: Callable[[dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor], torch.Tensor]],
    to_model: Callable[[dict[str, torch.Tensor]], Model],
    steps: int,
    lr: float,
    eval_every: int,
    evaluate: Evaluate | None,
    optimizer: str,
    variant: str,
) -> tuple[Model, int, float | None, list[dict[str, float]]]:
    """Optimise from ``start`` with checkpoints; return (best model, step, score, history)."""
    params = {k: v.detach().clone() for k, v in start.items()}
    opt: _FedFisherUpdate | _TorchAdam
    opt = _FedFisherUpdate(params, lr, variant) if optimizer == "fedfisher" else _TorchAdam(params, lr)
    history: list[dict[str, float]] = []
    best: BestSoFar[int] = BestSoFar()
    kept: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # the gradient is closed-form; no autograd graph is needed
        for step in range(steps + 1):
            grads, objective = gradient(params)
            if step % eval_every == 0 or step == steps:
                score = float("nan")
                if evaluate is not None:
                    score = float(evaluate(to_model(params)))
                    if best.offer(score, step):
                        kept = {k: v.detach().clone() for k, v in params.items()}
                history.append({"step": float(step), "objective": float(objective), "score": score})
            if step == steps:
                break
            opt.step(grads)
    if evaluate is None:
        return to_model(params), steps, None, history
    return to_model(kept), best.item, best.score, history


# ------------------------------------------------------------------------------- diagonal


def fedfisher_diag(
    models: Sequence[Mapping[str, np.ndarray]],
    fishers: Sequence[Mapping[str, np.ndarray]],
    num_examples: Sequence[int],
    *,
    steps: int = 2000,
    lr: float = 0.01,
    eval_every: int = 100,
    evaluate: Evaluate | None = None,
    fisher_scaling: str = "size",
    damping: float = 0.0,
    optimizer: str = "fedfisher",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    client_ids: Sequence[str] | None = None,
    checked: bool = False,
) -> FedFisherResult:
    """FedFisher with diagonal Fishers.

    The input checks guard direct callers; uploads that came over the wire were validated when
    they were decoded, and the server passes ``checked=True``.

    Parameters
    ----------
    models : sequence of mapping of str to np.ndarray
        Client state dicts (dequantized uploads).
    fishers : sequence of mapping of str to np.ndarray
        Diagonal Fishers (non-negative) of the same client's parameters; every client must
        cover the same tensors. Tensors without a Fisher stay at the average.
    num_examples : sequence of int
        Local data-set sizes.
    steps, lr, eval_every : int, float, int
        Adam steps, learning rate and checkpoint spacing (paper: 2000, 0.01, 100).
    evaluate : callable, optional
        ``model -> score`` on the validation set (higher is better, e.g. accuracy).
    fisher_scaling : str
        ``"size"`` (``c_k = n_k / n``) or ``"none"`` (``c_k = 1 / K``).
    damping : float
        Added to every Fisher entry.
    optimizer : str
        ``"fedfisher"`` (the update rule of FedFisher's code, default) or ``"adam"``
        (``torch.optim.Adam``); see the module docstring.
    device : torch.device or str, optional
        Defaults to CUDA when available.
    dtype : torch.dtype
        Working precision.
    client_ids : sequence of str, optional
        Names for error messages.
    checked : bool
        The uploads come from :func:`fedfiot_flwr.server.uploads.collect_uploads`: only counts
        and tensor names are checked, not sizes, shapes or values again.

    Returns
    -------
    FedFisherResult

    Raises
    ------
    ValueError
        On inconsistent models, Fishers with other keys or shapes, negative or non-finite
        entries, or bad optimisation settings.
    """
    t0 = time.perf_counter()
    ids = check_clients(models, num_examples, client_ids, checked=checked)
    _check_optim(steps, lr, eval_every, damping, optimizer)
    if len(fishers) != len(models):
        raise ValueError(f"fedfisher_diag: {len(fishers)} Fishers for {len(models)} models")
    names = list(fishers[0])
    for cid, fisher, model in zip(ids, fishers, models):
        if set(fisher) != set(names):
            raise ValueError(f"client {cid}: Fisher tensors differ from client {ids[0]}'s")
        for name in names:
            if name not in model:
                raise ValueError(f"client {cid}: Fisher entry {name!r} is not a model tensor")
            if checked:
                continue
            f = np.asarray(fisher[name])
            if f.shape != np.shape(model[name]):
                raise ValueError(f"client {cid}, tensor {name!r}: Fisher shape {f.shape} differs from {np.shape(model[name])}")
            if not np.all(np.isfinite(f)) or (f.size and float(f.min()) < 0):
                raise ValueError(f"client {cid}, tensor {name!r}: the Fisher must be finite and non-negative")
    init = size_weighted_average(models, num_examples)
    dev = _resolve(device)
    c = client_weights(num_examples, fisher_scaling)

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x, dtype=np.float64), device=dev).to(dtype)

    cw = torch.as_tensor(c, device=dev).to(dtype)
    stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in names:
        wk = t(np.stack([np.asarray(m[name]) for m in models]))
        fk = t(np.stack([np.asarray(f[name]) for f in fishers])) + damping
        stacked[name] = (wk, fk * cw.view((-1,) + (1,) * (wk.dim() - 1)))

    def gradient(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        grads: dict[str, torch.Tensor] = {}
        obj = torch.zeros((), dtype=dtype, device=dev)
        for name, (wk, cf) in stacked.items():
            delta = w[name].unsqueeze(0) - wk  # exactly 0 where a client equals the iterate
            p = cf * delta
            grads[name] = torch.sum(p, dim=0)
            obj = obj + torch.sum(p * delta)
        return grads, obj

    def to_model(w: dict[str, torch.Tensor]) -> Model:
        out = {k: v.copy() for k, v in init.items()}
        for name in names:
            out[name] = w[name].detach().to("cpu", torch.float64).numpy().astype(init[name].dtype)
        return out

    start = {name: t(init[name]) for name in names}
    model, step, score, history = _optimise(start, gradient, to_model, steps, lr, eval_every, evaluate, optimizer, "diag")
    return FedFisherResult(model, init, "diag", step, score, history, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------- K-FAC


def _check_factors(
    ids: Sequence[str],
    models: Sequence[Mapping[str, np.ndarray]],
    factors: Sequence[Mapping[str, KFACFactors]],
    checked: bool = False,
) -> list[str]:
    """The factored layers; with ``checked`` (decoded uploads) only counts and names are checked."""
    if len(factors) != len(models):
        raise ValueError(f"fedfisher_kfac: {len(factors)} factor sets for {len(models)} models")
    layers = list(factors[0])
    if not layers:
        raise ValueError(f"client {ids[0]}: no K-FAC factors")
    for cid, fac, model in zip(ids, factors, models):
        if list(fac) != layers:
            raise ValueError(f"client {cid}: K-FAC layers {list(fac)} differ from client {ids[0]}'s {layers}")
        for layer in layers:
            f = fac[layer]
            ref = factors[0][layer]
            if (f.weight, f.bias) != (ref.weight, ref.bias):
                raise ValueError(f"client {cid}, layer {layer!r}: weight/bias names differ from client {ids[0]}'s")
            for name in (f.weight, f.bias):
                if name is not None and name not in model:
                    raise ValueError(f"client {cid}, layer {layer!r}: tensor {name!r} is not in the model")
            if checked:
                continue
            w = np.asarray(model[f.weight])
            d_out, d_in = w.shape[0], int(np.prod(w.shape[1:])) + (f.bias is not None)
            for what, mat, size in (("A", f.A, d_in), ("G", f.G, d_out)):
                m = np.asarray(mat)
                if m.shape != (size, size):
                    raise ValueError(f"client {cid}, layer {layer!r}: factor {what} has shape {m.shape}, expected {(size, size)}")
                if not np.all(np.isfinite(m)):
                    raise ValueError(f"client {cid}, layer {layer!r}: factor {what} has NaN or infinite values")
    return layers


def fedfisher_kfac(
    models: Sequence[Mapping[str, np.ndarray]],
    factors: Sequence[Mapping[str, KFACFactors]],
    num_examples: Sequence[int],
    *,
    steps: int = 2000,
    lr: float = 0.01,
    eval_every: int = 100,
    evaluate: Evaluate | None = None,
    fisher_scaling: str = "size",
    damping: float = 0.0,
    optimizer: str = "fedfisher",
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    client_ids: Sequence[str] | None = None,
    checked: bool = False,
) -> FedFisherResult:
    """FedFisher with K-FAC Fishers (one Kronecker-factored block per layer).

    The input checks guard direct callers; uploads that came over the wire were validated when
    they were decoded (every factor fits its layer and is finite), and the server passes
    ``checked=True``.

    Parameters
    ----------
    models : sequence of mapping of str to np.ndarray
        Client state dicts (dequantized uploads).
    factors : sequence of mapping of str to KFACFactors
        Per client, ``{module name: KFACFactors}`` (dequantized; same layers for every
        client), as returned by :func:`fedfiot_flwr.curvature.kfac_factors`.
    num_examples : sequence of int
        Local data-set sizes.
    steps, lr, eval_every, evaluate, fisher_scaling, damping, optimizer, device, dtype, client_ids, checked
        As in :func:`fedfisher_diag`.

    Returns
    -------
    FedFisherResult

    Raises
    ------
    ValueError
        On inconsistent models, differing layer sets, factor shapes that do not fit the
        layer (``A``: ``d_in (+1 with a bias)``, ``G``: ``d_out``), non-finite factors or bad
        optimisation settings; the message names the client and layer.
    """
    t0 = time.perf_counter()
    ids = check_clients(models, num_examples, client_ids, checked=checked)
    _check_optim(steps, lr, eval_every, damping, optimizer)
    layers = _check_factors(ids, models, factors, checked)
    init = size_weighted_average(models, num_examples)
    dev = _resolve(device)
    c = torch.as_tensor(client_weights(num_examples, fisher_scaling), device=dev).to(dtype)

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x, dtype=np.float64), device=dev).to(dtype)

    stacked: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    start: dict[str, torch.Tensor] = {}
    for layer in layers:
        f0 = factors[0][layer]
        wk = np.stack([layer_matrix(m[f0.weight], None if f0.bias is None else m[f0.bias]) for m in models])
        a = np.stack([np.asarray(f[layer].A) for f in factors])
        g = np.stack([np.asarray(f[layer].G) for f in factors])
        stacked[layer] = (t(wk), t(a), t(g))
        start[layer] = t(layer_matrix(init[f0.weight], None if f0.bias is None else init[f0.bias]))

    cw = c.view(-1, 1, 1)

    def gradient(w: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        grads: dict[str, torch.Tensor] = {}
        obj = torch.zeros((), dtype=dtype, device=dev)
        for layer, (wk, a, g) in stacked.items():
            delta = w[layer].unsqueeze(0) - wk  # (K, d_out, d_in)
            p = torch.matmul(torch.matmul(g, delta), a)
            if damping:
                p = p + damping * delta
            grads[layer] = torch.sum(cw * p, dim=0)
            obj = obj + torch.sum(cw * delta * p)
        return grads, obj

    def to_model(w: dict[str, torch.Tensor]) -> Model:
        out = {k: v.copy() for k, v in init.items()}
        for layer in layers:
            f0 = factors[0][layer]
            mat = w[layer].detach().to("cpu", torch.float64).numpy()
            shape = np.shape(init[f0.weight])
            n_w = int(np.prod(shape[1:]))
            out[f0.weight] = mat[:, :n_w].reshape(shape).astype(init[f0.weight].dtype)
            if f0.bias is not None:
                out[f0.bias] = mat[:, n_w].astype(init[f0.bias].dtype)
        return out

    model, step, score, history = _optimise(start, gradient, to_model, steps, lr, eval_every, evaluate, optimizer, "kfac")
    return FedFisherResult(model, init, "kfac", step, score, history, time.perf_counter() - t0)
