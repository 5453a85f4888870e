"""Diagonal Fisher (the paper's eq. 106): fast path, torch.func fallback and naive loop agree
with the definition, computed here independently, example by example."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedfiot_flwr.fisher as fisher_module
from fedfiot_flwr.fisher import diagonal_fisher, supported_modules
from fedfiot_flwr.models import build_model

DT = torch.float64


def definition(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """Eq. 106 (empirical) or the true Fisher, straight from the definition, one example at a time."""
    model = copy.deepcopy(model).eval()
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    acc = {n: torch.zeros_like(p) for n, p in zip(names, params)}
    for i in range(x.shape[0]):
        logp = F.log_softmax(model(x[i : i + 1]), dim=1)[0]
        classes = [int(y[i])] if kind == "empirical" else range(logp.shape[0])
        for c in classes:
            weight = 1.0 if kind == "empirical" else float(logp[c].exp())
            grads = torch.autograd.grad(logp[c], params, retain_graph=True, allow_unused=True)
            for n, g in zip(names, grads):
                if g is not None:
                    acc[n] += weight * g.square()
    return {n: a / x.shape[0] for n, a in acc.items()}


class ConvBNNet(nn.Module):
    """Covers Conv2d with stride / padding / dilation / no bias, eval-mode BatchNorm,
    in-place ReLU after a hooked layer, a Linear on 3-D input, and LayerNorm (fallback)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 5, 3, stride=2, bias=False)
        self.conv3 = nn.Conv2d(5, 3, 2, dilation=2, padding=1)
        self.mix = nn.Linear(3, 3)  # applied over the channel axis of (B, H*W, C)
        self.norm = nn.LayerNorm(27)
        self.bn2 = nn.BatchNorm1d(6)
        self.fc = nn.Linear(27, 6)
        self.out = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x), inplace=True)
        x = self.conv3(x)  # (B, 3, 3, 3)
        x = self.mix(x.flatten(2).transpose(1, 2))  # (B, 9, 3)
        x = self.norm(x.flatten(1))
        x = torch.relu(self.bn2(self.fc(x)))
        return self.out(x)


