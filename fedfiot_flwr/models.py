"""Models of the paper and small test models, each with its merge permutation spec.

``build_model(name, input_shape, num_classes, seed)`` builds one of

- ``"fednet"``: the paper's CNN (FedFisher's ``FedNet``, after Wang et al. 2020): conv 5x5
  32, ReLU, max-pool 2, conv 5x5 64, ReLU, max-pool 2, fc 512, fc 128, fc ``num_classes``,
  ReLU between layers, no padding and no biases. 939,616 weights on 32x32x3 inputs
  (flatten block 5x5), 643,104 on 28x28x1 (flatten block 4x4).
- ``"lenet"``: FedFisher's LeNet-5 variant, same layout with 6 and 16 channels and fc 120,
  fc 84, fc ``num_classes`` (no biases).
- ``"mlp"``: flatten, fc 128, ReLU, fc 64, ReLU, fc ``num_classes`` with biases; for
  scikit-learn's 8x8 digits that is 64-128-64-10 (17,226 parameters).
- ``"resnet20"``: the CIFAR-style ResNet-20 of He et al. (2016) with BatchNorm: conv 3x3,
  three stages of three basic blocks (16, 32, 64 channels at the default ``width=16``),
  1x1 conv + BN shortcuts where the shape changes, global average pool, fc. 272,474
  parameters on 3-channel inputs with 10 classes; any input size works. ``"resnet20-w8"``
  (any ``-w<N>``) sets the first stage's width.

All weights get Xavier-uniform initialisation and biases zeros (paper, Appendix C.2); a
``seed`` makes the initialisation reproducible without touching torch's global RNG.
``permutation_spec(model)`` returns the merge engine's spec, with keys equal to
``model.state_dict()``'s keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedfiot_flwr.merge import PermutationSpec, cnn_spec, mlp_spec, spec_from_module

__all__ = ["MODEL_NAMES", "BasicBlock", "ConvNet", "MLP", "ResNet20", "build_model", "is_model_name",
           "permutation_spec", "xavier_init_"]

MODEL_NAMES = ("fednet", "lenet", "mlp", "resnet20")


def is_model_name(name: str) -> bool:
    """Whether :func:`build_model` knows ``name`` (any case; ``resnet20-w<N>`` included)."""
    key = name.lower()
    return key in MODEL_NAMES or (key.startswith("resnet20-w") and key[len("resnet20-w"):].isdigit())


class ConvNet(nn.Module):
    """Two 'valid' conv + max-pool blocks, a flatten and three Linear layers.

    Parameters
    ----------
    input_shape : tuple[int, int, int]
        ``(C, H, W)`` of one example.
    num_classes : int
        Outputs of the last layer (logits).
    channels : Sequence[int]
        Output channels of ``conv1`` and ``conv2``.
    hidden : Sequence[int]
        Widths of ``fc1`` and ``fc2``.
    kernel_size : int
        Square kernel of both convolutions (stride 1, no padding).
    bias : bool
        Whether every layer has a bias.

    Attributes
    ----------
    conv_names, linear_names : tuple[str, ...]
        Module names in layer order (what the permutation spec needs).
    flatten_block : int
        Spatial positions per channel at the flatten.
    """

    conv_names = ("conv1", "conv2")
    linear_names = ("fc1", "fc2", "fc3")

    def __init__(
        self,
        input_shape: tuple[int, int, int],
        num_classes: int,
        channels: Sequence[int] = (32, 64),
        hidden: Sequence[int] = (512, 128),
        kernel_size: int = 5,
        bias: bool = False,
    ) -> None:
        super().__init__()
        c, h, w = input_shape
        for _ in range(2):
            h, w = (h - kernel_size + 1) // 2, (w - kernel_size + 1) // 2
            if h < 1 or w < 1:
                raise ValueError(
                    f"input shape {tuple(input_shape)} is too small for two {kernel_size}x{kernel_size} "
                    "conv + 2x2 pool blocks"
                )
        self.input_shape = (int(c), int(input_shape[1]), int(input_shape[2]))
        self.flatten_block = int(h * w)
        self.bias = bool(bias)
        self.conv1 = nn.Conv2d(c, channels[0], kernel_size, bias=bias)
        self.conv2 = nn.Conv2d(channels[0], channels[1], kernel_size, bias=bias)
        self.fc1 = nn.Linear(channels[1] * self.flatten_block, hidden[0], bias=bias)
        self.fc2 = nn.Linear(hidden[0], hidden[1], bias=bias)
        self.fc3 = nn.Linear(hidden[1], num_classes, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, num_classes)``."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class MLP(nn.Module):
    """Flatten, then Linear layers ``fc1 .. fcL`` with ReLU between them.

    Parameters
    ----------
    in_features : int
        Inputs after flattening one example.
    num_classes : int
        Outputs of the last layer (logits).
    hidden : Sequence[int]
        Hidden widths.
    bias : bool
        Whether every layer has a bias.
    """

    def __init__(
        self, in_features: int, num_classes: int, hidden: Sequence[int] = (128, 64), bias: bool = True
    ) -> None:
        super().__init__()
        widths = [int(in_features), *map(int, hidden), int(num_classes)]
        self.linear_names = tuple(f"fc{i + 1}" for i in range(len(widths) - 1))
        self.bias = bool(bias)
        for name, fan_in, fan_out in zip(self.linear_names, widths[:-1], widths[1:]):
            self.add_module(name, nn.Linear(fan_in, fan_out, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, num_classes)``."""
        x = torch.flatten(x, 1)
        *hidden, last = self.linear_names
        for name in hidden:
            x = F.relu(getattr(self, name)(x))
        return getattr(self, last)(x)


