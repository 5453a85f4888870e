"""Validation-based choice among the aligned merge, the identity merge and FedAvg of the same uploads."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture (the strategy tests send messages)
from _fedfiot_helpers import WORKED_SPEC, packed, reply, worked_uploads
from flwr.app import RecordDict

from fedfiot_flwr import FedFiOT
from fedfiot_flwr.merge import MergeOptions, merge
from fedfiot_flwr.merge.robust import DEFAULT_FISHER_CAP
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.outcome import RoundContext, RoundOutcome
from fedfiot_flwr.server.selection import sweep_candidates
from fedfiot_flwr.server.shell import ValidateFn, arrays_to_numpy
from fedfiot_flwr.server.uploads import CollectedUploads, collect_uploads

SPEC = WORKED_SPEC
UPLOADS = worked_uploads()  # the paper's Appendix G: aligned J = 9 < identity J = 83
DEFAULT = FedFiOTConfig(rho=1.0, lam=1.0, reference=0)
ALIGNED = [0.5, 5.5, 8.5]
IDENTITY = [2.5, 3.0, 7.0]
FEDAVG = [2.5, 3.5, 7.5]  # weighted 3:1 by size


def closest_to(target):
    def validate(model):
        return {"accuracy": -float(np.sum((model["w"].ravel() - np.asarray(target)) ** 2))}
    return validate


def run(fallback, target, **kw):
    config = replace(DEFAULT, selection=fallback, **kw)
    return sweep_candidates(UPLOADS, SPEC, config, RoundContext(1, validate=closest_to(target)))


def test_paper_rule_keeps_the_aligned_merge_whatever_validation_says():
    out = run("objective", IDENTITY)
    assert out.variant == "aligned"
    np.testing.assert_allclose(out.model["w"].ravel(), ALIGNED)


def test_validation_fallback_follows_validation_where_the_objective_disagrees():
    out = run("validation", IDENTITY)
    assert out.engine_result.aligned_objective < out.engine_result.identity_objective  # the objective prefers aligned ...
    assert out.variant == "identity"  # ... validation prefers identity, and wins
    np.testing.assert_allclose(out.model["w"].ravel(), IDENTITY)
    assert {t["variant"] for t in out.trials} == {"aligned", "identity"}


def test_fedavg_candidate_wins_on_validation_and_is_reported_next_to_fedfiot():
    out = run("validation", FEDAVG, fedavg_candidate=True)
    assert out.variant == "fedavg"
    np.testing.assert_allclose(out.model["w"].ravel(), FEDAVG)
    # FedFiOT's own best merge is still reported
    assert out.own_variant == "identity"
    np.testing.assert_allclose(out.own_model["w"].ravel(), IDENTITY)
    assert out.own_validation["accuracy"] < out.validation["accuracy"]
    fedavg = merge(UPLOADS.weights, UPLOADS.fishers, SPEC, MergeOptions(matching="none", aggregation="size"),
                   num_examples=[3, 1])
    np.testing.assert_allclose(out.model["w"], fedavg.model["w"])


def test_fedavg_candidate_loses_when_fedfiot_validates_better():
    out = run("validation", ALIGNED, fedavg_candidate=True)
    assert out.variant == "aligned" and out.own_variant == "aligned"
    np.testing.assert_allclose(out.model["w"].ravel(), ALIGNED)
    assert out.baseline_validation is not None  # FedAvg was computed and validated


def _strategy_round(config: FedFiOTConfig, validate: ValidateFn | None = None) -> tuple[FedFiOT, np.ndarray]:
    """Round 1 of ``FedFiOT(config=config, validate_fn=validate)`` on the worked example sent by two clients.

    Returns the strategy and its merged ``w`` (flattened); the uploads go through the wire's 16-bit
    encoding, so the merge is within about 1e-4 of the worked example's numbers.
    """
    strategy = FedFiOT(spec=SPEC, validate_fn=validate, config=config, fedavg_baseline=False)
    arrays, _ = strategy.aggregate_train(1, [reply(i + 1, c) for i, c in enumerate(_contents())])
    return strategy, arrays_to_numpy(arrays)["w"].ravel()


def _contents() -> list[RecordDict]:
    """The worked example's uploads as the replies two clients send."""
    return [packed({"w": w["w"].astype(np.float32)}, {"w": f["w"].astype(np.float32)}, n)
            for w, f, n in zip(UPLOADS.weights, UPLOADS.fishers, UPLOADS.num_examples)]


