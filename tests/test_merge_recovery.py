"""Recovery: permuted noisy copies of one trained network merge back to it; averaging collapses."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.func import functional_call, grad, vmap

from fedfiot_flwr.merge import MergeOptions, apply_permutations, merge, spec_from_module


@pytest.fixture(scope="module")
def trained():
    """One trained MLP and its Fisher for every case of this module (training dominates the cost)."""
    model, x, y = trained_mlp()
    base = {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}
    return model, x, y, empirical_fisher(model, x, y), base


def trained_mlp():
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    model = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, x, y


def empirical_fisher(model, x, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return {k: (g**2).mean(0).numpy().astype(np.float64) for k, g in grads.items()}


def accuracy(model, state, x, y):
    model.load_state_dict({k: torch.as_tensor(np.asarray(v, dtype=np.float32)) for k, v in state.items()})
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


@pytest.mark.parametrize("matching", ["fisher", "euclidean"])
def test_permuted_copies_are_recovered(matching, trained):
    model, x, y, fisher, base = trained  # ``accuracy`` loads states into ``model``: read weights from ``base``
    spec = spec_from_module(model)
    base_acc = accuracy(model, base, x, y)
    assert base_acc > 0.95
    rng = np.random.default_rng(0)
    models, fishers = [], []
    for k in range(4):
        perms = {p: rng.permutation(n) for p, n in spec.sizes({n: v.shape for n, v in base.items()}).items()}
        noisy = {n: v + 1e-3 * rng.normal(size=v.shape) for n, v in base.items()}
        models.append(apply_permutations(noisy, spec, perms))
        fishers.append(apply_permutations(fisher, spec, perms))
    averaged = merge(models, fishers, spec,
                     MergeOptions(lam=1e-4, rho=0.5, reference=0, matching="none", aggregation="uniform"))
    res = merge(models, fishers, spec,
                MergeOptions(lam=1e-4, rho=0.5, reference=0, matching=matching, aggregation="fisher"))
    merged_acc = accuracy(model, res.model, x, y)
    avg_acc = accuracy(model, averaged.model, x, y)
    assert res.aligned
    assert merged_acc >= base_acc - 0.01
    assert avg_acc < 0.5 * base_acc
    assert res.objective < averaged.identity_objective
    assert min(res.fraction_permuted[1:]) > 0.8  # the non-reference copies were really permuted
