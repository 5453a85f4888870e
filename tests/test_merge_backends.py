"""The merge's faster paths equal the exact one: prepared uploads, streaming, float32 costs,
the torch backend, the LAPJV solver, and the sweep's shared work."""

import subprocess
import sys

import numpy as np
import pytest

from fedfiot_flwr.merge import MergeOptions, MergeSpeed, cnn_spec, fisher_cost_matrix, merge, prepare_clients
from fedfiot_flwr.merge.backend import get_backend
from fedfiot_flwr.merge.costs import ClientLayers, euclidean_cost_matrix
from fedfiot_flwr.merge import lap as lap_module
from fedfiot_flwr.merge.lap import assign, installed, lapjv_available

SHAPES = {"conv1.weight": (6, 2, 3, 3), "conv1.bias": (6,), "conv2.weight": (8, 6, 3, 3), "conv2.bias": (8,),
          "fc1.weight": (12, 8 * 4), "fc1.bias": (12,), "fc2.weight": (5, 12), "fc2.bias": (5,)}
SPEC = cnn_spec(["conv1", "conv2"], ["fc1", "fc2"], flatten_block=4)
SIZES = [30, 10, 20, 40]


def _clients(seed=0, k=4, shared=0.3):
    """Float32 clients around a shared model (``shared`` = its weight): they need real permutations."""
    rng = np.random.default_rng(seed)
    base = {n: rng.normal(size=s) for n, s in SHAPES.items()}
    models = [{n: (shared * v + rng.normal(size=v.shape)).astype(np.float32) for n, v in base.items()} for _ in range(k)]
    fishers = [{n: rng.exponential(size=v.shape).astype(np.float32) for n, v in base.items()} for _ in range(k)]
    return models, fishers


def _assert_same(a, b, exact=True):
    for p in a.permutations:
        for x, y in zip(a.permutations[p], b.permutations[p]):
            assert np.array_equal(x, y), p
    for n in a.model:
        if exact:
            assert np.array_equal(a.model[n], b.model[n]), n
        else:
            np.testing.assert_allclose(a.model[n], b.model[n], rtol=1e-6, atol=1e-6)
    assert a.aligned == b.aligned
    if exact:
        assert a.objective == b.objective and a.identity_objective == b.identity_objective
    else:
        assert a.objective == pytest.approx(b.objective, rel=1e-9)


OPTION_SETS = [
    {},
    {"aggregation": "uniform"},
    {"aggregation": "size"},
    {"matching": "euclidean"},
    {"matching": "none"},
    {"fisher_scaling": "normalized-size", "rho": 0.3},
    {"fallback": "none", "reference": 1},
]


@pytest.mark.parametrize("opts", OPTION_SETS)
def test_prepared_and_streamed_merges_are_bit_identical_to_a_plain_merge(opts):
    models, fishers = _clients()
    options = MergeOptions(**opts)
    plain = merge(models, fishers, SPEC, options, num_examples=SIZES)
    assert any(f > 0 for f in plain.fraction_permuted) or opts.get("matching") == "none"
    prepared = prepare_clients(models, fishers, num_examples=SIZES)
    _assert_same(plain, merge(prepared, None, SPEC, options))
    _assert_same(plain, merge(prepared, None, SPEC, options))  # second use: cached tempering / identity merge
    _assert_same(plain, merge(prepared, None, SPEC, options, speed=MergeSpeed(stack_bytes=0)))  # clients streamed
    uncached = prepare_clients(models, fishers, num_examples=SIZES, cache_bytes=0)
    _assert_same(plain, merge(uncached, None, SPEC, options))


def test_float32_costs_match_float64_on_a_small_problem():
    models, fishers = _clients(seed=1)
    always = MergeOptions(fallback="none")
    exact = merge(models, fishers, SPEC, always, num_examples=SIZES)
    fast = merge(models, fishers, SPEC, always, num_examples=SIZES, speed=MergeSpeed(cost_dtype="float32"))
    assert max(exact.fraction_permuted) > 0.5
    _assert_same(exact, fast)  # same assignments, hence the same float64 aggregation


@pytest.mark.parametrize("opts, cost_dtype", [({}, "float64"), ({"matching": "euclidean", "aggregation": "uniform"},
                                                                 "float64"), ({}, "float32")])
def test_torch_backend_on_cpu_matches_numpy(opts, cost_dtype):
    pytest.importorskip("torch")
    models, fishers = _clients(seed=2)
    options = MergeOptions(fallback="none", **opts)
    ref = merge(models, fishers, SPEC, options, num_examples=SIZES, speed=MergeSpeed(cost_dtype=cost_dtype))
    out = merge(models, fishers, SPEC, options, num_examples=SIZES,
                speed=MergeSpeed(cost_dtype=cost_dtype, backend="torch", device="cpu"))
    _assert_same(ref, out, exact=False)


def test_torch_backend_auto_device_is_cuda_only_when_available():
    torch = pytest.importorskip("torch")
    be = get_backend("torch")
    assert be.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="backend"):
        get_backend("jax")


