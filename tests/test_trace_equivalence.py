"""The fast permutation check of ``spec_from_module`` gives the same specs as the plain reference check.

Every model is derived twice from the same module: by ``spec_from_module`` and by the body of
``spec_from_module`` with the previous, slow check (``_derive_spec(..., reference=True)``). The
specs must agree in every tensor, axis entry and order, and so must the warnings they log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torchvision
from test_model_zoo import ZOO, FlowerTemplateCNN, GRUClassifier, LayerNormMLP, narrow_vgg11_bn, randomise_norms
from test_spec import CNN, MLP, GroupedNet, Residual, randomise_bn
from torch import nn

from fedfiot_flwr.merge import PermutationSpec, spec_from_module
from fedfiot_flwr.merge import trace
from fedfiot_flwr.models import build_model


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """The reference check runs on torch's default threads otherwise (slow on a busy machine; same answer)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class SortedHidden(nn.Module):
    """A non-equivariant operation in the middle: its layer is left unaligned (and logged)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(3, 6), nn.Linear(6, 5), nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sort(torch.relu(self.fc1(x)), dim=1).values
        return self.fc3(torch.relu(self.fc2(h)))


class Branching(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it, nothing is aligned."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if float(h.sum()) > 0:
            h = -h
        return self.fc2(h)


class Tied(nn.Module):
    """Two layers share one weight tensor (both names are in the state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.fc2b = nn.Linear(8, 8)
        self.fc2b.weight = self.fc2.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2b(torch.relu(self.fc2(torch.relu(self.fc1(x)))))))


def _bn_cnn() -> nn.Module:
    model = CNN(bn=True)
    randomise_bn(model)
    return model


def _zoo(name: str) -> tuple[Callable[[], nn.Module], Any]:
    build, shape, _ = ZOO[name]

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = build()
        randomise_norms(model, 2)
        return model

    return make, torch.randn(shape, generator=torch.Generator().manual_seed(0))


def _seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return build()

    return make


# name -> (constructor, example input or None to let spec_from_module guess one)
MODELS: dict[str, tuple[Callable[[], nn.Module], Any]] = {
    **{f"zoo-{name}": _zoo(name) for name in ZOO},
    "resnet18": (_seeded(lambda: torchvision.models.resnet18(num_classes=10)), None),
    "mobilenet_v3_small": (_seeded(lambda: torchvision.models.mobilenet_v3_small(num_classes=10)), None),
    "resnet20": (lambda: build_model("resnet20", (3, 32, 32), 10, seed=0), None),
    "fednet": (lambda: build_model("fednet", (3, 32, 32), 10, seed=0), None),
    "lenet-28": (lambda: build_model("lenet", (1, 28, 28), 10, seed=0), None),
    "mlp": (lambda: build_model("mlp", (1, 8, 8), 10, seed=0), None),
    "spec-mlp": (_seeded(MLP), torch.randn(4, 12)),
    "spec-cnn": (_seeded(CNN), torch.randn(2, 3, 12, 12)),
    "spec-cnn-bn": (_seeded(_bn_cnn), torch.randn(2, 3, 12, 12)),
    "spec-residual": (_seeded(Residual), torch.randn(3, 4)),
    "spec-grouped": (_seeded(GroupedNet), torch.randn(2, 2, 6, 6)),
    "sorted": (_seeded(SortedHidden), None),
    "branching": (_seeded(Branching), None),
    "tied": (_seeded(Tied), None),
    "float64-cnn": (_seeded(lambda: _bn_cnn().double()), torch.randn(2, 3, 12, 12, dtype=torch.float64)),
    "layernorm-mlp": (_seeded(LayerNormMLP), None),
    "gru": (_seeded(GRUClassifier), None),
    "flower-cnn": (_seeded(FlowerTemplateCNN), None),
    "vgg11_bn-narrow": (_seeded(narrow_vgg11_bn), None),
}


def content(spec: PermutationSpec) -> tuple[list[tuple[str, tuple[Any, ...]]], list[str]]:
    """Everything a spec holds, in order (``==`` on specs ignores the order of the tensors)."""
    return list(spec.axes.items()), list(spec.perm_names)


def derive_both(model: nn.Module, example: Any, caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """The spec and warnings of the reference and the fast derivation of the same module."""
    out = {}
    for path in ("reference", "fast"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedfiot_flwr.merge"):
            if path == "reference":
                spec = trace._derive_spec(model, "P_", example, True, reference=True)
            else:
                spec = spec_from_module(model, example_input=example)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        out[path] = (content(spec), warnings)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_the_fast_check_derives_the_reference_spec(name: str, caplog: pytest.LogCaptureFixture) -> None:
    build, example = MODELS[name]
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = derive_both(model, example, caplog)
    assert got["fast"][0] == got["reference"][0]
    assert got["fast"][1] == got["reference"][1]
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], v) for k, v in before.items())


@pytest.mark.slow
def test_the_fast_check_derives_the_reference_spec_of_full_width_vgg11_bn(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    got = derive_both(torchvision.models.vgg11_bn(num_classes=10), None, caplog)
    assert got["fast"] == got["reference"]


def broken(spec: PermutationSpec) -> tuple[PermutationSpec, list[str]]:
    """``spec`` with one consuming axis of every other permutation unlinked (so permuting it changes outputs)."""
    axes = {k: list(v) for k, v in spec.axes.items()}
    targets = spec.perm_names[::2]
    for perm in targets:
        name, axis = next((n, a) for n, entries in reversed(axes.items()) for a, e in enumerate(entries)
                          if a > 0 and e is not None and e.perm == perm)
        axes[name][axis] = None
    return PermutationSpec({k: tuple(v) for k, v in axes.items()}), targets


@pytest.mark.parametrize("name", ["resnet20", "fednet", "zoo-gru", "zoo-vit", "spec-grouped", "tied"])
def test_the_fast_check_rejects_the_permutations_the_reference_check_rejects(name: str) -> None:
    build, example = MODELS[name]
    model = build()
    if example is None:
        example = trace.guess_example_input(model)
    spec, targets = broken(spec_from_module(model, example_input=example))
    reference = trace._failing_permutations_reference(model, spec, example)
    assert set(targets) <= set(reference)
    assert trace._failing_permutations(model, spec, example) == reference


def test_a_slow_derivation_is_logged_at_info_with_the_model_class(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    model = MLP()
    with caplog.at_level(logging.INFO, logger="fedfiot_flwr.merge"):
        spec_from_module(model, example_input=torch.randn(4, 12))
    assert not [r for r in caplog.records if "took" in r.getMessage()]
    monkeypatch.setattr(trace, "_SLOW_SECONDS", -1.0)
    with caplog.at_level(logging.INFO, logger="fedfiot_flwr.merge"):
        spec_from_module(model, example_input=torch.randn(4, 12))
    lines = [r for r in caplog.records if "took" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert "MLP" in lines[0].getMessage() and lines[0].getMessage().endswith(" s")


def test_the_probes_run_on_one_thread_and_the_thread_count_is_restored() -> None:
    seen: list[int] = []

    class Recording(MLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            return super().forward(x)

    torch.set_num_threads(2)
    spec_from_module(Recording(), example_input=torch.randn(4, 12))
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
