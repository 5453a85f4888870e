"""Diagonal Fisher information of a classifier on a client's local data.

``diagonal_fisher(model, loader, kind)`` returns, for every named parameter ``theta`` of
``model``, the mean over all examples ``n`` of the loader of

- ``kind="empirical"`` (FedFiOT, eq. 106): ``(d/d theta log p(y_n | x_n))**2`` with the
  observed label ``y_n``;
- ``kind="true"`` (FedFisher's): ``sum_c p(c | x_n) (d/d theta log p(c | x_n))**2``, the
  expectation over the model's own predictive distribution, computed exactly by
  enumerating the classes (no sampling).
- ``kind="sampled"``: ``(d/d theta log p(c_n | x_n))**2`` with one label ``c_n`` drawn from
  the model's own ``p(. | x_n)``: an unbiased estimate of the true Fisher at the empirical
  Fisher's cost (one backward vector per example). Draws use torch's global RNG (seed it
  with ``torch.manual_seed`` for a reproducible Fisher).

``log p`` is ``log_softmax`` of the model's logits. Gradients are per example (never a
squared batch gradient) and taken at the current weights with the model in eval mode; the
model's weights, buffers, ``.grad`` fields, ``requires_grad`` flags, device and train/eval
mode are left as they were.

How it is computed (``method``):

- ``"auto"`` (default): per-layer closed forms for ``nn.Linear``, ``nn.Conv2d`` (groups 1,
  zero padding) and eval-mode ``nn.BatchNorm1d/2d/3d`` with running statistics. A forward
  hook records each layer's input ``A``; one backward pass of the *batch* logits, seeded with
  per-example output gradients, gives each layer's per-example output gradient ``G``
  exactly, because in eval mode example ``n``'s logits depend on example ``n`` only. Then,
  as in BackPACK's ``SumGradSquared`` and Opacus' grad samplers, ``sum_n g_n**2`` is
  ``(G*G)^T (A*A)`` (one GEMM) for a Linear layer on 2-D inputs and
  ``sum_n (G_n U_n^T)**2`` with ``U = unfold(A)`` for a convolution (for narrow convolutions,
  the per-example gradients ``G_n U_n^T`` come from one grouped convolution instead). Parameters of any other
  module (or of a layer called more than once per forward, or shared between modules) fall
  back to ``torch.func``: ``vmap`` over examples of a ``vjp`` of ``functional_call``. So does
  a layer whose forward does not run exactly once per batch (e.g. ``MultiheadAttention``'s
  ``out_proj``, whose weight the parent uses functionally); this is detected on the fly.
- ``"vmap"``: ``torch.func`` for every parameter (the general reference).
- ``"loop"``: one ``autograd.grad`` per example (the naive baseline; slow).

All methods share one formulation: for example ``n`` and a set of output vectors ``v``, the
contribution is ``sum_v (J_n^T v)**2`` where ``J_n`` is the Jacobian of the logits. The
empirical Fisher uses ``v = p_n - e_{y_n}``; the true Fisher uses the ``C`` vectors
``sqrt(p_nc) (p_n - e_c)`` (so it costs about ``C`` backward passes per batch).

Buffers (BatchNorm running statistics, ``num_batches_tracked``) get no Fisher: the result
holds parameters only. The merge engine takes their names as ``buffers=``; they move with
their channel's permutation and are averaged weighted by ``num_examples``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vjp, vmap

from fedfiot_flwr.progress import progress_bar
from fedfiot_flwr.task import split_batch
from fedfiot_flwr.options import CLIENT_FISHER_KINDS

__all__ = ["FISHER_KINDS", "FISHER_METHODS", "diagonal_fisher", "output_vectors", "supported_modules"]

FISHER_KINDS = CLIENT_FISHER_KINDS  # the name the client modules import
FISHER_METHODS = ("auto", "vmap", "loop")
_BN_TYPES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
# Largest per-chunk tensor of materialised per-example gradients, in elements; on a GPU 8 times
# more (fewer, larger batched GEMMs: ResNet-18's Fisher pass 1.26x faster on an H200,
# benchmarks/results/gpu.md).
_CHUNK_ELEMENTS = 1 << 24
_CUDA_CHUNK_FACTOR = 8
# Convolutions with at most this many weights per output channel (in * kh * kw) get their
# per-example gradients from one grouped convolution (no im2col copy); wider ones from im2col
# and a batched GEMM. Measured on CPU: the grouped convolution is ~2x faster for a first layer
# (in = 1, 5x5), im2col ~1.2x faster for in = 32, 5x5.
_GROUPED_CONV_MAX_FAN_IN = 64


# --------------------------------------------------------------------------- output vectors


def output_vectors(logits: torch.Tensor, labels: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-example logit-space vectors whose back-propagation squares sum to the Fisher.

    Parameters
    ----------
    logits : torch.Tensor
        ``(B, C)`` logits.
    labels : torch.Tensor
        ``(B,)`` integer labels in ``[0, C)`` (only used by ``kind="empirical"``).
    kind : str
        ``"empirical"``, ``"true"`` or ``"sampled"``.

    Returns
    -------
    torch.Tensor
        ``(B, R, C)`` with ``R = 1`` (empirical: ``p - e_y``, the gradient of
        ``-log p(y|x)`` with respect to the logits; sampled: ``p - e_c`` with ``c ~ p``)
        or ``R = C`` (true: row ``c`` is ``sqrt(p_c) (p - e_c)``).
    """
    p = torch.softmax(logits.detach(), dim=1)
    if kind in ("empirical", "sampled"):
        target = labels if kind == "empirical" else torch.multinomial(p.float(), 1).squeeze(1)
        v = p.clone()
        v[torch.arange(v.shape[0], device=v.device), target] -= 1.0
        return v.unsqueeze(1)
    if kind == "true":
        eye = torch.eye(p.shape[1], dtype=p.dtype, device=p.device)
        return p.sqrt().unsqueeze(2) * (p.unsqueeze(1) - eye.unsqueeze(0))
    raise ValueError(f"unknown Fisher kind {kind!r}; choose one of {FISHER_KINDS}")