def test_client_layers_costs_equal_the_definition_in_every_mode():
    rng = np.random.default_rng(3)
    m, d, k = 7, 5, 4
    w = rng.normal(size=(m, d))
    xs = [rng.normal(size=(m, d)) for _ in range(k)]
    fs = [rng.exponential(size=(m, d)) + 0.1 for _ in range(k)]
    perms = [rng.permutation(m) for _ in range(k)]
    for stack in (True, False):
        for max_bytes in (1, 2**26):  # one client per GEMM, all clients in one
            layers = ClientLayers(lambda i: (xs[i].copy(), fs[i].copy()), k, keep_layers=True, stack=stack, max_bytes=max_bytes)
            for c, x, f in zip(layers.fisher_costs(w), xs, fs):
                np.testing.assert_allclose(c, fisher_cost_matrix(w, x, f), rtol=1e-12, atol=1e-12)
            for c, x in zip(layers.euclidean_costs(w), xs):
                np.testing.assert_allclose(c, euclidean_cost_matrix(w, x), rtol=1e-12, atol=1e-12)
            num, den = layers.moments(perms)
            np.testing.assert_allclose(num, sum(f[p] * x[p] for x, f, p in zip(xs, fs, perms)), rtol=1e-12)
            np.testing.assert_allclose(den, sum(f[p] for f, p in zip(fs, perms)), rtol=1e-12)
            np.testing.assert_allclose(layers.average(perms, [1, 2, 3, 4]),
                                       sum(c * x[p] for c, x, p in zip([.1, .2, .3, .4], xs, perms)), rtol=1e-12)
    f32 = ClientLayers(lambda i: (xs[i].copy(), fs[i].copy()), k, cost_dtype="float32")
    for c, x, f in zip(f32.fisher_costs(w), xs, fs):
        np.testing.assert_allclose(c, fisher_cost_matrix(w, x, f), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not lapjv_available(), reason="the optional 'lap' package is not installed")
def test_lapjv_finds_the_same_optimum_as_scipy():
    rng = np.random.default_rng(4)
    for m in (1, 5, 60, 600):
        cost = rng.random((m, m))
        a, b = assign(cost, "scipy"), assign(cost, "lapjv")
        assert cost[np.arange(m), a].sum() == pytest.approx(cost[np.arange(m), b].sum(), rel=1e-12)
        assert np.array_equal(a, b)  # continuous random costs: the optimum is unique
        assert np.array_equal(assign(cost.astype(np.float32), "lapjv"), assign(cost.astype(np.float32), "scipy"))
    models, fishers = _clients(seed=5)
    _assert_same(merge(models, fishers, SPEC, num_examples=SIZES),
                 merge(models, fishers, SPEC, num_examples=SIZES, speed=MergeSpeed(lap_solver="lapjv")))


@pytest.mark.skipif(not installed("lapjv-avx"), reason="the optional 'lapjv' package is not installed")
def test_the_avx_lapjv_finds_scipys_optimum_in_either_precision():
    rng = np.random.default_rng(6)
    for m in (1, 5, 60, 600):
        for dtype in (np.float64, np.float32):
            cost = rng.random((m, m)).astype(dtype)
            a, b = assign(cost, "scipy"), assign(cost, "lapjv-avx")
            assert b.dtype == np.int64 and np.array_equal(a, b)  # continuous costs: a unique optimum
    # costs 1e-9 apart: only a solver that works in float64 tells them apart
    base = rng.random((50, 50))
    fine = base + 1e-9 * rng.random((50, 50))
    assert np.array_equal(assign(fine, "lapjv-avx"), assign(fine, "scipy"))
    models, fishers = _clients(seed=5)
    _assert_same(merge(models, fishers, SPEC, num_examples=SIZES),
                 merge(models, fishers, SPEC, num_examples=SIZES,
                       speed=MergeSpeed(lap_solver="lapjv-avx", lap_threads=2)))
    # float32 costs: LAPJV may solve in float32, and still finds the float64 merge's alignment here
    _assert_same(merge(models, fishers, SPEC, num_examples=SIZES),
                 merge(models, fishers, SPEC, num_examples=SIZES,
                       speed=MergeSpeed(cost_dtype="float32", lap_solver="lapjv-avx", certify=True)))


@pytest.mark.skipif(not installed("lapjv-avx"), reason="the optional 'lapjv' package is not installed")
def test_a_float32_accurate_matrix_is_solved_in_float32_by_the_avx_lapjv_only():
    rng = np.random.default_rng(8)
    cost = rng.random((300, 300))
    rounded = cost.astype(np.float32)
    assert np.array_equal(assign(cost, "lapjv-avx", single=True), assign(rounded, "scipy"))
    assert np.array_equal(assign(cost, "scipy", single=True), assign(cost, "scipy"))  # scipy ignores it
    # costs 1e-9 apart: told apart in float64, not after the float32 rounding
    base = rng.random((40, 40))
    fine = base + 1e-9 * rng.random((40, 40))
    assert np.array_equal(assign(fine, "lapjv-avx"), assign(fine, "scipy"))


