"""Coupled channel groups of any ``nn.Module``: a union-find over the axes of a torch.fx graph.

Every axis of every ``state_dict`` tensor and of every intermediate value is an element. Each
operation of the traced graph joins the axes that a hidden-unit permutation must move together
for the operation to commute with it (a Linear layer joins its weight's input axis with the last
axis of its input; an addition joins the matching axes of its operands; a BatchNorm joins its
affine parameters and running statistics with the channel axis; ...). An operation that does not
commute with a permutation of some axis (a convolution's spatial axes, concatenation along an
axis, attention's head dimensions, any operation this module does not know) marks the groups of
those axes *fixed*; so do the model's inputs and outputs. A flatten or reshape that merges a
channel axis with the axes after it makes the merged axis a *block* copy of the channel group
(``(perm, block)`` in a :class:`~fedfiot_flwr.merge.spec.PermutationSpec`).

The result is conservative by construction: an unknown operation can only fix groups, never
join them. :func:`fedfiot_flwr.merge.trace.spec_from_module` also checks every group numerically.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp
from torch.utils._pytree import tree_leaves

Element = tuple  # ("t", tensor name, axis) or ("n", node name, tuple index or None, axis)

# Reasons that make a group fixed without anything being unsupported (never reported).
BOUNDARY_REASONS = frozenset({"model input", "model output", "spatial axis", "reshape", "kernel axis", "unused"})

_ELEMENTWISE = {
    "add", "sub", "mul", "truediv", "floordiv", "neg", "pow", "iadd", "isub", "imul", "itruediv",
    "relu", "relu_", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "mish", "tanh", "sigmoid",
    "hardtanh", "hardswish", "hardsigmoid", "softplus", "softsign", "logsigmoid", "tanh_", "sigmoid_",
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
    "clamp", "clip", "exp", "log", "abs", "sqrt", "rsqrt", "sin", "cos", "erf", "square", "reciprocal",
    "add_", "mul_", "sub_", "div", "div_", "contiguous", "float", "double", "half", "to", "type_as", "clone",
    "detach", "expand", "expand_as", "softmax", "log_softmax",
}
_POOL = {
    "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d",
    "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
}
_RESHAPE = {"reshape", "view", "flatten", "squeeze", "unsqueeze", "view_as", "reshape_as", "unflatten"}
_REDUCE = {"mean", "sum", "amax", "amin", "logsumexp"}
_NON_TENSOR = {"size", "dim", "getattr", "_assert", "eq", "ne", "lt", "gt", "le", "ge", "numel", "len"}
_ELEMENTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid,
    nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign, nn.LogSigmoid, nn.Identity,
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Softmax, nn.LogSoftmax,
)
_POOL_MODULES = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


@dataclass
class ChannelGroups:
    """The derived axis groups of a module's ``state_dict`` tensors.

    Attributes
    ----------
    groups : dict[str, list[tuple[str, int]]]
        Free groups (a permutation each), keyed by a group id: the (tensor, axis) pairs it moves.
    blocks : dict[tuple[str, int], tuple[str, int]]
        (tensor, axis) moved in blocks by a free group: ``(group id, block)`` (flatten outputs).
    fixed : dict[tuple[str, int], set[str]]
        Every (tensor, axis) longer than 1 that cannot be permuted, with the reasons (operation
        names; boundary reasons such as the model's input and output included).
    """

    groups: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    blocks: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    fixed: dict[tuple[str, int], set[str]] = field(default_factory=dict)


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Element, Element] = {}
        self.reasons: dict[Element, set[str]] = {}

    def find(self, x: Element) -> Element:
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: Element, b: Element) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[rb] = ra
            self.reasons.setdefault(ra, set()).update(self.reasons.pop(rb, set()))

    def fix(self, x: Element, reason: str) -> None:
        self.reasons.setdefault(self.find(x), set()).add(reason)

    def reasons_of(self, x: Element) -> set[str]:
        return self.reasons.get(self.find(x), set())


def _is_multi(meta: Any) -> bool:
    """Whether shape-propagation metadata describes several values (TensorMetadata is a tuple too)."""
    return isinstance(meta, (tuple, list)) and not hasattr(meta, "shape")


def _shape(meta: Any) -> tuple[int, ...] | None:
    shape = getattr(meta, "shape", None)
    return None if shape is None else tuple(int(s) for s in shape)


class _GroupBuilder:
    """Walks the traced graph once and records which axes move together."""

    def __init__(self, module: nn.Module, gm: fx.GraphModule) -> None:
        self.module = module
        self.gm = gm
        self.modules = dict(module.named_modules())
        self.state = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        self.uf = _UnionFind()
        self.block_rel: list[tuple[Element, Element, int]] = []  # (derived, source, block)
        self.touched: set[str] = set()
        for name, shape in self.state.items():
            for axis in range(len(shape)):
                self.uf.find(("t", name, axis))

    # ------------------------------------------------------------------ elements of a value
    def value_shapes(self, node: fx.Node) -> list[tuple[Any, tuple[int, ...]]]:
        """``[(index, shape)]`` of the tensors a node produces (index None for a single tensor)."""
        meta = node.meta.get("tensor_meta")
        if meta is None:
            return []
        if _is_multi(meta):
            return [(i, s) for i, m in enumerate(meta) if (s := _shape(m)) is not None]
        shape = _shape(meta)
        return [] if shape is None else [(None, shape)]

    def shape(self, node: Any) -> tuple[int, ...] | None:
        if not isinstance(node, fx.Node):
            return None
        meta = node.meta.get("tensor_meta")
        return None if _is_multi(meta) else _shape(meta)

    @staticmethod
    def el(node: fx.Node, axis: int, index: Any = None) -> Element:
        return ("n", node.name, index, axis)

    def axes(self, node: fx.Node, index: Any = None) -> list[Element]:
        shapes = dict(self.value_shapes(node))
        shape = shapes.get(index)
        return [] if shape is None else [self.el(node, a, index) for a in range(len(shape))]

    def tensor_inputs(self, node: fx.Node) -> list[fx.Node]:
        found = [a for a in tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
        return [a for a in found if self.value_shapes(a)]

    def fix_node(self, node: fx.Node, reason: str) -> None:
        for index, shape in self.value_shapes(node):
            for axis in range(len(shape)):
                self.uf.fix(self.el(node, axis, index), reason)

    def fix_tensor(self, name: str, reason: str) -> None:
        self.touched.add(name)
        for axis in range(len(self.state[name])):
            self.uf.fix(("t", name, axis), reason)

    def unknown(self, node: fx.Node, reason: str, params: Iterable[str] = ()) -> None:
        """An operation that may not commute with any permutation: fix everything it touches."""
        for arg in self.tensor_inputs(node):
            self.fix_node(arg, reason)
        self.fix_node(node, reason)
        for p in params:
            self.fix_tensor(p, reason)

    def param(self, prefix: str, local: str) -> str | None:
        name = f"{prefix}.{local}" if prefix else local
        if name in self.state:
            self.touched.add(name)
            return name
        return None

    @staticmethod
    def own_state(prefix: str, sub: nn.Module) -> list[str]:
        """Names of the ``state_dict`` tensors of submodule ``sub`` (called ``prefix``)."""
        return [f"{prefix}.{k}" for k in sub.state_dict()]

    def join_tensor(self, name: str | None, axis: int, other: Element) -> None:
        if name is not None:
            self.uf.union(("t", name, axis), other)

    # ------------------------------------------------------------------ generic rules
    def broadcast(self, node: fx.Node, inputs: Sequence[fx.Node]) -> None:
        """Elementwise with broadcasting: join equal-sized axes aligned from the right."""
        out = self.shape(node)
        if out is None:
            return self.unknown(node, f"operation {node.target}")
        for arg in inputs:
            shape = self.shape(arg)
            if shape is None:
                return self.unknown(node, f"operation {node.target}")
            for k in range(1, len(shape) + 1):
                if k <= len(out) and shape[-k] == out[-k]:
                    self.uf.union(self.el(arg, len(shape) - k), self.el(node, len(out) - k))
        return None

    def reshape(self, src: fx.Node, dst: fx.Node, src_index: Any = None) -> None:
        """Map axes through a reshape: equal axes join, a merged leading axis becomes a block copy."""
        meta = dict(self.value_shapes(src))
        shape_in, shape_out = meta.get(src_index), self.shape(dst)
        if shape_in is None or shape_out is None:
            return self.unknown(dst, "reshape")
        ins = [(a, s) for a, s in enumerate(shape_in) if s != 1]
        outs = [(a, s) for a, s in enumerate(shape_out) if s != 1]
        i = j = 0
        while i < len(ins) and j < len(outs):
            seg_in, seg_out = [ins[i]], [outs[j]]
            p_in, p_out = ins[i][1], outs[j][1]
            i, j = i + 1, j + 1
            while p_in != p_out:
                if p_in < p_out and i < len(ins):
                    seg_in.append(ins[i])
                    p_in *= ins[i][1]
                    i += 1
                elif p_out < p_in and j < len(outs):
                    seg_out.append(outs[j])
                    p_out *= outs[j][1]
                    j += 1
                else:
                    break
            src_el = [self.el(src, a, src_index) for a, _ in seg_in]
            dst_el = [self.el(dst, a) for a, _ in seg_out]
            if len(seg_in) == 1 and len(seg_out) == 1:
                self.uf.union(src_el[0], dst_el[0])
            elif len(seg_out) == 1:  # merge: the leading input axis moves the output in blocks
                self.block_rel.append((dst_el[0], src_el[0], p_out // seg_in[0][1]))
                for e in src_el[1:]:
                    self.uf.fix(e, "reshape")
            elif len(seg_in) == 1:  # split: the input is a block copy of the leading output axis
                self.block_rel.append((src_el[0], dst_el[0], p_in // seg_out[0][1]))
                for e in dst_el[1:]:
                    self.uf.fix(e, "reshape")
            else:
                for e in src_el + dst_el:
                    self.uf.fix(e, "reshape")
        return None

    def pass_axes(self, src: fx.Node, dst: fx.Node, mapping: Sequence[tuple[int, int]], src_index: Any = None) -> None:
        for a, b in mapping:
            self.uf.union(self.el(src, a, src_index), self.el(dst, b))

    def channel_op(self, node: fx.Node, x: fx.Node) -> None:
        """Pooling and the like: batch and channel axes pass, the others are spatial."""
        shape_in, shape_out = self.shape(x), self.shape(node)
        if shape_in is None or shape_out is None or len(shape_in) != len(shape_out) or len(shape_in) < 2:
            return self.unknown(node, f"operation {node.target}")
        self.pass_axes(x, node, [(0, 0), (1, 1)])
        for a in range(2, len(shape_in)):
            self.uf.fix(self.el(x, a), "spatial axis")
            self.uf.fix(self.el(node, a), "spatial axis")
        return None

    # ------------------------------------------------------------------ modules
    def call_module(self, node: fx.Node) -> None:
        sub = self.modules[node.target]
        prefix = str(node.target)
        inputs = self.tensor_inputs(node)
        x = inputs[0] if inputs else None
        shape_in, shape_out = self.shape(x), self.shape(node)
        if isinstance(sub, _ELEMENTWISE_MODULES):
            return self.broadcast(node, inputs)
        if isinstance(sub, _POOL_MODULES) and x is not None:
            return self.channel_op(node, x)
        if isinstance(sub, nn.Flatten) and x is not None:
            return self.reshape(x, node)
        if shape_in is None or shape_out is None or len(inputs) != 1:
            if isinstance(sub, nn.MultiheadAttention):
                return self.attention(node, sub, prefix)
            return self.unknown(node, f"module type {type(sub).__name__}", self.own_state(prefix, sub))
        if isinstance(sub, nn.Linear):
            self.join_tensor(self.param(prefix, "weight"), 1, self.el(x, len(shape_in) - 1))
            self.join_tensor(self.param(prefix, "weight"), 0, self.el(node, len(shape_out) - 1))
            self.join_tensor(self.param(prefix, "bias"), 0, self.el(node, len(shape_out) - 1))
            self.pass_axes(x, node, [(a, a) for a in range(len(shape_in) - 1)])
            return None
        if isinstance(sub, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            return self.conv(node, sub, prefix, x, shape_in, shape_out)
        if isinstance(sub, _BATCHNORMS) or (isinstance(sub, nn.GroupNorm) and sub.num_groups in (1, sub.num_channels)):
            self.pass_axes(x, node, [(a, a) for a in range(len(shape_in))])
            for local in ("weight", "bias", "running_mean", "running_var"):
                self.join_tensor(self.param(prefix, local), 0, self.el(node, 1))
            self.param(prefix, "num_batches_tracked")
            return None
        if isinstance(sub, nn.LayerNorm):
            self.pass_axes(x, node, [(a, a) for a in range(len(shape_in))])
            k = len(sub.normalized_shape)
            for j in range(k):
                for local in ("weight", "bias"):
                    self.join_tensor(self.param(prefix, local), j, self.el(node, len(shape_out) - k + j))
            return None
        if isinstance(sub, nn.Embedding):
            weight = self.param(prefix, "weight")
            self.join_tensor(weight, 1, self.el(node, len(shape_out) - 1))
            if weight is not None:
                self.uf.fix(("t", weight, 0), "embedding rows")
            self.pass_axes(x, node, [(a, a) for a in range(len(shape_in))])
            return None
        if isinstance(sub, nn.MultiheadAttention):
            return self.attention(node, sub, prefix)
        reason = f"module type {type(sub).__name__}"
        if isinstance(sub, nn.GroupNorm):
            reason = f"GroupNorm with {sub.num_groups} groups of several channels"
        return self.unknown(node, reason, self.own_state(prefix, sub))

    def conv(self, node: fx.Node, sub: nn.Module, prefix: str, x: fx.Node,
             shape_in: tuple[int, ...], shape_out: tuple[int, ...]) -> None:
        weight, bias = self.param(prefix, "weight"), self.param(prefix, "bias")
        if len(shape_in) != len(shape_out) or len(shape_in) < 3:  # unbatched input: leave it alone
            return self.unknown(node, "unbatched convolution", [n for n in (weight, bias) if n])
        self.pass_axes(x, node, [(0, 0)])
        for a in range(2, len(shape_in)):
            self.uf.fix(self.el(x, a), "spatial axis")
            self.uf.fix(self.el(node, a), "spatial axis")
        if weight is not None:
            for a in range(2, len(self.state[weight])):
                self.uf.fix(("t", weight, a), "kernel axis")
        out_c = self.el(node, 1)
        self.join_tensor(weight, 0, out_c)
        self.join_tensor(bias, 0, out_c)
        groups, c_in, c_out = sub.groups, sub.in_channels, sub.out_channels
        if groups == 1:
            self.join_tensor(weight, 1, self.el(x, 1))
        elif groups == c_in == c_out:  # depthwise: each channel keeps its own filter
            self.uf.union(self.el(x, 1), out_c)
        elif groups == c_in:  # depthwise with a channel multiplier: blocks of c_out // c_in outputs
            self.block_rel.append((out_c, self.el(x, 1), c_out // c_in))
        else:
            reason = f"grouped convolution ({groups} groups)"
            self.uf.fix(self.el(x, 1), reason)
            self.uf.fix(out_c, reason)
            if weight is not None:
                self.uf.fix(("t", weight, 1), reason)
        return None

    def attention(self, node: fx.Node, sub: nn.MultiheadAttention, prefix: str) -> None:
        """Self-attention commutes with a permutation of the embedding axis (heads stay fixed)."""
        args = list(node.args) + [node.kwargs.get(k) for k in ("query", "key", "value")]
        qkv = [a for a in args[:3] + args[len(node.args):] if isinstance(a, fx.Node) and self.shape(a) is not None]
        outs = dict(self.value_shapes(node))
        in_w = self.param(prefix, "in_proj_weight")
        ok = (sub._qkv_same_embed_dim and in_w is not None and sub.bias_k is None and not sub.add_zero_attn
              and len(qkv) >= 1 and 0 in outs)
        if not ok:
            return self.unknown(node, "attention with separate or extra projections", self.own_state(prefix, sub))
        reason = "attention heads"
        self.uf.fix(("t", in_w, 0), reason)
        in_b = self.param(prefix, "in_proj_bias")
        if in_b is not None:
            self.uf.fix(("t", in_b, 0), reason)
        out_w, out_b = self.param(prefix, "out_proj.weight"), self.param(prefix, "out_proj.bias")
        if out_w is not None:
            self.uf.fix(("t", out_w, 1), reason)
        for a in qkv:
            shape = self.shape(a)
            self.join_tensor(in_w, 1, self.el(a, len(shape) - 1))
            for axis in range(len(shape) - 1):
                self.uf.fix(self.el(a, axis), "attention sequence axis")
        out_shape = outs[0]
        last = self.el(node, len(out_shape) - 1, 0)
        self.join_tensor(out_w, 0, last)
        self.join_tensor(out_b, 0, last)
        for axis in range(len(out_shape) - 1):
            self.uf.fix(self.el(node, axis, 0), "attention sequence axis")
        for index, shape in outs.items():
            if index != 0:
                for axis in range(len(shape)):
                    self.uf.fix(self.el(node, axis, index), "attention weights")
        return None

    # ------------------------------------------------------------------ functions and methods
    def call_function(self, node: fx.Node) -> None:
        name = getattr(node.target, "__name__", str(node.target)).lstrip("_") if node.op == "call_function" \
            else str(node.target)
        inputs = self.tensor_inputs(node)
        produces = bool(self.value_shapes(node))
        if node.op == "call_function" and node.target is getattr:  # .shape is harmless, .values is not
            return self.unknown(node, f"attribute {node.args[1]}") if produces else None
        first = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(first, fx.Node) and self.shape(first) is None:
            return self.getitem(node, first, node.args[1]) if produces else None  # an element of a tuple
        if not produces and name in _NON_TENSOR | {"assert"}:
            return None
        if not inputs and produces:
            return self.fix_node(node, "constant")
        if not produces:
            return self.unknown(node, f"operation {name}")
        if node.target is operator.getitem and isinstance(first, fx.Node):
            return self.getitem(node, first, node.args[1])
        if name in _ELEMENTWISE:
            return self.broadcast(node, inputs)
        if name in _POOL and isinstance(first, fx.Node):
            return self.channel_op(node, first)
        if name in _RESHAPE and isinstance(first, fx.Node):
            return self.reshape(first, node)
        if name in ("permute", "transpose", "t") and isinstance(first, fx.Node):
            return self.transpose(node, first, name)
        if name in _REDUCE and isinstance(first, fx.Node):
            return self.reduce(node, first)
        if name in ("cat", "concat", "concatenate", "stack"):
            return self.concat(node, name)
        return self.unknown(node, f"operation {name}")

    def getitem(self, node: fx.Node, src: fx.Node, index: Any) -> None:
        if isinstance(self.shape(src), tuple):
            return self.tensor_index(node, src, index)
        if isinstance(index, int) and index in dict(self.value_shapes(src)):
            shape = dict(self.value_shapes(src))[index]
            if self.shape(node) == shape:
                return self.pass_axes(src, node, [(a, a) for a in range(len(shape))], src_index=index)
        return self.unknown(node, "indexing")

    def tensor_index(self, node: fx.Node, src: fx.Node, index: Any) -> None:
        shape_in, shape_out = self.shape(src), self.shape(node)
        items = list(index) if isinstance(index, tuple) else [index]
        if shape_in is None or shape_out is None:
            return self.unknown(node, "indexing")
        consumed = sum(1 for it in items if it is not None and it is not Ellipsis)
        i = j = 0
        for it in items:
            if it is Ellipsis:
                for _ in range(len(shape_in) - consumed):
                    self.uf.union(self.el(src, i), self.el(node, j))
                    i, j = i + 1, j + 1
            elif it is None:
                j += 1
            elif isinstance(it, int):
                self.uf.fix(self.el(src, i), "indexing")
                i += 1
            elif isinstance(it, slice) and it == slice(None):
                self.uf.union(self.el(src, i), self.el(node, j))
                i, j = i + 1, j + 1
            elif isinstance(it, slice):
                self.uf.fix(self.el(src, i), "slicing")
                self.uf.fix(self.el(node, j), "slicing")
                i, j = i + 1, j + 1
            else:
                return self.unknown(node, "indexing")
        while i < len(shape_in) and j < len(shape_out):
            self.uf.union(self.el(src, i), self.el(node, j))
            i, j = i + 1, j + 1
        return None

    def transpose(self, node: fx.Node, src: fx.Node, name: str) -> None:
        shape = self.shape(src)
        if shape is None:
            return self.unknown(node, name)
        n = len(shape)
        rest = [a for a in list(node.args[1:]) + list(node.kwargs.values())]
        if name == "permute":
            dims = list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else list(rest)
            order = [int(d) % n for d in dims]
        else:
            a, b = (0, 1) if name == "t" else (int(rest[0]) % n, int(rest[1]) % n)
            order = list(range(n))
            order[a], order[b] = order[b], order[a]
        return self.pass_axes(src, node, [(src_axis, out_axis) for out_axis, src_axis in enumerate(order)])

    def reduce(self, node: fx.Node, src: fx.Node) -> None:
        shape_in, shape_out = self.shape(src), self.shape(node)
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if shape_in is None or shape_out is None or dim is None:
            return self.unknown(node, f"reduction {node.target}")
        dims = {int(d) % len(shape_in) for d in (dim if isinstance(dim, (tuple, list)) else [dim])}
        keep = len(shape_out) == len(shape_in)
        j = 0
        for a in range(len(shape_in)):
            if a in dims:  # a sum over a permuted axis is unchanged by the permutation
                j += int(keep)
                continue
            self.uf.union(self.el(src, a), self.el(node, j))
            j += 1
        return None

    def concat(self, node: fx.Node, name: str) -> None:
        parts = node.args[0] if node.args else node.kwargs.get("tensors")
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        out = self.shape(node)
        if not isinstance(parts, (list, tuple)) or out is None or not all(isinstance(p, fx.Node) for p in parts):
            return self.unknown(node, name)
        cut = int(dim) % len(out)
        reason = f"{name} along axis {cut}"
        self.uf.fix(self.el(node, cut), reason)
        for part in parts:
            shape = self.shape(part)
            if shape is None:
                return self.unknown(node, name)
            out_axes = [a for a in range(len(out)) if a != cut]
            in_axes = list(range(len(shape)))
            if name != "stack":
                self.uf.fix(self.el(part, cut), reason)
                in_axes = [a for a in in_axes if a != cut]
            for a, b in zip(in_axes, out_axes):
                self.uf.union(self.el(part, a), self.el(node, b))
        return None

    # ------------------------------------------------------------------ driver
    def run(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.fix_node(node, "model input")
            elif node.op == "output":
                for arg in self.tensor_inputs(node):
                    self.fix_node(arg, "model output")
            elif node.op == "get_attr":
                target = str(node.target)
                if target in self.state:
                    self.touched.add(target)
                    for axis in range(len(self.state[target])):
                        self.uf.union(("t", target, axis), self.el(node, axis))
                else:
                    self.fix_node(node, "constant")
            elif node.op == "call_module":
                self.call_module(node)
            else:
                self.call_function(node)
        for name in self.state:
            if name not in self.touched:
                self.fix_tensor(name, "unused")

    def result(self) -> ChannelGroups:
        uf = self.uf
        # A block copy is only movable together with its source: fixing either fixes both.
        relations: dict[Element, tuple[Element, int]] = {}
        for derived, source, block in self.block_rel:
            d, s = uf.find(derived), uf.find(source)
            if d in relations and relations[d] != (s, block) or d == s:
                uf.fix(d, "conflicting reshapes")
                uf.fix(s, "conflicting reshapes")
            relations.setdefault(d, (s, block))
        changed = True
        while changed:
            changed = False
            for d, (s, _) in relations.items():
                d_fixed, s_fixed = bool(uf.reasons_of(d)), bool(uf.reasons_of(s))
                if d_fixed and not s_fixed:
                    uf.fix(s, next(iter(uf.reasons_of(d))))
                    changed = True

        def resolve(root: Element, depth: int = 0) -> tuple[Element, int] | None:
            if root not in relations:
                return None
            source, block = relations[root]
            if depth > 64:
                return None
            further = resolve(uf.find(source), depth + 1)
            return (uf.find(source), block) if further is None else (further[0], further[1] * block)

        out = ChannelGroups()
        members: dict[Element, list[tuple[str, int]]] = {}
        for name, shape in self.state.items():
            for axis, size in enumerate(shape):
                if size <= 1:
                    continue
                root = uf.find(("t", name, axis))
                if uf.reasons_of(root):
                    out.fixed[(name, axis)] = set(uf.reasons_of(root))
                    continue
                members.setdefault(root, []).append((name, axis))
        ids: dict[Element, str] = {}
        for root, axes in members.items():
            if root not in relations:
                ids[root] = f"g{len(ids)}"
                out.groups[ids[root]] = axes
        for root, axes in members.items():
            if root in relations:
                source = resolve(root)
                for name, axis in axes:
                    if source is not None and source[0] in ids:
                        out.blocks[(name, axis)] = (ids[source[0]], source[1])
                    else:
                        out.fixed[(name, axis)] = {"reshape"}
        return out


def derive_channel_groups(module: nn.Module, example_input: Any) -> ChannelGroups:
    """Trace ``module`` with torch.fx, propagate shapes on ``example_input`` and group its axes.

    Parameters
    ----------
    module : nn.Module
        Any module that torch.fx can trace (torch.nn layers are kept as leaves).
    example_input : torch.Tensor or tuple of torch.Tensor
        A batch the module accepts (positional arguments when a tuple).

    Returns
    -------
    ChannelGroups

    Raises
    ------
    Exception
        Whatever torch.fx raises when the module cannot be traced or run on the input.
    """
    gm = fx.GraphModule(module, fx.Tracer().trace(module))
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(*args)
    finally:
        module.train(was_training)
    builder = _GroupBuilder(module, gm)
    builder.run()
    return builder.result()
