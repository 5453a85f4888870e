"""Faster alignment paths against the exact one: certified warm-started assignments, the
reference client's skipped first cost matrix, alignment iterations and aligned merges shared
across a sweep, and the (opt-in) warm starts of a sweep."""

import numpy as np
import pytest
from scipy.optimize import linear_sum_assignment

from fedfiot_flwr.merge import MergeOptions, MergeSpeed, merge, mlp_spec, prepare_clients
from fedfiot_flwr.merge import certify as certify_module
from fedfiot_flwr.merge.certify import assign_with_hint, certify_assignment

SPEC = mlp_spec(["fc1", "fc2", "fc3"])
SIZES = [30, 10, 20, 40]


def _clients(seed=0, k=4, noise=0.3, width=(160, 130), d_in=12):
    """Clients around a shared model (small ``noise``: few neurons move) or independent
    (``noise=None``); layers wide enough (>= 128) for the certificate to run with scipy."""
    rng = np.random.default_rng(seed)
    h1, h2 = width
    shapes = {"fc1.weight": (h1, d_in), "fc1.bias": (h1,), "fc2.weight": (h2, h1), "fc2.bias": (h2,),
              "fc3.weight": (5, h2), "fc3.bias": (5,)}
    base = {n: rng.normal(size=s) for n, s in shapes.items()}
    models = [{n: (rng.normal(size=v.shape) if noise is None else v + noise * rng.normal(size=v.shape))
               for n, v in base.items()} for _ in range(k)]
    fishers = [{n: rng.exponential(size=v.shape) for n, v in base.items()} for _ in range(k)]
    return models, fishers, base


def _assert_bit_identical(a, b):
    for p in a.permutations:
        for x, y in zip(a.permutations[p], b.permutations[p]):
            assert np.array_equal(x, y), p
    for n in a.model:
        assert np.array_equal(a.model[n], b.model[n]), n
    assert a.aligned == b.aligned
    assert a.objective == b.objective and a.identity_objective == b.identity_objective
    assert [r.iterations for r in a.reports.values()] == [r.iterations for r in b.reports.values()]


def test_certificate_accepts_exactly_the_optimal_assignments():
    rng = np.random.default_rng(0)
    accepted = rejected = 0
    for _ in range(400):
        m = int(rng.integers(2, 10))
        cost = rng.normal(size=(m, m))
        rows, cols = linear_sum_assignment(cost)
        best = cost[rows, cols].sum()
        hint = rng.permutation(m) if rng.random() < 0.5 else cols.copy()
        optimal = np.isclose(cost[np.arange(m), hint].sum(), best)
        ok = certify_assignment(cost, hint, max_work=1000, max_violated=1.0)  # ample for m < 10
        assert ok == optimal
        accepted += ok
        rejected += not ok
    assert accepted > 50 and rejected > 50
    # A budget too small to finish never certifies a wrong assignment.
    cost = rng.normal(size=(300, 300))
    assert not certify_assignment(cost, rng.permutation(300), max_work=1)


def test_assign_with_hint_returns_the_solvers_optimum():
    rng = np.random.default_rng(1)
    cost = rng.normal(size=(200, 200)) + np.diag(np.full(200, -5.0))
    p, hinted = assign_with_hint(cost, np.arange(200))
    assert hinted and np.array_equal(p, linear_sum_assignment(cost)[1])
    bad = np.arange(200)
    bad[[0, 1]] = [1, 0]
    p, hinted = assign_with_hint(cost, bad)
    assert not hinted and np.array_equal(p, linear_sum_assignment(cost)[1])


@pytest.mark.parametrize("noise, opts, stack_bytes", [
    (0.3, {}, 2**31),
    (0.3, {"reference": 2}, 0),  # streamed clients: the skipped client's GEMM too
    (None, {}, 2**31),
    (None, {"aggregation": "size", "fisher_scaling": "size"}, 2**31),
    (None, {"matching": "euclidean", "aggregation": "uniform"}, 2**31),
])
def test_certified_merge_is_bit_identical_to_the_exact_merge(noise, opts, stack_bytes, monkeypatch):
    models, fishers, _ = _clients(noise=noise)
    exact = merge(models, fishers, SPEC, MergeOptions(**opts), num_examples=SIZES,
                  speed=MergeSpeed(stack_bytes=stack_bytes))
    calls = {"solver": 0}
    solve = certify_module.assign

    def counted(cost, solver="scipy", single=False):
        calls["solver"] += 1
        return solve(cost, solver, single)

    monkeypatch.setattr(certify_module, "assign", counted)
    fast = merge(models, fishers, SPEC, MergeOptions(**opts), num_examples=SIZES,
                 speed=MergeSpeed(certify=True, stack_bytes=stack_bytes))
    _assert_bit_identical(exact, fast)
    assignments = sum(r.iterations for r in exact.reports.values()) * len(models)
    assert calls["solver"] < assignments  # the certificate (or the reference's skip) did replace some solves


