"""The server refinement as a post-merge stage of every strategy: asked for explicitly, the same
after FedFiOT, FedAvg and RegMean, and after the FedAvg the round is compared with; server data
without it only chooses."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import tiny_mlp
from _fedfiot_helpers import SHAPES, client_uploads, packed, reply
from torch.utils.data import DataLoader, Subset, TensorDataset

from fedfiot_flwr import FedFiOT, FedFiOTConfig, RefineOptions, RegMeanStrategy, SweepGrid
from fedfiot_flwr.baselines import regmean_select, size_weighted_average
from fedfiot_flwr.client import curvature_reply
from fedfiot_flwr.merge import spec_from_module
from fedfiot_flwr.refine import ClientModels, Folds, refine_merged_model
from fedfiot_flwr.refine.stage import RefinementStage, describe_candidate, split_folds
from fedfiot_flwr.server import FedAvgAggregator, FedFiOTLegacy, MergeStrategy
from fedfiot_flwr.server.aggregators import FedFiOTAggregator, RoundContext
from fedfiot_flwr.server.shell import arrays_to_numpy
from fedfiot_flwr.server.uploads import collect_uploads
from fedfiot_flwr.validation import make_validate_fn
from fedfiot_flwr.wire import unpack_curvature_reply

SMALL = SweepGrid(rhos=(0.3, 0.7), lams=(1e-4,), references=("largest",), fisher_scalings=("none",))
QUICK = RefineOptions(finetune_epochs=2, augment_copies=1)


Net = tiny_mlp


def _server_data(n: int = 60, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _default(**changes) -> FedFiOTConfig:
    return FedFiOTConfig.default(**{"sweep": SMALL, "max_iters": 3, **changes})


def _replies(k: int = 3, seed: int = 1):
    return [reply(1 + i, packed(w, f, n)) for i, (w, f, n) in enumerate(client_uploads(k, seed=seed))]


def _folds(data: TensorDataset) -> tuple[DataLoader, DataLoader]:
    fit, sel = split_folds(len(data))
    return (DataLoader(Subset(data, fit.tolist()), batch_size=500),
            DataLoader(Subset(data, sel.tolist()), batch_size=500))


def _uploads(replies):
    return collect_uploads([(str(1 + i), r.content) for i, r in enumerate(replies)], None, (), [])


def _assert_equal(got: dict, expected: dict) -> None:
    assert list(got) == list(SHAPES)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_split_folds_is_a_seeded_disjoint_cover() -> None:
    fit, sel = split_folds(11, seed=3)
    assert len(fit) == 5 and len(sel) == 6
    assert set(fit).isdisjoint(sel) and sorted([*fit, *sel]) == list(range(11))
    np.testing.assert_array_equal(split_folds(11, seed=3)[0], fit)
    assert not np.array_equal(split_folds(11, seed=4)[0], fit)
    with pytest.raises(ValueError, match="at least 2"):
        split_folds(1)


def test_fedfiot_with_refine_returns_the_refinement_of_its_merge() -> None:
    torch.manual_seed(0)
    data = _server_data()
    strategy = FedFiOT(model=Net(), server_data=data, config=_default(), refine=QUICK)
    replies = _replies()
    arrays, _ = strategy.aggregate_train(1, replies)
    got = arrays_to_numpy(arrays)
    assert "fedavg-won" not in strategy.server_metrics[1]  # FedAvg does not compete: the refinement's candidates do

    # The same round by hand: the merge chosen on the selection fold, then the refinement function.
    model = Net()
    spec = spec_from_module(model)
    fit_loader, sel_loader = _folds(data)
    uploads = _uploads(replies)
    outcome = FedFiOTAggregator(spec, strategy.fedfiot_config).aggregate(
        uploads, RoundContext(1, validate=make_validate_fn(Net(), sel_loader)))
    perms = outcome.engine_result.permutations if outcome.variant == "aligned" else None
    clients = ClientModels(uploads.weights, spec, perms, uploads.num_examples, uploads.fishers)
    expected, rep = refine_merged_model(outcome.model, clients, model, Folds(fit_loader, sel_loader), options=QUICK)
    _assert_equal(got, expected)

    report = strategy.reports[0]
    # The stage got the uploads' Fishers: the Fisher-anchored fine-tuning runs were candidates.
    assert {f"ft2a{g:g}(" for g in QUICK.fisher_anchor} <= {n.split("(")[0] + "(" for n in report["post_merge"]["selection_accuracy"]}
    assert "Fisher anchor" in strategy.plan
    assert report["post_merge"]["chosen"] == rep.chosen
    assert report["post_merge"]["returned"] == describe_candidate(rep.chosen, 30, uploads.client_ids)
    assert report["post_merge"]["selection_accuracy"] == pytest.approx(rep.selection_accuracy)
    assert report["post_merge"]["fit_examples"] == 30 and report["post_merge"]["select_examples"] == 30
    server = strategy.server_metrics[1]
    assert server["selection-fold-accuracy"] == pytest.approx(rep.selection_accuracy[rep.chosen])
    assert server["val-accuracy"] == pytest.approx(rep.selection_accuracy[rep.chosen])
    _assert_equal(strategy.last_round.alternatives["unrefined"], outcome.model)


def test_server_data_without_refine_fits_nothing() -> None:
    data = _server_data()
    strategy = FedFiOT(model=Net(), server_data=data, config=_default())
    assert strategy.post_merge is None and "nothing is trained" in strategy.plan
    replies = _replies()
    got = arrays_to_numpy(strategy.aggregate_train(1, replies)[0])
    validate = make_validate_fn(Net(), DataLoader(data, batch_size=500))
    outcome = FedFiOTAggregator(spec_from_module(Net()), strategy.fedfiot_config).aggregate(
        _uploads(replies), RoundContext(1, validate=validate))
    _assert_equal(got, outcome.model)
    assert "post_merge" not in strategy.reports[0]


def test_the_same_stage_runs_after_fedavg_and_after_the_fedavg_it_is_compared_with() -> None:
    data = _server_data()
    replies = _replies(seed=4)
    uploads = _uploads(replies)
    fit_loader, sel_loader = _folds(data)
    fedavg = size_weighted_average(uploads.weights, uploads.num_examples)
    clients = ClientModels(uploads.weights, num_examples=uploads.num_examples, fishers=uploads.fishers)
    expected, _ = refine_merged_model(fedavg, clients, Net(), Folds(fit_loader, sel_loader), options=QUICK)
    strategy = MergeStrategy(FedAvgAggregator(), model=Net(), server_data=data, refine=QUICK)
    _assert_equal(arrays_to_numpy(strategy.aggregate_train(1, replies)[0]), expected)
    # FedFiOT's round reports FedAvg of the same uploads given the same stage.
    fedfiot = FedFiOT(model=Net(), server_data=data, config=_default(), refine=QUICK)
    fedfiot.aggregate_train(1, replies)
    _assert_equal(fedfiot.last_round.alternatives["fedavg"], expected)


def test_the_same_stage_runs_after_regmean() -> None:
    torch.manual_seed(3)
    data = _server_data()
    base = Net()
    replies = []
    for i in range(3):
        m = Net()
        m.load_state_dict({n: v + 0.3 * torch.randn_like(v) for n, v in base.state_dict().items()})
        x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        replies.append(reply(1 + i, curvature_reply("regmean", m, [(x[:8], y[:8]), (x[8:], y[8:])],
                                                    num_examples=16, device="cpu")))
    strategy = RegMeanStrategy(model=Net(), server_data=data, refine=QUICK, fedavg_baseline=False)
    got = arrays_to_numpy(strategy.aggregate_train(1, replies)[0])
    ups = [unpack_curvature_reply(r.content) for r in replies]
    fit_loader, sel_loader = _folds(data)
    sel_score = make_validate_fn(Net(), sel_loader)
    chosen = regmean_select([u.weights for u in ups], [u.grams for u in ups], [u.num_examples for u in ups],
                            lambda m: sel_score(m)["accuracy"])
    clients = ClientModels([u.weights for u in ups], num_examples=[u.num_examples for u in ups])
    expected, rep = refine_merged_model(chosen.model, clients, Net(), Folds(fit_loader, sel_loader), options=QUICK)
    _assert_equal(got, expected)
    assert strategy.reports[0]["post_merge"]["chosen"] == rep.chosen


def test_the_merge_knobs_are_chosen_on_the_selection_fold_only() -> None:
    data = _server_data()
    fit, _ = split_folds(len(data))
    relabelled = _server_data()
    relabelled.tensors[1][fit] = (relabelled.tensors[1][fit] + 1) % 3  # only the fitting fold's labels change
    scores = []
    for d in (data, relabelled):
        strategy = FedFiOT(model=Net(), server_data=d, config=_default(), refine=replace(QUICK, finetune_epochs=0))
        stage = strategy.post_merge
        assert isinstance(stage, RefinementStage)
        assert set(stage.fit_indices).isdisjoint(stage.select_indices)
        strategy.aggregate_train(1, _replies())
        scores.append([t["validation"] for t in strategy.reports[0]["trials"]])
    assert scores[0] == scores[1] and len(scores[0]) >= 2


def test_the_paper_preset_validates_on_all_server_data_and_stays_the_paper() -> None:
    data = _server_data(40)
    paper = FedFiOTConfig.paper(sweep=SMALL, max_iters=3)
    strategy = FedFiOT(model=Net(), server_data=data, config=paper)
    assert strategy.fedfiot_config == paper and strategy.post_merge is None
    probe = {k: v.detach().numpy() for k, v in Net().state_dict().items()}
    assert strategy.validate_fn(probe) == pytest.approx(make_validate_fn(Net(), DataLoader(data))(probe))
    # Asked for, the refinement follows the paper's merge without changing its configuration.
    refined = FedFiOT(model=Net(), server_data=data, config=paper, refine=QUICK)
    assert refined.fedfiot_config == paper and isinstance(refined.post_merge, RefinementStage)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"refine": QUICK}, ValueError, "refine needs labelled server_data"),
        ({"server_data": "data", "refine": {"finetune_epochs": 3}}, TypeError, "refine must be a RefineOptions"),
        ({"server_data": "data", "validate_fn": lambda m: {"accuracy": 0.0}}, ValueError, "either validate_fn"),
        ({"server_data": "data", "model": None}, ValueError, "needs model"),
        ({"server_data": TensorDataset(torch.randn(8, 7), torch.zeros(8, dtype=torch.long))}, ValueError,
         r"inputs of shape \(7,\) don't fit the model"),
        ({"server_data": TensorDataset(torch.randn(8, 4), torch.full((8,), 16))}, ValueError,
         "label 16 is not a class of the model's 3 outputs"),
        ({"server_data": TensorDataset(torch.randn(8, 4))}, ValueError, "labelled"),
        ({"server_data": "data", "refine": QUICK, "bn_recalibration": lambda m: m}, ValueError, "not both"),
    ],
)
def test_server_data_and_refine_are_checked_when_the_strategy_is_built(kwargs, error, match) -> None:
    args = {"model": Net(), "spec": spec_from_module(Net()), "config": _default(), **kwargs}
    if args.get("server_data") == "data":
        args["server_data"] = _server_data(20)
    with pytest.raises(error, match=match):
        FedFiOT(**args)


def test_the_start_up_line_says_what_is_trained_on_what(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="flwr"):
        FedFiOT(model=Net(), config=_default()).summary()
    none = next(r.getMessage() for r in caplog.records if "no server data" in r.getMessage())
    assert "paper's rule" in none and "pass server_data=" in none
    refined = FedFiOT(model=Net(), server_data=_server_data(), config=_default(), refine=QUICK)
    assert "30 fitting examples train 2 epochs of distillation fine-tuning" in refined.plan
    assert "30 choose FedFiOT merge" in refined.plan


def test_the_legacy_strategy_refines_the_same_way() -> None:
    from types import SimpleNamespace

    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    from fedfiot_flwr.server.legacy_envelope import reply_to_ndarrays

    data, replies = _server_data(), _replies()
    results = [(SimpleNamespace(cid=str(1 + i)),
                FitRes(Status(Code.OK, ""), ndarrays_to_parameters(reply_to_ndarrays(r.content)), 0, {}))
               for i, r in enumerate(replies)]
    returned = {}
    for refine in (QUICK, None):
        torch.manual_seed(0)
        message_api = FedFiOT(model=Net(), server_data=data, config=_default(), refine=refine)
        expected = arrays_to_numpy(message_api.aggregate_train(1, replies)[0])
        torch.manual_seed(0)
        legacy = FedFiOTLegacy(model=Net(), server_data=data, config=_default(), refine=refine)
        params, _ = legacy.aggregate_fit(1, results, [])
        returned[refine] = dict(zip(legacy.names, parameters_to_ndarrays(params)))
        _assert_equal(returned[refine], expected)
        stages = [{k: v for k, v in strategy.reports[0].get("post_merge", {}).items() if k != "seconds"}
                  for strategy in (legacy, message_api)]
        assert stages[0] == stages[1] and bool(stages[0]) == (refine is not None)
    assert not all(np.allclose(returned[QUICK][k], returned[None][k]) for k in SHAPES)  # the refinement changed it


def test_without_fishers_the_anchored_stage_runs_the_plain_refinement(caplog) -> None:
    data = _server_data()
    uploads = _uploads(_replies(seed=4))
    fedavg = size_weighted_average(uploads.weights, uploads.num_examples)
    stage = RefinementStage(Net(), data, QUICK)
    plain = RefinementStage(Net(), data, replace(QUICK, fisher_anchor=()))
    with caplog.at_level(logging.WARNING, logger="flwr"):
        got = stage(fedavg, uploads.weights, None, uploads.num_examples, fishers=[uploads.fishers[0], {}, {}])
    assert "Fisher anchor needs every client's Fisher (1 of 3" in caplog.text
    want = plain(fedavg, uploads.weights, None, uploads.num_examples)
    _assert_equal(got.model, want.model)
    assert not any(re.fullmatch(r"ft\d+a.*", n) for n in got.record["selection_accuracy"])
