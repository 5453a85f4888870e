"""Client-side curvature: K-FAC factors, RegMean Grams, their compression and the wire format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedfiot_flwr.wire import (
    FACTOR_PREFIX,
    fedavg_payload_bytes,
    pack_gram_reply,
    pack_kfac_reply,
    payload_bytes,
    unpack_curvature_reply,
)
from fedfiot_flwr.curvature import (
    CODE_LEVELS,
    CompressedPSD,
    compress_psd,
    compressed_nbytes,
    curvature_modules,
    decompress_psd,
    input_grams,
    kfac_factors,
    rank_for_budget,
)
from fedfiot_flwr.quantize import LEVELS


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 5)).double()


def _batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


def _output_vectors(z: torch.Tensor, y: int, kind: str) -> list[torch.Tensor]:
    """Logit-space vectors v whose J^T v outer products sum to the per-example Fisher."""
    p = torch.softmax(z, 0)
    eye = torch.eye(len(p), dtype=z.dtype)
    if kind == "empirical":
        return [p - eye[y]]
    return [p[c].sqrt() * (p - eye[c]) for c in range(len(p))]


def _hand_factors(model: nn.Module, x: torch.Tensor, y: torch.Tensor, kind: str) -> dict[str, tuple]:
    """Definition: A = mean [a;1][a;1]^T, G = mean sum_v g_v g_v^T, one example at a time."""
    layers = {"0": model[0], "2": model[2]}
    out: dict[str, list] = {name: [0.0, 0.0] for name in layers}
    records: dict[str, tuple] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, o, n=n: records.__setitem__(n, (inp[0], o)))
             for n, m in layers.items()]
    n = len(x)
    for i in range(n):
        z = model(x[i : i + 1])[0]
        for name in layers:
            a = torch.cat([records[name][0][0], torch.ones(1, dtype=x.dtype)])
            out[name][0] = out[name][0] + torch.outer(a, a) / n
        for v in _output_vectors(z.detach(), int(y[i]), kind):
            grads = torch.autograd.grad(z, [records[k][1] for k in layers], grad_outputs=v, retain_graph=True)
            for name, g in zip(layers, grads):
                out[name][1] = out[name][1] + torch.outer(g[0], g[0]) / n
    for h in hooks:
        h.remove()
    return {k: (a.detach().numpy(), g.detach().numpy()) for k, (a, g) in out.items()}


@pytest.mark.parametrize("kind", ["empirical", "true"])
def test_kfac_linear_factors_equal_their_definition(kind: str) -> None:
    model = _mlp()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 5, (7,), generator=gen)
    got = kfac_factors(model, _batches(x, y, 3), kind)
    want = _hand_factors(model, x, y, kind)
    assert list(got) == ["0", "2"]
    for name, (a, g) in want.items():
        assert got[name].weight == f"{name}.weight" and got[name].bias == f"{name}.bias"
        assert got[name].A.shape == (a.shape[0], a.shape[0])  # bias folded in: d_in + 1
        np.testing.assert_allclose(got[name].A, a, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got[name].G, g, rtol=1e-10, atol=1e-12)


def test_kfac_conv_factors_use_unfolded_patches() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, bias=True)
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.Linear(3 * 3 * 3, 4)).double()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2, 5, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (5,), generator=gen)
    got = kfac_factors(model, _batches(x, y, 2), "empirical")["0"]
    patches = F.unfold(x, 3).transpose(1, 2)  # (N, T, C k k), the order of weight.view(out, -1)
    patches = torch.cat([patches, torch.ones(5, 9, 1, dtype=x.dtype)], dim=2)
    n, t = patches.shape[:2]
    a = torch.einsum("nti,ntj->ij", patches, patches) / (n * t)
    g_sum = torch.zeros(3, 3, dtype=x.dtype)
    for i in range(n):
        out = conv.double()(x[i : i + 1])
        z = model[1:](out)[0]
        (g,) = torch.autograd.grad(z, out, grad_outputs=_output_vectors(z.detach(), int(y[i]), "empirical")[0])
        gt = g[0].reshape(3, -1)  # (C_out, T)
        g_sum += gt @ gt.T
    np.testing.assert_allclose(got.A, a.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(got.G, (g_sum / n).numpy(), rtol=1e-10, atol=1e-12)


def test_kfac_restores_the_model_and_checks_inputs() -> None:
    model = _mlp().train()
    model[0].weight.requires_grad_(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    kfac_factors(model, [(x, y)], "true")
    assert model.training and not model[0].weight.requires_grad and model[2].weight.requires_grad
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="Fisher kind"):
        kfac_factors(model, [(x, y)], "monte-carlo")
    with pytest.raises(ValueError, match="nope"):
        kfac_factors(model, [(x, y)], modules=["nope"])
    with pytest.raises(ValueError, match="no examples"):
        kfac_factors(model, [], "true")


def test_curvature_modules_cover_linear_and_conv_layers() -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Conv2d(2, 2, 1, groups=2), nn.Flatten(), nn.Linear(8, 2))
    assert list(curvature_modules(model)) == ["0", "4"]
    assert list(curvature_modules(model, linear_only=True)) == ["4"]


def test_input_grams_equal_the_mean_augmented_outer_product() -> None:
    model = _mlp()
    x = torch.randn(9, 4, dtype=torch.float64)
    grams = input_grams(model, _batches(x, torch.zeros(9, dtype=torch.long), 4))
    xa = torch.cat([x, torch.ones(9, 1, dtype=x.dtype)], 1)
    np.testing.assert_allclose(grams["0"].gram, (xa.T @ xa / 9).numpy(), rtol=1e-12)
    h = torch.cat([torch.relu(model[0](x)), torch.ones(9, 1, dtype=x.dtype)], 1).detach()
    np.testing.assert_allclose(grams["2"].gram, (h.T @ h / 9).numpy(), rtol=1e-12)
    nobias = nn.Linear(4, 2, bias=False).double()
    g = input_grams(nobias, [(x, torch.zeros(9, dtype=torch.long))])[""]
    assert g.bias is None and g.gram.shape == (4, 4)


# ------------------------------------------------------------------------------ compression


def _psd(n: int, rank: int, seed: int = 0) -> np.ndarray:
    m = np.random.default_rng(seed).normal(size=(n, rank))
    return m @ m.T


def test_compress_psd_full_rank_round_trip_and_bytes() -> None:
    m = _psd(12, 12)
    c = compress_psd(m)
    assert c.codes.dtype == np.int8 and c.codes.shape == (12, 12) and c.scales.dtype == np.float32
    assert c.nbytes == compressed_nbytes(12, None) == 12 * 12 + 4 * 12
    assert int(np.abs(c.codes).max()) == CODE_LEVELS  # every column uses the full code range
    back = decompress_psd(c)
    assert np.linalg.norm(back - m) / np.linalg.norm(m) < 2e-2
    assert np.linalg.eigvalsh(back).min() > -1e-9  # PSD by construction


def test_compress_psd_truncation_keeps_the_top_eigenspace() -> None:
    m = _psd(20, 3, seed=1)  # rank 3: truncating at 3 loses nothing but quantization
    back = decompress_psd(compress_psd(m, rank=3))
    assert np.linalg.norm(back - m) / np.linalg.norm(m) < 2e-2
    vals = np.linalg.eigvalsh(m)
    trunc = decompress_psd(compress_psd(m, rank=2))
    # Eckart-Young: the rank-2 error is the smallest kept eigenvalue (up to quantization).
    assert np.linalg.norm(trunc - m, 2) == pytest.approx(vals[-3], rel=5e-2)
    assert compress_psd(m, rank=50).rank == 20


def test_compression_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="square"):
        compress_psd(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="NaN"):
        compress_psd(np.full((2, 2), np.nan))
    with pytest.raises(ValueError, match="-128"):
        decompress_psd(CompressedPSD(np.full((2, 1), -128, dtype=np.int8), np.ones(1, np.float32)))
    with pytest.raises(ValueError, match="scales"):
        decompress_psd(CompressedPSD(np.zeros((2, 1), dtype=np.int8), np.ones(2, np.float32)))


def test_rank_for_budget_is_the_largest_rank_that_fits() -> None:
    sizes = [25, 32, 800, 64]
    for budget in (0, 100, 5000, 123_456):
        r = rank_for_budget(sizes, budget)
        cost = sum(compressed_nbytes(s, r) for s in sizes)
        assert cost <= budget or r == 0
        assert sum(compressed_nbytes(s, r + 1) for s in sizes) > budget
    assert rank_for_budget(sizes, 10**9) == 800


# --------------------------------------------------------------------------------- the wire


def _trained_like_mlp() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(20, 6), torch.randint(0, 3, (20,))
    return model, _batches(x, y, 8)


def test_kfac_reply_round_trip_and_budget() -> None:
    model, data = _trained_like_mlp()
    factors = kfac_factors(model, data, "empirical")
    state = model.state_dict()
    content = pack_kfac_reply(state, factors, 20, fisher_kind="empirical", rank=None, metrics={"train-loss": 1.0})
    up = unpack_curvature_reply(content, {k: tuple(v.shape) for k, v in state.items()}, client="c7")
    assert up.method == "kfac" and up.fisher_kind == "empirical" and up.rank is None and up.num_examples == 20
    assert up.metrics == {"train-loss": 1.0}
    for name, value in state.items():  # 16-bit weights: error <= ||x||_inf / (2 l_q)
        tol = float(value.abs().max()) / (2 * LEVELS) * (1 + 1e-6)
        assert np.abs(up.weights[name] - value.numpy()).max() <= tol
    for layer, f in factors.items():
        got = up.factors[layer]
        assert (got.weight, got.bias) == (f.weight, f.bias)
        for mine, theirs in ((got.A, f.A), (got.G, f.G)):
            assert np.linalg.norm(mine - theirs) / np.linalg.norm(theirs) < 3e-2
    budget = pack_kfac_reply(state, factors, 20, fisher_kind="true", rank="fedavg")
    sizes = payload_bytes(budget)
    assert sizes["total"] <= fedavg_payload_bytes(state)
    assert sizes["weights"] == sum(2 * v.numel() + 4 for v in state.values())


def test_gram_reply_round_trip_and_bad_replies() -> None:
    model, data = _trained_like_mlp()
    grams = input_grams(model, data)
    state = model.state_dict()
    content = pack_gram_reply(state, grams, 20, rank=4)
    up = unpack_curvature_reply(content, client="c1")
    assert up.method == "gram" and up.fisher_kind is None and up.rank == 4 and set(up.grams) == {"0", "2"}
    assert up.grams["0"].gram.shape == (7, 7)
    assert np.linalg.matrix_rank(up.grams["0"].gram) <= 4
    # A factor that does not fit its layer names the client and the factor.
    arrays = content["fedfiot"]
    arrays[f"{FACTOR_PREFIX}0/gram"] = arrays[f"{FACTOR_PREFIX}2/gram"]
    with pytest.raises(ValueError, match=r"client c1: factor 'curvature/0/gram'"):
        unpack_curvature_reply(content, client="c1")
    del content["curvature"]
    with pytest.raises(ValueError, match="client c1: reply lacks the ConfigRecord"):
        unpack_curvature_reply(content, client="c1")