class BasicBlock(nn.Module):
    """Two 3x3 conv + BN layers and a residual add (1x1 conv + BN shortcut when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """CIFAR-style ResNet-20 with BatchNorm (3 stages x 3 basic blocks).

    Parameters
    ----------
    in_channels : int
        Channels of the input images.
    num_classes : int
        Outputs of the last layer (logits).
    width : int
        Channels of the first stage; the others have ``2 * width`` and ``4 * width``.
    blocks_per_stage : int
        Basic blocks per stage (3 for ResNet-20, 5 for ResNet-32, ...).
    """

    def __init__(self, in_channels: int, num_classes: int, width: int = 16, blocks_per_stage: int = 3) -> None:
        super().__init__()
        if width < 1 or blocks_per_stage < 1:
            raise ValueError(f"width and blocks_per_stage must be >= 1, got {width}, {blocks_per_stage}")
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages: list[nn.Module] = []
        channels = width
        for stage, out in enumerate((width, 2 * width, 4 * width)):
            blocks = []
            for b in range(blocks_per_stage):
                blocks.append(BasicBlock(channels, out, 2 if stage > 0 and b == 0 else 1))
                channels = out
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return logits of shape ``(batch, num_classes)``."""
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def xavier_init_(model: nn.Module, seed: int | None = None) -> nn.Module:
    """Xavier-uniform weights and zero biases for every Linear and Conv layer, in place.

    Parameters
    ----------
    model : nn.Module
        Model to initialise.
    seed : int, optional
        Seed of a private generator; ``None`` uses torch's global RNG.

    Returns
    -------
    nn.Module
        ``model`` itself.
    """
    gen = None
    if seed is not None:
        gen = torch.Generator(device="cpu").manual_seed(int(seed))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
                if module.weight.device.type == "cpu":
                    nn.init.xavier_uniform_(module.weight, generator=gen)
                else:  # draw on the CPU so that a seed gives the same weights on every device
                    w = torch.empty(module.weight.shape, dtype=module.weight.dtype)
                    module.weight.copy_(nn.init.xavier_uniform_(w, generator=gen))
                if module.bias is not None:
                    module.bias.zero_()
    return model


