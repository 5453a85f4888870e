"""FedFisher K-FAC with the factors' low-rank roots equals the dense-factor merge.

A decoded upload carries each factor's 8-bit low-rank root (``A = L_A L_A^T``); the merge applies
the root of a layer's wide side where :func:`~fedfiot_flwr.baselines.fedfisher.kfac_plan` counts
fewer multiply-adds. On random factors of every plan (input side, output side, both, dense) the
merged model and the checkpoint objectives agree with ``low_rank=False`` to float rounding
(float64: 1e-9; float32 over a few hundred steps: 1e-5). Speed is measured by
``benchmarks/server_speed.py``, not here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfiot_flwr.baselines import FedFisherOptions, fedfisher_kfac
from fedfiot_flwr.baselines.fedfisher import _KFACLayer, kfac_plan
from fedfiot_flwr.psd import KFACFactors
from fedfiot_flwr.wire import pack_kfac_reply, unpack_curvature_reply


def _root(n: int, r: int, rng: np.random.Generator) -> np.ndarray:
    return rng.normal(size=(n, r)) / np.sqrt(n)


def _factored(root_a: np.ndarray | None, root_g: np.ndarray | None, n_a: int, n_g: int,
              rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Dense factors equal to the roots' products (a full-rank PSD matrix where no root)."""
    def dense(root: np.ndarray | None, n: int) -> np.ndarray:
        if root is not None:
            return root @ root.T
        m = rng.normal(size=(n, n))
        return m @ m.T / n + 0.1 * np.eye(n)
    return dense(root_a, n_a), dense(root_g, n_g)


# (d_out, d_in, rank of A's root or None, rank of G's root or None), one per plan.
LAYERS = {
    "input side": (6, 40, 5, None),    # kfac_plan: ("A", False)
    "output side": (40, 6, None, 5),   # ("G", False)
    "both sides": (30, 40, 3, 4),      # ("A", True)
    "full rank": (5, 7, 8, 5),         # roots as wide as the factors: ("dense", False)
}


def _clients(layer: str, k: int = 3, seed: int = 0, ranks: list[int] | None = None
             ) -> tuple[list[dict], list[dict], list[int]]:
    d_out, d_w, r_a, r_g = LAYERS[layer]
    d_in = d_w + 1  # the bias column
    rng = np.random.default_rng(seed)
    models, factors = [], []
    for i in range(k):
        ra = None if r_a is None else (ranks[i] if ranks else r_a)
        root_a = None if ra is None else _root(d_in, ra, rng)
        root_g = None if r_g is None else _root(d_out, r_g, rng)
        a, g = _factored(root_a, root_g, d_in, d_out, rng)
        models.append({"fc.weight": rng.normal(size=(d_out, d_w)).astype(np.float32),
                       "fc.bias": rng.normal(size=d_out).astype(np.float32)})
        factors.append({"fc": KFACFactors("fc.weight", "fc.bias", a, g, A_root=root_a, G_root=root_g)})
    return models, factors, [20, 50, 30, 40][:k]


def _close(a, b, rtol: float) -> None:
    for n in a.model:
        scale = float(np.max(np.abs(a.model[n])))
        np.testing.assert_allclose(a.model[n], b.model[n], rtol=rtol, atol=rtol * scale, err_msg=n)
    assert [h["step"] for h in a.history] == [h["step"] for h in b.history]
    objectives = [h["objective"] for h in a.history]  # they fall by orders of magnitude: relative to the first
    np.testing.assert_allclose(objectives, [h["objective"] for h in b.history], rtol=rtol, atol=rtol * objectives[0])


def test_the_plans_are_the_cheapest_products() -> None:
    plans = {name: kfac_plan(d_out, d_in + 1, r_a, r_g) for name, (d_out, d_in, r_a, r_g) in LAYERS.items()}
    assert plans == {"input side": ("A", False), "output side": ("G", False), "both sides": ("A", True),
                     "full rank": ("dense", False)}
    # The paper's CNN at FedAvg's upload size: fc1 (512 x 1601) uses the input factor's root.
    assert kfac_plan(512, 1601, 487, 487) == ("A", False)
    assert kfac_plan(512, 1601, None, None) == ("dense", False)


@pytest.mark.parametrize("layer", list(LAYERS))
@pytest.mark.parametrize("dtype, rtol, steps", [(torch.float64, 1e-9, 300), (torch.float32, 1e-5, 300)])
def test_low_rank_roots_give_the_dense_merge(layer: str, dtype: torch.dtype, rtol: float, steps: int) -> None:
    models, factors, n = _clients(layer)
    kw = {"options": FedFisherOptions(steps=steps, eval_every=50, device="cpu"), "dtype": dtype}
    dense = fedfisher_kfac(models, factors, n, low_rank=False, **kw)
    rooted = fedfisher_kfac(models, factors, n, **kw)
    moved = float(np.max(np.abs(dense.model["fc.weight"] - dense.initial_model["fc.weight"])))
    assert moved > 1e-2  # the optimisation really moved away from the average
    _close(dense, rooted, rtol)
    if layer == "full rank":  # no cheaper plan: the dense path itself, bit for bit
        for k in dense.model:
            assert np.array_equal(dense.model[k], rooted.model[k])


