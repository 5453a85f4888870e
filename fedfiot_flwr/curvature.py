"""Client-side curvature of the baselines: K-FAC factors (FedFisher) and input Grams (RegMean).

K-FAC (Martens & Grosse 2015; for convolutions Grosse & Martens 2016, "KFC") approximates
the Fisher block of a layer with weight ``W`` (``d_out x d_in``; a convolution's weight is
flattened to ``d_out x (C_in k_h k_w)`` in ``F.unfold``'s order) by a Kronecker product,

    F_l ~= A ⊗ G,    vec(dW)^T (A ⊗ G) vec(dW) = tr(G dW A dW^T),

with ``vec`` stacking columns. Over a client's ``N`` examples ``n`` and, for a convolution,
its ``T`` output positions ``t`` (the unfolded input patches ``a_{n,t}``):

- ``A = (1 / (N T)) sum_{n,t} a_{n,t} a_{n,t}^T`` (``T = 1`` for a Linear layer), the input
  second moment; when the layer has a bias, ``a`` gets a trailing 1 so that the bias is the
  last column of ``[W b]`` and shares the factor;
- ``G = (1 / N) sum_n sum_{v} sum_t g_{n,t,v} g_{n,t,v}^T``, where ``g_{n,t,v}`` is the
  gradient with respect to the layer's output (at position ``t``) of ``v^T z_n``, ``z_n`` the
  logits: ``kind="empirical"`` uses the single vector ``v = p_n - e_{y_n}`` (the gradient of
  ``-log p(y_n | x_n)``, observed labels, as in eq. 106); ``kind="true"`` uses the ``C``
  columns of a square root of ``diag(p_n) - p_n p_n^T`` (the exact expectation over the
  model's predictive distribution, FedFisher's choice), so ``sum_v`` is the expectation over
  labels. The two kinds are the options of :func:`fedfiot_flwr.fisher.diagonal_fisher`.

So ``A ⊗ G`` is the K-FAC approximation of the per-example *mean* Fisher (KFC's ``Ω ⊗ Γ``
for convolutions: the ``1/T`` sits on ``A`` here), the same normalisation as
:func:`fedfiot_flwr.fisher.diagonal_fisher`. For a single Linear layer on a single example
it is exact.

The factors are computed by ``curvlinops-for-pytorch``'s ``KFACLinearOperator``
(``kfac_approx="expand"``, ``separate_weight_and_bias=False``, summed cross-entropy, then
``G`` divided by ``N``; curvlinops is the ``baselines`` extra, imported on first use).
RegMean's Gram of a Linear layer's inputs (and FedFiOT's, of its Linear and Conv2d layers) is the
same ``A`` factor, from the forward pass alone (:func:`fedfiot_flwr.grams.forward_grams`, no curvlinops).

Uploads compress each symmetric PSD factor ``M`` (``n x n``) as ``M ~= L L^T`` with
``L = V_r diag(sqrt(lambda_r))`` from its top-``r`` eigenpairs, each column of ``L`` stored as
signed 8-bit codes (``[-127, 127]``, eq. 107 with ``l_q = 127``) plus one float32 scale:
``n r + 4 r`` bytes. A symmetric factor needs only one set of singular vectors, so at the
same byte count this keeps twice the rank of FedFisher's ``U S V^T`` code. The
reconstruction ``L_hat L_hat^T`` is PSD by construction. :func:`rank_for_budget` picks the
largest rank ``r`` shared by all factors (``min(n, r)`` each, as in FedFisher's code) that
fits a byte budget, e.g. FedAvg's float32 upload minus the 16-bit weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfiot_flwr.extras import require
from fedfiot_flwr.fisher import FISHER_KINDS, gradient_mode
from fedfiot_flwr.task import split_batch
from fedfiot_flwr.psd import (  # re-exported: the records live with their code
    CODE_LEVELS,
    CompressedPSD,
    InputGram,
    KFACFactors,
    compress_psd,
    compressed_nbytes,
    decompress_psd,
    layer_matrix,
    rank_for_budget,
)


__all__ = [
    "CODE_LEVELS",
    "CompressedPSD",
    "InputGram",
    "KFACFactors",
    "compress_psd",
    "compressed_nbytes",
    "curvature_modules",
    "decompress_psd",
    "input_grams",
    "kfac_factors",
    "layer_matrix",
    "rank_for_budget",
]


# ------------------------------------------------------------------------ layer helpers


def curvature_modules(model: nn.Module, linear_only: bool = False) -> dict[str, nn.Module]:
    """Layers that get factors: ``{module name: module}`` in ``named_modules`` order.

    Linear layers and (unless ``linear_only``) Conv2d layers with ``groups == 1``; a layer
    whose parameters are shared with another module is left out, as are layers without a
    weight.

    Parameters
    ----------
    model : nn.Module
        The network.
    linear_only : bool
        Only Linear layers (RegMean).

    Returns
    -------
    dict[str, nn.Module]
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    types: tuple[type, ...] = (nn.Linear,) if linear_only else (nn.Linear, nn.Conv2d)
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if not isinstance(module, types) or getattr(module, "weight", None) is None:
            continue
        if isinstance(module, nn.Conv2d) and module.groups != 1:
            continue
        if any(owners[id(p)] > 1 for p in module.parameters(recurse=False)):
            continue
        out[name] = module
    return out


