"""One FedAvg: every FedAvg of the package is :func:`size_weighted_average`, with one integer rule."""

from __future__ import annotations

import numpy as np
import pytest

from fedfiot_flwr.baselines import size_weighted_average
from fedfiot_flwr.merge import PermutationSpec, merge, method_options, prepare_clients
from fedfiot_flwr.server.aggregators import FedAvgAggregator
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.outcome import RoundContext
from fedfiot_flwr.server.selection import sweep_candidates
from fedfiot_flwr.server.uploads import CollectedUploads

SPEC = PermutationSpec({"fc1.weight": ("P0", None), "fc1.bias": ("P0",), "bn.running_mean": ("P0",),
                        "bn.num_batches_tracked": (), "fc2.weight": (None, "P0")})
BUFFERS = ("bn.running_mean", "bn.num_batches_tracked")


def _uploads(sizes: tuple[int, ...] = (37, 11, 90), counts: tuple[int, ...] = (10, 21, 40)) -> CollectedUploads:
    rng = np.random.default_rng(7)
    weights, fishers = [], []
    for count in counts:
        w = {"fc1.weight": rng.normal(size=(5, 4)).astype(np.float32), "fc1.bias": rng.normal(size=5).astype(np.float32),
             "bn.running_mean": rng.normal(size=5).astype(np.float32), "bn.num_batches_tracked": np.array(count),
             "fc2.weight": rng.normal(size=(3, 5)).astype(np.float32)}
        weights.append(w)
        fishers.append({k: np.abs(rng.normal(size=v.shape)) for k, v in w.items() if k not in BUFFERS})
    return CollectedUploads(client_ids=[str(i) for i in range(len(sizes))], weights=weights, fishers=fishers,
                            num_examples=list(sizes))


def test_integer_buffers_take_the_rounded_size_weighted_mean() -> None:
    uploads = _uploads(sizes=(1, 3), counts=(10, 21))
    out = size_weighted_average(uploads.weights, uploads.num_examples)
    assert out["bn.num_batches_tracked"].dtype == np.int64 and int(out["bn.num_batches_tracked"]) == 18  # 18.25
    assert out["fc1.weight"].dtype == np.float32


@pytest.mark.parametrize("counts", [(10, 21, 40), (3, 3, 3), (0, 1, 2)])
def test_the_engine_without_alignment_follows_the_same_integer_rule(counts: tuple[int, ...]) -> None:
    uploads = _uploads(counts=counts)
    fedavg = size_weighted_average(uploads.weights, uploads.num_examples)
    clients = prepare_clients(uploads.weights, uploads.fishers, buffers=BUFFERS, num_examples=uploads.num_examples)
    engine = merge(clients, None, SPEC, method_options("fedavg")).model
    assert int(engine["bn.num_batches_tracked"]) == int(fedavg["bn.num_batches_tracked"])
    for name in fedavg:
        np.testing.assert_allclose(engine[name], fedavg[name], rtol=1e-6)


def test_the_selections_fedavg_baseline_is_the_one_fedavg() -> None:
    uploads = _uploads()
    fedavg = size_weighted_average(uploads.weights, uploads.num_examples)
    out = sweep_candidates(uploads, SPEC, FedFiOTConfig(rho=0.5, lam=1e-4), RoundContext(1, buffers=BUFFERS), baseline=True)
    assert out.baseline_model is not None
    for name in fedavg:
        np.testing.assert_array_equal(out.baseline_model[name], fedavg[name])
    validate = lambda m: {"accuracy": float(np.array_equal(m["fc1.weight"], fedavg["fc1.weight"]))}  # noqa: E731
    won = sweep_candidates(uploads, SPEC, FedFiOTConfig(rho=0.5, lam=1e-4, selection="validation", fedavg_candidate=True),
                           RoundContext(1, buffers=BUFFERS, validate=validate), baseline=True)
    assert won.variant == "fedavg"
    for name in fedavg:
        np.testing.assert_array_equal(won.model[name], fedavg[name])


def test_the_fedavg_strategy_returns_the_one_fedavg() -> None:
    uploads = _uploads()
    got = FedAvgAggregator().aggregate(uploads, RoundContext(1, buffers=BUFFERS)).model
    fedavg = size_weighted_average(uploads.weights, uploads.num_examples)
    for name in fedavg:
        np.testing.assert_array_equal(got[name], fedavg[name])
