"""Derive a :class:`PermutationSpec` from a torch ``nn.Module`` by tracing it with torch.fx.

Only chains are supported: Linear / Conv2d / BatchNorm layers joined by element-wise
activations, pooling, dropout and flatten. Anything else (residual adds, concatenation,
grouped convolutions, a tensor used twice) raises a ``ValueError`` naming the fx node.
torch is imported lazily so that the merge engine itself needs only numpy and scipy.
"""

from __future__ import annotations

from typing import Any

from .spec import Layer, PermutationSpec, chain_spec

# Modules and functions that keep the feature/channel axis as it is.
_PASS_MODULES = (
    "ReLU", "ReLU6", "LeakyReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish", "Tanh", "Sigmoid",
    "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus", "PReLU_", "Identity",
    "MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d", "AdaptiveAvgPool2d", "AdaptiveMaxPool2d",
    "Dropout", "Dropout1d", "Dropout2d", "AlphaDropout",
)
_PASS_FUNCTIONS = {
    "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "mish", "tanh", "sigmoid",
    "hardtanh", "hardswish", "hardsigmoid", "softplus", "max_pool1d", "max_pool2d", "avg_pool1d",
    "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d", "dropout", "dropout1d", "dropout2d",
    "contiguous", "relu_", "sigmoid_", "tanh_",
}
_FLATTEN = {"flatten", "view", "reshape"}
_SHAPE_METHODS = {"size", "dim"}


def _describe(node: Any) -> str:
    return f"fx node {node.name!r} ({node.op} {getattr(node.target, '__name__', node.target)})"


def spec_from_module(module: Any, perm_prefix: str = "P_") -> PermutationSpec:
    """Trace ``module`` with torch.fx and return its permutation spec.

    Parameters
    ----------
    module : torch.nn.Module
        A chain of Linear / Conv2d / BatchNorm1d/2d layers joined by activations, pooling,
        dropout and flatten. The last Linear/Conv2d layer is the output layer (identity).
    perm_prefix : str
        Prefix of the generated permutation names (``P_<module name>``).

    Returns
    -------
    PermutationSpec
        Keys equal ``module.state_dict()``'s keys.

    Raises
    ------
    ValueError
        For any graph that is not such a chain, naming the node it cannot handle.
    """
    from torch import fx, nn

    graph = fx.symbolic_trace(module).graph
    modules = dict(module.named_modules())
    layers: list[Layer] = []
    # State of the tensor flowing down the chain.
    current: Layer | None = None
    channels: int | None = None
    spatial = False  # True while the tensor holds conv feature maps (channel axis 1 of NCHW)
    flattened = False
    chain_node = None

    def is_tensor_arg(arg: Any) -> bool:
        return isinstance(arg, fx.Node) and arg.op not in ("get_attr",) and not _is_shape(arg)

    def _is_shape(node: fx.Node) -> bool:
        return (node.op == "call_method" and node.target in _SHAPE_METHODS) or (
            node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem"
            and isinstance(node.args[0], fx.Node) and _is_shape(node.args[0])
        ) or (node.op == "call_function" and getattr(node.target, "__name__", "") == "getattr")

    for node in graph.nodes:
        if node.op == "placeholder":
            if chain_node is not None:
                raise ValueError(f"spec_from_module: {_describe(node)}: more than one input tensor")
            chain_node = node
            continue
        if node.op == "output" or _is_shape(node):
            continue
        tensor_args = [a for a in list(node.args) + list(node.kwargs.values()) if is_tensor_arg(a)]
        if node.op == "get_attr" or tensor_args != [chain_node]:
            raise ValueError(
                f"spec_from_module: {_describe(node)} is not part of a single chain "
                "(branches, residual adds, concatenation and parameters used directly are not supported; "
                "write a PermutationSpec by hand)"
            )
        others = [u for u in chain_node.users if u is not node and not _is_shape(u) and u.op != "output"]
        if others:
            raise ValueError(
                f"spec_from_module: {_describe(others[0])} is not part of a single chain: it reads "
                f"{chain_node.name!r}, which also feeds {node.name!r} (branches and residual adds are not "
                "supported; write a PermutationSpec by hand)"
            )
        chain_node = node
        if node.op == "call_module":
            sub = modules[node.target]
            kind = type(sub).__name__
            if isinstance(sub, nn.Linear):
                block = 1
                if spatial or flattened:
                    if channels is None or sub.in_features % channels:
                        raise ValueError(
                            f"spec_from_module: {_describe(node)}: in_features {sub.in_features} is not a "
                            f"multiple of the {channels} channels flattened before it"
                        )
                    block = sub.in_features // channels
                if spatial and not flattened:
                    raise ValueError(f"spec_from_module: {_describe(node)}: Linear applied to conv maps without flatten")
                current = Layer(node.target, "linear", sub.bias is not None, None, block)
                layers.append(current)
                channels, spatial, flattened = sub.out_features, False, False
            elif isinstance(sub, nn.Conv2d):
                if sub.groups != 1:
                    raise ValueError(f"spec_from_module: {_describe(node)}: grouped convolution is not supported")
                if flattened:
                    raise ValueError(f"spec_from_module: {_describe(node)}: Conv2d after flatten")
                current = Layer(node.target, "conv", sub.bias is not None)
                layers.append(current)
                channels, spatial = sub.out_channels, True
            elif isinstance(sub, (nn.BatchNorm1d, nn.BatchNorm2d)):
                if current is None or current.norm is not None or not sub.affine:
                    raise ValueError(
                        f"spec_from_module: {_describe(node)}: BatchNorm must follow a Linear/Conv2d layer "
                        "directly, once, and be affine"
                    )
                layers[-1] = current = Layer(current.name, current.kind, current.bias, node.target, current.flatten_block)
            elif isinstance(sub, nn.Flatten):
                flattened = flattened or spatial
            elif kind in _PASS_MODULES or isinstance(sub, nn.Sequential) and len(sub) == 0:
                pass
            else:
                raise ValueError(f"spec_from_module: {_describe(node)}: module type {kind} is not supported")
        elif node.op in ("call_function", "call_method"):
            name = getattr(node.target, "__name__", str(node.target))
            if name in _FLATTEN:
                flattened = flattened or spatial
            elif name not in _PASS_FUNCTIONS:
                raise ValueError(f"spec_from_module: {_describe(node)}: operation {name!r} is not supported")
        else:
            raise ValueError(f"spec_from_module: {_describe(node)}: unsupported node")

    if not layers:
        raise ValueError("spec_from_module: the module has no Linear or Conv2d layer")
    spec = chain_spec(layers, perm_prefix)
    state_keys = list(module.state_dict().keys())
    if set(spec.names) != set(state_keys):
        missing = sorted(set(state_keys) - set(spec.names))
        raise ValueError(
            f"spec_from_module: tensors {missing} of the module are not reached by the traced chain "
            "(parameters or buffers used outside Linear/Conv2d/BatchNorm layers)"
        )
    return PermutationSpec({k: tuple(spec.axes[k]) for k in state_keys})