def test_auto_takes_the_fastest_installed_solver_for_wide_layers_only(monkeypatch):
    present = {"scipy": True, "lapjv": True, "lapjv-avx": True}
    monkeypatch.setattr(lap_module, "installed", present.__getitem__)
    assert lap_module.resolve_solver("auto", lap_module.AUTO_MIN_SIZE) == "lapjv-avx"
    assert lap_module.resolve_solver("auto", lap_module.AUTO_MIN_SIZE - 1) == "scipy"
    present["lapjv-avx"] = False
    assert lap_module.resolve_solver("auto", 4096) == "lapjv"
    present["lapjv"] = False
    assert lap_module.resolve_solver("auto", 4096) == "scipy"


def test_a_lapjv_answer_that_is_not_a_permutation_is_replaced_by_scipys(monkeypatch):
    class Broken:
        @staticmethod
        def lapjv(cost, **kwargs):
            n = cost.shape[0]
            return np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32), (0.0, None, None)

    monkeypatch.setattr(lap_module, "require", lambda *args: Broken)
    cost = np.random.default_rng(7).random((30, 30))
    assert np.array_equal(assign(cost, "lapjv-avx"), assign(cost, "scipy"))


def test_bad_speed_options_and_prepared_misuse_are_rejected():
    models, fishers = _clients()
    with pytest.raises(ValueError, match="cost_dtype"):
        MergeSpeed(cost_dtype="float16")
    with pytest.raises(ValueError, match="lap_solver"):
        MergeSpeed(lap_solver="greedy")
    with pytest.raises(ValueError, match="stack_bytes"):
        MergeSpeed(stack_bytes=-1)
    with pytest.raises(TypeError, match="MergeSpeed"):
        merge(models, fishers, SPEC, speed={"certify": True})
    with pytest.raises(TypeError, match="MergeOptions"):
        merge(models, fishers, SPEC, {"reference": 0})
    prepared = prepare_clients(models, fishers, num_examples=SIZES)
    with pytest.raises(ValueError, match="fishers=None"):
        merge(prepared, fishers, SPEC)
    with pytest.raises(ValueError, match="num_examples"):
        merge(prepared, None, SPEC, num_examples=[1, 1, 1, 1])
    fishers[2] = {**fishers[2], "fc1.weight": -fishers[2]["fc1.weight"]}
    with pytest.raises(ValueError, match="client '2'.*fc1.weight"):
        prepare_clients(models, fishers)


def test_merge_engine_imports_and_runs_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np\n"
        "from fedfiot_flwr.merge import MergeOptions, merge, mlp_spec\n"
        "m = [{'fc1.weight': np.eye(3), 'fc2.weight': np.ones((2, 3))}] * 2\n"
        "print(merge(m, m, mlp_spec(['fc1', 'fc2'], bias=False), MergeOptions(reference=0)).aligned)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_sweep_validates_each_distinct_model_once_and_chooses_as_separate_merges():
    from fedfiot_flwr.server.config import FedFiOTConfig
    from fedfiot_flwr.server.outcome import RoundContext
    from fedfiot_flwr.server.selection import Candidate, SweepGrid, model_digest, sweep_candidates
    from fedfiot_flwr.server.uploads import CollectedUploads

    models, fishers = _clients(seed=6, shared=3.0)
    uploads = CollectedUploads(weights=models, fishers=fishers, num_examples=SIZES, client_ids=list("abcd"),
                               metrics=[{}] * 4)
    target = merge(models, fishers, SPEC, MergeOptions(reference=0), num_examples=SIZES).model
    seen: list[str] = []

    def validate(model):
        seen.append(model_digest(model))
        return {"accuracy": -sum(float(np.sum((model[n] - target[n]) ** 2)) for n in model)}

    grid = SweepGrid((0.3, 0.7), (1e-3, 1e-5), ("largest", "broadcast"), ("none", "size"))
    default = Candidate(0.5, 1e-4)
    config = FedFiOTConfig(rho=0.5, lam=1e-4, sweep=grid, selection="validation", fedavg_candidate=True)
    out = sweep_candidates(uploads, SPEC, config, RoundContext(2, broadcast=models[0], validate=validate), baseline=True)
    assert len(seen) == len(set(seen))  # no model validated twice
    assert len(seen) < len(out.trials) + 1  # trials (+ FedAvg) repeat models
    best = None
    for cand in grid.candidates(default, 2):
        ref = models[0] if cand.reference == "broadcast" else cand.reference
        options = MergeOptions(lam=cand.lam, rho=cand.rho, reference=ref, fallback="none",
                               fisher_scaling=cand.fisher_scaling)
        res = merge(models, fishers, SPEC, options, num_examples=SIZES)
        for variant, model in [("aligned", res.model), ("identity", res.identity_model)]:
            score = validate(model)["accuracy"]
            if best is None or score > best[0]:
                best = (score, cand, variant, model)
    assert (out.candidate, out.variant) == (best[1], best[2])
    assert all(np.array_equal(out.model[n], best[3][n]) for n in out.model)
