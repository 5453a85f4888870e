"""Threaded assignments (``lap_threads``) give the sequential merge bit for bit.

Within one alignment step the clients' assignment problems are independent given the global
layer; solved in a thread pool and collected in client order they must leave every permutation,
objective, report and merged tensor exactly as without threads, on every matching, with certified
hints, streamed clients and a reference model, and against the readable reference
:mod:`fedfiot_flwr.algorithm`. Speed is measured by ``benchmarks/server_speed.py --wide``, not here.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import SPEC as TINY_SPEC
from _fedfiot_helpers import client_uploads, packed, reply

from fedfiot_flwr import FedFiOT, FedFiOTConfig
from fedfiot_flwr.algorithm import fedfiot_merge
from fedfiot_flwr.merge import MergeOptions, MergeSpeed, merge, mlp_spec, prepare_clients
from fedfiot_flwr.merge import lap as lap_module
from fedfiot_flwr.merge import parallel
from fedfiot_flwr.merge.parallel import MIN_PARALLEL_SIZE, lap_workers, solve_in_order
from fedfiot_flwr.server import aggregators

# One layer wide enough for the automatic setting to use threads, one narrow one.
WIDE = MIN_PARALLEL_SIZE
SHAPES = {"fc1.weight": (WIDE, 12), "fc1.bias": (WIDE,), "fc2.weight": (24, WIDE), "fc2.bias": (24,),
          "fc3.weight": (5, 24), "fc3.bias": (5,)}
SPEC = mlp_spec(["fc1", "fc2", "fc3"], bias=True)
SIZES = [30, 50, 20, 40, 10]


def _uploads(seed: int = 0, k: int = 5) -> tuple[list[dict], list[dict]]:
    """Independently initialised float32 clients: alignment permutes most neurons."""
    rng = np.random.default_rng(seed)
    models = [{n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()} for _ in range(k)]
    fishers = [{n: (rng.exponential(size=s) ** 2).astype(np.float32) for n, s in SHAPES.items()} for _ in range(k)]
    return models, fishers


def _assert_bit_identical(a, b) -> None:
    assert list(a.permutations) == list(b.permutations)
    for g in a.permutations:
        for x, y in zip(a.permutations[g], b.permutations[g], strict=True):
            assert np.array_equal(x, y), g
    for n in a.model:
        assert a.model[n].dtype == b.model[n].dtype and np.array_equal(a.model[n], b.model[n]), n
        assert np.array_equal(a.aligned_model[n], b.aligned_model[n]), n
    assert (a.objective, a.aligned_objective, a.identity_objective, a.aligned) == \
        (b.objective, b.aligned_objective, b.identity_objective, b.aligned)
    for g, r in a.reports.items():
        s = b.reports[g]
        assert (r.iterations, r.initial_objective, r.alignment_objectives, r.objectives, r.fraction_permuted) == \
            (s.iterations, s.initial_objective, s.alignment_objectives, s.objectives, s.fraction_permuted), g


OPTIONS = [  # (the merge's options, its speed options)
    ({}, {}),
    ({}, {"certify": True}),
    ({"reference": 2, "max_iters": 3}, {"certify": True}),
    ({"matching": "euclidean", "aggregation": "uniform"}, {}),
    ({"aggregation": "size"}, {"stack_bytes": 0}),
    ({}, {"cost_dtype": "float32", "certify": True}),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=["fisher", "certify", "certify-ref2-S3", "euclidean", "streamed",
                                               "float32"])
def test_threaded_assignments_equal_sequential_bit_for_bit(opts: tuple[dict, dict]) -> None:
    options, speed = opts
    models, fishers = _uploads()
    sequential = merge(models, fishers, SPEC, MergeOptions(**options), num_examples=SIZES,
                       speed=MergeSpeed(lap_threads=1, **speed))
    assert max(sequential.fraction_permuted) > 0.5  # alignment really permutes
    counts = (None, 3) if speed.get("stack_bytes") == 0 else (None, 2, 3, 16)  # streaming reloads: slower
    for threads in counts:  # None: automatic (threads on the wide layer only)
        _assert_bit_identical(sequential, merge(models, fishers, SPEC, MergeOptions(**options), num_examples=SIZES,
                                                speed=MergeSpeed(lap_threads=threads, **speed)))


def test_threads_with_a_reference_model_and_prepared_uploads() -> None:
    models, fishers = _uploads(seed=1)
    broadcast = {n: v * 0.5 for n, v in models[3].items()}
    clients = prepare_clients(models, fishers, num_examples=SIZES)
    options = MergeOptions(reference=broadcast)
    sequential = merge(clients, None, SPEC, options, speed=MergeSpeed(certify=True, lap_threads=1))
    threaded = merge(clients, None, SPEC, options, speed=MergeSpeed(certify=True, lap_threads=4))
    _assert_bit_identical(sequential, threaded)


def test_threaded_engine_equals_the_readable_reference() -> None:
    models, fishers = _uploads(seed=2, k=3)
    ours = fedfiot_merge(models, fishers, SPEC, num_examples=SIZES[:3])
    fast = merge(models, fishers, SPEC, num_examples=SIZES[:3], speed=MergeSpeed(lap_threads=3))
    for n, value in fast.model.items():
        assert np.array_equal(ours.model[n], value), n
    for g, perms in fast.permutations.items():
        for p, q in zip(ours.permutations[g], perms, strict=True):
            assert np.array_equal(p, q), g
    assert ours.aligned == fast.aligned


def test_solve_in_order_keeps_client_order_and_bounds_the_matrices_in_flight() -> None:
    rng = np.random.default_rng(0)
    costs = [rng.random((8, 8)) for _ in range(7)]
    costs[3] = None  # a skipped client (the reference against itself)
    lock, alive, peak = threading.Lock(), [0], [0]

    def produced():  # counts cost matrices read but not yet handed back
        for c in costs:
            with lock:
                alive[0] += c is not None
                peak[0] = max(peak[0], alive[0])
            yield c

    def solve(cost: np.ndarray, hint: np.ndarray) -> np.ndarray:
        time.sleep(0.02 * float(cost[0, 0]))  # finish out of order
        return np.argsort(cost[0] + hint)

    hints = [np.arange(8) * k for k in range(7)]
    from concurrent.futures import ThreadPoolExecutor

    out = []
    with ThreadPoolExecutor(2) as pool:
        for cost, p in solve_in_order(produced(), hints, solve, pool, in_flight=2):
            out.append((cost, p))
            with lock:
                alive[0] -= cost is not None
    assert [c is None for c, _ in out] == [c is None for c in costs]
    for (c, p), expected, h in zip(out, costs, hints):
        if expected is None:
            assert p is None
        else:
            assert c is expected and np.array_equal(p, np.argsort(expected[0] + h))
    assert peak[0] <= 2 + 1  # in flight, plus the one being read


def test_a_solver_error_reaches_the_caller() -> None:
    from concurrent.futures import ThreadPoolExecutor

    def solve(cost: np.ndarray, hint: np.ndarray) -> np.ndarray:
        raise RuntimeError("solver failed")

    with ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError, match="solver failed"):
        list(solve_in_order([np.eye(2)] * 3, [None] * 3, solve, pool, in_flight=2))


def test_the_automatic_setting_threads_wide_layers_of_gil_free_solvers_only(monkeypatch) -> None:
    monkeypatch.setattr(parallel, "_cpu_count", lambda: 4)
    assert lap_workers(None, MIN_PARALLEL_SIZE - 1, 6, "scipy") == 1
    assert lap_workers(None, MIN_PARALLEL_SIZE, 6, "scipy") == 4
    assert lap_workers(None, 4096, 3, "scipy") == 3  # never more than K
    assert lap_workers(None, 4096, 6, "lapjv") == 1  # LAPJV holds the GIL
    assert lap_workers(5, 8, 6, "lapjv") == 5  # an explicit count is honoured
    assert lap_workers(None, 4096, 6, "lapjv-avx") == 4  # the lapjv package releases it
    only_lap = {"scipy": True, "lapjv": True, "lapjv-avx": False}
    monkeypatch.setattr(lap_module, "installed", only_lap.__getitem__)
    assert lap_workers(None, 4096, 6, "auto") == 1 and lap_workers(None, 300, 6, "auto") == 4
    monkeypatch.setattr(lap_module, "installed", lambda solver: True)
    assert lap_workers(None, 4096, 6, "auto") == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_thread_counts_are_rejected(bad: object) -> None:
    models, fishers = _uploads()
    with pytest.raises(ValueError, match="lap_threads"):
        MergeSpeed(lap_threads=bad)
    with pytest.raises(ValueError, match="lap_threads"):
        FedFiOTConfig.paper(lap_threads=bad)


def test_the_config_carries_lap_threads_to_the_merge(monkeypatch) -> None:
    seen: list[object] = []
    real = aggregators.sweep_candidates

    def spy(*args, **kwargs):
        seen.append(args[2].speed.lap_threads)  # the configuration the aggregator passes down
        return real(*args, **kwargs)

    monkeypatch.setattr(aggregators, "sweep_candidates", spy)
    replies = [reply(1 + i, packed(w, f, n)) for i, (w, f, n) in enumerate(client_uploads(4, seed=3))]
    FedFiOT(spec=TINY_SPEC, config=FedFiOTConfig.paper(sweep=None, lap_threads=3)).aggregate_train(1, replies)
    FedFiOT(spec=TINY_SPEC, config=FedFiOTConfig.paper(sweep=None)).aggregate_train(1, replies)
    assert seen == [3, None]
    assert FedFiOTConfig.default().lap_threads is None


def test_the_module_examples_hold() -> None:
    import doctest

    result = doctest.testmod(parallel, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