def _decoded() -> CollectedUploads:
    """The uploads as the server decodes them (the oracle merges start from these)."""
    return collect_uploads([(str(i + 1), c) for i, c in enumerate(_contents())], None)


@pytest.mark.parametrize("preferred", [IDENTITY, FEDAVG], ids=["identity", "fedavg"])
def test_the_paper_preset_keeps_the_aligned_merge_whatever_validation_says(preferred: list[float]) -> None:
    worked = {"rho": 1.0, "lam": 1.0, "sweep": None}
    _, paper = _strategy_round(FedFiOTConfig.paper(**worked), closest_to(preferred))
    np.testing.assert_allclose(paper, ALIGNED, atol=1e-3)
    # The default preset, given the same validation, follows it.
    _, default = _strategy_round(FedFiOTConfig.default(**worked, fisher_cap=None), closest_to(preferred))
    np.testing.assert_allclose(default, preferred, atol=1e-3)
    # With its whole grid, every knob setting the paper tries keeps what the objective keeps.
    strategy, _ = _strategy_round(FedFiOTConfig.paper(), closest_to(preferred))
    trials = strategy.reports[0]["trials"]
    assert len(trials) > 1 and all(t["variant"] == "aligned" and t["paper_rule_aligned"] for t in trials)
    assert strategy.last_round.chosen["variant"] == "aligned" and "fedavg-won" not in strategy.server_metrics[1]


def test_the_default_preset_offers_the_size_scaled_fisher_and_the_paper_preset_does_not() -> None:
    def aligned(fisher_scaling: str) -> np.ndarray:
        config = FedFiOTConfig(rho=0.5, lam=1e-4, fisher_scaling=fisher_scaling, selection="none",
                               fisher_cap=DEFAULT_FISHER_CAP)
        return sweep_candidates(_decoded(), SPEC, config, RoundContext(1)).model["w"].ravel()

    target = aligned("size")
    assert not np.allclose(target, aligned("none"), rtol=1e-6, atol=0)  # the scaling changes the merge
    strategy, got = _strategy_round(FedFiOTConfig.default(), closest_to(target))
    np.testing.assert_allclose(got, target, rtol=1e-6)
    assert strategy.last_round.chosen["fisher_scaling"] == "size"
    best = [t for t in strategy.reports[0]["trials"] if t["validation"]["accuracy"] == 0.0]
    assert [t["fisher_scaling"] for t in best] == ["size"]  # no unscaled candidate merges to it
    # The paper's grid never shows validation a size-scaled merge.
    paper, _ = _strategy_round(FedFiOTConfig.paper(), closest_to(target))
    trials = paper.reports[0]["trials"]
    assert {t["fisher_scaling"] for t in trials} == {"none"}
    assert max(t["validation"]["accuracy"] for t in trials) < 0.0


@pytest.mark.parametrize("preset", ["default", "paper"])
def test_without_validation_a_preset_merges_once_with_its_own_knobs_and_the_papers_rule(preset: str) -> None:
    def expected(rho: float) -> RoundOutcome:
        config = FedFiOTConfig(rho=rho, lam=1e-4, selection="objective",
                               fisher_cap=DEFAULT_FISHER_CAP if preset == "default" else None)
        return sweep_candidates(_decoded(), SPEC, config, RoundContext(1))

    strategy, got = _strategy_round(FedFiOTConfig.named(preset, rho=0.3))
    want = expected(0.3)
    assert not np.allclose(want.model["w"], expected(0.5).model["w"])  # rho matters here
    np.testing.assert_allclose(got, want.model["w"].ravel(), rtol=1e-6)
    server = strategy.server_metrics[1]
    assert server["num-trials"] == 1 and "fedavg-won" not in server and "val-accuracy" not in server
    assert server["kept-aligned"] == server["paper-rule-aligned"] == int(want.engine_result.aligned)


