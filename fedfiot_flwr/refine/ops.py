"""The refinement's torch operations: run models on server data and correct a merged model's layers.

Forward hooks capture layer inputs and outputs; :func:`least_squares_refine` and :func:`repair`
hand the linear algebra to :mod:`fedfiot_flwr.refine.linalg`. Clients are expected in the merged
model's neuron order (aligned first), so "the mean of the clients' outputs" compares the same
neuron across clients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedfiot_flwr.batches import split_batch
from fedfiot_flwr.batchnorm import has_batchnorm, recompute_batchnorm_statistics
from fedfiot_flwr.refine.linalg import LayerMoments, NeuronStats, reconstruction_error, repair_rescale, ridge_refit
from fedfiot_flwr.options import Model

__all__ = [
    "Capture",
    "ClientOutputs",
    "augment_inputs",
    "channels_last",
    "client_neuron_stats",
    "client_outputs",
    "client_targets",
    "collect_fit",
    "example_weights",
    "fit_batches",
    "layer_modules",
    "add_rows",
    "host_double",
    "layer_moments",
    "least_squares_refine",
    "load_state",
    "model_device",
    "model_state",
    "recalibrate_batchnorm",
    "repair",
]



# --------------------------------------------------------------------------------- models


def load_state(model: nn.Module, state: Mapping[str, np.ndarray]) -> nn.Module:
    """Load a numpy state dict into ``model`` (each tensor cast to the model's dtype); returns ``model``."""
    ref = model.state_dict()
    missing = [k for k in ref if k not in state]
    if missing:
        raise ValueError(f"state lacks tensors {missing[:5]} of the model")
    model.load_state_dict({k: torch.as_tensor(np.asarray(state[k])).to(ref[k].dtype) for k in ref})
    return model


def model_state(model: nn.Module) -> Model:
    """A copy of ``model``'s state dict as numpy arrays."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters live (the CPU for a model without parameters)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def host_double(x: torch.Tensor) -> np.ndarray:
    """``x`` as a float64 numpy array on the host (from any device)."""
    return x.detach().to(device="cpu", dtype=torch.float64).numpy()


@contextlib.contextmanager
def channels_last(model: nn.Module, example: torch.Tensor) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Inside the block ``model`` keeps its 4-d weights channels-last; yields the batch conversion.

    Convolutions and max-pooling of image batches run faster on the CPU in that memory layout;
    the values are the same up to rounding. Other inputs pass unchanged. Enter it outside
    ``torch.inference_mode`` (the weights are re-laid out, and must stay trainable tensors).
    """
    if example.ndim != 4:
        yield lambda x: x
        return
    model.to(memory_format=torch.channels_last)
    try:
        yield lambda x: x.contiguous(memory_format=torch.channels_last)
    finally:
        model.to(memory_format=torch.contiguous_format)


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


def input_rows(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A layer's input as least-squares rows ``(rows, fan_in [+1])`` (bias column last)."""
    if isinstance(module, nn.Conv2d):
        cols = F.unfold(x, module.kernel_size, module.dilation, module.padding, module.stride)  # (B, C*k*k, L)
        r = cols.transpose(1, 2).reshape(-1, cols.shape[1])
    else:
        r = x.reshape(-1, x.shape[-1])
    if module.bias is not None:
        r = torch.cat([r, torch.ones(r.shape[0], 1, dtype=r.dtype, device=r.device)], dim=1)
    return r


def output_rows(module: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """A layer's output as rows ``(rows, out)``, matching :func:`input_rows`."""
    if isinstance(module, nn.Conv2d):
        return y.flatten(2).transpose(1, 2).reshape(-1, y.shape[1])
    return y.reshape(-1, y.shape[-1])


def flat_weight(module: nn.Module) -> np.ndarray:
    w = host_double(module.weight.reshape(module.weight.shape[0], -1))
    if module.bias is not None:
        w = np.concatenate([w, host_double(module.bias)[:, None]], axis=1)
    return w


def setflat_weight(module: nn.Module, w: np.ndarray) -> None:
    with torch.no_grad():
        if module.bias is not None:
            module.bias.copy_(torch.as_tensor(w[:, -1]))
            w = w[:, :-1]
        module.weight.copy_(torch.as_tensor(w).reshape(module.weight.shape))


class StopForward(Exception):
    """Raised by a :class:`Capture` hook to end a forward pass once its layer was recorded."""


class Capture:
    """Forward hooks recording chosen layers' inputs and outputs.

    With ``stop=True`` (inputs only) the forward pass ends, by :class:`StopForward`, as soon
    as the layer's input is recorded: nothing after that layer runs; :meth:`run` catches it.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]], inputs: bool, outputs: bool,
                 stop: bool = False) -> None:
        if stop and outputs:
            raise ValueError("a capture that stops the forward pass records inputs only")
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self._handles = []
        for name, mod in layers:
            if stop:
                def pre_hook(m: nn.Module, a: tuple[Any, ...], name: str = name) -> None:
                    self.inputs[name] = a[0].detach()
                    raise StopForward
                self._handles.append(mod.register_forward_pre_hook(pre_hook))
                continue

            def hook(m: nn.Module, a: tuple[Any, ...], o: torch.Tensor, name: str = name) -> None:
                if inputs:
                    self.inputs[name] = a[0].detach()
                if outputs:
                    self.outputs[name] = o.detach()
            self._handles.append(mod.register_forward_hook(hook))

    @staticmethod
    def run(model: nn.Module, x: torch.Tensor) -> None:
        """``model(x)`` for its hooks' sake, ended early by a stopping capture."""
        try:
            model(x)
        except StopForward:
            pass

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


def collect_fit(loader: Iterable[Any], copies: int, seed: int,
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


def fit_batches(loader: Iterable[Any], copies: int, seed: int,
                batch: int = 500) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """The fitting rows as :func:`collect_fit` makes them, the examples' own batches first.

    Returns ``(batches, labels, n)``: the first ``n`` batches hold the un-augmented examples
    (exactly :func:`collect_fit` with no copies), the rest their augmented copies.
    """
    base, base_labels = collect_fit(loader, 0, seed, batch)
    if copies <= 0:
        return base, base_labels, len(base)
    x, y = torch.cat(base), torch.cat(base_labels)
    extra = augment_inputs(x, copies, torch.Generator().manual_seed(seed))[x.shape[0]:]
    return (base + list(torch.split(extra, batch)), base_labels + list(torch.split(y.repeat(copies), batch)),
            len(base))


# ----------------------------------------------------------------------------- statistics


def example_weights(
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
        return [[torch.full((len(x),), 1.0 / k, device=x.device) for x in batches] for _ in clients]
    if mode == "size":
        assert sizes is not None
        tot = float(sum(sizes))
        return [[torch.full((len(x),), float(n) / tot, device=x.device) for x in batches] for n in sizes]
    probs: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for client in clients:
            load_state(model, client).eval()
            probs.append([torch.softmax(model(x), 1).gather(1, y[:, None]).squeeze(1) + 1e-3
                          for x, y in zip(batches, labels)])
    totals = [sum(p[i] for p in probs) for i in range(len(batches))]
    return [[p[i] / totals[i] for i in range(len(batches))] for p in probs]


def client_targets(
    model: nn.Module, clients: Sequence[Model], weights: Sequence[Sequence[torch.Tensor]],
    layers: Sequence[tuple[str, nn.Module]], batches: Sequence[torch.Tensor],
) -> list[dict[str, torch.Tensor]]:
    """Per batch and layer, the weighted mean of the (aligned) clients' layer outputs (per-row weights)."""
    targets: list[dict[str, torch.Tensor]] = [{} for _ in batches]
    cap = Capture(layers, inputs=False, outputs=True)
    try:
        with torch.no_grad():
            for client, wk in zip(clients, weights):
                load_state(model, client).eval()
                for i, x in enumerate(batches):
                    model(x)
                    for name, _ in layers:
                        out = cap.outputs[name]
                        y = out * wk[i].reshape((-1,) + (1,) * (out.ndim - 1))
                        targets[i][name] = y if name not in targets[i] else targets[i][name] + y
    finally:
        cap.close()
    return targets


@dataclass
class ClientOutputs:
    """The clients' weighted mean outputs on the fitting rows, from one forward pass per client.

    Attributes
    ----------
    targets : list[dict[str, torch.Tensor]]
        Per target batch and layer, the weighted mean of the clients' layer outputs (the
        least-squares targets).
    teacher : list[torch.Tensor]
        Per batch (target batches first), the weighted mean of the clients' last-layer
        outputs (the distillation teacher); empty when not asked for.
    """

    targets: list[dict[str, torch.Tensor]]
    teacher: list[torch.Tensor]


def client_outputs(
    model: nn.Module, clients: Sequence[Model], batches: Sequence[torch.Tensor], labels: Sequence[torch.Tensor],
    layers: Sequence[tuple[str, nn.Module]], mode: str, sizes: Sequence[float] | None, target_batches: int,
    teacher: bool,
) -> ClientOutputs:
    """:func:`example_weights`, :func:`client_targets` and the teacher's logits in one pass per client.

    Each client runs once on each batch; the same forward pass gives the row's label weight
    (``mode`` as in :func:`example_weights`), every layer's output on the first
    ``target_batches`` batches and, with ``teacher``, the last layer's output on all of them.
    Under ``"label"`` the weighted sums are divided by the summed weights at the end, which
    equals weighting by the normalised weights up to rounding; image batches run channels-last
    (:func:`channels_last`).
    """
    if mode == "size":
        assert sizes is not None
        shares = [float(n) / float(sum(sizes)) for n in sizes]
    else:
        shares = [1.0 / len(clients)] * len(clients)
    last = layers[-1][0]
    num: list[dict[str, torch.Tensor]] = [{} for _ in batches]
    total: list[torch.Tensor | None] = [None for _ in batches]
    cap = Capture(layers, inputs=False, outputs=True)
    try:
        with channels_last(model, batches[0]) as layout, torch.inference_mode():
            for j, client in enumerate(clients):
                load_state(model, client).eval()
                for i, (x, y) in enumerate(zip(batches, labels)):
                    if i >= target_batches and not teacher:
                        break
                    logits = model(layout(x))
                    w = (torch.softmax(logits, 1).gather(1, y[:, None]).squeeze(1) + 1e-3 if mode == "label"
                         else torch.full((len(y),), shares[j], device=logits.device))
                    total[i] = w if total[i] is None else total[i] + w
                    names = [n for n, _ in layers] if i < target_batches else [last]
                    for name in names:
                        out = cap.outputs[name]
                        part = out * w.reshape((-1,) + (1,) * (out.ndim - 1))
                        num[i][name] = part if name not in num[i] else num[i][name] + part
    finally:
        cap.close()
    if mode == "label":
        for i, acc in enumerate(num):
            for name, v in acc.items():
                acc[name] = v / total[i].reshape((-1,) + (1,) * (v.ndim - 1))  # type: ignore[union-attr]
    targets = [{n: v for n, v in num[i].items()} for i in range(target_batches)]
    return ClientOutputs(targets, [acc[last] for acc in num if last in acc] if teacher else [])


def client_neuron_stats(
    model: nn.Module, clients: Sequence[Model], weights: Sequence[float], layers: Sequence[tuple[str, nn.Module]],
    batches: Sequence[torch.Tensor],
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per layer, the weighted mean over clients of each neuron's pre-activation mean and std."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    cap = Capture(layers, inputs=False, outputs=True)
    try:
        with torch.no_grad():
            for client, wk in zip(clients, weights):
                load_state(model, client).eval()
                stats = {name: NeuronStats(mod.weight.shape[0]) for name, mod in layers}
                for x in batches:
                    model(x)
                    for name, mod in layers:
                        stats[name].add(host_double(output_rows(mod, cap.outputs[name])))
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
        cap = Capture([(name, mod)], inputs=False, outputs=True)
        stats = NeuronStats(mod.weight.shape[0])
        try:
            with torch.no_grad():
                for x in batches:
                    model(x)
                    stats.add(host_double(output_rows(mod, cap.outputs[name])))
        finally:
            cap.close()
        w, b = repair_rescale(host_double(mod.weight), None if mod.bias is None else host_double(mod.bias),
                              stats, *targets[name])
        with torch.no_grad():
            mod.weight.copy_(torch.as_tensor(w))
            if b is not None:
                mod.bias.copy_(torch.as_tensor(b))


def add_rows(moments: LayerMoments, x: torch.Tensor, y: torch.Tensor) -> None:
    """Accumulate least-squares rows into ``moments``, the products taken in float64 on the rows' device.

    Only the ``(d_in, d_in)`` and ``(d_out, d_in)`` products cross to the host, not the rows.
    """
    x, y = x.double(), y.double()
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != moments.d_in or y.shape != (x.shape[0], moments.d_out):
        raise ValueError(f"rows must be (n, {moments.d_in}) inputs and (n, {moments.d_out}) targets, "
                         f"got {tuple(x.shape)} and {tuple(y.shape)}")
    if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
        raise ValueError("non-finite inputs or targets in the refinement data")
    moments.add_products(host_double(x.T @ x), host_double(y.T @ x), float((y * y).sum()), int(x.shape[0]))


def layer_moments(
    model: nn.Module, name: str, mod: nn.Module, batches: Sequence[torch.Tensor],
    targets: Sequence[Mapping[str, torch.Tensor]], reference: bool = False,
) -> LayerMoments:
    """One layer's least-squares sums: ``model``'s inputs to it against the ``targets`` rows.

    Each forward pass ends at the layer (nothing after it runs) and image batches run
    channels-last (:func:`channels_last`); ``reference`` runs whole forward passes in the
    default layout instead.
    """
    d_in = int(np.prod(mod.weight.shape[1:])) + (mod.bias is not None)
    moments = LayerMoments(d_in, mod.weight.shape[0])
    cap = Capture([(name, mod)], inputs=True, outputs=False, stop=not reference)
    layout_of = contextlib.nullcontext(lambda x: x) if reference else channels_last(model, batches[0])
    try:
        with layout_of as layout, torch.no_grad():
            for x, tgt in zip(batches, targets):
                Capture.run(model, layout(x))
                add_rows(moments, input_rows(mod, cap.inputs[name]), output_rows(mod, tgt[name]))
    finally:
        cap.close()
    return moments


def least_squares_refine(
    model: nn.Module, layers: Sequence[tuple[str, nn.Module]], batches: Sequence[torch.Tensor],
    targets: Sequence[Mapping[str, torch.Tensor]], ridge: float,
    first_moments: dict[str, LayerMoments] | None = None, reference: bool = False,
) -> list[float]:
    """Least-squares refinement in place, layer by layer in forward order.

    For each layer, accumulate the merged model's inputs to it (after the earlier layers were
    refitted) against ``targets`` (the clients' mean outputs, per batch), then replace its
    weights by :func:`fedfiot_flwr.refine.linalg.ridge_refit` with ``ridge``.

    Parameters
    ----------
    first_moments : dict, optional
        A cache of the first layer's sums, shared by refits on the same ``batches`` and
        ``targets`` (that layer's inputs are the data, whatever was refitted): filled on first
        use, read afterwards.
    reference : bool
        Whole forward passes in the default memory layout (:func:`layer_moments`).

    Returns
    -------
    list[float]
        ``[before, after]`` reconstruction MSE of every layer on the fitting rows.
    """
    errors: list[float] = []
    model.eval()
    for pos, (name, mod) in enumerate(layers):
        w0 = flat_weight(mod)
        if pos == 0 and first_moments is not None and name in first_moments:
            moments = first_moments[name]
        else:
            moments = layer_moments(model, name, mod, batches, targets, reference)
            if pos == 0 and first_moments is not None:
                first_moments[name] = moments
        w = ridge_refit(moments, w0, ridge)
        errors += [reconstruction_error(moments, w0), reconstruction_error(moments, w)]
        setflat_weight(mod, w)
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
