"""Robust Fisher weighting: an inflated client's share is bounded and the merge stays near the honest one."""

from __future__ import annotations

import numpy as np
import pytest
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import SHAPES, SPEC, client_uploads, packed, reply

from fedfiot_flwr import FedFiOT, FedFiOTConfig
from fedfiot_flwr.merge import MergeOptions, MergeSpeed, merge
from fedfiot_flwr.merge.prepared import fisher_scale_factors
from fedfiot_flwr.merge.robust import (
    DEFAULT_FISHER_CAP,
    DEFAULT_FISHER_CAP_RULE,
    cap_factors,
    cap_fishers,
    fisher_outliers,
    weight_shares,
)
from fedfiot_flwr.reply_limits import MAX_FISHER_MAGNITUDE, fisher_bound_for
from fedfiot_flwr.server.outcome import RoundContext
from fedfiot_flwr.server.selection import sweep_candidates
from fedfiot_flwr.server.shell import arrays_to_numpy
from fedfiot_flwr.server.uploads import collect_uploads

K = 6
F32_MAX = float(np.finfo(np.float32).max)


def _honest(seed: int = 0) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]], list[int]]:
    uploads = client_uploads(K, seed=seed)
    return [w for w, _, _ in uploads], [f for _, f, _ in uploads], [n for _, _, n in uploads]


def _inflate(fishers: list[dict[str, np.ndarray]], k: int, factor: float) -> list[dict[str, np.ndarray]]:
    return [{n: f * factor for n, f in fk.items()} if i == k else fk for i, fk in enumerate(fishers)]


def _distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.sum((a[n].astype(np.float64) - b[n]) ** 2) for n in a)))


def _at_float32_max(fisher: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor scaled so that its largest entry is float32's maximum (float32, as decoded)."""
    return {n: (f.astype(np.float64) / f.max() * F32_MAX).astype(np.float32) for n, f in fisher.items()}


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
    unaligned = MergeOptions(matching="none")
    honest = merge(weights, fishers, SPEC, unaligned, num_examples=sizes).model
    attacked = _inflate(fishers, 0, 1e4)
    raw = merge(weights, attacked, SPEC, unaligned, num_examples=sizes).model
    capped = merge(weights, cap_fishers(attacked, DEFAULT_FISHER_CAP), SPEC, unaligned, num_examples=sizes).model
    assert _distance(capped, honest) < 0.35 * _distance(raw, honest)
    assert _distance(raw, {n: weights[0][n] for n in SHAPES}) < 0.25 * _distance(honest, weights[0])


def test_cap_factor_below_one_and_an_unknown_rule_are_refused() -> None:
    for rule in ("outliers", "median"):
        with pytest.raises(ValueError, match="cap factor"):
            cap_fishers([{"w": np.ones(2)}], 0.5, rule=rule)
    with pytest.raises(ValueError, match="cap rule"):
        cap_fishers([{"w": np.ones(2)}], 2.0, rule="clip")
    with pytest.raises(ValueError, match="fisher_cap_rule"):
        FedFiOTConfig.default(fisher_cap_rule="clip")


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


# ------------------------------------------------------------------ Fishers at float32's maximum


def test_the_median_rule_caps_a_float32_max_fisher_in_float64_to_the_median_magnitude() -> None:
    _, fishers, _ = _honest(seed=4)
    attacked = [*fishers[:K - 1], {n: np.full(f.shape, F32_MAX, np.float32) for n, f in fishers[0].items()}]
    capped = cap_fishers(attacked, 1.0, rule="median")
    for name in fishers[0]:
        # a constant tensor's mean is its maximum: the mean cap binds, at the clients' median mean
        med_mean = float(np.median([np.mean(f[name], dtype=np.float64) for f in attacked]))
        assert capped[-1][name].dtype == np.float32
        np.testing.assert_allclose(capped[-1][name], med_mean, rtol=1e-6)
    # two clients: the median of two is their mean, so the absolute limit keeps the merge's range
    pair = cap_fishers([fishers[0], attacked[-1]], 1.0, rule="median")
    for name in fishers[0]:
        assert 0.99 * MAX_FISHER_MAGNITUDE <= float(pair[1][name].max()) <= MAX_FISHER_MAGNITUDE
        assert pair[0][name] is fishers[0][name]


def test_normalized_scaling_of_a_float32_max_fisher_does_not_overflow() -> None:
    fisher = {"w": np.full(8, F32_MAX, np.float32), "b": np.full(3, F32_MAX, np.float32)}
    (factor,) = fisher_scale_factors([fisher], "normalized", None)
    assert factor * F32_MAX == pytest.approx(1.0)  # a float32 sum would overflow and give 0


def _float32_max_round(seed: int, attacker: int):  # noqa: ANN202
    """Honest and attacked (client ``attacker`` at float32's maximum) uploads, collected as a capping
    server collects them."""
    uploads = client_uploads(K, seed=seed)
    inflated = [(w, _at_float32_max(f) if k == attacker else f, n) for k, (w, f, n) in enumerate(uploads)]

    def collected(triples: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]]):  # noqa: ANN202
        replies = [(str(k + 1), packed(w, f, n)) for k, (w, f, n) in enumerate(triples)]
        return collect_uploads(replies, SHAPES, fisher_bound=fisher_bound_for(DEFAULT_FISHER_CAP))

    return uploads, collected(uploads), collected(inflated)