@pytest.mark.parametrize("options", [{"damping": 0.3}, {"optimizer": "adam"}, {"fisher_scaling": "none"}])
def test_low_rank_roots_with_damping_adam_and_uniform_weights(options: dict) -> None:
    models, factors, n = _clients("both sides", seed=1)
    kw = {"options": FedFisherOptions(steps=200, eval_every=40, device="cpu", **options), "dtype": torch.float64}
    _close(fedfisher_kfac(models, factors, n, low_rank=False, **kw), fedfisher_kfac(models, factors, n, **kw), 1e-9)


def test_clients_with_different_ranks_are_padded() -> None:
    models, factors, n = _clients("input side", ranks=[3, 5, 1])
    kw = {"options": FedFisherOptions(steps=150, eval_every=50, device="cpu"), "dtype": torch.float64}
    _close(fedfisher_kfac(models, factors, n, low_rank=False, **kw), fedfisher_kfac(models, factors, n, **kw), 1e-9)


def test_one_step_of_every_plan_equals_the_dense_products() -> None:
    rng = np.random.default_rng(3)
    to = lambda x: torch.as_tensor(x, dtype=torch.float64)  # noqa: E731
    cw = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64).view(-1, 1, 1)
    for layer, (d_out, d_w, r_a, r_g) in LAYERS.items():
        d_in = d_w + 1
        la = None if r_a is None else rng.normal(size=(3, d_in, r_a))
        lg = None if r_g is None else rng.normal(size=(3, d_out, r_g))
        a = la @ la.transpose(0, 2, 1) if la is not None else np.stack([np.eye(d_in) * 2.0] * 3)
        g = lg @ lg.transpose(0, 2, 1) if lg is not None else np.stack([np.eye(d_out) * 0.5] * 3)
        wk, w = rng.normal(size=(3, d_out, d_in)), rng.normal(size=(d_out, d_in))
        want_grad = sum(0.0 + c * g[k] @ (w - wk[k]) @ a[k] for k, c in enumerate([0.2, 0.5, 0.3]))
        want_obj = sum(c * np.sum((w - wk[k]) * (g[k] @ (w - wk[k]) @ a[k])) for k, c in enumerate([0.2, 0.5, 0.3]))
        terms = _KFACLayer(to(wk), a, g, la, lg, to)
        grad, obj = terms.step(to(w), cw, 0.0, True)
        np.testing.assert_allclose(grad.numpy(), want_grad, rtol=1e-10, err_msg=layer)
        assert float(obj) == pytest.approx(want_obj, rel=1e-10), layer
        assert terms.step(to(w), cw, 0.0, False)[1] is None


def test_decoded_uploads_carry_the_roots_and_merge_as_the_dense_factors() -> None:
    rng = np.random.default_rng(5)
    d_out, d_w = 8, 60
    models, decoded = [], []
    for i in range(3):
        state = {"fc.weight": rng.normal(size=(d_out, d_w)).astype(np.float32),
                 "fc.bias": rng.normal(size=d_out).astype(np.float32)}
        x = rng.normal(size=(200, d_w + 1)) * np.linspace(2.0, 0.01, d_w + 1)  # a decaying input spectrum
        gr = rng.normal(size=(50, d_out))
        factors = {"fc": KFACFactors("fc.weight", "fc.bias", x.T @ x / 200, gr.T @ gr / 50)}
        reply = pack_kfac_reply(state, factors, 10 * (i + 1), fisher_kind="empirical", rank=6)
        up = unpack_curvature_reply(reply, {k: v.shape for k, v in state.items()}, client=str(i))
        f = up.factors["fc"]
        assert f.A_root.shape == (d_w + 1, 6) and f.G_root.shape == (d_out, 6)
        assert np.array_equal(f.A, f.A_root @ f.A_root.T) and np.array_equal(f.G, f.G_root @ f.G_root.T)
        models.append(up.weights)
        decoded.append(up.factors)
    assert kfac_plan(d_out, d_w + 1, 6, 6)[0] == "A"
    n = [10, 20, 30]
    kw = {"options": FedFisherOptions(steps=300, eval_every=100, device="cpu"), "checked": True}
    _close(fedfisher_kfac(models, decoded, n, low_rank=False, **kw), fedfisher_kfac(models, decoded, n, **kw), 1e-5)


def test_a_root_that_does_not_reproduce_its_factor_is_rejected() -> None:
    models, factors, n = _clients("input side")
    f = factors[1]["fc"]
    factors[1] = {"fc": KFACFactors(f.weight, f.bias, f.A, f.G, A_root=f.A_root * 1.1)}
    with pytest.raises(ValueError, match=r"client 1, layer 'fc': root of factor A does not reproduce"):
        fedfisher_kfac(models, factors, n, FedFisherOptions(steps=1))
    factors[1] = {"fc": KFACFactors(f.weight, f.bias, f.A, f.G, A_root=f.A_root[:-1])}
    with pytest.raises(ValueError, match="root of factor A has shape"):
        fedfisher_kfac(models, factors, n, FedFisherOptions(steps=1))
    factors[1] = {"fc": KFACFactors(f.weight, f.bias, f.A, f.G, A_root=np.full_like(f.A_root, np.nan))}
    with pytest.raises(ValueError, match="NaN"):
        fedfisher_kfac(models, factors, n, FedFisherOptions(steps=1))


@pytest.mark.parametrize("module", ["fedfiot_flwr.baselines.fedfisher", "fedfiot_flwr.psd"])
def test_the_module_examples_hold(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
