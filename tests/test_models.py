"""Models: sizes, initialisation and permutation specs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedfiot_flwr.merge import apply_permutations
from fedfiot_flwr.models import ConvNet, build_model, permutation_spec


def _weights(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if n.endswith("weight"))


@pytest.mark.parametrize(
    ("name", "shape", "n_params"),
    [
        ("fednet", (3, 32, 32), 939_616),  # the paper's count (no biases)
        ("fednet", (1, 28, 28), 643_104),
        ("lenet", (3, 32, 32), 61_770),
        ("lenet", (1, 28, 28), 44_190),
        ("mlp", (1, 8, 8), 17_226),  # 64-128-64-10 with biases
    ],
)
def test_sizes_and_forward(name: str, shape: tuple[int, int, int], n_params: int) -> None:
    model = build_model(name, shape, 10, seed=0)
    assert sum(p.numel() for p in model.parameters()) == n_params
    out = model(torch.randn(4, *shape))
    assert out.shape == (4, 10)


def test_fednet_matches_the_paper_layout() -> None:
    model = build_model("fednet", (3, 32, 32), 10, seed=0)
    assert isinstance(model, ConvNet)
    assert _weights(model) == 939_616
    assert model.flatten_block == 25
    assert [tuple(p.shape) for p in model.parameters()] == [
        (32, 3, 5, 5), (64, 32, 5, 5), (512, 1600), (128, 512), (10, 128),
    ]
    assert build_model("fednet", (1, 28, 28), 10).flatten_block == 16


def test_seeded_xavier_init_is_reproducible_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a = build_model("lenet", (1, 28, 28), 10, seed=7, bias=True)
    b = build_model("lenet", (1, 28, 28), 10, seed=7, bias=True)
    c = build_model("lenet", (1, 28, 28), 10, seed=8, bias=True)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb)
        if n.endswith("bias"):
            assert not pa.any()
        else:
            assert not torch.equal(pa, pc)
            fan_out, fan_in = pa.shape[0] * pa[0, 0].numel(), pa[0].numel()
            bound = math.sqrt(6.0 / (fan_in + fan_out))
            assert float(pa.abs().max()) <= bound
            assert float(pa.abs().max()) > 0.9 * bound  # uniform over the whole range


@pytest.mark.parametrize(("name", "shape"), [("fednet", (1, 28, 28)), ("lenet", (3, 32, 32)), ("mlp", (1, 8, 8))])
def test_permutation_spec_keys_and_function_invariance(name: str, shape: tuple[int, int, int]) -> None:
    model = build_model(name, shape, 10, seed=1, bias=True).double().eval()
    spec = permutation_spec(model)
    state = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    assert spec.names == list(state)
    sizes = spec.sizes({k: v.shape for k, v in state.items()})
    rng = np.random.default_rng(0)
    perms = {p: rng.permutation(sizes[p]) for p in spec.perm_names}
    assert any((p != np.arange(len(p))).any() for p in perms.values())
    permuted = apply_permutations(state, spec, perms)
    x = torch.randn(5, *shape, dtype=torch.float64)
    before = model(x)
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in permuted.items()})
    assert not torch.equal(model.state_dict()["fc1.weight"], torch.from_numpy(state["fc1.weight"]))
    torch.testing.assert_close(model(x), before, rtol=1e-12, atol=1e-12)


def test_spec_falls_back_to_tracing_for_other_chains() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 6), nn.ReLU(), nn.Linear(6, 3))
    spec = permutation_spec(model)
    assert spec.names == list(model.state_dict())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="too small"):
        build_model("fednet", (1, 8, 8), 10)
    with pytest.raises(ValueError, match="input_shape"):
        build_model("mlp", (8, 8), 10)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", (1, 8, 8), 1)


def test_resnet20_size_width_and_derived_spec() -> None:
    model = build_model("resnet20", (3, 32, 32), 10, seed=0)
    assert sum(p.numel() for p in model.parameters()) == 272_474  # He et al.'s ResNet-20 (+ projection shortcuts)
    narrow = build_model("resnet20-w4", (1, 28, 28), 10, seed=0)
    assert narrow.conv1.out_channels == 4 and narrow.fc.in_features == 16
    assert narrow(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    spec = permutation_spec(narrow)
    assert len(spec.perm_names) == 12  # 3 residual streams + 9 block-internal layers
    stream = spec.axes["conv1.weight"][0].perm
    assert spec.axes["layer1.2.bn2.running_var"][0].perm == stream
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet20-wide", (1, 28, 28), 10)
