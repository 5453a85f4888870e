"""Issue 8: validation-based choice among the aligned merge, the identity merge and FedAvg."""

import numpy as np
import pytest

from fedfiot_flwr.merge import PermutationSpec, merge
from fedfiot_flwr.selection import PRESETS, Candidate, merge_round
from fedfiot_flwr.strategy_utils import CollectedUploads

SPEC = PermutationSpec({"w": ("P0", None)})
# The worked example (SPEC.md, Appendix G): aligned J = 9 < identity J = 83.
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


def test_presets():
    assert PRESETS["paper"] == {"fallback": "objective", "fisher_scalings": ("none",), "fedavg_candidate": False,
                                "fisher_cap": None}
    assert PRESETS["default"]["fedavg_candidate"] and PRESETS["default"]["fallback"] == "validation"
    assert PRESETS["default"]["fisher_cap"] is not None and PRESETS["default"]["fisher_cap"] >= 1


def test_strategy_preset_wiring():
    from fedfiot_flwr import FedFiOT

    paper = FedFiOT(spec=SPEC, preset="paper", sweep=True)
    assert paper.fallback == "objective" and not paper.fedavg_candidate
    assert paper.sweep.fisher_scalings == ("none",)
    default = FedFiOT(spec=SPEC, sweep=True)
    assert default.fallback == "validation" and default.fedavg_candidate
    assert default.sweep.fisher_scalings == ("none", "size")
    explicit = FedFiOT(spec=SPEC, fallback="none", fedavg_candidate=False)
    assert explicit.fallback == "none" and not explicit.fedavg_candidate
    with pytest.raises(ValueError, match="preset"):
        FedFiOT(spec=SPEC, preset="best")
