"""Validation-based choice among the aligned merge, the identity merge and FedAvg of the same uploads."""

import numpy as np
import pytest

from fedfiot_flwr.merge import PermutationSpec, merge
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.selection import Candidate, merge_round
from fedfiot_flwr.server.uploads import CollectedUploads

SPEC = PermutationSpec({"w": ("P0", None)})
# The worked example of the paper's Appendix G: aligned J = 9 < identity J = 83.
UPLOADS = CollectedUploads(
    client_ids=["a", "b"],
    weights=[{"w": np.array([[0.0], [4.0], [8.0]])}, {"w": np.array([[10.0], [2.0], [6.0]])}],
    fishers=[{"w": np.array([[2.0], [0.0], [2.0]])}, {"w": np.array([[0.0], [0.0], [2.0]])}],
    num_examples=[3, 1],
)
DEFAULT = Candidate(rho=1.0, lam=1.0, reference=0)
ALIGNED = [0.5, 5.5, 8.5]
IDENTITY = [2.5, 3.0, 7.0]
FEDAVG = [2.5, 3.5, 7.5]  # weighted 3:1 by size


def closest_to(target):
    def validate(model):
        return {"accuracy": -float(np.sum((model["w"].ravel() - np.asarray(target)) ** 2))}
    return validate


def run(fallback, target, **kw):
    return merge_round(UPLOADS, SPEC, DEFAULT, fallback=fallback, validate=closest_to(target), baseline=False, **kw)


def test_paper_rule_keeps_the_aligned_merge_whatever_validation_says():
    out = run("objective", IDENTITY)
    assert out.variant == "aligned"
    np.testing.assert_allclose(out.model["w"].ravel(), ALIGNED)


def test_validation_fallback_follows_validation_where_the_objective_disagrees():
    out = run("validation", IDENTITY)
    assert out.result.aligned_objective < out.result.identity_objective  # the objective prefers aligned ...
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
    fedavg = merge(UPLOADS.weights, UPLOADS.fishers, SPEC, num_examples=[3, 1], matching="none", aggregation="size")
    np.testing.assert_allclose(out.model["w"], fedavg.model["w"])


def test_fedavg_candidate_loses_when_fedfiot_validates_better():
    out = run("validation", ALIGNED, fedavg_candidate=True)
    assert out.variant == "aligned" and out.own_variant == "aligned"
    np.testing.assert_allclose(out.model["w"].ravel(), ALIGNED)
    assert out.baseline_validation is not None  # FedAvg was computed and validated


def test_the_strategy_runs_its_configuration_or_the_paper_rule_without_validation():
    from fedfiot_flwr import FedFiOT

    with_val = FedFiOT(spec=SPEC, validate_fn=closest_to(IDENTITY), config=FedFiOTConfig.default())
    assert with_val.fedfiot_config == FedFiOTConfig.default()  # a validate_fn: the configuration as given
    assert with_val.fedfiot_config.sweep.fisher_scalings == ("none", "size")
    without = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(rho=0.3))
    assert (without.fedfiot_config.selection, without.fedfiot_config.sweep) == ("objective", None)
    assert not without.fedfiot_config.fedavg_candidate and without.fedfiot_config.rho == 0.3
    paper = FedFiOT(spec=SPEC, validate_fn=closest_to(IDENTITY), config=FedFiOTConfig.paper())
    assert paper.fedfiot_config.selection == "objective" and paper.fedfiot_config.sweep.fisher_scalings == ("none",)
    with pytest.raises(ValueError, match="configuration"):
        FedFiOTConfig.named("best")
