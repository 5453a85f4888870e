"""RegMean server merge: least squares on the union of the clients' inputs, and its edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedfiot_flwr.baselines import regmean_merge, regmean_select, scale_off_diagonal, size_weighted_average
from fedfiot_flwr.curvature import InputGram, input_grams
from fedfiot_flwr.models import build_model


def _fit_clients(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray], list[dict], list[dict]]:
    """Three clients, each fitting a Linear(5, 3) with bias by least squares on its own data."""
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, 5)) + rng.normal(size=5) for n in (20, 35, 50)]
    w_true, b_true = rng.normal(size=(3, 5)), rng.normal(size=3)
    ys = [x @ w_true.T + b_true + 2 * rng.normal(size=3) + 0.5 * rng.normal(size=(len(x), 3)) for x in xs]
    models, grams = [], []
    for x, y in zip(xs, ys):
        coef = np.linalg.lstsq(np.c_[x, np.ones(len(x))], y, rcond=None)[0].T
        layer = nn.Linear(5, 3).double()
        with torch.no_grad():
            layer.weight.copy_(torch.from_numpy(coef[:, :5]))
            layer.bias.copy_(torch.from_numpy(coef[:, 5]))
        models.append({k: v.numpy().copy() for k, v in layer.state_dict().items()})
        xt = torch.from_numpy(x)
        batches = [(xt[:8], torch.zeros(8, dtype=torch.long)), (xt[8:], torch.zeros(len(x) - 8, dtype=torch.long))]
        grams.append(input_grams(layer, batches))
    return xs, ys, models, grams


def test_regmean_on_a_linear_model_is_least_squares_on_the_union_of_inputs() -> None:
    xs, ys, models, grams = _fit_clients()
    merged = regmean_merge(models, grams, [len(x) for x in xs], alpha=1.0)
    x_all = np.vstack(xs)
    want = np.linalg.lstsq(np.c_[x_all, np.ones(len(x_all))], np.vstack(ys), rcond=None)[0].T
    np.testing.assert_allclose(merged["weight"], want[:, :5], atol=1e-10)
    np.testing.assert_allclose(merged["bias"], want[:, 5], atol=1e-10)
    # ... and not the plain average, which the data sizes and inputs pull away from it.
    assert np.abs(size_weighted_average(models, [len(x) for x in xs])["weight"] - want[:, :5]).max() > 1e-3


@pytest.mark.parametrize("alpha", [0.1, 0.9])
def test_identical_clients_and_a_single_client_return_that_model(alpha: float) -> None:
    xs, _, models, grams = _fit_clients()
    same = regmean_merge([models[0]] * 3, grams, [5, 10, 15], alpha=alpha)
    alone = regmean_merge([models[2]], [grams[2]], [7], alpha=alpha)
    for name in models[0]:
        np.testing.assert_allclose(same[name], models[0][name], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(alone[name], models[2][name], rtol=1e-12, atol=1e-12)


def test_scale_off_diagonal_keeps_the_diagonal() -> None:
    g = np.arange(9.0).reshape(3, 3)
    out = scale_off_diagonal(g, 0.1)
    np.testing.assert_allclose(np.diag(out), np.diag(g))
    np.testing.assert_allclose(out - np.diag(np.diag(out)), 0.1 * (g - np.diag(np.diag(g))))


def test_convolutions_are_averaged_by_size_and_linear_layers_solved() -> None:
    shape = (1, 16, 16)
    models = [{k: v.numpy() for k, v in build_model("lenet", shape, 10, seed=s).state_dict().items()} for s in (0, 1)]
    gen = torch.Generator().manual_seed(0)
    grams = []
    for s in (0, 1):
        model = build_model("lenet", shape, 10, seed=s)
        x = torch.randn(16, *shape, generator=gen)
        grams.append(input_grams(model, [(x, torch.zeros(16, dtype=torch.long))]))
    assert list(grams[0]) == ["fc1", "fc2", "fc3"]
    merged = regmean_merge(models, grams, [30, 10], alpha=0.9)
    avg = size_weighted_average(models, [30, 10])
    for name in ("conv1.weight", "conv2.weight"):
        np.testing.assert_allclose(merged[name], avg[name])
    assert np.abs(merged["fc2.weight"] - avg["fc2.weight"]).max() > 1e-3


def test_inputs_seen_by_no_client_keep_the_average() -> None:
    xs, _, models, grams = _fit_clients()
    dead = []
    for g in grams:  # input 2 is zero on every client: its Gram row and column vanish
        m = g[""].gram.copy()
        m[2, :] = m[:, 2] = 0.0
        dead.append({"": InputGram("weight", "bias", m)})
    n = [len(x) for x in xs]
    merged = regmean_merge(models, dead, n, alpha=0.9)
    np.testing.assert_allclose(merged["weight"][:, 2], size_weighted_average(models, n)["weight"][:, 2], atol=1e-12)
    assert np.all(np.isfinite(merged["weight"]))


def test_select_keeps_the_alpha_with_the_best_validation_score() -> None:
    xs, _, models, grams = _fit_clients()
    n = [len(x) for x in xs]
    target = regmean_merge(models, grams, n, alpha=0.1)

    def evaluate(model: dict) -> float:
        return -float(np.abs(model["weight"] - target["weight"]).max())

    res = regmean_select(models, grams, n, evaluate)
    assert res.alpha == 0.1 and set(res.scores) == {0.1, 0.9} and res.scores[0.1] == 0.0
    assert res.merged_layers == [""]
    np.testing.assert_allclose(res.model["weight"], target["weight"])


def test_bad_inputs_name_the_client_and_layer() -> None:
    xs, _, models, grams = _fit_clients()
    n = [len(x) for x in xs]
    bad = list(grams)
    bad[1] = {"": InputGram("weight", None, grams[1][""].gram)}
    with pytest.raises(ValueError, match="client 1, layer '': weight/bias names differ"):
        regmean_merge(models, bad, n)
    with pytest.raises(ValueError, match="client 1, layer '': weight/bias names differ"):
        regmean_merge(models, bad, n, checked=True)  # decoded uploads: names are still checked
    bad[1] = {"": InputGram("weight", "bias", np.eye(5))}
    with pytest.raises(ValueError, match=r"client 1, layer '': Gram has shape \(5, 5\), expected \(6, 6\)"):
        regmean_merge(models, bad, n)
    with pytest.raises(ValueError, match="alpha"):
        regmean_merge(models, grams, n, alpha=1.5)
