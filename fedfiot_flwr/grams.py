"""Client side: the input second moments ``E[a a^T]`` of a model's Linear and Conv2d layers, in one forward pass.

A Linear layer's rows ``a`` are its inputs (every position of a sequence input); a convolution's are its
unfolded input patches (``C_in k_h k_w``, :func:`torch.nn.functional.unfold`'s order, channel major), one per
output position. A layer with a bias gets a trailing constant input 1, so that ``[W b]`` shares the Gram.
The Gram is the mean over the client's examples and positions, in float64 (each batch's product in the
batch's dtype, the sum in float64); no labels and no backward pass are needed.

A convolution has one row per example and output position, and with more inputs than outputs its Gram
(``d_in^2`` per row) costs more than its forward pass (``d_in d_out``). With ``sample=True`` each batch's
Gram is estimated from a uniform random subset of its rows, ``ceil(n_rows * d_out / d_in)`` of them but at
least one per example: an unbiased estimate whose product costs about the layer's forward pass. A layer
with one row per example (a Linear layer on flat inputs) keeps them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from fedfiot_flwr.fisher import _conv2d_padding, _patches, gradient_mode, patch_view
from fedfiot_flwr.task import split_batch


__all__ = ["forward_grams", "grams_and_output_factors"]


def _subset(n: int, d_in: int, d_out: int, examples: int, gen: torch.Generator | None) -> torch.Tensor | None:
    """Indices of a uniform random subset of ``n`` rows whose Gram costs about the layer's forward pass.

    ``None`` keeps every row: no generator (no sampling), or a subset no smaller than ``n``.
    """
    if gen is None:
        return None
    keep = min(n, max(examples, -(-n * d_out // d_in)))
    return None if keep >= n else torch.randperm(n, generator=gen)[:keep]


def _patch_view(module: nn.Conv2d, x: torch.Tensor, out_hw: tuple[int, int]) -> torch.Tensor:
    """The convolution's input patches as ``(B, H', W', C_in, k_h, k_w)``, a strided view where it can be."""
    padding = _conv2d_padding(module)
    if padding is None or module.groups != 1:
        raise ValueError(f"input Grams: Conv2d {module} needs groups=1 and zero padding given as numbers")
    if tuple(module.dilation) != (1, 1):  # unfolded patches, every one copied
        return _patches(module, x, padding).reshape(x.shape[0], *out_hw, module.in_channels, *module.kernel_size)
    return patch_view(module, x, padding)