def _key(module_name: str, param: str) -> str:
    return f"{module_name}.{param}" if module_name else param


# ----------------------------------------------------------------------- factor passes


class _Pairs:
    """Re-iterable view of a loader as ``(x, y)`` tensor pairs (dict batches allowed)."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch in self.loader:
            yield split_batch(batch)


def _count(pairs: _Pairs, loader: Iterable[Any]) -> int:
    dataset = getattr(loader, "dataset", None)
    drop_last = bool(getattr(loader, "drop_last", False))
    if dataset is not None and hasattr(dataset, "__len__") and not drop_last:
        return int(len(dataset))
    return int(sum(int(x.shape[0]) for x, _ in pairs))


def _run_kfac(
    model: nn.Module,
    dataloader: Iterable[Any],
    modules: Mapping[str, nn.Module],
    fisher_type: str,
    progress: bool,
    purpose: str,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """Run curvlinops' K-FAC over the data; return (input, gradient covariances, N)."""
    with warnings.catch_warnings():  # linear_operator (a curvlinops dependency) calls torch.jit.script
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.script.*", category=FutureWarning)
        KFACLinearOperator = require("curvlinops", "curvlinops-for-pytorch", "baselines", purpose).KFACLinearOperator

    pairs = _Pairs(dataloader)
    n = _count(pairs, dataloader)
    if n == 0:
        raise ValueError("curvature: the data loader yielded no examples")
    params = [p for m in modules.values() for p in m.parameters(recurse=False)]
    op = KFACLinearOperator(
        model,
        nn.CrossEntropyLoss(reduction="sum"),
        params,
        pairs,
        progressbar=progress,
        check_deterministic=False,
        fisher_type=fisher_type,
        kfac_approx="expand",
        num_per_example_loss_terms=1,
        separate_weight_and_bias=False,
        num_data=n,
    )
    op.compute_kronecker_factors()
    state = op.state_dict()
    return dict(state["input_covariances"]), dict(state["gradient_covariances"]), n