def build_model(
    name: str,
    input_shape: tuple[int, int, int],
    num_classes: int,
    seed: int | None = None,
    bias: bool | None = None,
) -> nn.Module:
    """Build one of the project's models with Xavier-uniform initialisation.

    Parameters
    ----------
    name : str
        ``"fednet"``, ``"lenet"``, ``"mlp"`` or ``"resnet20"`` (see the module docstring).
    input_shape : tuple[int, int, int]
        ``(C, H, W)`` of one example, e.g. ``(3, 32, 32)``, ``(1, 28, 28)`` or ``(1, 8, 8)``.
    num_classes : int
        Number of classes (logits).
    seed : int, optional
        Initialisation seed; clients that share it share the initialisation.
    bias : bool, optional
        Override the architecture's default (no biases for fednet/lenet, biases for mlp).

    Returns
    -------
    nn.Module
        The model on the CPU, in training mode.

    Raises
    ------
    ValueError
        For an unknown name, a malformed shape, ``num_classes < 2`` or an input too small
        for the convolutions.
    """
    if len(tuple(input_shape)) != 3 or any(int(s) < 1 for s in input_shape):
        raise ValueError(f"input_shape must be (C, H, W) with positive sizes, got {input_shape!r}")
    if int(num_classes) < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes!r}")
    shape = tuple(int(s) for s in input_shape)
    key = name.lower()
    if key.startswith("resnet20-w") and key[len("resnet20-w"):].isdigit():
        width = int(key[len("resnet20-w"):])
        with torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext():
            model = ResNet20(shape[0], int(num_classes), width=width)
        return xavier_init_(model, seed)
    if key not in MODEL_NAMES:
        raise ValueError(f"unknown model {name!r}; choose one of {MODEL_NAMES}")
    # torch's default layer init draws from the global RNG; with a seed, keep it untouched.
    rng_guard = torch.random.fork_rng(devices=[]) if seed is not None else contextlib.nullcontext()
    with rng_guard:
        model = _construct(key, shape, int(num_classes), bias)  # type: ignore[arg-type]
    return xavier_init_(model, seed)


def _construct(key: str, shape: tuple[int, int, int], num_classes: int, bias: bool | None) -> nn.Module:
    if key == "fednet":
        model: nn.Module = ConvNet(shape, num_classes, (32, 64), (512, 128), 5, bool(bias))
    elif key == "lenet":
        model = ConvNet(shape, num_classes, (6, 16), (120, 84), 5, bool(bias))
    elif key == "resnet20":
        model = ResNet20(shape[0], num_classes)
    else:
        in_features = shape[0] * shape[1] * shape[2]
        model = MLP(in_features, num_classes, (128, 64), True if bias is None else bias)
    return model


def permutation_spec(model: nn.Module) -> PermutationSpec:
    """The merge engine's permutation spec of ``model``.

    Uses the explicit builders for this module's models (:func:`cnn_spec` for
    :class:`ConvNet`, :func:`mlp_spec` for :class:`MLP`) and falls back to tracing
    (:func:`spec_from_module`) for any other chain network.

    Returns
    -------
    PermutationSpec
        Spec whose tensor names equal ``model.state_dict()``'s keys.

    Raises
    ------
    ValueError
        If the spec's keys differ from the state dict's (or tracing fails).
    """
    if isinstance(model, ConvNet):
        spec = cnn_spec(
            conv=list(model.conv_names),
            linear=list(model.linear_names),
            flatten_block=model.flatten_block,
            bias=model.bias,
        )
    elif isinstance(model, MLP):
        spec = mlp_spec(list(model.linear_names), bias=model.bias)
    else:
        spec = spec_from_module(model)
    keys = list(model.state_dict().keys())
    if sorted(spec.names) != sorted(keys):
        raise ValueError(
            f"permutation spec of {type(model).__name__} does not match its state_dict: "
            f"missing {sorted(set(keys) - set(spec.names))}, extra {sorted(set(spec.names) - set(keys))}"
        )
    return spec
