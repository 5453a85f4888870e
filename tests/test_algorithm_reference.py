"""The readable reference :mod:`fedfiot_flwr.algorithm` equals the fast engine bit for bit.

On random uploads of K = 3 independently initialised clients (so that alignment really
permutes) of an MLP, a small CNN (conv -> linear flatten) and a small ResNet (a residual group
shared by a stem conv and a block's second conv, BatchNorm statistics as buffers), the
reference and :func:`fedfiot_flwr.merge.merge` with the paper's options return equal tensors
(``np.array_equal``, same dtype) and equal permutations.
"""

from __future__ import annotations

import doctest

import numpy as np
import pytest
import torch
from torch import nn

from fedfiot_flwr import algorithm
from fedfiot_flwr.algorithm import fedfiot_merge
from fedfiot_flwr.merge import (
    MergeOptions,
    MergeSpeed,
    PermutationSpec,
    apply_permutations,
    merge,
    prepare_clients,
    spec_from_module,
)
from fedfiot_flwr.merge.costs import ClientLayers
from fedfiot_flwr.models import ResNet20

# The paper's configuration of the engine, with every speed option at its exact setting.
PAPER = {"matching": "fisher", "aggregation": "fisher", "fallback": "objective"}
EXACT = MergeSpeed(certify=False, cost_dtype="float64", backend="numpy", lap_solver="scipy", lap_threads=1)
NUM_EXAMPLES = [300, 500, 200]


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 32), nn.Linear(32, 24), nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.pool = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 6, 3), nn.MaxPool2d(2)
        self.fc1, self.fc2 = nn.Linear(6 * 2 * 2, 12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = torch.flatten(self.pool(torch.relu(self.conv2(x))), 1)
        return self.fc2(torch.relu(self.fc1(x)))


MODELS = {
    "mlp": (MLP, None),
    "cnn": (CNN, (2, 3, 14, 14)),
    "resnet": (lambda: ResNet20(3, 10, width=4, blocks_per_stage=1), None),
}


def _state(name: str, seed: int) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    model = MODELS[name][0]()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.BatchNorm2d):  # non-trivial BatchNorm parameters and statistics
                mod.running_mean.normal_(), mod.running_var.uniform_(0.5, 2.0)
                mod.weight.normal_(), mod.bias.normal_()
                mod.num_batches_tracked.fill_(seed + 1)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def uploads() -> dict[str, tuple]:
    """Per model: (spec, client models, raw Fishers, buffers, an extra model used as broadcast)."""
    out = {}
    for name, (make, shape) in MODELS.items():
        module = make()
        spec = spec_from_module(module, example_input=None if shape is None else torch.randn(shape))
        params = {n for n, _ in module.named_parameters()}
        models = [_state(name, 10 * k + 1) for k in range(3)]
        buffers = [n for n in models[0] if n not in params]
        rng = np.random.default_rng(len(name))
        fishers = [{n: (rng.exponential(size=v.shape) ** 2).astype(np.float32) for n, v in m.items() if n in params}
                   for m in models]
        out[name] = (spec, models, fishers, buffers, _state(name, 99))
    assert any(len(spec.neuron_tensors(p)) > 4 for p in out["resnet"][0].perm_names), "no residual group"
    return out


def _both(upload: tuple, **options: object) -> tuple:
    spec, models, fishers, buffers, broadcast = upload
    if options.get("reference") == "broadcast":
        options["reference"] = broadcast
    ours = fedfiot_merge(models, fishers, spec, num_examples=NUM_EXAMPLES, buffers=buffers, **options)
    clients = prepare_clients(models, fishers, buffers=buffers, num_examples=NUM_EXAMPLES)
    fast = merge(clients, None, spec, MergeOptions(**PAPER, **options), speed=EXACT)
    return ours, fast


def _assert_identical(ours: algorithm.FedFiOTResult, fast: object) -> None:
    assert list(ours.model) == list(fast.model)
    for name, value in fast.model.items():
        assert ours.model[name].dtype == value.dtype, name
        assert np.array_equal(ours.model[name], value), f"tensor {name!r} differs"
    assert list(ours.permutations) == list(fast.permutations)
    for group, perms in fast.permutations.items():
        for k, p in enumerate(perms):
            assert np.array_equal(ours.permutations[group][k], p), f"group {group!r}, client {k}"
    assert ours.aligned == fast.aligned


