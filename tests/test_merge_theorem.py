"""Theorem 1: with exact updates the layer objective never increases across inner iterations."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedfiot_flwr.merge import MergeOptions, PermutationSpec, merge


@settings(max_examples=60, deadline=None)
@given(
    m=st.integers(2, 7),
    d=st.integers(1, 5),
    k=st.integers(1, 5),
    lam=st.sampled_from([1e-5, 1e-3, 0.1, 1.0]),
    rho=st.sampled_from([0.2, 0.5, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_layer_objective_is_monotone(m, d, k, lam, rho, seed):
    rng = np.random.default_rng(seed)
    spec = PermutationSpec({"w": ("P", None), "b": ("P",)})
    models = [{"w": rng.normal(size=(m, d)), "b": rng.normal(size=m)} for _ in range(k)]
    fishers = [{"w": rng.exponential(size=(m, d)) * rng.integers(0, 2, size=(m, d)),
                "b": rng.exponential(size=m)} for _ in range(k)]
    res = merge(models, fishers, spec, MergeOptions(lam=lam, rho=rho, max_iters=10, reference=int(rng.integers(k))))
    rep = res.reports["P"]
    trace = [rep.initial_objective]
    for a, o in zip(rep.alignment_objectives, rep.objectives):
        trace += [a, o]
    tol = 1e-9 * max(1.0, abs(trace[0]))
    assert all(later <= earlier + tol for earlier, later in zip(trace, trace[1:])), trace
    # the final layer objective is the merged model's full objective (single layer)
    assert np.isclose(rep.objectives[-1], res.aligned_objective, rtol=1e-9, atol=1e-9)