def test_sweep_reuses_alignments_and_aligned_merges_bit_identically():
    models, fishers, base = _clients(seed=3, noise=0.05)
    # A rotated copy of the first layer makes the alignment move neurons in every candidate.
    perm = np.random.default_rng(0).permutation(160)
    models[1] = dict(models[1], **{"fc1.weight": models[1]["fc1.weight"][perm], "fc1.bias": models[1]["fc1.bias"][perm],
                                   "fc2.weight": models[1]["fc2.weight"][:, perm]})
    fishers[1] = dict(fishers[1], **{"fc1.weight": fishers[1]["fc1.weight"][perm],
                                     "fc1.bias": fishers[1]["fc1.bias"][perm],
                                     "fc2.weight": fishers[1]["fc2.weight"][:, perm]})
    clients = prepare_clients(models, fishers, num_examples=SIZES)
    for reference in ("largest", base, 0):
        for lam in (1e-3, 1e-4):
            options = MergeOptions(lam=lam, reference=reference)
            shared = merge(clients, None, SPEC, options)
            fresh = merge(models, fishers, SPEC, options, num_examples=SIZES)
            _assert_bit_identical(shared, fresh)
            assert shared.aligned and shared.fraction_permuted[1] > 0.3
    assert clients.alignments.hits > 0  # later references continued from an earlier one's iterations
    assert clients.aligned_merges.hits > 0  # and reached the same alignment: merged once


def test_warm_start_from_a_fixed_point_stops_at_once_with_the_same_merge():
    models, fishers, _ = _clients(seed=4, noise=None)
    cold = merge(models, fishers, SPEC, num_examples=SIZES, speed=MergeSpeed(certify=True))
    warm = merge(models, fishers, SPEC, num_examples=SIZES, speed=MergeSpeed(certify=True),
                 initial_perms=cold.permutations)
    assert all(r.iterations == 1 for r in warm.reports.values())
    for n in cold.model:
        np.testing.assert_allclose(warm.model[n], cold.model[n], rtol=1e-12, atol=1e-12)
    for p in cold.permutations:
        assert all(np.array_equal(x, y) for x, y in zip(cold.permutations[p], warm.permutations[p]))


def test_sweep_options_keep_the_choice_on_a_shared_initialisation():
    from fedfiot_flwr.server.config import FedFiOTConfig
    from fedfiot_flwr.server.outcome import RoundContext
    from fedfiot_flwr.server.selection import SweepGrid, sweep_candidates
    from fedfiot_flwr.server.uploads import CollectedUploads

    models, fishers, base = _clients(seed=5, noise=0.3)
    uploads = CollectedUploads(weights=models, fishers=fishers, num_examples=SIZES, client_ids=list("abcd"),
                               metrics=[{}] * 4)
    target = {n: v + 0.1 for n, v in base.items()}

    def validate(model):
        return {"accuracy": -sum(float(np.sum((model[n] - target[n]) ** 2)) for n in model)}

    grid = SweepGrid((0.3, 0.5, 0.7), (1e-3, 1e-4), ("largest", "broadcast"), ("none", "size"))
    kwargs = dict(rho=0.5, lam=1e-4, sweep=grid, selection="validation", fedavg_candidate=True)
    context = RoundContext(2, broadcast=base, validate=validate)
    exact = sweep_candidates(uploads, SPEC, FedFiOTConfig(**kwargs), context, baseline=True)
    for options in ({"certify": True}, {"certify": True, "warm_start": True}):
        fast = sweep_candidates(uploads, SPEC, FedFiOTConfig(**kwargs, **options), context, baseline=True)
        assert (fast.candidate, fast.variant) == (exact.candidate, exact.variant)
        assert all(np.array_equal(fast.model[n], exact.model[n]) for n in exact.model)
        if "warm_start" not in options:  # exact: every trial scores the same
            assert [t["validation"] for t in fast.trials] == [t["validation"] for t in exact.trials]
