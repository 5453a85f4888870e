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
  Where the factors carry their low-rank roots (``A = L_A L_A^T``, ``G = L_G L_G^T``: a
  decoded upload's 8-bit codes, see :class:`~fedfiot_flwr.psd.KFACFactors`), a step applies the
  root of the wide side instead of the dense factor when that is cheaper
  (:func:`kfac_plan`): ``G dW A = (G (dW L_A)) L_A^T``, and the quadratic form is
  ``<dW L_A, G dW L_A>``; equal to the dense products up to float rounding.

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
from fedfiot_flwr.baselines.averaging import (
    check_clients,
    check_curvature_replies,
    check_square,
    client_weights,
    size_weighted_average,
)
from fedfiot_flwr.baselines.fedfisher_options import OPTIMIZERS, FedFisherOptions
from fedfiot_flwr.choose import BestSoFar
from fedfiot_flwr.psd import KFACFactors, layer_matrix
from fedfiot_flwr.options import Model

__all__ = [
    "OPTIMIZERS",
    "FedFisherOptions",
    "FedFisherResult",
    "fedfisher_diag",
    "fedfisher_kfac",
    "kfac_plan",
    "kfac_quadratic",
]


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
    gradient: Callable[[dict[str, torch.Tensor], bool], tuple[dict[str, torch.Tensor], torch.Tensor | None]],
    to_model: Callable[[dict[str, torch.Tensor]], Model],
    options: FedFisherOptions,
    evaluate: Evaluate | None,
    variant: str,
) -> tuple[Model, int, float | None, list[dict[str, float]]]:
    """Optimise from ``start`` with checkpoints; return (best model, step, score, history).

    ``gradient(params, objective)`` returns the gradient and, when ``objective`` is True (at
    checkpoints only: nothing else reads it), the objective.
    """
    steps, lr, eval_every = options.steps, options.lr, options.eval_every
    params = {k: v.detach().clone() for k, v in start.items()}
    opt: _FedFisherUpdate | _TorchAdam
    opt = _FedFisherUpdate(params, lr, variant) if options.optimizer == "fedfisher" else _TorchAdam(params, lr)
    history: list[dict[str, float]] = []
    best: BestSoFar[int] = BestSoFar()
    kept: dict[str, torch.Tensor] = {}
    with torch.no_grad():  # the gradient is closed-form; no autograd graph is needed
        for step in range(steps + 1):
            checkpoint = step % eval_every == 0 or step == steps
            grads, objective = gradient(params, checkpoint)
            if checkpoint:
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


def _check_diag_fishers(ids: Sequence[str], models: Sequence[Mapping[str, np.ndarray]],
                        fishers: Sequence[Mapping[str, np.ndarray]], checked: bool) -> list[str]:
    """The tensors the diagonal Fishers cover (the same for every client); sizes and values unless ``checked``."""
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
    return names


