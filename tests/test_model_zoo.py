"""Derived permutation specs on a zoo of real models, merges of them, and BatchNorm across rounds.

For every model: permuting it by random permutations in every derived group leaves its outputs
unchanged (eval mode, random BN statistics), merging two identical copies returns that model,
and merging three independently initialised copies gives finite weights that load strictly.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torchvision
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import FakeGrid
from flwr.app import ArrayRecord, Message
from torch import nn

from fedfiot_flwr import FedFiOT
from fedfiot_flwr.batchnorm import batchnorm_recalibration, recompute_batchnorm_statistics
from fedfiot_flwr.client import pack_reply
from fedfiot_flwr.merge import MergeOptions, apply_permutations, merge, prepare_clients, spec_from_module
from fedfiot_flwr.models import ResNet20
from fedfiot_flwr.server.shell import arrays_to_numpy


class LayerNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.ln1, self.fc2, self.ln2, self.fc3 = (
            nn.Linear(12, 16), nn.LayerNorm(16), nn.Linear(16, 8), nn.LayerNorm(8), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.ln2(self.fc2(torch.relu(self.ln1(self.fc1(x)))))))


class GRUClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(6, 10, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(10, 12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.fc2(torch.relu(self.fc1(out[:, -1])))


class FlowerTemplateCNN(nn.Module):
    """The CNN of Flower's PyTorch app template."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.pool, self.conv2 = nn.Conv2d(3, 6, 5), nn.MaxPool2d(2, 2), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84), nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def narrow_vgg11_bn() -> nn.Module:
    """torchvision's VGG-11-BN (its ``make_layers`` and ``forward``) at 1/8 width, classifier sized for 32x32.

    Built without ``VGG.__init__``, which would first initialise the full 120M-weight classifier.
    """
    cfg = [8, "M", 16, "M", 32, 32, "M", 64, 64, "M", 64, 64, "M"]
    model = torchvision.models.VGG.__new__(torchvision.models.VGG)
    nn.Module.__init__(model)
    model.features = torchvision.models.vgg.make_layers(cfg, batch_norm=True)
    model.avgpool = nn.AdaptiveAvgPool2d(1)
    model.classifier = nn.Sequential(nn.Linear(64, 32), nn.ReLU(True), nn.Dropout(), nn.Linear(32, 32),
                                     nn.ReLU(True), nn.Dropout(), nn.Linear(32, 10))
    return model


def tiny_vit() -> nn.Module:
    return torchvision.models.VisionTransformer(image_size=16, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=32, mlp_dim=64, num_classes=10)


# name -> (constructor, input shape of one batch, minimum number of aligned groups)
ZOO: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], int]] = {
    "resnet18": (lambda: torchvision.models.resnet18(num_classes=10), (2, 3, 32, 32), 12),
    "resnet20": (lambda: ResNet20(3, 10, width=4), (2, 3, 16, 16), 12),
    "mobilenet_v3_small": (lambda: torchvision.models.mobilenet_v3_small(num_classes=10), (2, 3, 32, 32), 25),
    "vgg11_bn": (narrow_vgg11_bn, (2, 3, 32, 32), 10),
    "vit": (tiny_vit, (2, 3, 16, 16), 3),
    "layernorm_mlp": (LayerNormMLP, (2, 12), 2),
    "gru": (GRUClassifier, (2, 5, 6), 1),
    "flower_cnn": (FlowerTemplateCNN, (2, 3, 32, 32), 4),
}
HEAVY = {"resnet18"}


def build(name: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return ZOO[name][0]()


def randomise_norms(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)):
                if getattr(mod, "running_mean", None) is not None:
                    mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=gen))
                    mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=gen) + 0.5)
                if mod.weight is not None:
                    mod.weight.copy_(torch.randn(mod.weight.shape, generator=gen))
                    mod.bias.copy_(torch.randn(mod.bias.shape, generator=gen))


def numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def parameters_and_buffers(model: nn.Module) -> tuple[set[str], list[str]]:
    params = {n for n, _ in model.named_parameters()}
    return params, [k for k in model.state_dict() if k not in params]


def random_fishers(state: dict[str, np.ndarray], params: set[str], k: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{n: rng.random(v.shape) + 0.1 for n, v in state.items() if n in params} for _ in range(k)]


@pytest.fixture(scope="module")
def specs() -> dict[str, object]:
    cache: dict[str, object] = {}

    def get(name: str):  # noqa: ANN202
        if name not in cache:
            x = torch.randn(ZOO[name][1], generator=torch.Generator().manual_seed(0))
            cache[name] = spec_from_module(build(name, 0), example_input=x)
        return cache[name]

    return get  # type: ignore[return-value]


@pytest.mark.parametrize("name", list(ZOO))
def test_random_permutations_in_every_group_leave_outputs_unchanged(name: str, specs) -> None:  # noqa: ANN001
    model = build(name, 1).eval()
    randomise_norms(model, 2)
    spec = specs(name)
    assert list(spec.names) == list(model.state_dict())
    assert len(spec.perm_names) >= ZOO[name][2]
    state = numpy_state(model)
    rng = np.random.default_rng(3)
    perms = {p: rng.permutation(n) for p, n in spec.sizes({k: v.shape for k, v in state.items()}).items()}
    permuted = apply_permutations(state, spec, perms)
    x = torch.randn(ZOO[name][1], generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(x)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in permuted.items()})
        after = model(x)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    moved = [k for k in state if not np.array_equal(state[k], permuted[k])]
    assert any("running_mean" in k for k in moved) or not any("running_mean" in k for k in state)
    assert len(moved) > len(spec.perm_names)


