"""The client's input Grams in one forward pass: each layer's mean input (patch) second moment, with the
constant input of a bias last, equal to curvlinops' K-FAC input factor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedfiot_flwr.curvature import input_grams


def _net_and_data() -> tuple[nn.Module, torch.Tensor, torch.utils.data.DataLoader]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 3, stride=2, bias=False),
                        nn.Flatten(), nn.Linear(4 * 3 * 3, 5))
    x = torch.randn(10, 2, 8, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.randint(0, 5, (10,))), batch_size=4)
    return net, x, loader


def _patch_gram(x: torch.Tensor, bias: bool, **unfold: int) -> np.ndarray:
    p = F.unfold(x.double(), 3, **unfold)  # (N, C*9, T)
    if bias:
        p = torch.cat([p, torch.ones(p.shape[0], 1, p.shape[2], dtype=p.dtype)], dim=1)
    return (torch.einsum("nct,ndt->cd", p, p) / (p.shape[0] * p.shape[2])).numpy()


def test_a_convolutions_gram_is_the_mean_second_moment_of_its_unfolded_patches() -> None:
    net, x, loader = _net_and_data()
    grams = input_grams(net, loader, convolutions=True)
    assert list(grams) == ["0", "2", "4"]
    assert grams["0"].bias == "0.bias" and grams["2"].bias is None
    np.testing.assert_allclose(grams["0"].gram, _patch_gram(x, True, padding=1), atol=1e-6)
    with torch.no_grad():
        hidden = net[1](net[0](x))
    np.testing.assert_allclose(grams["2"].gram, _patch_gram(hidden, False, stride=2), atol=1e-6)
    with torch.no_grad():
        flat = torch.cat([net[3](net[2](hidden)), torch.ones(10, 1)], dim=1).double()
    np.testing.assert_allclose(grams["4"].gram, (flat.T @ flat / 10).numpy(), atol=1e-6)
    assert list(input_grams(net, loader)) == ["4"]  # RegMean's: Linear layers only


def test_the_grams_equal_curvlinops_input_factors() -> None:
    pytest.importorskip("curvlinops")
    from fedfiot_flwr.curvature import _run_kfac, curvature_modules

    net, _, loader = _net_and_data()
    modules = curvature_modules(net)
    factors, _, _ = _run_kfac(net, loader, modules, "forward-only", False, "a test")
    grams = input_grams(net, loader, convolutions=True)
    for name in modules:
        np.testing.assert_allclose(grams[name].gram, factors[name].double().numpy(), atol=1e-6, err_msg=name)


def test_the_pass_leaves_the_model_as_it_was_and_refuses_an_empty_loader() -> None:
    net, _, loader = _net_and_data()
    net.train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    input_grams(net, loader, convolutions=True)
    assert net.training and all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    with pytest.raises(ValueError, match="no examples"):
        input_grams(net, [], convolutions=True)


def test_a_sampled_pass_estimates_the_grams_from_fewer_rows_and_is_repeatable() -> None:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Conv2d(1, 2, 5), nn.Flatten(), nn.Linear(2 * 12 * 12, 3))
    x = torch.randn(400, 1, 16, 16)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, torch.zeros(400, dtype=torch.long)),
                                         batch_size=200)
    full = input_grams(net, loader, convolutions=True)
    sampled = input_grams(net, loader, convolutions=True, sample=True)
    again = input_grams(net, loader, convolutions=True, sample=True)
    error = np.linalg.norm(sampled["0"].gram - full["0"].gram) / np.linalg.norm(full["0"].gram)
    assert 0 < error < 0.1, error  # the convolution: fewer rows (2 outputs for 25 inputs), the same moment
    np.testing.assert_array_equal(sampled["2"].gram, full["2"].gram)  # one row per example: all kept
    for name in full:
        np.testing.assert_array_equal(sampled[name].gram, again[name].gram)
