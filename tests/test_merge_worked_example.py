"""The worked example of the paper's Appendix G, exactly."""

import numpy as np
import pytest

from fedfiot_flwr.merge import MergeOptions, PermutationSpec, merge, prepare_clients
from fedfiot_flwr.merge.costs import fisher_cost_matrix
from _fedfiot_helpers import WORKED_FISHERS, WORKED_MODELS, WORKED_SPEC

SPEC, MODELS, FISHERS = WORKED_SPEC, WORKED_MODELS, WORKED_FISHERS


def run(**kw):
    return merge(models=MODELS, fishers=FISHERS, spec=SPEC,
                 options=MergeOptions(lam=1.0, rho=1.0, max_iters=8, reference=0, **kw), num_examples=None)


def test_fedfiot_alignment_merge_objective_and_iterations():
    res = run(matching="fisher", aggregation="fisher")
    assert res.permutations["P0"][0].tolist() == [0, 1, 2]
    assert res.permutations["P0"][1].tolist() == [1, 2, 0]  # (2, 3, 1) one-based
    np.testing.assert_allclose(res.model["w"].ravel(), [0.5, 5.5, 8.5])
    report = res.reports["P0"]
    assert report.initial_objective == pytest.approx(116.0)
    assert report.alignment_objectives[0] == pytest.approx(20.0)
    assert report.objectives == pytest.approx([9.0, 9.0])
    assert report.iterations == 2
    assert res.objective == pytest.approx(9.0)
    assert res.identity_objective == pytest.approx(83.0)
    assert res.aligned is True
    assert res.fraction_permuted == pytest.approx([0.0, 1.0])


def test_second_alignment_costs_match_the_paper():
    w1 = np.array([[0.5], [5.5], [8.5]])
    f1 = FISHERS[0]["w"] + 1.0
    c1 = fisher_cost_matrix(w1, MODELS[0]["w"], f1)
    assert c1[np.arange(3), [0, 1, 2]].sum() == pytest.approx(3.75)
    c2 = fisher_cost_matrix(w1, MODELS[1]["w"], FISHERS[1]["w"] + 1.0)
    assert c2[np.arange(3), [1, 2, 0]].sum() == pytest.approx(5.25)


def test_all_six_alignments_of_client_two_cost_as_in_the_paper():
    c2 = fisher_cost_matrix(MODELS[0]["w"], MODELS[1]["w"], FISHERS[1]["w"] + 1.0)
    costs = {p: c2[np.arange(3), np.array(p) - 1].sum() for p in
             [(1, 2, 3), (2, 1, 3), (3, 2, 1), (1, 3, 2), (2, 3, 1), (3, 1, 2)]}
    assert costs == {(1, 2, 3): 116, (2, 1, 3): 52, (3, 2, 1): 116, (1, 3, 2): 148, (2, 3, 1): 20, (3, 1, 2): 180}


@pytest.mark.parametrize(
    "matching, aggregation, merged, objective",
    [
        ("none", "uniform", [5.0, 3.0, 7.0], 108.0),  # average by index
        ("none", "fisher", [2.5, 3.0, 7.0], 83.0),  # Fisher merging
        ("fisher", "uniform", [1.0, 5.0, 9.0], 12.0),  # average of aligned weights
        ("fisher", "fisher", [0.5, 5.5, 8.5], 9.0),  # FedFiOT
    ],
)
def test_comparison_table_rows(matching, aggregation, merged, objective):
    res = run(matching=matching, aggregation=aggregation)
    np.testing.assert_allclose(res.model["w"].ravel(), merged)
    assert res.objective == pytest.approx(objective)


def test_fedavg_configuration_weights_by_size():
    res = merge(MODELS, FISHERS, SPEC, MergeOptions(lam=1.0, rho=1.0, reference=0, matching="none", aggregation="size"),
                num_examples=[3, 1])
    np.testing.assert_allclose(res.model["w"].ravel(), [2.5, 3.5, 7.5])
    assert res.aligned is False


def test_uniform_aggregation_ignores_sizes_and_buffers_follow_sizes():
    spec = PermutationSpec({"w": ("P0", None), "rm": ("P0",)})
    models = [dict(MODELS[0], rm=np.array([1.0, 2.0, 3.0])), dict(MODELS[1], rm=np.array([5.0, 6.0, 7.0]))]
    clients = prepare_clients(models, FISHERS, buffers=["rm"], num_examples=[3, 1])
    res = merge(clients, None, spec,
                MergeOptions(lam=1.0, rho=1.0, reference=0, matching="none", aggregation="uniform"))
    np.testing.assert_allclose(res.model["w"].ravel(), [5.0, 3.0, 7.0])
    np.testing.assert_allclose(res.model["rm"], [2.0, 3.0, 4.0])  # buffers: weighted 3:1 by size
    res = merge(clients, None, spec, MergeOptions(lam=1.0, rho=1.0, reference=0))
    # the running stats moved with client 2's aligned channels (2, 3, 1)
    np.testing.assert_allclose(res.model["rm"], [(3 * 1 + 6) / 4, (3 * 2 + 7) / 4, (3 * 3 + 5) / 4])