CONFIGS = [
    {"rho": 0.5, "lam": 1e-4, "max_iters": 8, "reference": "largest"},
    {"rho": 1.0, "lam": 1e-3, "max_iters": 1, "reference": 0},
    {"rho": 0.3, "lam": 1e-5, "max_iters": 3, "reference": "broadcast"},
]


@pytest.mark.parametrize("config", CONFIGS, ids=["largest-S8", "client0-S1", "broadcast-S3"])
@pytest.mark.parametrize("name", list(MODELS))
def test_reference_equals_the_engine_bit_for_bit(uploads: dict, name: str, config: dict) -> None:
    ours, fast = _both(uploads[name], **config)
    _assert_identical(ours, fast)
    # Not a trivial agreement: alignment moved most neurons of at least two clients (the
    # reference client's own alignment may stay near the identity), and the aligned merge was kept.
    assert ours.aligned and sorted(fast.fraction_permuted)[1] > 0.5


@pytest.mark.parametrize("max_iters", [2, 3, 8])
def test_alternation_beyond_one_realignment_and_its_cap(uploads: dict, max_iters: int) -> None:
    # Here one group's alignments still change after the first aggregation: with S = 8 it aligns
    # anew in iterations 2 and 3 and confirms in 4. S = 2 stops it while it is changing (other
    # alignments than with S = 8); S = 3 ends on the converged alignment without confirming it.
    options = {"rho": 0.3, "lam": 1e-4, "reference": "largest"}
    ours, fast = _both(uploads["resnet"], max_iters=max_iters, **options)
    _assert_identical(ours, fast)
    full, _ = _both(uploads["resnet"], max_iters=8, **options)
    assert max(r.iterations for r in fast.reports.values()) == min(max_iters, 4)
    changed = any(not np.array_equal(a, b) for g in full.permutations
                  for a, b in zip(full.permutations[g], ours.permutations[g]))
    assert changed == (max_iters < 3)


def test_the_reference_client_is_realigned_and_carries_its_new_order_into_the_next_group() -> None:
    # Every client keeps its order against the reference (client 0) in iteration 1; the Fisher-
    # weighted layer that follows then makes the reference itself swap its hidden neurons, and the
    # next group must start from the reference's layer with its incoming columns in that new order.
    spec = PermutationSpec({"fc1.weight": ("P1", None), "fc2.weight": ("P2", "P1"), "fc3.weight": (None, "P2")})
    def net(fc1: list, fc2: list, fc3: list) -> dict[str, np.ndarray]:
        return {"fc1.weight": np.array(fc1), "fc2.weight": np.array(fc2), "fc3.weight": np.array(fc3)}

    models = [net([[1.0], [-2.0]], [[-5.0, -3.0], [2.0, -3.0]], [[0.0, 4.0]]),
              net([[0.0], [4.0]], [[-2.0, -4.0], [-4.0, -2.0]], [[1.0, 2.0]]),
              net([[1.0], [2.0]], [[3.0, -1.0], [-4.0, 0.0]], [[0.0, 3.0]])]
    fishers = [net([[0.0], [1.0]], [[0.0, 100.0], [100.0, 1.0]], [[1.0, 0.0]]),
               net([[100.0], [1.0]], [[1.0, 0.0], [100.0, 100.0]], [[0.0, 10.0]]),
               net([[10.0], [0.0]], [[100.0, 0.0], [1.0, 100.0]], [[1.0, 1.0]])]
    options = {"rho": 1.0, "lam": 1.0, "reference": 0}
    first = fedfiot_merge(models, fishers, spec, max_iters=1, **options)
    assert all(p.tolist() == [0, 1] for p in first.permutations["P1"])
    ours = fedfiot_merge(models, fishers, spec, max_iters=8, **options)
    assert ours.permutations["P1"][0].tolist() == [1, 0] and ours.aligned
    _assert_identical(ours, merge(models, fishers, spec, MergeOptions(max_iters=8, **PAPER, **options), speed=EXACT))