def _merged(up, cap: float | None, **options: object) -> dict[str, np.ndarray]:  # noqa: ANN001
    # rho = 1: the tempered Fisher stays at float32's maximum unless it is capped
    config = FedFiOTConfig(rho=1.0, lam=1e-4, max_iters=2, fisher_cap=cap, **options)
    return sweep_candidates(up, SPEC, config, RoundContext(1)).model


@pytest.mark.parametrize(("rule", "factor"), [("outliers", DEFAULT_FISHER_CAP), ("median", 1.0)])
def test_a_float32_max_fisher_client_is_capped_to_a_bounded_share_near_the_honest_merge(rule: str, factor: float) -> None:
    attacker = 2
    uploads, honest_up, attacked_up = _float32_max_round(7, attacker)
    assert not attacked_up.rejections and len(attacked_up) == K  # accepted by a capping server
    # the Fisher-weighted average itself (no alignment, whose permutations would blur the comparison)
    honest = _merged(honest_up, factor, matching="none", fisher_cap_rule=rule)
    capped = _merged(attacked_up, factor, matching="none", fisher_cap_rule=rule)
    raw = _merged(attacked_up, None, matching="none")  # no cap: the attacker owns the merge
    assert all(np.all(np.isfinite(v)) for v in capped.values())
    assert _distance(capped, honest) < 0.1 * _distance(raw, honest)
    assert _distance(raw, uploads[attacker][0]) < 1e-3 * _distance(honest, uploads[attacker][0])
    shares = weight_shares(cap_fishers(attacked_up.fishers, factor, rule=rule), rho=1.0)
    assert shares[attacker] < 1.5 / K
    assert weight_shares(attacked_up.fishers, rho=1.0)[attacker] > 0.99


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("cost_dtype", ["float64", "float32"])
def test_an_aligned_merge_with_a_float32_max_fisher_client_is_finite_in_every_precision(
    cost_dtype: str, backend: str
) -> None:
    _, _, attacked_up = _float32_max_round(7, 2)
    reference = _merged(attacked_up, DEFAULT_FISHER_CAP)  # float64 costs, NumPy
    capped = _merged(attacked_up, DEFAULT_FISHER_CAP, cost_dtype=cost_dtype, backend=backend)
    for name, value in capped.items():
        assert np.all(np.isfinite(value)), name
        np.testing.assert_allclose(value, reference[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # without the cap (a direct merge call; a server without the cap excludes the reply) float32
    # costs still do not overflow
    uncapped = _merged(attacked_up, None, cost_dtype=cost_dtype, backend=backend)
    assert all(np.all(np.isfinite(v)) for v in uncapped.values())


def test_a_float32_max_fisher_is_merged_by_the_default_preset_and_excluded_by_the_paper_preset() -> None:
    uploads = client_uploads(K, seed=9)
    inflated = [(uploads[0][0], _at_float32_max(uploads[0][1]), uploads[0][2]), *uploads[1:]]
    honest_msgs = [reply(k + 1, packed(w, f, n)) for k, (w, f, n) in enumerate(uploads)]
    attack_msgs = [reply(k + 1, packed(w, f, n)) for k, (w, f, n) in enumerate(inflated)]
    for preset in ("default", "paper"):
        strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.named(preset, max_iters=2), fedavg_baseline=False)
        honest = arrays_to_numpy(strategy.aggregate_train(1, honest_msgs)[0])
        attacked = arrays_to_numpy(strategy.aggregate_train(1, attack_msgs)[0])
        rejected = strategy.reports[-1]["rejected"]
        assert all(np.all(np.isfinite(v)) for v in attacked.values())
        if preset == "default":
            assert rejected == [] and strategy.server_metrics[1]["num-valid"] == K
            assert _distance(attacked, honest) < 0.25 * _distance(honest, uploads[0][0])
        else:
            assert [r["client"] for r in rejected] == ["1"]
            reason = rejected[0]["reason"]
            assert "client 1" in reason and "fc1.weight" in reason and "Fisher" in reason and "bound" in reason


# ------------------------------------------------------------------ the outlier rule


def _spread_fishers(seed: int, spread: float) -> list[dict[str, np.ndarray]]:
    """Honest-looking heavy-tailed Fishers of one shape whose magnitudes differ by up to ``spread`` between clients."""
    rng = np.random.default_rng(seed)
    base = {n: rng.lognormal(0.0, 2.0, size=s) for n, s in SHAPES.items()}
    scales = np.geomspace(1.0, spread, K)
    return [{n: b * scales[k] * rng.uniform(0.9, 1.1, size=b.shape) for n, b in base.items()} for k in range(K)]


def test_the_outlier_rule_leaves_honest_clients_above_the_median_as_uploaded() -> None:
    fishers = _spread_fishers(0, spread=3.0)  # every client within 3x of the others' median
    assert fisher_outliers(fishers, 4.0) == [set()] * K
    capped = cap_fishers(fishers, 4.0, rule="outliers")
    assert all(capped[k][n] is fishers[k][n] for k in range(K) for n in fishers[k])
    # the median rule at c = 1 changes the clients above the median
    at_median = cap_fishers(fishers, 1.0, rule="median")
    assert sum(at_median[k][n] is not fishers[k][n] for k in range(K) for n in fishers[k]) >= K // 2


@pytest.mark.parametrize("attack", ["1e3", "1e6", "f32max"])
def test_an_inflated_outlier_keeps_its_shape_at_the_other_clients_median_magnitude(attack: str) -> None:
    fishers = _spread_fishers(1, spread=2.0)
    inflated = (_at_float32_max(fishers[3]) if attack == "f32max"
                else {n: f * float(attack) for n, f in fishers[3].items()})
    attacked = [*fishers[:3], inflated, *fishers[4:]]
    assert fisher_outliers(attacked, 4.0) == [set(), set(), set(), set(SHAPES), set(), set()]
    capped = cap_fishers(attacked, 4.0, rule="outliers")
    others = [f for i, f in enumerate(fishers) if i != 3]
    for name in SHAPES:
        got = capped[3][name].astype(np.float64)
        ratio = got / fishers[3][name]  # its honest shape, one scale
        np.testing.assert_allclose(ratio, ratio.ravel()[0], rtol=1e-5)
        med_mean = float(np.median([f[name].mean() for f in others]))
        med_max = float(np.median([f[name].max() for f in others]))
        assert got.mean() <= med_mean * (1 + 1e-5) and got.max() <= med_max * (1 + 1e-5)
        assert np.isclose(got.mean(), med_mean, rtol=1e-5) or np.isclose(got.max(), med_max, rtol=1e-5)
        assert capped[3][name].dtype == inflated[name].dtype
        assert all(capped[k][name] is attacked[k][name] for k in range(K) if k != 3)
    assert weight_shares(capped)[3] < 1.5 / K


@pytest.mark.parametrize("level", [F32_MAX, 1.0])
def test_a_flat_fisher_weighs_like_the_median_client_at_every_coordinate(level: float) -> None:
    rng = np.random.default_rng(2)
    shapes = {"w": (64, 32), "b": (64,)}
    base = {n: rng.lognormal(0.0, 2.0, size=s) for n, s in shapes.items()}
    fishers = [{n: b * rng.uniform(0.5, 2.0) * rng.lognormal(0.0, 0.5, size=b.shape) for n, b in base.items()}
               for _ in range(K - 1)]
    # at float32's maximum, or at the honest clients' magnitude (which no magnitude cap notices)
    flat = {n: np.full(s, level * np.median([f[n].mean() for f in fishers]) if level == 1.0 else level, np.float32)
            for n, s in shapes.items()}
    attacked = [*fishers, flat]
    assert fisher_outliers(attacked, DEFAULT_FISHER_CAP) == [set()] * (K - 1) + [set(shapes)]
    outlier = cap_fishers(attacked, DEFAULT_FISHER_CAP, rule="outliers")
    median = cap_fishers(attacked, 1.0, rule="median")
    for name in shapes:
        # the flat client has no ranking of its own: it takes the other clients' median ranking
        others = np.median(np.stack([f[name].ravel() for f in fishers]), axis=0)
        assert np.array_equal(np.argsort(outlier[-1][name].ravel(), kind="stable"), np.argsort(others, kind="stable"))
        assert all(outlier[k][name] is fishers[k][name] for k in range(K - 1))
    # so it holds about an honest client's share, where the median rule (its mean at most the median
    # mean, on every coordinate) gives it more than any honest client
    assert weight_shares(outlier)[-1] < 1.25 / K
    assert weight_shares(median)[-1] > weight_shares(median)[:-1].max()


def test_the_outlier_rule_finds_the_inflated_client_of_a_two_client_round() -> None:
    fishers = _spread_fishers(3, spread=1.0)[:2]
    attacked = [fishers[0], {n: f * 1e6 for n, f in fishers[1].items()}]
    assert fisher_outliers(attacked, DEFAULT_FISHER_CAP) == [set(), set(SHAPES)]
    capped = cap_fishers(attacked, DEFAULT_FISHER_CAP, rule="outliers")
    for name in SHAPES:  # its own shape, no larger than the other client's in mean and largest entry
        ratio = capped[1][name] / fishers[1][name]
        np.testing.assert_allclose(ratio, ratio.ravel()[0], rtol=1e-6)
        assert capped[1][name].mean() <= fishers[0][name].mean() * (1 + 1e-9)
        assert capped[1][name].max() <= fishers[0][name].max() * (1 + 1e-9)
        assert capped[0][name] is fishers[0][name]


def test_the_default_preset_uses_the_outlier_rule_and_names_the_outlier_client(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert FedFiOTConfig.default().fisher_cap_rule == DEFAULT_FISHER_CAP_RULE == "outliers"
    uploads = client_uploads(K, seed=11)
    w, f, n = uploads[4]
    inflated = [*uploads[:4], (w, {k: v * 1e4 for k, v in f.items()}, n), *uploads[5:]]
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(max_iters=2), fedavg_baseline=False)
    with caplog.at_level("WARNING", logger="fedfiot_flwr"):
        attacked = arrays_to_numpy(strategy.aggregate_train(
            1, [reply(i + 1, packed(*t)) for i, t in enumerate(inflated)])[0])
    warned = [r.getMessage() for r in caplog.records if "median" in r.getMessage()]
    assert len(warned) == 1 and "client 5" in warned[0] and "fc1.weight" in warned[0] and "times above" in warned[0]
    # the round equals the uncapped merge of the uploads with the outlier mapped by hand
    mapped = cap_fishers([t[1] for t in inflated], DEFAULT_FISHER_CAP, rule="outliers")
    uncapped = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(max_iters=2, fisher_cap=None), fedavg_baseline=False)
    by_hand = arrays_to_numpy(uncapped.aggregate_train(
        1, [reply(i + 1, packed(t[0], m, t[2])) for i, (t, m) in enumerate(zip(inflated, mapped))])[0])
    assert _distance(attacked, by_hand) < 1e-3 * _distance(by_hand, uploads[4][0])