def fedfisher_diag(
    models: Sequence[Mapping[str, np.ndarray]],
    fishers: Sequence[Mapping[str, np.ndarray]],
    num_examples: Sequence[int],
    options: FedFisherOptions = FedFisherOptions("diag"),
    *,
    evaluate: Evaluate | None = None,
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
    options : FedFisherOptions
        The optimisation: ``steps``, ``lr``, ``eval_every`` (paper: 2000, 0.01, 100),
        ``optimizer`` (see the module docstring), ``fisher_scaling`` (``"size"``: ``c_k = n_k /
        n``, ``"none"``: ``1 / K``), ``damping`` (added to every Fisher entry) and ``device``
        (default: CUDA when available); its ``variant`` is not read.
    evaluate : callable, optional
        ``model -> score`` on the validation set (higher is better, e.g. accuracy).
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
        On inconsistent models, Fishers with other keys or shapes, or negative or non-finite
        entries (bad optimisation settings are refused when ``options`` is built).
    """
    t0 = time.perf_counter()
    ids = check_clients(models, num_examples, client_ids, checked=checked)
    names = _check_diag_fishers(ids, models, fishers, checked)
    init = size_weighted_average(models, num_examples)
    dev = _resolve(options.device)
    c = client_weights(num_examples, options.fisher_scaling)

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x, dtype=np.float64), device=dev).to(dtype)

    cw = torch.as_tensor(c, device=dev).to(dtype)
    stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name in names:
        wk = t(np.stack([np.asarray(m[name]) for m in models]))
        fk = t(np.stack([np.asarray(f[name]) for f in fishers])) + options.damping
        stacked[name] = (wk, fk * cw.view((-1,) + (1,) * (wk.dim() - 1)))

    def gradient(w: dict[str, torch.Tensor], objective: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        grads: dict[str, torch.Tensor] = {}
        obj = torch.zeros((), dtype=dtype, device=dev)
        for name, (wk, cf) in stacked.items():
            delta = w[name].unsqueeze(0) - wk  # exactly 0 where a client equals the iterate
            p = cf * delta
            grads[name] = torch.sum(p, dim=0)
            if objective:
                obj = obj + torch.sum(p * delta)
        return grads, obj if objective else None

    def to_model(w: dict[str, torch.Tensor]) -> Model:
        out = {k: v.copy() for k, v in init.items()}
        for name in names:
            out[name] = w[name].detach().to("cpu", torch.float64).numpy().astype(init[name].dtype)
        return out

    start = {name: t(init[name]) for name in names}
    model, step, score, history = _optimise(start, gradient, to_model, options, evaluate, "diag")
    return FedFisherResult(model, init, "diag", step, score, history, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------- K-FAC


def _check_factors(
    ids: Sequence[str],
    models: Sequence[Mapping[str, np.ndarray]],
    factors: Sequence[Mapping[str, KFACFactors]],
    checked: bool = False,
) -> list[str]:
    """The factored layers; with ``checked`` (decoded uploads) only counts and names are checked."""
    return check_curvature_replies(ids, models, factors, "fedfisher_kfac", None if checked else _check_kfac_layer)


def _check_kfac_layer(where: str, f: KFACFactors, model: Mapping[str, np.ndarray]) -> None:
    """One layer's factors fit its weight (``A``: ``d_in (+1 with a bias)``, ``G``: ``d_out``), are finite,
    and so are their roots."""
    w = np.asarray(model[f.weight])
    d_out, d_in = w.shape[0], int(np.prod(w.shape[1:])) + (f.bias is not None)
    for what, mat, size in (("A", f.A, d_in), ("G", f.G, d_out)):
        check_square(f"{where}: factor {what}", mat, size)
    for what, root, mat, size in (("A", f.A_root, f.A, d_in), ("G", f.G_root, f.G, d_out)):
        if root is not None:
            _check_root(f"{where}: root of factor {what}", root, mat, size)


def _check_root(where: str, root: np.ndarray, mat: np.ndarray, size: int) -> None:
    """A root given with its factor must be ``(size, r)``, finite, and reproduce it (``root
    root^T = mat`` up to ``1e-6`` of its largest entry)."""
    r = np.asarray(root, dtype=np.float64)
    if r.ndim != 2 or r.shape[0] != size:
        raise ValueError(f"{where} has shape {r.shape}, expected ({size}, rank)")
    if not np.all(np.isfinite(r)):
        raise ValueError(f"{where} has NaN or infinite values")
    m = np.asarray(mat, dtype=np.float64)
    scale = float(np.max(np.abs(m))) if m.size else 0.0
    if m.size and float(np.max(np.abs(r @ r.T - m))) > 1e-6 * max(scale, np.finfo(np.float64).tiny):
        raise ValueError(f"{where} does not reproduce the factor (root @ root.T differs from it)")


def kfac_plan(d_out: int, d_in: int, rank_a: int | None, rank_g: int | None) -> tuple[str, bool]:
    """How one client's ``G dW A`` (``dW``: ``d_out x d_in``) is cheapest to apply, counting
    multiply-adds, given the ranks of the roots known (``None``: only the dense factor).

    - ``"dense"``: ``(G dW) A``: ``d_out^2 d_in + d_out d_in^2``;
    - ``"A"``: ``Z = dW L_A``, ``Y = G Z``, ``G dW A = Y L_A^T``: ``2 d_out d_in r_A`` plus
      ``G Z``, itself ``d_out^2 r_A`` dense or ``2 d_out r_G r_A`` through ``L_G``;
    - ``"G"``: ``Z = L_G^T dW``, ``Y = Z A``, ``G dW A = L_G Y``: ``2 d_out d_in r_G`` plus
      ``Z A``, ``d_in^2 r_G`` dense or ``2 d_in r_A r_G`` through ``L_A``.

    In the last two the quadratic form ``<dW, G dW A>`` is ``<Z, Y>``.

    Parameters
    ----------
    d_out, d_in : int
        Shape of the layer matrix ``[W b]``.
    rank_a, rank_g : int or None
        Columns of the roots ``L_A`` (``d_in x r_A``) and ``L_G`` (``d_out x r_G``), ``None``
        when not known.

    Returns
    -------
    tuple of (str, bool)
        ``("dense" | "A" | "G", whether the other side is applied through its root too)``.

    Examples
    --------
    >>> kfac_plan(512, 1601, 486, 486), kfac_plan(512, 1601, None, None), kfac_plan(10, 129, 129, 10)
    (('A', False), ('dense', False), ('dense', False))
    """
    best = (d_out * d_out * d_in + d_out * d_in * d_in, ("dense", False))
    if rank_a is not None:
        inner = [(d_out * d_out * rank_a, False)] + ([(2 * d_out * rank_g * rank_a, True)] if rank_g is not None else [])
        cost, root = min(inner)
        best = min(best, (2 * d_out * d_in * rank_a + cost, ("A", root)))
    if rank_g is not None:
        inner = [(d_in * d_in * rank_g, False)] + ([(2 * d_in * rank_a * rank_g, True)] if rank_a is not None else [])
        cost, root = min(inner)
        best = min(best, (2 * d_out * d_in * rank_g + cost, ("G", root)))
    return best[1]


def _stacked_roots(roots: Sequence[np.ndarray | None], size: int) -> np.ndarray | None:
    """Every client's ``(size, r_k)`` root, zero-padded to one ``(K, size, max r_k)`` stack (zero
    columns leave ``L L^T`` unchanged); ``None`` when a client has none."""
    if any(r is None for r in roots):
        return None
    arrays = [np.asarray(r, dtype=np.float64) for r in roots]
    if any(r.ndim != 2 or r.shape[0] != size for r in arrays):
        return None
    out = np.zeros((len(arrays), size, max(r.shape[1] for r in arrays)))
    for k, r in enumerate(arrays):
        out[k, :, :r.shape[1]] = r
    return out


class _KFACLayer:
    """One factored layer's client data on the device and how a step applies it (:func:`kfac_plan`).

    ``wk``: ``(K, d_out, d_in)`` client matrices; the factors as the plan needs them: dense
    ``a`` / ``g`` (``(K, n, n)``) or roots ``la`` (``(K, d_in, r_A)``) / ``lg`` (``(K, d_out,
    r_G)``), plus the transposed roots stacked for the one GEMM that sums the clients' terms.
    """

    def __init__(self, wk: torch.Tensor, a: np.ndarray, g: np.ndarray, la: np.ndarray | None,
                 lg: np.ndarray | None, to: Callable[[np.ndarray], torch.Tensor]) -> None:
        k, d_out, d_in = wk.shape
        self.wk = wk
        self.plan = kfac_plan(d_out, d_in, None if la is None else la.shape[2], None if lg is None else lg.shape[2])
        side, inner_root = self.plan
        use_la = side == "A" or (side == "G" and inner_root)
        use_lg = side == "G" or (side == "A" and inner_root)
        self.a = None if use_la else to(a)
        self.g = None if use_lg else to(g)
        self.la = to(la) if use_la else None  # type: ignore[arg-type]
        self.lg = to(lg) if use_lg else None  # type: ignore[arg-type]
        # The roots' transposes: (K, r, n) for the per-client products, and stacked (K r, n) so
        # that sum_k Y_k L_k^T is one (d_out, K r) @ (K r, d_in) GEMM.
        self.la_t = None if self.la is None else self.la.transpose(1, 2).contiguous()
        self.lg_t = None if self.lg is None else self.lg.transpose(1, 2).contiguous()
        self.la_stack = None if self.la_t is None else self.la_t.reshape(-1, d_in)
        self.lg_wide = None if self.lg is None else self.lg.permute(1, 0, 2).reshape(d_out, -1)

    def apply_g(self, z: torch.Tensor) -> torch.Tensor:
        """``G_k z_k`` for every client."""
        return torch.matmul(self.g, z) if self.g is not None else torch.matmul(self.lg, torch.matmul(self.lg_t, z))

    def apply_a(self, z: torch.Tensor) -> torch.Tensor:
        """``z_k A_k`` for every client."""
        return torch.matmul(z, self.a) if self.a is not None else torch.matmul(torch.matmul(z, self.la), self.la_t)

    def step(self, w: torch.Tensor, cw: torch.Tensor, damping: float,
             objective: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``sum_k c_k (G_k dW_k A_k + damping dW_k)`` and (when asked) ``sum_k c_k <dW_k, that>``."""
        delta = w.unsqueeze(0) - self.wk  # (K, d_out, d_in)
        side, _ = self.plan
        if side == "dense":  # the dense products of one client at a time, as FedFisher's code
            p = torch.matmul(torch.matmul(self.g, delta), self.a)
            if damping:
                p = p + damping * delta
            return torch.sum(cw * p, dim=0), torch.sum(cw * delta * p) if objective else None
        if side == "A":
            z = torch.matmul(delta, self.la)  # (K, d_out, r_A)
            y = self.apply_g(z)
            weighted = cw * y
            grad = weighted.permute(1, 0, 2).reshape(w.shape[0], -1) @ self.la_stack
        else:
            z = torch.matmul(self.lg_t, delta)  # (K, r_G, d_in)
            y = self.apply_a(z)
            weighted = cw * y
            grad = self.lg_wide @ weighted.reshape(-1, w.shape[1])
        obj = torch.sum(z * weighted) if objective else None
        if damping:
            scaled = cw * delta
            grad = grad + damping * torch.sum(scaled, dim=0)
            if objective:
                obj = obj + damping * torch.sum(scaled * delta)
        return grad, obj