def kfac_factors(
    model: nn.Module,
    dataloader: Iterable[Any],
    kind: str = "true",
    *,
    modules: Sequence[str] | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> dict[str, KFACFactors]:
    """K-FAC factors ``A`` and ``G`` of every Linear / Conv2d layer over a client's data.

    Parameters
    ----------
    model : nn.Module
        Classifier returning ``(batch, classes)`` logits; evaluated in eval mode.
    dataloader : Iterable
        Yields ``(x, y)`` batches (or dicts, see :func:`fedfiot_flwr.task.split_batch`); one
        pass is the client's data. Use a loader without augmentation or ``drop_last``.
    kind : str
        ``"true"`` (expectation over the model's predictive distribution; FedFisher's
        code) or ``"empirical"`` (observed labels; FedFiOT's eq. 106).
    modules : sequence of str, optional
        Module names to cover; default :func:`curvature_modules` of ``model``.
    device : torch.device or str, optional
        Where to compute (default: the model's device); the model is moved back after.
    progress : bool
        Show curvlinops' progress bar.

    Returns
    -------
    dict[str, KFACFactors]
        Keyed by module name, in layer order; float64 NumPy factors on the CPU.

    Raises
    ------
    ValueError
        For an unknown ``kind``, an unknown or unsupported module, a model without
        parameters or an empty loader.
    ImportError
        Without ``curvlinops-for-pytorch`` (``pip install 'fedfiot-flwr[baselines]'``).
    """
    if kind not in FISHER_KINDS:
        raise ValueError(f"unknown Fisher kind {kind!r}; choose one of {FISHER_KINDS}")
    chosen = _select(model, modules, linear_only=False)
    fisher_type = {"true": "type-2", "empirical": "empirical", "sampled": "mc"}[kind]
    with gradient_mode(model, device, "curvature"):
        a_cov, g_cov, n = _run_kfac(model, dataloader, chosen, fisher_type, progress, "FedFisher's K-FAC factors")
    out: dict[str, KFACFactors] = {}
    for name, module in chosen.items():
        bias = _key(name, "bias") if module.bias is not None else None
        out[name] = KFACFactors(
            weight=_key(name, "weight"),
            bias=bias,
            A=_to_numpy(a_cov[name]),
            G=_to_numpy(g_cov[name]) / n,
        )
    return out


def input_grams(
    model: nn.Module,
    dataloader: Iterable[Any],
    *,
    modules: Sequence[str] | None = None,
    device: torch.device | str | None = None,
    convolutions: bool = False,
    sample: bool = False,
    outputs: bool = False,
) -> dict[str, InputGram]:
    """RegMean's Gram matrices ``E[x x^T]`` of every Linear layer's inputs (and Conv2d layer's patches).

    The Gram of a layer with a bias is augmented with an input of ones (last row/column:
    the mean input and 1). Multiply by the client's example count to get ``X^T X``. A
    convolution's Gram is that of its unfolded input patches (``C_in k_h k_w``, ``F.unfold``'s
    order), averaged over the examples and the output positions.

    Parameters
    ----------
    model : nn.Module
        The network (eval mode; only forward passes are run).
    dataloader : Iterable
        Yields ``(x, y)`` batches; one pass is the client's data (labels are unused).
    modules : sequence of str, optional
        Module names to cover; default every Linear layer (and Conv2d layer with ``convolutions``).
    device : torch.device or str, optional
        Where to compute (default: the model's device).
    convolutions : bool
        Also cover the Conv2d layers (``groups=1``): FedFiOT's Gram curvature; RegMean merges
        Linear layers only.
    sample : bool
        Estimate each batch's Gram from a random subset of its rows whose product costs at most
        the layer's forward pass (:func:`fedfiot_flwr.grams.forward_grams`).
    outputs : bool
        Also each layer's diagonal output factor (``InputGram.output``, K-FAC's), from one backward pass
        of the observed labels' log-likelihood per batch (:func:`fedfiot_flwr.grams.grams_and_output_factors`).

    Returns
    -------
    dict[str, InputGram]
        Keyed by module name, in layer order; float64 NumPy Grams on the CPU.

    Raises
    ------
    ValueError
        For an unknown or non-Linear module, a model without parameters or an empty loader.
    """
    from fedfiot_flwr.grams import forward_grams, grams_and_output_factors

    chosen = _select(model, modules, linear_only=not convolutions)
    if outputs:
        grams, factors = grams_and_output_factors(model, dataloader, chosen, device, sample)
    else:
        grams, factors = forward_grams(model, dataloader, chosen, device, sample), {}
    return {
        name: InputGram(
            weight=_key(name, "weight"),
            bias=_key(name, "bias") if module.bias is not None else None,
            gram=grams[name],
            output=factors.get(name),
        )
        for name, module in chosen.items()
    }


def _select(model: nn.Module, modules: Sequence[str] | None, linear_only: bool) -> dict[str, nn.Module]:
    available = curvature_modules(model, linear_only=linear_only)
    if modules is None:
        if not available:
            kinds = "Linear" if linear_only else "Linear or Conv2d"
            raise ValueError(f"curvature: {type(model).__name__} has no {kinds} layer")
        return available
    unknown = [m for m in modules if m not in available]
    if unknown:
        kinds = "Linear" if linear_only else "Linear / Conv2d (groups=1)"
        raise ValueError(f"curvature: modules {unknown} are not unshared {kinds} layers of the model")
    return {m: available[m] for m in available if m in set(modules)}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    m = t.detach().to("cpu", torch.float64).numpy()
    return (m + m.T) / 2.0  # exact symmetry (accumulation order can differ by an ulp)