def test_a_round_where_every_client_is_an_outlier_is_merged_without_error() -> None:
    rng = np.random.default_rng(5)
    peaky = {n: rng.lognormal(0.0, 2.0, size=s) * 10.0 for n, s in SHAPES.items()}
    flat = {n: np.ones(s) for n, s in SHAPES.items()}
    # two clients: one flat, the other more than c times above it, so each is an outlier
    first, second = fisher_outliers([flat, peaky], DEFAULT_FISHER_CAP)
    assert first & second  # a tensor where both clients are outliers
    for fishers in ([flat, peaky], [flat, {n: np.ones(s) * 2.0 for n, s in SHAPES.items()}]):
        capped = cap_fishers(fishers, DEFAULT_FISHER_CAP, rule="outliers")
        assert all(np.all(np.isfinite(f)) and np.all(f >= 0) for fk in capped for f in fk.values())
    capped = cap_fishers([flat, flat, flat], DEFAULT_FISHER_CAP, rule="outliers")  # alike: left as they are
    assert all(capped[k][n] is flat[n] for k in range(3) for n in SHAPES)


def _outlier_warnings(uploads: list, caplog: pytest.LogCaptureFixture) -> list[str]:
    """The warnings a user sees when the default preset merges ``uploads`` (weights, Fisher, size)."""
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(max_iters=2), fedavg_baseline=False)
    with caplog.at_level("WARNING", logger="fedfiot_flwr"):
        strategy.aggregate_train(1, [reply(i + 1, packed(*t)) for i, t in enumerate(uploads)])
    return [r.getMessage() for r in caplog.records if "Fisher cap" in r.getMessage()]