class SharedNet(nn.Module):
    """A Linear layer used twice in one forward, and one whose weights are used functionally
    without calling it (their Fisher must come from torch.func), and an unused one."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, 6)
        self.block = nn.Linear(6, 6)
        self.side = nn.Linear(6, 6)
        self.unused = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        x = torch.tanh(self.block(x))
        x = torch.tanh(self.block(x))
        x = torch.tanh(F.linear(x, self.side.weight, self.side.bias))
        return self.out(x)


def _randomise_bn(model: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen, dtype=DT))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen, dtype=DT) + 0.5)
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen, dtype=DT))
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen, dtype=DT))


def _case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if name == "mlp":
        model = build_model("mlp", (1, 8, 8), 10, seed=0).to(DT)
        x, c = torch.randn(13, 1, 8, 8, generator=gen, dtype=DT), 10
    elif name == "conv-bn":
        torch.manual_seed(0)
        model = ConvBNNet().to(DT)
        _randomise_bn(model, gen)
        x, c = torch.randn(13, 2, 7, 7, generator=gen, dtype=DT), 4
    else:
        torch.manual_seed(0)
        model = SharedNet().to(DT)
        x, c = torch.randn(13, 5, generator=gen, dtype=DT), 3
    y = torch.randint(0, c, (x.shape[0],), generator=gen)
    return model, x, y


def _batches(x: torch.Tensor, y: torch.Tensor, size: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, x.shape[0], size)]


_EXPECTED: dict[tuple[str, str], dict[str, torch.Tensor]] = {}


@pytest.mark.parametrize("kind", ["empirical", "true"])
@pytest.mark.parametrize("method", ["auto", "vmap", "loop"])
@pytest.mark.parametrize("case", ["mlp", "conv-bn", "shared"])
def test_matches_the_per_example_definition(case: str, method: str, kind: str) -> None:
    model, x, y = _case(case)
    model.train()  # diagonal_fisher must switch to eval mode itself
    if (case, kind) not in _EXPECTED:
        _EXPECTED[case, kind] = definition(model, x, y, kind)
    expected = _EXPECTED[case, kind]
    got = diagonal_fisher(model, _batches(x, y), kind, method=method)
    assert list(got) == [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        assert got[n].shape == p.shape and got[n].dtype == p.dtype and got[n].device.type == "cpu"
        assert bool((got[n] >= 0).all())
        torch.testing.assert_close(got[n], expected[n], rtol=1e-9, atol=1e-14, msg=f"{case}/{method}/{kind}: {n}")


def test_chunked_vmap_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    import fedfiot_flwr.fisher as fisher_mod

    model, x, y = _case("conv-bn")
    whole = diagonal_fisher(model, _batches(x, y), "true", method="vmap")
    monkeypatch.setattr(fisher_mod, "_CHUNK_ELEMENTS", 64)  # forces chunks of one example
    chunked = diagonal_fisher(model, _batches(x, y), "true", method="vmap")
    for n in whole:
        torch.testing.assert_close(chunked[n], whole[n], rtol=1e-12, atol=1e-15)


def test_fast_path_covers_linear_conv_and_eval_batchnorm() -> None:
    model, _, _ = _case("conv-bn")
    assert set(supported_modules(model)) == {"conv1", "bn1", "conv2", "conv3", "mix", "bn2", "fc", "out"}
    shared, _, _ = _case("shared")
    assert "block" in supported_modules(shared)  # reuse is only detected while running


def test_empirical_fisher_is_not_the_squared_batch_gradient() -> None:
    model, x, y = _case("mlp")
    fisher = diagonal_fisher(model, _batches(x, y))
    loss = F.cross_entropy(model.eval()(x), y)
    batch_grads = torch.autograd.grad(loss, list(model.parameters()))
    for (n, _), g in zip(model.named_parameters(), batch_grads):
        squared_mean = g.square()
        assert bool((fisher[n] >= squared_mean - 1e-15).all()), n  # Jensen: mean of squares >= square of mean
        assert not torch.allclose(fisher[n], squared_mean, rtol=1e-3), n


def test_empirical_and_true_fisher_differ() -> None:
    model, x, y = _case("mlp")
    emp = diagonal_fisher(model, _batches(x, y), "empirical")
    true = diagonal_fisher(model, _batches(x, y), "true")
    assert not torch.allclose(emp["fc1.weight"], true["fc1.weight"], rtol=1e-2)


def test_fednet_float32_fast_path_matches_vmap() -> None:
    model = build_model("fednet", (1, 28, 28), 10, seed=0)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 1, 28, 28, generator=gen), torch.randint(0, 10, (12,), generator=gen)
    fast = diagonal_fisher(model, _batches(x, y, 6))
    ref = diagonal_fisher(model, _batches(x, y, 6), method="vmap")
    for n in ref:
        torch.testing.assert_close(fast[n], ref[n], rtol=1e-4, atol=1e-10)


def test_model_is_left_unchanged() -> None:
    model, x, y = _case("conv-bn")
    model.train()
    model.fc.weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    diagonal_fisher(model, _batches(x, y), "true")
    assert model.training and all(m.training for m in model.modules())
    assert not model.fc.weight.requires_grad and model.conv1.weight.requires_grad
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # incl. BatchNorm running stats
    assert all(not m._forward_hooks for m in model.modules())


def test_frozen_parameters_still_get_a_fisher() -> None:
    model, x, y = _case("mlp")
    for p in model.parameters():
        p.requires_grad_(False)
    fisher = diagonal_fisher(model, _batches(x, y))
    assert all(bool(f.sum() > 0) for f in fisher.values())


def test_dict_batches_and_progress_flag() -> None:
    model, x, y = _case("mlp")
    tuples = diagonal_fisher(model, _batches(x, y))
    dicts = diagonal_fisher(model, [{"img": a, "label": b} for a, b in _batches(x, y)], progress=False)
    for n in tuples:
        torch.testing.assert_close(dicts[n], tuples[n])


def test_bad_input() -> None:
    model, x, y = _case("mlp")
    with pytest.raises(ValueError, match="unknown Fisher kind"):
        diagonal_fisher(model, _batches(x, y), "monte-carlo")
    with pytest.raises(ValueError, match="unknown Fisher method"):
        diagonal_fisher(model, _batches(x, y), method="backpack")
    with pytest.raises(ValueError, match="no examples"):
        diagonal_fisher(model, [])
    with pytest.raises(ValueError, match="labels must lie"):
        diagonal_fisher(model, [(x, y + 10)])
    with pytest.raises(ValueError, match="integer class indices"):
        diagonal_fisher(model, [(x, y.double())])
    with pytest.raises(ValueError, match="no parameters"):
        diagonal_fisher(nn.Flatten(), [(x, y)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    model = build_model("fednet", (3, 32, 32), 10, seed=0)
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(64, 3, 32, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    cpu = diagonal_fisher(model, _batches(x, y, 32))
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # torch's default TF32 convolutions differ by about 1e-2
    try:
        gpu = diagonal_fisher(model, _batches(x, y, 32), device="cuda")
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert next(model.parameters()).device.type == "cpu"
    for n in cpu:
        torch.testing.assert_close(gpu[n], cpu[n], rtol=1e-3, atol=1e-9)


@pytest.mark.parametrize("max_fan_in", [0, 10_000])
def test_both_conv_paths_match_the_per_example_loop(monkeypatch: pytest.MonkeyPatch, max_fan_in: int) -> None:
    """im2col + batched GEMM (threshold 0) and the grouped convolution (every conv) agree with
    the naive loop on strided, padded and dilated convolutions."""
    monkeypatch.setattr(fisher_module, "_GROUPED_CONV_MAX_FAN_IN", max_fan_in)
    torch.manual_seed(7)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3, dilation=2, padding=2, bias=False),
        nn.ReLU(), nn.Conv2d(5, 3, (2, 3), stride=(2, 1)), nn.Flatten(), nn.LazyLinear(4),
    ).double()
    x = torch.randn(6, 3, 11, 9, dtype=torch.float64)
    model(x)  # materialise the lazy layer
    y = torch.randint(0, 4, (6,))
    fast = diagonal_fisher(model, [(x, y)], method="auto")
    loop = diagonal_fisher(model, [(x, y)], method="loop")
    for name in loop:
        torch.testing.assert_close(fast[name], loop[name], rtol=1e-10, atol=1e-12)