def _rows(module: nn.Module, x: torch.Tensor, output: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """The layer's input rows ``(n, d)`` (a bias's constant input last), all or a random subset (``gen``)."""
    bias = int(module.bias is not None)
    if isinstance(module, nn.Conv2d):
        view = _patch_view(module, x, (int(output.shape[-2]), int(output.shape[-1])))
        d = int(np.prod(view.shape[3:]))
        n = int(np.prod(view.shape[:3]))
        keep = _subset(n, d + bias, module.out_channels, int(x.shape[0]), gen)
        if keep is None:
            rows = view.reshape(n, d)
        else:
            per_example = view.shape[1] * view.shape[2]
            keep = keep.to(view.device)
            b, pos = keep // per_example, keep % per_example
            rows = view[b, pos // view.shape[2], pos % view.shape[2]].reshape(-1, d)
    else:
        rows = x.reshape(-1, x.shape[-1])
        keep = _subset(rows.shape[0], rows.shape[1] + bias, module.out_features, int(x.shape[0]), gen)
        rows = rows if keep is None else rows[keep.to(rows.device)]
    if bias:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


def forward_grams(
    model: nn.Module,
    loader: Iterable[Any],
    modules: Mapping[str, nn.Module],
    device: torch.device | str | None = None,
    sample: bool = False,
) -> dict[str, np.ndarray]:
    """``{module name: E[a a^T]}`` of ``modules`` (Linear or Conv2d layers of ``model``) over ``loader``.

    Parameters
    ----------
    model : nn.Module
        The network; run in eval mode without gradients, then restored.
    loader : Iterable
        ``(x, y)`` batches (or dicts, :func:`fedfiot_flwr.task.split_batch`); the labels are unused.
    modules : mapping of str to nn.Module
        The layers to cover, by name.
    device : torch.device or str, optional
        Where to run (default: the model's device).
    sample : bool
        Estimate each batch's Gram from a random subset of its rows (see the module docstring; the
        subsets are drawn from a generator seeded with 0, so the pass is deterministic).

    Returns
    -------
    dict[str, np.ndarray]
        Symmetric float64 Grams on the CPU.

    Raises
    ------
    ValueError
        For an empty loader or a convolution whose patches cannot be unfolded.
    """
    return _moments(model, loader, modules, device, sample, outputs=False)[0]


def grams_and_output_factors(
    model: nn.Module,
    loader: Iterable[Any],
    modules: Mapping[str, nn.Module],
    device: torch.device | str | None = None,
    sample: bool = False,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """:func:`forward_grams` and, from one backward pass per batch, each layer's diagonal output factor.

    A unit's output factor is the mean over the examples of ``(sum_t d/dz_t log p(y | x))**2``: the
    gradient of the observed label's log-likelihood with respect to the unit's pre-activation ``z``, summed
    over a convolution's positions ``t`` (the empirical Fisher of a bias on that unit; K-FAC's output factor,
    diagonal). In eval mode an example's logits depend on that example only, so the batch's backward pass
    gives every example's gradient.

    Returns
    -------
    tuple of dict[str, np.ndarray]
        The Grams, and per module the ``(d_out,)`` float64 output factor.
    """
    grams, outputs = _moments(model, loader, modules, device, sample, outputs=True)
    return grams, outputs  # type: ignore[return-value]


def _add_output_square(squares: dict[str, torch.Tensor], name: str, module: nn.Module, grad: torch.Tensor) -> None:
    """Add ``sum_n (sum_t grad_n,t)**2`` per unit (a convolution's positions ``t``; a Linear layer's leading axes)."""
    if isinstance(module, nn.Conv2d):
        per_example = grad.sum(dim=(2, 3))
    else:
        per_example = grad.reshape(grad.shape[0], -1, grad.shape[-1]).sum(dim=1)
    square = (per_example.detach().to(torch.float64) ** 2).sum(dim=0)
    squares[name] = square if name not in squares else squares[name] + square


def _moments(model: nn.Module, loader: Iterable[Any], modules: Mapping[str, nn.Module],
             device: torch.device | str | None, sample: bool,
             outputs: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray] | None]:
    """The pass behind :func:`forward_grams` (``outputs=False``: no labels, no backward pass) and
    :func:`grams_and_output_factors`."""
    sums: dict[str, torch.Tensor] = {}
    squares: dict[str, torch.Tensor] = {}
    counts = dict.fromkeys(modules, 0)
    gen = torch.Generator().manual_seed(0)

    captured: list[tuple[str, nn.Module, torch.Tensor]] = []

    def hook(name: str) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            rows = _rows(module, args[0].detach(), output, gen if sample else None)
            product = (rows.T @ rows).to(torch.float64)
            sums[name] = product if name not in sums else sums[name] + product
            counts[name] += rows.shape[0]
            if outputs:
                captured.append((name, module, output))
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in modules.items()]
    examples = 0
    try:
        with gradient_mode(model, device, "input Grams") as dev, torch.set_grad_enabled(outputs):
            for batch in loader:
                x, y = split_batch(batch)
                logits = model(x.to(dev))
                examples += int(x.shape[0])
                if outputs:
                    log_p = torch.log_softmax(logits, dim=-1).gather(-1, y.to(dev).long().reshape(-1, 1)).sum()
                    grads = torch.autograd.grad(log_p, [o for _, _, o in captured])
                    for (name, module, _), grad in zip(captured, grads):
                        _add_output_square(squares, name, module, grad)
                    captured.clear()
    finally:
        for h in handles:
            h.remove()
    if not sums or min(counts.values()) == 0:
        raise ValueError("input Grams: the data loader yielded no examples")
    out = {}
    for name in modules:
        m = (sums[name] / counts[name]).cpu().numpy()
        out[name] = (m + m.T) / 2.0
    if not outputs:
        return out, None
    return out, {name: (squares[name] / examples).cpu().numpy() for name in modules}