def test_the_outlier_warning_is_one_whole_sentence_naming_tensors_factor_and_rule(
    caplog: pytest.LogCaptureFixture,
) -> None:
    uploads = client_uploads(K, seed=11)
    w, f, n = uploads[4]
    warned = _outlier_warnings([*uploads[:4], (w, {k: v * 1e4 for k, v in f.items()}, n), *uploads[5:]], caplog)
    assert len(warned) == 1
    line = warned[0]
    assert "client 5's Fisher is more than 4 times above the other clients' median in " in line
    assert "fc1.weight (1.1e+04 times)" in line and "its own shape at their median magnitude" in line  # how far, and what was done
    assert "robustness rule, not an accusation" in line and line.endswith("(fisher_cap=None turns it off).")
    assert "client 1" not in line and "client 2" not in line  # only the outlier is named


def test_the_outlier_warning_of_a_two_client_round_names_the_other_client_not_a_median(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (w0, f0, n0), (w1, f1, n1) = client_uploads(2, seed=3)
    warned = _outlier_warnings([(w0, f0, n0), (w1, {k: v * 1e6 for k, v in f1.items()}, n1)], caplog)
    assert len(warned) == 1
    line = warned[0]
    assert "median" not in line and "with two clients, each is compared with the other alone" in line
    assert "client 2's Fisher is more than 4 times above client 1's in " in line
    assert "client 1's Fisher is more than" not in line  # the honest client is not named as an outlier


def test_a_client_whose_training_diverged_is_excluded_as_such(caplog: pytest.LogCaptureFixture) -> None:
    uploads = client_uploads(3, seed=2)
    w, f, n = uploads[2]
    diverged = (dict(w, **{"fc1.weight": w["fc1.weight"] * 1e9}), f, n)
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(max_iters=2), fedavg_baseline=False)
    with caplog.at_level("WARNING"):
        strategy.aggregate_train(1, [reply(i + 1, packed(*t)) for i, t in enumerate([*uploads[:2], diverged])])
    excluded = [r.getMessage() for r in caplog.records if "excluded client" in r.getMessage()]
    assert len(excluded) == 1 and "excluded client 3: tensor 'fc1.weight'" in excluded[0]
    assert "weights out of range" in excluded[0] and "exceeds the bound 1e+06" in excluded[0]
    assert "training most likely diverged" in excluded[0] and "codes" not in excluded[0]


def test_a_client_whose_fisher_is_zero_everywhere_is_named(caplog: pytest.LogCaptureFixture) -> None:
    uploads = client_uploads(3, seed=4)
    w, f, n = uploads[1]
    zero = (w, {k: np.zeros_like(v) for k, v in f.items()}, n)
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.paper(max_iters=2), fedavg_baseline=False)
    with caplog.at_level("WARNING"):
        strategy.aggregate_train(1, [reply(i + 1, packed(*t)) for i, t in enumerate([uploads[0], zero, uploads[2]])])
    warned = [r.getMessage() for r in caplog.records if "zero everywhere" in r.getMessage()]
    assert warned == ["FedFiOT round 1: client 2's Fisher is zero everywhere, so its weights enter the merge with "
                      "the damping lam alone (as little as a client can weigh); check how it computes its Fisher"]
    assert strategy.server_metrics[1]["num-valid"] == 3  # still merged: a zero Fisher is valid, only uninformative