def test_an_unknown_configuration_name_is_refused() -> None:
    with pytest.raises(ValueError, match="configuration"):
        FedFiOTConfig.named("best")


@pytest.mark.parametrize("with_validation", [False, True], ids=["no-validation", "validation"])
def test_an_exact_objective_tie_keeps_the_aligned_merge_and_every_flag_says_so(
    with_validation: bool, caplog: pytest.LogCaptureFixture,
) -> None:
    from fedfiot_flwr.algorithm import fedfiot_merge

    # Two identical clients: the alignment finds nothing to move, so both objectives are equal.
    twin = packed({"w": UPLOADS.weights[0]["w"].astype(np.float32)}, {"w": UPLOADS.fishers[0]["w"].astype(np.float32)}, 3)
    config = FedFiOTConfig.paper(rho=1.0, lam=1.0, sweep=None if not with_validation else FedFiOTConfig.paper().sweep)
    strategy = FedFiOT(spec=SPEC, validate_fn=closest_to(IDENTITY) if with_validation else None, config=config,
                       fedavg_baseline=False)
    with caplog.at_level("INFO"):
        strategy.aggregate_train(1, [reply(1, twin), reply(2, twin)])
    server = strategy.server_metrics[1]
    assert server["objective-aligned"] == server["objective-identity"]  # an exact tie
    # what the round's line says when nothing moved
    kept = [r.getMessage() for r in caplog.records if "kept the" in r.getMessage()]
    assert len(kept) == 1 and "kept the aligned merge (the alignment found nothing to move" in kept[0]
    assert "0%" not in kept[0]
    assert server["kept-aligned"] == server["paper-rule-aligned"] == 1
    trials = strategy.reports[0]["trials"]
    assert trials and all(t["variant"] == "aligned" and t["paper_rule_aligned"] for t in trials)
    assert all(t["objective"] == t["identity_objective"] for t in trials)
    # The paper's reference and the engine read the tie the same way.
    decoded = collect_uploads([("1", twin), ("2", twin)], None)
    assert fedfiot_merge(decoded.weights, decoded.fishers, SPEC, rho=1.0, lam=1.0, reference=0).aligned
    assert merge(decoded.weights, decoded.fishers, SPEC, MergeOptions(rho=1.0, lam=1.0, reference=0)).aligned


def test_the_sweeps_log_lines_count_the_same_knob_settings_and_merges(caplog: pytest.LogCaptureFixture) -> None:
    import re

    with caplog.at_level("INFO"):
        strategy, _ = _strategy_round(FedFiOTConfig.default(fisher_cap=None), closest_to(IDENTITY))
    text = "\n".join(r.getMessage() for r in caplog.records)
    # the start-up line: the grid, and what round 1 (no broadcast model to align to yet) tries of it
    assert "up to 72 knob settings (36 in round 1, without the broadcast reference)" in strategy.aggregator.describe(True)
    trying = re.search(r"trying (\d+) knob settings on the validation data, each as the aligned and the identity merge",
                       text)
    chosen = re.search(r"out of (\d+) knob settings \((\d+) merges, (\d+) distinct models validated", text)
    assert trying and chosen, text
    trials = strategy.reports[0]["trials"]
    assert int(trying[1]) == int(chosen[1]) == 36 and int(chosen[2]) == len(trials)
    assert int(chosen[3]) <= len(trials)  # FedAvg's validation is not counted among the merges'
