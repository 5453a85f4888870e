"""Cost matrices equal their direct definition."""

import numpy as np
import pytest

from fedfiot_flwr.merge import MergeSpeed, assign, euclidean_cost_matrix, fisher_cost_matrix


def test_fisher_cost_matches_definition():
    rng = np.random.default_rng(0)
    m, d = 9, 6
    w, wk, fk = rng.normal(size=(m, d)), rng.normal(size=(m, d)), rng.exponential(size=(m, d))
    direct = np.array([[np.sum(fk[j] * (w[i] - wk[j]) ** 2) for j in range(m)] for i in range(m)])
    np.testing.assert_allclose(fisher_cost_matrix(w, wk, fk), direct, rtol=1e-10, atol=1e-10)


def test_euclidean_cost_matches_definition():
    rng = np.random.default_rng(1)
    w, wk = rng.normal(size=(7, 4)), rng.normal(size=(7, 4))
    direct = ((w[:, None, :] - wk[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(euclidean_cost_matrix(w, wk), direct, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(fisher_cost_matrix(w, wk, np.ones_like(wk)), direct, rtol=1e-10, atol=1e-10)


def test_assign_recovers_a_hidden_permutation():
    rng = np.random.default_rng(2)
    w = rng.normal(size=(20, 5))
    p = rng.permutation(20)
    wk = np.empty_like(w)
    wk[p] = w  # client neuron p[i] holds global neuron i
    assert assign(euclidean_cost_matrix(w, wk)).tolist() == p.tolist()


def test_stacked_cost_matrices_equal_per_client_ones_in_any_grouping():
    from fedfiot_flwr.merge.costs import euclidean_cost_matrices, fisher_cost_matrices

    rng = np.random.default_rng(3)
    m, d, k = 6, 5, 5
    w = rng.normal(size=(m, d))
    layers = [rng.normal(size=(m, d)) for _ in range(k)]
    fishers = [rng.exponential(size=(m, d)) for _ in range(k)]
    for max_bytes in (1, 8 * m * m * 2, 2**28):  # one client per GEMM, pairs, all at once
        stacked = list(fisher_cost_matrices(w, layers, fishers, max_bytes=max_bytes))
        for c, x, f in zip(stacked, layers, fishers):
            np.testing.assert_allclose(c, fisher_cost_matrix(w, x, f), rtol=1e-10, atol=1e-10)
        stacked = list(euclidean_cost_matrices(w, layers, max_bytes=max_bytes))
        for c, x in zip(stacked, layers):
            np.testing.assert_allclose(c, euclidean_cost_matrix(w, x), rtol=1e-10, atol=1e-10)


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("stack_bytes", [2**31, 0])  # stacked clients, and streamed ones
def test_float32_costs_do_not_overflow_on_a_float32_max_fisher(stack_bytes: int) -> None:
    from _fedfiot_helpers import SPEC, client_uploads

    from fedfiot_flwr.merge import MergeOptions, merge

    f32_max = float(np.finfo(np.float32).max)
    uploads = client_uploads(4, seed=11)
    weights = [w for w, _, _ in uploads]
    fishers = [f for _, f, _ in uploads]
    # rho = 1 leaves the Fisher at float32's maximum, so f * w overflows a float32 GEMM input
    fishers[0] = {n: (f.astype(np.float64) / f.max() * f32_max).astype(np.float32) for n, f in fishers[0].items()}
    sizes = [n for _, _, n in uploads]
    runs = {dtype: merge(weights, fishers, SPEC, MergeOptions(rho=1.0), num_examples=sizes,
                         speed=MergeSpeed(cost_dtype=dtype, stack_bytes=stack_bytes))
            for dtype in ("float64", "float32")}
    for name, value in runs["float32"].model.items():
        assert np.all(np.isfinite(value)), name
        np.testing.assert_allclose(value, runs["float64"].model[name], rtol=1e-5, atol=1e-6)
    for name, perms in runs["float32"].permutations.items():
        assert [p.tolist() for p in perms] == [p.tolist() for p in runs["float64"].permutations[name]], name