@pytest.mark.parametrize("name", list(ZOO))
def test_merging_two_identical_copies_returns_the_model(name: str, specs) -> None:  # noqa: ANN001
    model = build(name, 5)
    randomise_norms(model, 6)
    state = numpy_state(model)
    params, buffers = parameters_and_buffers(model)
    clients = prepare_clients([state, state], random_fishers(state, params, 2, 7), buffers=buffers, num_examples=[3, 5])
    res = merge(clients, None, specs(name), MergeOptions(reference=0, max_iters=1 if name in HEAVY else 2))
    assert res.aligned
    for k, v in state.items():
        assert res.model[k].shape == v.shape and res.model[k].dtype == v.dtype
        np.testing.assert_allclose(res.model[k], v, rtol=1e-6, atol=1e-6, err_msg=k)
    assert all(f == 0.0 for f in res.fraction_permuted)


@pytest.mark.parametrize("name", list(ZOO))
def test_merging_three_independent_models_loads_strictly(name: str, specs) -> None:  # noqa: ANN001
    models = [build(name, 10 + k) for k in range(3)]
    for k, m in enumerate(models):
        randomise_norms(m, 20 + k)
    states = [numpy_state(m) for m in models]
    params, buffers = parameters_and_buffers(models[0])
    clients = prepare_clients(states, random_fishers(states[0], params, 3, 8), buffers=buffers, num_examples=[4, 5, 6])
    res = merge(clients, None, specs(name), MergeOptions(max_iters=1 if name in HEAVY else 4, fallback="none"))
    assert all(np.all(np.isfinite(v)) for v in res.model.values())
    if len(specs(name).perm_names):
        assert max(res.fraction_permuted) > 0  # independent inits: alignment moves neurons
    target = build(name, 0)
    target.load_state_dict({k: torch.as_tensor(v) for k, v in res.model.items()}, strict=True)
    with torch.no_grad():
        out = target.eval()(torch.randn(ZOO[name][1]))
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- BatchNorm across rounds


def test_recompute_batchnorm_statistics_matches_the_batch_moments() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 2))
    x = torch.randn(8, 2, 6, 6) * 3 + 1
    loader = [(x[:4], None), (x[4:], None)]
    model.eval()
    recompute_batchnorm_statistics(model, loader)
    with torch.no_grad():
        h = model[0](x)
    bn = model[1]
    per_batch_mean = torch.stack([h[:4].mean((0, 2, 3)), h[4:].mean((0, 2, 3))]).mean(0)
    torch.testing.assert_close(bn.running_mean, per_batch_mean, rtol=1e-5, atol=1e-5)
    assert not model.training and bn.momentum == 0.1 and int(bn.num_batches_tracked) == 2


@pytest.mark.slow
def test_three_rounds_on_a_batchnorm_model_keep_every_buffer_and_recalibrate() -> None:
    torch.manual_seed(0)
    model = ResNet20(1, 3, width=2, blocks_per_stage=1)
    init = model.state_dict()
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in init.items()}
    params, _ = parameters_and_buffers(model)
    server_x = torch.randn(16, 1, 8, 8)
    hook = batchnorm_recalibration(ResNet20(1, 3, width=2, blocks_per_stage=1), [(server_x[:8],), (server_x[8:],)])
    received: list[dict[str, np.ndarray]] = []

    def client_fn(node: int, msg: Message) -> Message:
        arrays = arrays_to_numpy(msg.content["arrays"])
        received.append(arrays)
        local = ResNet20(1, 3, width=2, blocks_per_stage=1)
        local.load_state_dict({k: torch.as_tensor(v) for k, v in arrays.items()}, strict=True)
        opt = torch.optim.SGD(local.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(node)
        x, y = torch.randn(8, 1, 8, 8, generator=gen) + node % 3, torch.randint(0, 3, (8,), generator=gen)
        nn.functional.cross_entropy(local(x), y).backward()
        opt.step()
        fisher = {n: p.grad.detach() ** 2 + 1e-3 for n, p in local.named_parameters()}
        return Message(content=pack_reply(local.state_dict(), fisher, 8 + node), reply_to=msg)

    strategy = FedFiOT(model=model, min_train_nodes=3, min_available_nodes=3, fedavg_baseline=False,
                       fraction_evaluate=0.0, bn_recalibration=hook)
    result = strategy.start(grid=FakeGrid([1, 2, 3], client_fn), initial_arrays=ArrayRecord(init), num_rounds=3)
    assert sorted(strategy.server_metrics) == [1, 2, 3]
    for metrics in strategy.server_metrics.values():
        assert metrics["num-valid"] == 3 and metrics["num-rejected"] == 0
    assert len(received) == 9
    for arrays in received:  # every broadcast keeps each buffer's shape and dtype (0-d counters too)
        assert {k: (v.shape, v.dtype) for k, v in arrays.items()} == {
            k: (s, np.dtype(str(d).replace("torch.", ""))) for k, (s, d) in shapes.items()}
    final = {k: v.numpy() for k, v in result.arrays.items()}
    check = ResNet20(1, 3, width=2, blocks_per_stage=1)
    check.load_state_dict({k: torch.as_tensor(v) for k, v in final.items() if k in params}, strict=False)
    recompute_batchnorm_statistics(check, [(server_x[:8],), (server_x[8:],)])
    for k, v in check.state_dict().items():
        if k.endswith(("running_mean", "running_var")):
            np.testing.assert_allclose(final[k], v.numpy(), rtol=1e-4, atol=1e-5, err_msg=k)
    assert int(final["bn1.num_batches_tracked"]) == 2
