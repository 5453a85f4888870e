"""Permutation specs: which axes of which tensors share a permutation (Git Re-Basin style).

A :class:`PermutationSpec` maps every tensor name to one entry per axis. An entry is

* ``None`` -- the axis is never permuted (input features, class logits, kernel taps);
* ``"P"`` -- permutation ``P`` reorders the axis element by element;
* ``("P", b)`` -- permutation ``P`` reorders contiguous blocks of ``b`` elements
  (a conv -> linear flatten: conv channel ``c`` owns input columns ``c*b .. (c+1)*b - 1``).

Permutations follow one convention everywhere: for a client permutation ``p``, global
neuron ``i`` receives the client's neuron ``p[i]`` (``permuted = x[p]`` along the axis).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

AxisEntry = Union[str, tuple[str, int], None]


@dataclass(frozen=True)
class AxisPerm:
    """A permutation acting on one axis, in blocks of ``block`` elements."""

    perm: str
    block: int = 1


def _normalise_entry(tensor: str, axis: int, entry: object) -> AxisPerm | None:
    if entry is None:
        return None
    if isinstance(entry, str):
        return AxisPerm(entry, 1)
    if isinstance(entry, AxisPerm):
        return entry
    if (
        isinstance(entry, tuple)
        and len(entry) == 2
        and isinstance(entry[0], str)
        and isinstance(entry[1], (int, np.integer))
        and entry[1] >= 1
    ):
        return AxisPerm(entry[0], int(entry[1]))
    raise ValueError(
        f"tensor {tensor!r}, axis {axis}: an axis entry must be None, a permutation name or "
        f"(name, block >= 1), got {entry!r}"
    )


class PermutationSpec:
    """Which axes of which tensors move together under each hidden-unit permutation.

    Parameters
    ----------
    axes : Mapping[str, Sequence[AxisEntry]]
        For every tensor of the model (in layer order), one entry per axis: ``None``,
        a permutation name, or ``(name, block)`` for block-wise (flatten) permutation.

    Attributes
    ----------
    names : list[str]
        Tensor names in the given order.
    perm_names : list[str]
        Permutation names in layer order (the order in which the merge processes them).
    axes : dict[str, tuple[AxisPerm | None, ...]]
        Normalised axis entries.

    Examples
    --------
    >>> spec = PermutationSpec({"w1": ("P0", None), "b1": ("P0",), "w2": (None, "P0")})
    >>> spec.perm_names
    ['P0']
    >>> spec.neuron_tensors("P0")
    ['w1', 'b1']
    """

    def __init__(self, axes: Mapping[str, Sequence[AxisEntry]]) -> None:
        if not isinstance(axes, Mapping):
            raise ValueError(f"PermutationSpec expects a mapping of tensor name -> axes, got {type(axes)}")
        self.axes: dict[str, tuple[AxisPerm | None, ...]] = {}
        for name, entries in axes.items():
            if isinstance(entries, (str, AxisPerm)) or entries is None:
                raise ValueError(f"tensor {name!r}: axes must be a tuple with one entry per axis, got {entries!r}")
            self.axes[name] = tuple(_normalise_entry(name, i, e) for i, e in enumerate(entries))
        order: list[str] = []
        for entries in self.axes.values():
            for entry in entries:
                if entry is not None and entry.perm not in order:
                    order.append(entry.perm)
        for perm in order:
            if not self.neuron_tensors(perm):
                raise ValueError(
                    f"permutation {perm!r} acts on no tensor's leading axis, so it has no neurons to align"
                )
        self.perm_names: list[str] = order

    @property
    def names(self) -> list[str]:
        """Tensor names in spec order."""
        return list(self.axes)

    def neuron_tensors(self, perm: str) -> list[str]:
        """Tensors whose leading axis is permuted by ``perm`` (the neurons' incoming parameters)."""
        return [n for n, e in self.axes.items() if e and e[0] is not None and e[0].perm == perm]

    def hidden_permutations(self) -> list[str]:
        """All permutation names (hidden layers; output layers carry no permutation)."""
        return list(self.perm_names)

    def sizes(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
        """Number of neurons of every permutation, checked for consistency against ``shapes``.

        Raises
        ------
        ValueError
            If a tensor is missing, has the wrong number of axes, or two axes disagree on a size.
        """
        sizes: dict[str, int] = {}
        for name, entries in self.axes.items():
            if name not in shapes:
                raise ValueError(f"the permutation spec names tensor {name!r}, which the model does not have")
            shape = tuple(shapes[name])
            if len(shape) != len(entries):
                raise ValueError(
                    f"tensor {name!r} has shape {shape} ({len(shape)} axes) but the spec gives {len(entries)} axes"
                )
            for axis, entry in enumerate(entries):
                if entry is None:
                    continue
                if shape[axis] % entry.block:
                    raise ValueError(
                        f"tensor {name!r}, axis {axis}: length {shape[axis]} is not a multiple of block {entry.block}"
                    )
                n = shape[axis] // entry.block
                if sizes.setdefault(entry.perm, n) != n:
                    raise ValueError(
                        f"permutation {entry.perm!r} has {sizes[entry.perm]} neurons elsewhere but tensor "
                        f"{name!r}, axis {axis} gives {n}"
                    )
        return sizes

    def __repr__(self) -> str:
        return f"PermutationSpec({len(self.axes)} tensors, permutations={self.perm_names})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PermutationSpec) and self.axes == other.axes


def expand_block_permutation(p: np.ndarray, block: int) -> np.ndarray:
    """Index array that moves contiguous blocks of ``block`` elements according to ``p``.

    >>> expand_block_permutation(np.array([1, 0]), 2).tolist()
    [2, 3, 0, 1]
    """
    if block == 1:
        return p
    return (p[:, None] * block + np.arange(block)[None, :]).reshape(-1)


def permute_tensor(
    x: np.ndarray,
    entries: Sequence[AxisPerm | None],
    perms: Mapping[str, np.ndarray],
    skip_axes: Sequence[int] = (),
) -> np.ndarray:
    """Apply every permutation of ``perms`` that acts on an axis of ``x``.

    Axes whose permutation is absent from ``perms`` (not yet decided) or listed in
    ``skip_axes`` are left as they are.
    """
    for axis, entry in enumerate(entries):
        if entry is None or axis in skip_axes or entry.perm not in perms:
            continue
        x = np.take(x, expand_block_permutation(perms[entry.perm], entry.block), axis=axis)
    return x


def apply_permutations(
    model: Mapping[str, np.ndarray], spec: PermutationSpec, perms: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Return ``model`` with every tensor permuted by ``perms`` (global i <- model neuron p[i]).

    Tensors the spec does not name are returned unchanged. Permuting hidden neurons together
    with the matching input axes of the next layer leaves the network's function unchanged.
    """
    return {
        name: permute_tensor(np.asarray(x), spec.axes[name], perms) if name in spec.axes else np.asarray(x)
        for name, x in model.items()
    }


def invert_permutation(p: np.ndarray) -> np.ndarray:
    """Inverse of a permutation index array."""
    inv = np.empty_like(p)
    inv[p] = np.arange(len(p))
    return inv


@dataclass(frozen=True)
class Layer:
    """One weighted layer of a chain network, for :func:`chain_spec`.

    Parameters
    ----------
    name : str
        Module name (tensor prefix), e.g. ``"conv1"`` for ``conv1.weight``.
    kind : str
        ``"linear"`` or ``"conv"``.
    bias : bool
        Whether the layer has a ``<name>.bias`` tensor.
    norm : str or None
        Name of a BatchNorm module applied to this layer's output (moves with its channels).
    flatten_block : int
        For a linear layer that follows a flatten of conv feature maps: spatial positions per
        channel (``H*W``); 1 otherwise.
    """

    name: str
    kind: str = "linear"
    bias: bool = True
    norm: str | None = None
    flatten_block: int = 1


def chain_spec(layers: Sequence[Layer], perm_prefix: str = "P_") -> PermutationSpec:
    """Spec for a chain of Linear/Conv2d layers; the last layer is the (unpermuted) output.

    >>> chain_spec([Layer("fc1"), Layer("fc2")]).axes["fc2.weight"]
    (None, AxisPerm(perm='P_fc1', block=1))
    """
    if not layers:
        raise ValueError("chain_spec needs at least one layer")
    axes: dict[str, tuple[AxisEntry, ...]] = {}
    incoming: str | None = None
    for index, layer in enumerate(layers):
        if layer.kind not in ("linear", "conv"):
            raise ValueError(f"layer {layer.name!r}: kind must be 'linear' or 'conv', got {layer.kind!r}")
        out = None if index == len(layers) - 1 else f"{perm_prefix}{layer.name}"
        inp: AxisEntry = None if incoming is None else (
            (incoming, layer.flatten_block) if layer.flatten_block > 1 else incoming
        )
        extra: tuple[AxisEntry, ...] = (None, None) if layer.kind == "conv" else ()
        axes[f"{layer.name}.weight"] = (out, inp, *extra)
        if layer.bias:
            axes[f"{layer.name}.bias"] = (out,)
        if layer.norm is not None:
            for suffix in ("weight", "bias", "running_mean", "running_var"):
                axes[f"{layer.norm}.{suffix}"] = (out,)
            axes[f"{layer.norm}.num_batches_tracked"] = ()
        incoming = out
    return PermutationSpec(axes)


def mlp_spec(linear: Sequence[str], bias: bool = True) -> PermutationSpec:
    """Spec of an MLP given its Linear module names in order (the last is the output layer).

    >>> mlp_spec(["fc1", "fc2"]).perm_names
    ['P_fc1']
    """
    return chain_spec([Layer(n, "linear", bias) for n in linear])


def cnn_spec(
    conv: Sequence[str],
    linear: Sequence[str],
    flatten_block: int,
    norms: Sequence[str | None] | None = None,
    bias: bool = True,
) -> PermutationSpec:
    """Spec of a plain CNN: Conv2d layers, a flatten, then Linear layers (last = output).

    Parameters
    ----------
    conv, linear : Sequence[str]
        Module names of the Conv2d and Linear layers in order.
    flatten_block : int
        Spatial positions per channel at the flatten (``H*W`` of the last feature map).
    norms : Sequence[str | None], optional
        BatchNorm module following each conv layer (``None`` where there is none).
    bias : bool
        Whether every layer has a bias.
    """
    norms = list(norms) if norms is not None else [None] * len(conv)
    if len(norms) != len(conv):
        raise ValueError(f"norms has {len(norms)} entries for {len(conv)} conv layers")
    layers = [Layer(c, "conv", bias, n) for c, n in zip(conv, norms)]
    layers += [Layer(n, "linear", bias, None, flatten_block if i == 0 else 1) for i, n in enumerate(linear)]
    return chain_spec(layers)