@pytest.mark.parametrize("m, d", [(3, 1), (33, 70), (7, 1000), (2000, 5)])
def test_cost_matrices_are_the_engines_bit_for_bit(m: int, d: int) -> None:
    # Equal costs, not only equal assignments: ties and near-ties are then broken alike. (GEMM
    # rounding depends on the product's width; m = 2000 splits the three clients into two products.)
    rng = np.random.default_rng(m + d)
    w = rng.standard_normal((m, d))
    w_k = [rng.standard_normal((m, d)) for _ in range(3)]
    f_k = [rng.exponential(size=(m, d)) + 1e-4 for _ in range(3)]
    engine = ClientLayers(lambda k: (w_k[k].copy(), f_k[k].copy()), 3)
    for ours, fast in zip(algorithm._fisher_costs(w, w_k, f_k), engine.fisher_costs(w), strict=True):
        assert np.array_equal(ours, fast)


def test_tempering_and_damping_change_the_merge(uploads: dict) -> None:
    spec, models, fishers, buffers, _ = uploads["mlp"]
    run = lambda **o: fedfiot_merge(models, fishers, spec, reference=1, **o).model  # noqa: E731
    sharp, flat = run(rho=1.0, lam=1e-4), run(rho=0.2, lam=1e-4)
    assert all(not np.allclose(sharp[n], flat[n]) for n in sharp)
    # A damping far above every Fisher entry weighs all clients alike: the merge is the plain
    # average of the clients aligned by the alignments it found.
    heavy = fedfiot_merge(models, fishers, spec, rho=1.0, lam=1e9, reference=1)
    perms = [{g: ps[k] for g, ps in heavy.permutations.items()} for k in range(3)]
    aligned = [apply_permutations(m, spec, p) for m, p in zip(models, perms)]
    for n in heavy.model:
        np.testing.assert_allclose(heavy.model[n], np.mean([a[n] for a in aligned], axis=0), rtol=1e-5, atol=1e-7)


def test_identity_rule_drops_an_alignment_that_raises_the_objective() -> None:
    # Client 1's hidden neurons are client 0's swapped, but its output weights are not: aligning
    # the hidden layer (its cost 2 -> 0) breaks the output layer, whose Fisher is large: J goes from
    # 1 (identity merge: hidden layer averaged by index, output layers equal) to 2 * 100 * (25 + 25).
    spec = PermutationSpec({"fc1.weight": ("P", None), "fc2.weight": (None, "P")})
    models = [{"fc1.weight": np.array([[0.0], [1.0]]), "fc2.weight": np.array([[0.0, 10.0]])},
              {"fc1.weight": np.array([[1.0], [0.0]]), "fc2.weight": np.array([[0.0, 10.0]])}]
    fishers = [{"fc1.weight": np.ones((2, 1)), "fc2.weight": np.full((1, 2), 100.0)} for _ in models]
    options = {"rho": 1.0, "lam": 1e-6, "reference": 0}
    ours = fedfiot_merge(models, fishers, spec, **options)
    assert ours.permutations["P"][1].tolist() == [1, 0] and not ours.aligned
    # The identity merge: Fisher-weighted average by index (equal Fishers: the plain average).
    assert ours.model["fc1.weight"].ravel().tolist() == [0.5, 0.5]
    assert ours.model["fc2.weight"].ravel().tolist() == [0.0, 10.0]
    _assert_identical(ours, merge(models, fishers, spec, MergeOptions(**PAPER, **options), speed=EXACT))
    # Equal objectives keep the aligned merge (the rule is "strictly higher"): identical clients.
    same = fedfiot_merge([models[0], models[0]], fishers, spec, **options)
    assert same.aligned and same.permutations["P"][1].tolist() == [0, 1]


def test_worked_example_docstring() -> None:
    result = doctest.testmod(algorithm, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("change, message", [
    ({"rho": 0.0}, "rho"), ({"lam": 0.0}, "lam"), ({"max_iters": 0}, "max_iters"),
    ({"reference": 2}, "reference"), ({"reference": "largest"}, "num_examples"),
    ({"num_examples": [1, -1]}, "num_examples"), ({"fisher": -1.0}, "negative"),
    ({"weight": np.nan}, "finite"), ({"buffers": ["w"]}, "Fisher keys"),
])
def test_bad_inputs_are_rejected_with_a_clear_error(change: dict, message: str) -> None:
    spec = PermutationSpec({"w": ("P0", None)})
    models = [{"w": np.array([[0.0], [4.0]])}, {"w": np.array([[1.0], [change.pop("weight", 3.0)]])}]
    fishers = [{"w": np.ones((2, 1))}, {"w": np.array([[1.0], [change.pop("fisher", 1.0)]])}]
    with pytest.raises(ValueError, match=message):
        fedfiot_merge(models, fishers, spec, **{"reference": 0, **change})
