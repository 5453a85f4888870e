"""The default configuration's server refinement inside the strategies: folds, selection, and the
refined model equal to the refinement function run on the same merge."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
import torch
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import SHAPES, client_uploads, packed, reply
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from fedfiot_flwr import FedFiOT, FedFiOTConfig, SweepGrid
from fedfiot_flwr.merge import spec_from_module
from fedfiot_flwr.server import FedFiOTLegacy
from fedfiot_flwr.server.refinement import ServerRefinement, split_folds
from fedfiot_flwr.server.selection import Candidate, merge_round
from fedfiot_flwr.server.shell import arrays_to_numpy
from fedfiot_flwr.server.uploads import collect_uploads
from fedfiot_flwr.server_refine import RefineOptions, refine_merged_model
from fedfiot_flwr.validation import make_validate_fn

SMALL = SweepGrid(rhos=(0.3, 0.7), lams=(1e-4,), references=("largest",), fisher_scalings=("none",))
QUICK = RefineOptions(finetune_epochs=2, augment_copies=1)


class Net(nn.Module):
    """The helpers' 4-6-5-3 MLP (``SHAPES``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _server_data(n: int = 60, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def _default(**changes) -> FedFiOTConfig:
    return FedFiOTConfig.default(**{"sweep": SMALL, "max_iters": 3, "refine": QUICK, **changes})


def _replies(k: int = 3, seed: int = 1):
    return [reply(1 + i, packed(w, f, n)) for i, (w, f, n) in enumerate(client_uploads(k, seed=seed))]


def test_split_folds_is_a_seeded_disjoint_cover() -> None:
    fit, sel = split_folds(11, seed=3)
    assert len(fit) == 5 and len(sel) == 6
    assert set(fit).isdisjoint(sel) and sorted([*fit, *sel]) == list(range(11))
    np.testing.assert_array_equal(split_folds(11, seed=3)[0], fit)
    assert not np.array_equal(split_folds(11, seed=4)[0], fit)
    with pytest.raises(ValueError, match="at least 2"):
        split_folds(1)


def test_the_default_strategy_returns_the_refinement_of_its_merge() -> None:
    torch.manual_seed(0)
    data = _server_data()
    strategy = FedFiOT(model=Net(), server_data=data, config=_default())
    assert strategy.fedfiot_config.refine == QUICK and not strategy.fedfiot_config.fedavg_candidate
    replies = _replies()
    arrays, _ = strategy.aggregate_train(1, replies)
    got = arrays_to_numpy(arrays)

    # The same round by hand: the merge chosen on the selection fold, then the refinement function.
    model = Net()
    spec = spec_from_module(model)
    fit, sel = split_folds(len(data))
    fit_loader = DataLoader(Subset(data, fit.tolist()), batch_size=500)
    sel_loader = DataLoader(Subset(data, sel.tolist()), batch_size=500)
    uploads = collect_uploads([(str(1 + i), r.content) for i, r in enumerate(replies)], None, (), [])
    cfg = strategy.fedfiot_config
    outcome = merge_round(uploads, spec, Candidate(cfg.rho, cfg.lam, cfg.reference, cfg.fisher_scaling),
                          max_iters=cfg.max_iters, matching=cfg.matching, aggregation=cfg.aggregation,
                          fallback=cfg.selection, server_round=1, sweep=SMALL,
                          validate=make_validate_fn(Net(), sel_loader), baseline=False, fedavg_candidate=False,
                          fisher_cap=cfg.fisher_cap)
    perms = outcome.result.permutations if outcome.variant == "aligned" else None
    expected, rep = refine_merged_model(outcome.model, uploads.weights, model, fit_loader, sel_loader, spec=spec,
                                        permutations=perms, num_examples=uploads.num_examples, options=QUICK)
    assert list(got) == list(SHAPES)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6)

    report = strategy.reports[0]
    assert report["chosen"]["refinement"] == rep.chosen
    assert report["refinement"]["selection_accuracy"] == pytest.approx(rep.selection_accuracy)
    assert report["refinement"]["fit_examples"] == 30 and report["refinement"]["select_examples"] == 30
    server = strategy.server_metrics[1]
    assert server["refine-selection-accuracy"] == pytest.approx(rep.selection_accuracy[rep.chosen])
    # What the round reports as validation is the returned model on the selection fold.
    assert server["val-accuracy"] == pytest.approx(rep.selection_accuracy[rep.chosen])
    # The unrefined merge is reported next to it.
    assert strategy.last_round.outcome.alternatives["fedfiot-unrefined"].keys() == got.keys()


def test_the_merge_knobs_are_chosen_on_the_selection_fold_only() -> None:
    data = _server_data()
    fit, _ = split_folds(len(data))
    relabelled = _server_data()
    relabelled.tensors[1][fit] = (relabelled.tensors[1][fit] + 1) % 3  # only the fitting fold's labels change
    scores = []
    for d in (data, relabelled):
        strategy = FedFiOT(model=Net(), server_data=d, config=_default(refine=replace(QUICK, finetune_epochs=0)))
        refiner = strategy.aggregator.refiner
        assert isinstance(refiner, ServerRefinement)
        assert set(refiner.fit_indices).isdisjoint(refiner.select_indices)
        strategy.aggregate_train(1, _replies())
        scores.append([t["validation"] for t in strategy.reports[0]["trials"]])
    assert scores[0] == scores[1] and len(scores[0]) >= 2


def test_the_paper_preset_never_refines_and_validates_on_all_server_data() -> None:
    data = _server_data(40)
    paper = FedFiOTConfig.paper(sweep=SMALL, max_iters=3)
    strategy = FedFiOT(model=Net(), server_data=data, config=paper)
    assert strategy.fedfiot_config == paper and strategy.aggregator.refiner is None
    probe = {k: v.detach().numpy() for k, v in Net().state_dict().items()}
    assert strategy.validate_fn(probe) == pytest.approx(make_validate_fn(Net(), DataLoader(data))(probe))
    strategy.aggregate_train(1, _replies())
    assert "refinement" not in strategy.reports[0]


def test_server_data_is_checked_and_the_refinement_needs_it(caplog) -> None:
    data = _server_data(20)
    with pytest.raises(ValueError, match="either validate_fn or server_data"):
        FedFiOT(model=Net(), server_data=data, validate_fn=lambda m: {"accuracy": 0.0})
    with pytest.raises(ValueError, match="needs model"):
        FedFiOT(spec=spec_from_module(Net()), server_data=data)
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy = FedFiOT(model=Net(), validate_fn=lambda m: {"accuracy": 0.0}, config=_default())
    assert strategy.fedfiot_config.refine is None and strategy.fedfiot_config.fedavg_candidate
    assert any("no server refinement" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="no refiner"):
        from fedfiot_flwr.server import FedFiOTAggregator

        FedFiOTAggregator(spec_from_module(Net()), _default())


def test_the_legacy_strategy_refines_the_same_way() -> None:
    legacy = FedFiOTLegacy(model=Net(), server_data=_server_data(), config=_default())
    assert isinstance(legacy.merger.aggregator.refiner, ServerRefinement)
    assert legacy.merger.validate_fn is legacy.merger.aggregator.refiner.validate_fn