# ------------------------------------------------------------------- per-layer closed forms


def _conv2d_padding(module: nn.Conv2d) -> tuple[int, int] | None:
    if module.padding_mode != "zeros":
        return None
    if isinstance(module.padding, str):
        return (0, 0) if module.padding == "valid" else None
    return tuple(int(p) for p in module.padding)  # type: ignore[return-value]


def supported_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Modules whose parameters the fast path covers: ``{module name: module}``.

    Linear; Conv2d with ``groups == 1`` and zero (or ``"valid"``) padding; BatchNorm with
    running statistics (used in eval mode). A module is excluded when one of its parameters
    is shared with another module.
    """
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or any(owners[id(p)] > 1 for p in own):
            continue
        if isinstance(module, nn.Linear):
            ok = True
        elif isinstance(module, nn.Conv2d):
            ok = module.groups == 1 and _conv2d_padding(module) is not None
        elif isinstance(module, _BN_TYPES):
            ok = module.running_mean is not None and module.running_var is not None
        else:
            ok = False
        if ok:
            out[name] = module
    return out


def _chunks(n: int, per_example: int, device: torch.device) -> Iterator[slice]:
    budget = _CHUNK_ELEMENTS * (_CUDA_CHUNK_FACTOR if device.type == "cuda" else 1)
    step = max(1, budget // max(1, per_example))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def _linear_sq(module: nn.Linear, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if a.dim() == 2:
        g2 = g * g
        out["weight"] = g2.t() @ (a * a)
        if module.bias is not None:
            out["bias"] = g2.sum(0)
        return out
    b = a.shape[0]
    a3, g3 = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
    w = torch.zeros_like(module.weight)
    for s in _chunks(b, module.weight.numel(), g.device):
        w += torch.bmm(g3[s].transpose(1, 2), a3[s]).square_().sum(0)
    out["weight"] = w
    if module.bias is not None:
        out["bias"] = g3.sum(1).square().sum(0)
    return out


def _patches(module: nn.Conv2d, a: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
    """Input patches ``(B, L, in*kh*kw)`` of a convolution (the transpose of ``F.unfold``)."""
    b = a.shape[0]
    if tuple(module.dilation) != (1, 1):
        u = F.unfold(a, module.kernel_size, module.dilation, padding, module.stride)
        return u.transpose(1, 2)
    # The strided view copied once into GEMM layout: about twice as fast as F.unfold's im2col on the CPU.
    v = patch_view(module, a, padding)
    return v.reshape(b, v.shape[1] * v.shape[2], -1)


def patch_view(module: nn.Conv2d, a: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
    """A convolution's input patches ``(B, H', W', in, kh, kw)`` as a strided view of ``a`` (dilation 1).

    Nothing is copied but the padding: indexing the first three axes copies only the patches taken.
    """
    if padding != (0, 0):
        a = F.pad(a, (padding[1], padding[1], padding[0], padding[0]))
    (kh, kw), (sh, sw) = module.kernel_size, module.stride
    return a.unfold(2, kh, sh).unfold(3, kw, sw).permute(0, 2, 3, 1, 4, 5)


def _grouped_conv_grads(module: nn.Conv2d, a: torch.Tensor, g: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
    """Per-example weight gradients ``(B, out, in, kh, kw)`` as one grouped convolution.

    Example ``n``'s gradient correlates its input with its output gradient; with the batch as
    the channel axis and ``groups=B`` every example is its own group (the convolution's stride
    becomes the dilation of this one and vice versa; rows beyond the kernel are cropped).
    """
    b, cin = a.shape[:2]
    cout = g.shape[1]
    kh, kw = module.kernel_size
    if padding != (0, 0):
        a = F.pad(a, (padding[1], padding[1], padding[0], padding[0]))
    out = F.conv2d(a.transpose(0, 1), g.reshape(b * cout, 1, *g.shape[2:]), stride=module.dilation,
                   dilation=module.stride, groups=b)  # (in, B*out, >= kh, >= kw)
    out = out[:, :, :kh, :kw]
    return out.reshape(cin, b, cout, kh, kw).permute(1, 2, 0, 3, 4)


def _conv2d_sq(module: nn.Conv2d, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    b = a.shape[0]
    padding = _conv2d_padding(module)
    g3 = g.reshape(b, g.shape[1], -1)  # (B, out, L)
    w = torch.zeros(module.weight.shape[0], module.weight[0].numel(), dtype=g.dtype, device=g.device)
    grouped = module.weight[0].numel() <= _GROUPED_CONV_MAX_FAN_IN
    for s in _chunks(b, module.weight.numel(), g.device):
        if grouped:
            w += _grouped_conv_grads(module, a[s], g[s], padding).square().sum(0).reshape(w.shape)
        else:
            w += torch.bmm(g3[s], _patches(module, a[s], padding)).square_().sum(0)
    out = {"weight": w.view_as(module.weight)}
    if module.bias is not None:
        out["bias"] = g3.sum(2).square().sum(0)
    return out


def _batchnorm_sq(module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    shape = [1, -1] + [1] * (a.dim() - 2)
    xhat = (a - module.running_mean.view(shape)) * torch.rsqrt(module.running_var.view(shape) + module.eps)
    dims = tuple(range(2, a.dim()))
    out: dict[str, torch.Tensor] = {}
    if module.weight is not None:
        gw = (g * xhat).sum(dims) if dims else g * xhat
        out["weight"] = gw.square().sum(0)
    if module.bias is not None:
        gb = g.sum(dims) if dims else g
        out["bias"] = gb.square().sum(0)
    return out


def _layer_sq(module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    if isinstance(module, nn.Linear):
        return _linear_sq(module, a, g)
    if isinstance(module, nn.Conv2d):
        return _conv2d_sq(module, a, g)
    return _batchnorm_sq(module, a, g)


class _NeedsFallback(Exception):
    """Hooked modules that did not run exactly once in a forward pass (names in args[0]):
    reused layers, or layers whose parameters the parent uses functionally."""


class _Recorder:
    """Forward hooks recording each covered module's input and (pre-clone) output."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        self.modules = modules
        self.records: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.active = False
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in modules.items()]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            if not self.active:
                return None
            self.records.setdefault(name, []).append((args[0].detach(), output))
            # Downstream in-place ops (ReLU(inplace=True)) must not overwrite the tensor we
            # differentiate with respect to, so the rest of the network gets a copy.
            return output.clone()

        return hook

    def take(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        bad = [n for n in self.modules if len(self.records.get(n, ())) != 1]
        if bad:
            self.records = {}
            raise _NeedsFallback(bad)
        out = {n: r[0] for n, r in self.records.items()}
        self.records = {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ------------------------------------------------------------------------------ the passes


def _check_logits(logits: torch.Tensor, y: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"diagonal_fisher: the model must return (batch, classes) logits, got {tuple(logits.shape)}")
    if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
        raise ValueError(f"diagonal_fisher: labels must be integer class indices, got dtype {y.dtype}")
    if y.dim() != 1 or y.shape[0] != logits.shape[0]:
        raise ValueError(f"diagonal_fisher: labels of shape {tuple(y.shape)} for logits {tuple(logits.shape)}")
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= logits.shape[1]):
        raise ValueError(f"diagonal_fisher: labels must lie in [0, {logits.shape[1]}), got {int(y.min())}..{int(y.max())}")


def _vmap_sq(
    model: nn.Module,
    targets: list[str],
    x: torch.Tensor,
    v: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Sum over the batch of squared per-example gradients (``torch.func``) of ``targets``."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.detach() for n, b in model.named_buffers()}
    tp = {n: params[n] for n in targets}
    rest = {n: p for n, p in params.items() if n not in tp}

    def per_example(x1: torch.Tensor, v1: torch.Tensor) -> dict[str, torch.Tensor]:
        def logits(t: dict[str, torch.Tensor]) -> torch.Tensor:
            return functional_call(model, ({**rest, **t}, buffers), (x1.unsqueeze(0),)).squeeze(0)

        _, pullback = vjp(logits, tp)
        (grads,) = vmap(pullback)(v1)  # one pullback per output vector: (R, *shape)
        return {n: g.square().sum(0) for n, g in grads.items()}

    # Bound the (chunk, R, *shape) per-example gradients held at once.
    per_ex = v.shape[1] * sum(p.numel() for p in tp.values())
    chunk = max(1, (_CHUNK_ELEMENTS * 4) // max(1, per_ex))
    sq = vmap(per_example, chunk_size=chunk if chunk < x.shape[0] else None)(x, v)
    return {n: s.sum(0) for n, s in sq.items()}


def _loop_sq(model: nn.Module, x: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Naive reference: one forward and ``R`` backward passes per example."""
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    acc = {n: torch.zeros_like(p) for n, p in zip(names, params)}
    for i in range(x.shape[0]):
        z = model(x[i : i + 1])
        for r in range(v.shape[1]):
            grads = torch.autograd.grad(z, params, grad_outputs=v[i, r].unsqueeze(0), retain_graph=True, allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:
                    acc[n] += g.square()
    return acc


@contextlib.contextmanager
def gradient_mode(
    model: nn.Module, device: torch.device | str | None, who: str = "diagonal_fisher"
) -> Iterator[torch.device]:
    """Eval mode, grad-enabled parameters and (optionally) another device, all restored.

    Shared by every client-side curvature pass (this module and :mod:`fedfiot_flwr.curvature`);
    ``who`` names the caller in the error raised for a model without parameters.
    """
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{who}: the model has no parameters")
    home = params[0].device
    dev = home if device is None else torch.device(device)
    was_training = model.training
    flags = [p.requires_grad for p in params]
    try:
        if dev != home:
            model.to(dev)
        model.eval()
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            yield dev
    finally:
        for p, f in zip(params, flags):
            p.requires_grad_(f)
        model.train(was_training)
        if dev != home:
            model.to(home)


def diagonal_fisher(
    model: nn.Module,
    dataloader: Iterable[Any],
    kind: str = "empirical",
    *,
    method: str = "auto",
    device: torch.device | str | None = None,
    progress: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Diagonal Fisher of ``model`` over every example of ``dataloader``.

    Parameters
    ----------
    model : nn.Module
        Classifier returning ``(batch, classes)`` logits. It is evaluated in eval mode and
        must treat examples independently there (no batch statistics).
    dataloader : Iterable
        Yields ``(x, y)`` batches (or dicts, see :func:`fedfiot_flwr.task.split_batch`); the
        whole iterable is one pass over the client's local data. Use a loader without
        augmentation.
    kind : str
        ``"empirical"`` (observed labels, eq. 106; FedFiOT) or ``"true"`` (expectation over
        the model's predictive distribution; FedFisher).
    method : str
        ``"auto"`` (per-layer closed forms, ``torch.func`` fallback), ``"vmap"`` or ``"loop"``;
        all give the same result up to floating-point rounding.
    device : torch.device or str, optional
        Where to compute; defaults to the device of the model's parameters. The model is
        moved back afterwards.
    progress : bool, optional
        tqdm bar over batches (the ``progress`` extra); ``None`` shows it only on a terminal
        and only when tqdm is installed.

    Returns
    -------
    dict[str, torch.Tensor]
        One non-negative tensor per named parameter (``model.named_parameters()`` order),
        same shape and dtype as the parameter, on the CPU.

    Raises
    ------
    ValueError
        For an unknown ``kind`` or ``method``, a model without parameters, logits that are
        not ``(batch, classes)``, labels out of range or an empty loader.
    """
    if kind not in FISHER_KINDS:
        raise ValueError(f"unknown Fisher kind {kind!r}; choose one of {FISHER_KINDS}")
    if method not in FISHER_METHODS:
        raise ValueError(f"unknown Fisher method {method!r}; choose one of {FISHER_METHODS}")
    excluded: set[str] = set()
    while True:
        try:
            return _diagonal_fisher(model, dataloader, kind, method, device, progress, excluded)
        except _NeedsFallback as err:  # a layer not run exactly once: give it to torch.func
            excluded.update(err.args[0])


def _diagonal_fisher(
    model: nn.Module,
    dataloader: Iterable[Any],
    kind: str,
    method: str,
    device: torch.device | str | None,
    progress: bool | None,
    excluded: set[str],
) -> dict[str, torch.Tensor]:
    names = [n for n, _ in model.named_parameters()]
    with gradient_mode(model, device) as dev:
        acc = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in model.named_parameters()}
        covered: dict[str, nn.Module] = {}
        if method == "auto":
            covered = {n: m for n, m in supported_modules(model).items() if n not in excluded}
        covered_params = {
            f"{mn}.{pn}" if mn else pn: (mn, pn)
            for mn, m in covered.items()
            for pn, _ in m.named_parameters(recurse=False)
        }
        fallback = [n for n in names if n not in covered_params]
        recorder = _Recorder(covered) if covered else None
        total = len(dataloader) if hasattr(dataloader, "__len__") else None  # type: ignore[arg-type]
        bar = progress_bar(dataloader, progress, total=total, desc=f"{kind} Fisher", unit="batch", leave=False)
        seen = 0
        try:
            for batch in bar:
                x, y = split_batch(batch)
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                if method == "loop":
                    with torch.no_grad():
                        logits = model(x)
                    _check_logits(logits, y)
                    sq = _loop_sq(model, x, output_vectors(logits, y, kind))
                else:
                    sq = {}
                    if recorder is not None:
                        recorder.active = True
                        try:
                            logits = model(x)
                        finally:
                            recorder.active = False
                        records = recorder.take()
                    else:
                        with torch.no_grad():
                            logits = model(x)
                        records = {}
                    _check_logits(logits, y)
                    v = output_vectors(logits, y, kind)
                    if records:
                        sq.update(_hooked_sq(covered, records, logits, v))
                    if fallback:
                        sq.update(_vmap_sq(model, fallback, x, v))
                for n, s in sq.items():
                    acc[n] += s.to(torch.float64)
                seen += int(y.shape[0])
        finally:
            bar.close()
            if recorder is not None:
                recorder.remove()
        if seen == 0:
            raise ValueError("diagonal_fisher: the data loader yielded no examples")
        params = dict(model.named_parameters())
        return {n: (acc[n] / seen).to(dtype=params[n].dtype, device="cpu") for n in names}


def _hooked_sq(
    covered: dict[str, nn.Module],
    records: dict[str, tuple[torch.Tensor, torch.Tensor]],
    logits: torch.Tensor,
    v: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Per-layer closed forms, one backward pass per output vector."""
    order = list(records)
    outputs = [records[n][1] for n in order]
    sq: dict[str, torch.Tensor] = {}
    for r in range(v.shape[1]):
        grads = torch.autograd.grad(
            logits, outputs, grad_outputs=v[:, r], retain_graph=r < v.shape[1] - 1, allow_unused=True
        )
        for name, g in zip(order, grads):
            if g is None:  # the layer does not reach the logits: zero Fisher
                continue
            for pn, s in _layer_sq(covered[name], records[name][0], g).items():
                key = f"{name}.{pn}" if name else pn
                sq[key] = sq[key] + s if key in sq else s
    return sq
