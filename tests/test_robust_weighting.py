"""Robust Fisher weighting: an inflated client's share is bounded and the merge stays near the honest one."""

from __future__ import annotations

import numpy as np
import pytest
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import SHAPES, SPEC, client_uploads, packed, reply

from fedfiot_flwr import FedFiOT, FedFiOTConfig
from fedfiot_flwr.merge import merge
from fedfiot_flwr.merge.robust import DEFAULT_FISHER_CAP, cap_factors, cap_fishers, weight_shares
from fedfiot_flwr.server.shell import arrays_to_numpy

K = 6


def _honest(seed: int = 0) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], list[int]]:
    uploads = client_uploads(K, seed=seed)
    return [w for w, _, _ in uploads], [f for _, f, _ in uploads], [n for _, _, n in uploads]


def _inflate(fishers: list[dict[str, np.ndarray]], k: int, factor: float) -> list[dict[str, np.ndarray]]:
    return [{n: f * factor for n, f in fk.items()} if i == k else fk for i, fk in enumerate(fishers)]


def _distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a[n].astype(np.float64) - b[n]) ** 2) for n in a)))


def test_honest_fishers_of_similar_magnitude_are_untouched() -> None:
    rng = np.random.default_rng(1)
    base = {n: rng.random(size=s) + 0.1 for n, s in SHAPES.items()}
    fishers = [{n: b * rng.uniform(0.8, 1.25, size=b.shape) for n, b in base.items()} for _ in range(K)]
    scales = cap_factors(fishers, 2.0)  # every client within twice the median
    assert all(s == 1.0 for client in scales for s in client.values())
    capped = cap_fishers(fishers, 2.0)
    assert all(capped[k][n] is fishers[k][n] for k in range(K) for n in fishers[k])
    # at c = 1, the clients above the median (and only they) are brought down to it
    at_median = cap_factors(fishers, 1.0)
    for name in base:
        means = np.array([f[name].mean() for f in fishers])
        maxes = np.array([f[name].max() for f in fishers])
        above = (means > np.median(means)) | (maxes > np.median(maxes))
        assert [at_median[k][name] < 1.0 for k in range(K)] == above.tolist()


@pytest.mark.parametrize("factor", [1e3, 1e6])
def test_an_inflated_clients_share_is_bounded(factor: float) -> None:
    _, fishers, _ = _honest()
    attacked = _inflate(fishers, 2, factor)
    honest_share = weight_shares(fishers)[2]
    raw_share = weight_shares(attacked)[2]
    capped_share = weight_shares(cap_fishers(attacked, DEFAULT_FISHER_CAP))[2]
    assert raw_share > 0.75  # without the cap the attacker owns most of the merge
    # with it, no more than a client DEFAULT_FISHER_CAP times the median: sqrt(c) / (sqrt(c) + K - 1) at rho = 0.5
    c = np.sqrt(DEFAULT_FISHER_CAP)
    assert capped_share <= c / (c + K - 1) + 0.05
    assert capped_share < 2.5 * honest_share
    assert weight_shares(cap_fishers(attacked, DEFAULT_FISHER_CAP)).sum() == pytest.approx(1.0)


def test_the_capped_merge_of_an_inflated_round_stays_near_the_honest_merge() -> None:
    weights, fishers, sizes = _honest(seed=3)
    honest = merge(weights, fishers, SPEC, num_examples=sizes, matching="none").model
    attacked = _inflate(fishers, 0, 1e4)
    raw = merge(weights, attacked, SPEC, num_examples=sizes, matching="none").model
    capped = merge(weights, cap_fishers(attacked, DEFAULT_FISHER_CAP), SPEC, num_examples=sizes, matching="none").model
    assert _distance(capped, honest) < 0.35 * _distance(raw, honest)
    assert _distance(raw, {n: weights[0][n] for n in SHAPES}) < 0.25 * _distance(honest, weights[0])


def test_cap_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="cap factor"):
        cap_fishers([{"w": np.ones(2)}], 0.5)


def test_the_default_preset_caps_and_the_paper_preset_does_not() -> None:
    uploads = client_uploads(K, seed=5)
    w0, f0, n0 = uploads[0]
    inflated = [(w0, {k: v * 1e3 for k, v in f0.items()}, n0), *uploads[1:]]
    honest_msgs = [reply(i + 1, packed(w, f, n)) for i, (w, f, n) in enumerate(uploads)]
    attack_msgs = [reply(i + 1, packed(w, f, n)) for i, (w, f, n) in enumerate(inflated)]
    results = {}
    for preset in ("default", "paper"):
        strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.named(preset, max_iters=2), fedavg_baseline=False)
        assert strategy.fedfiot_config.fisher_cap == (DEFAULT_FISHER_CAP if preset == "default" else None)
        honest = arrays_to_numpy(strategy.aggregate_train(1, honest_msgs)[0])
        attacked = arrays_to_numpy(strategy.aggregate_train(1, attack_msgs)[0])
        results[preset] = _distance(attacked, honest)
    assert results["default"] < 0.5 * results["paper"]


def test_strategy_refuses_a_cap_below_one_and_zero_turns_it_off() -> None:
    with pytest.raises(ValueError, match="fisher_cap"):
        FedFiOTConfig.default(fisher_cap=0.5)
    assert FedFiOT(spec=SPEC, config=FedFiOTConfig.default(fisher_cap=0)).fedfiot_config.fisher_cap is None


def test_robust_module_examples_hold() -> None:
    import doctest

    import fedfiot_flwr.merge.robust as robust

    result = doctest.testmod(robust, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