def fedfisher_kfac(
    models: Sequence[Mapping[str, np.ndarray]],
    factors: Sequence[Mapping[str, KFACFactors]],
    num_examples: Sequence[int],
    options: FedFisherOptions = FedFisherOptions("kfac"),
    *,
    evaluate: Evaluate | None = None,
    dtype: torch.dtype = torch.float32,
    client_ids: Sequence[str] | None = None,
    checked: bool = False,
    low_rank: bool = True,
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
        client), as returned by :func:`fedfiot_flwr.curvature.kfac_factors` or decoded from an
        upload (then with their low-rank roots).
    num_examples : sequence of int
        Local data-set sizes.
    options, evaluate, dtype, client_ids, checked
        As in :func:`fedfisher_diag` (``options.damping`` adds ``damping * ||W - W_k||^2``).
    low_rank : bool
        Where every client's factor of a layer side carries its root (``KFACFactors.A_root`` /
        ``G_root``; decoded uploads do), apply the roots instead of the dense factors when
        :func:`kfac_plan` counts fewer multiply-adds (for the paper's CNN at FedAvg's upload
        size: the first fully connected layer's input side). The same objective and gradient
        up to float rounding; ``False``: dense factors only.

    Returns
    -------
    FedFisherResult

    Raises
    ------
    ValueError
        On inconsistent models, differing layer sets, factor shapes that do not fit the
        layer (``A``: ``d_in (+1 with a bias)``, ``G``: ``d_out``), non-finite factors, roots
        that do not reproduce their factor; the message names the client and layer.
    """
    t0 = time.perf_counter()
    ids = check_clients(models, num_examples, client_ids, checked=checked)
    layers = _check_factors(ids, models, factors, checked)
    init = size_weighted_average(models, num_examples)
    dev = _resolve(options.device)
    c = torch.as_tensor(client_weights(num_examples, options.fisher_scaling), device=dev).to(dtype)

    def t(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x, dtype=np.float64), device=dev).to(dtype)

    stacked: dict[str, _KFACLayer] = {}
    start: dict[str, torch.Tensor] = {}
    for layer in layers:
        f0 = factors[0][layer]
        wk = np.stack([layer_matrix(m[f0.weight], None if f0.bias is None else m[f0.bias]) for m in models])
        a = np.stack([np.asarray(f[layer].A) for f in factors])
        g = np.stack([np.asarray(f[layer].G) for f in factors])
        la = _stacked_roots([f[layer].A_root for f in factors], a.shape[1]) if low_rank else None
        lg = _stacked_roots([f[layer].G_root for f in factors], g.shape[1]) if low_rank else None
        stacked[layer] = _KFACLayer(t(wk), a, g, la, lg, t)
        start[layer] = t(layer_matrix(init[f0.weight], None if f0.bias is None else init[f0.bias]))

    cw = c.view(-1, 1, 1)

    def gradient(w: dict[str, torch.Tensor], objective: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        grads: dict[str, torch.Tensor] = {}
        obj = torch.zeros((), dtype=dtype, device=dev) if objective else None
        for layer, terms in stacked.items():
            grads[layer], part = terms.step(w[layer], cw, options.damping, objective)
            if objective:
                obj = obj + part
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

    model, step, score, history = _optimise(start, gradient, to_model, options, evaluate, "kfac")
    return FedFisherResult(model, init, "kfac", step, score, history, time.perf_counter() - t0)
