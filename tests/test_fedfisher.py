"""FedFisher server merge: the K-FAC quadratic form, the optimisation and checkpoint choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedfiot_flwr.baselines import (
    FedFisherOptions,
    fedfisher_diag,
    fedfisher_kfac,
    kfac_quadratic,
    size_weighted_average,
)
from fedfiot_flwr.curvature import KFACFactors, kfac_factors

RNG = np.random.default_rng(0)


def _psd(n: int, rng: np.random.Generator = RNG) -> np.ndarray:
    m = rng.normal(size=(n, n))
    return m @ m.T / n + 0.1 * np.eye(n)


def _clients(k: int = 3, seed: int = 0) -> tuple[list[dict], list[dict], list[int]]:
    rng = np.random.default_rng(seed)
    models, factors = [], []
    for _ in range(k):
        models.append({"conv.weight": rng.normal(size=(2, 1, 2, 2)), "fc.weight": rng.normal(size=(3, 4)),
                       "fc.bias": rng.normal(size=3), "bn.running_mean": rng.normal(size=2)})
        factors.append({"conv": KFACFactors("conv.weight", None, _psd(4, rng), _psd(2, rng)),
                        "fc": KFACFactors("fc.weight", "fc.bias", _psd(5, rng), _psd(3, rng))})
    return models, factors, [10, 20, 30][:k]


def test_kfac_quadratic_equals_the_explicit_kronecker_product() -> None:
    delta, a, g = RNG.normal(size=(3, 4)), _psd(4), _psd(3)
    vec = delta.flatten(order="F")  # column stacking
    assert kfac_quadratic(delta, a, g) == pytest.approx(float(vec @ np.kron(a, g) @ vec), rel=1e-12)


def test_kfac_of_one_linear_layer_on_one_example_is_the_exact_fisher() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    x, y = torch.randn(1, 4, dtype=torch.float64), torch.tensor([2])
    f = kfac_factors(layer, [(x, y)], "empirical")[""]
    loss = nn.functional.cross_entropy(layer(x), y)
    gw, gb = torch.autograd.grad(loss, [layer.weight, layer.bias])
    grad = torch.cat([gw, gb[:, None]], 1).numpy().flatten(order="F")  # vec([W b])
    np.testing.assert_allclose(np.kron(f.A, f.G), np.outer(grad, grad), atol=1e-12)


@pytest.mark.parametrize("optimizer", ["fedfisher", "adam"])
def test_kfac_merge_reaches_the_minimiser_of_the_kronecker_objective(optimizer: str) -> None:
    models, factors, n = _clients()
    c = np.asarray(n) / sum(n)
    h, rhs = 0.0, 0.0
    for ck, f, m in zip(c, factors, models):
        kron = np.kron(f["fc"].A, f["fc"].G)
        h, rhs = h + ck * kron, rhs + ck * kron @ np.c_[m["fc.weight"], m["fc.bias"]].flatten(order="F")
    want = np.linalg.solve(h, rhs).reshape(5, 3).T
    res = fedfisher_kfac(models, factors, n, FedFisherOptions(steps=2000, optimizer=optimizer, device="cpu"),
                         dtype=torch.float64)
    np.testing.assert_allclose(res.model["fc.weight"], want[:, :4], atol=1e-8)
    np.testing.assert_allclose(res.model["fc.bias"], want[:, 4], atol=1e-8)
    # Tensors without factors stay at the size-weighted average.
    np.testing.assert_allclose(res.model["bn.running_mean"], size_weighted_average(models, n)["bn.running_mean"])
    # The step-0 objective is sum_k c_k tr(G dW A dW^T) at the average, and Adam lowered it.
    avg = res.initial_model
    j0 = sum(ck * (kfac_quadratic(np.c_[avg["fc.weight"] - m["fc.weight"], avg["fc.bias"] - m["fc.bias"]],
                                  f["fc"].A, f["fc"].G)
                   + kfac_quadratic((avg["conv.weight"] - m["conv.weight"]).reshape(2, 4), f["conv"].A, f["conv"].G))
             for ck, f, m in zip(c, factors, models))
    assert res.history[0]["objective"] == pytest.approx(j0, rel=1e-10)
    assert res.history[-1]["objective"] < j0


@pytest.mark.parametrize("variant", ["kfac", "diag"])
def test_first_steps_follow_fedfishers_update_rule(variant: str) -> None:
    models, factors, n = _clients()
    fishers = [{"fc.weight": np.abs(m["fc.weight"])} for m in models]
    c = np.asarray(n) / sum(n)
    avg = size_weighted_average(models, n)
    w = np.c_[avg["fc.weight"], avg["fc.bias"]] if variant == "kfac" else avg["fc.weight"].copy()
    m_ = v_ = 0.0
    for _ in range(2):  # m <- g + 0.9 m, v <- g^2 + 0.99 v, g = sum_k c_k F_k (W - W_k)
        if variant == "kfac":
            d = [w - np.c_[m["fc.weight"], m["fc.bias"]] for m in models]
            g = sum(ck * f["fc"].G @ dk @ f["fc"].A for ck, f, dk in zip(c, factors, d))
        else:
            g = sum(ck * f["fc.weight"] * (w - m["fc.weight"]) for ck, f, m in zip(c, fishers, models))
        m_, v_ = g + 0.9 * m_, g * g + 0.99 * v_
        w = w - 0.01 * m_ / (np.sqrt(v_ + 0.01) if variant == "kfac" else np.sqrt(v_) + 0.01)
    options = FedFisherOptions(steps=2, device="cpu")
    if variant == "kfac":
        only_fc = [{"fc": f["fc"]} for f in factors]
        got = fedfisher_kfac(models, only_fc, n, options, dtype=torch.float64).model
    else:
        got = fedfisher_diag(models, fishers, n, options, dtype=torch.float64).model
    np.testing.assert_allclose(got["fc.weight"], w[:, :4], rtol=1e-12, atol=1e-14)
    if variant == "kfac":  # the bias is the last column of the layer matrix and moves with it
        np.testing.assert_allclose(got["fc.bias"], w[:, 4], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("variant", ["kfac", "diag"])
def test_identical_clients_and_a_single_client_return_that_model(variant: str) -> None:
    models, factors, _ = _clients(k=3)
    fishers = [{k: np.abs(v) for k, v in m.items() if k != "bn.running_mean"} for m in models]

    def run(ms: list[dict], idx: list[int]) -> dict:
        kw = dict(options=FedFisherOptions(steps=300, eval_every=100, device="cpu"), dtype=torch.float64)
        if variant == "kfac":
            return fedfisher_kfac(ms, [factors[i] for i in idx], [5 * (i + 1) for i in idx], **kw).model
        return fedfisher_diag(ms, [fishers[i] for i in idx], [5 * (i + 1) for i in idx], **kw).model

    same = run([models[0]] * 3, [0, 1, 2])  # same weights, different curvature and sizes
    alone = run([models[1]], [1])
    for name in models[0]:
        np.testing.assert_array_equal(same[name], models[0][name])
        np.testing.assert_array_equal(alone[name], models[1][name])


def test_checkpoints_every_eval_every_steps_and_the_best_one_is_kept() -> None:
    models, factors, n = _clients()
    seen: list[dict] = []
    scores = iter([0.2, 0.5, 0.9, 0.9, 0.1])

    def evaluate(model: dict) -> float:
        seen.append(model)
        return next(scores)

    res = fedfisher_kfac(models, factors, n, FedFisherOptions(steps=350, eval_every=100, device="cpu"),
                         evaluate=evaluate, dtype=torch.float64)
    assert [h["step"] for h in res.history] == [0, 100, 200, 300, 350]
    assert res.best_step == 200 and res.best_score == 0.9  # ties go to the earlier step
    for name in seen[2]:
        np.testing.assert_array_equal(res.model[name], seen[2][name])
    for name in models[0]:  # checkpoint 0 is the size-weighted average
        np.testing.assert_allclose(seen[0][name], size_weighted_average(models, n)[name])


def test_diag_merge_converges_to_the_fisher_weighted_average() -> None:
    models, _, n = _clients()
    fishers = [{k: np.abs(v) + 0.5 for k, v in m.items() if k.startswith("fc")} for m in models]
    res = fedfisher_diag(models, fishers, n, FedFisherOptions(steps=2000, fisher_scaling="none", device="cpu"),
                         dtype=torch.float64)
    for name in fishers[0]:
        want = sum(f[name] * m[name] for f, m in zip(fishers, models)) / sum(f[name] for f in fishers)
        np.testing.assert_allclose(res.model[name], want, atol=1e-6)
    np.testing.assert_allclose(res.model["conv.weight"], size_weighted_average(models, n)["conv.weight"])
    assert res.variant == "diag" and res.best_score is None and res.best_step == 2000


def test_bad_inputs_name_the_client_and_layer() -> None:
    models, factors, n = _clients()
    bad = [dict(f) for f in factors]
    bad[1]["fc"] = KFACFactors("fc.weight", "fc.bias", _psd(4), _psd(3))  # A lacks the bias column
    with pytest.raises(ValueError, match=r"client b, layer 'fc': factor A has shape \(4, 4\), expected \(5, 5\)"):
        fedfisher_kfac(models, bad, n, FedFisherOptions(steps=1), client_ids=["a", "b", "c"])
    renamed = [dict(f) for f in factors]
    renamed[2]["fc"] = KFACFactors("fc.weight", None, _psd(4), _psd(3))
    with pytest.raises(ValueError, match="client 2, layer 'fc': weight/bias names differ"):
        fedfisher_kfac(models, renamed, n, FedFisherOptions(steps=1), checked=True)  # decoded uploads: names are still checked
    with pytest.raises(ValueError, match="client 2: num_examples"):
        fedfisher_kfac(models, factors, [1, 2, 0], FedFisherOptions(steps=1))
    fishers = [{"fc.weight": -np.ones((3, 4))} for _ in models]
    with pytest.raises(ValueError, match="client 0, tensor 'fc.weight': the Fisher must be finite and non-negative"):
        fedfisher_diag(models, fishers, n, FedFisherOptions(steps=1))
    with pytest.raises(ValueError, match="scaling"):
        fedfisher_kfac(models, factors, n, FedFisherOptions(steps=1, fisher_scaling="sqrt"))
