"""The one best-on-validation rule: NaN never wins, ties go to the earliest, all-NaN keeps the first.

The rule itself (:mod:`fedfiot_flwr.choose`), then every place that chooses on validation data:
FedFiOT's sweep and its FedAvg candidate, RegMean's alpha, FedFisher's checkpoints and the
refinement's candidates.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedfiot_flwr.choose import BestSoFar, beats, best_index, higher_is_better
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.outcome import RoundContext
from fedfiot_flwr.server.selection import Candidate, SweepGrid, sweep_candidates
from _fedfiot_helpers import WORKED_SPEC, worked_uploads

NAN = math.nan


# ------------------------------------------------------------------------------ the rule


@pytest.mark.parametrize(
    ("scores", "maximize", "winner"),
    [
        ([0.5, NAN, 0.7], True, 2),  # NaN is skipped, the highest wins
        ([NAN, 0.1], True, 1),  # any number beats a NaN first candidate
        ([0.9, NAN], True, 0),  # a NaN never replaces a number
        ([0.4, 0.6, 0.6, 0.2], True, 1),  # ties go to the earliest
        ([0.6, 0.6], True, 0),
        ([NAN, NAN, NAN], True, 0),  # no number at all: the first candidate
        ([0.3, 0.2, 0.2, NAN], False, 1),  # a loss: the lowest wins, ties to the earliest
        ([NAN, 0.2, 0.1], False, 2),
        ([-math.inf, -1.0], True, 1),
        ([7.0], True, 0),
    ],
)
def test_best_index_follows_the_rule(scores: list[float], maximize: bool, winner: int) -> None:
    assert best_index(scores, maximize=maximize) == winner


def test_best_so_far_keeps_the_same_winner_as_best_index() -> None:
    scores = [NAN, 0.2, 0.5, NAN, 0.5, 0.1]
    best: BestSoFar[str] = BestSoFar()
    won = [best.offer(s, f"c{i}") for i, s in enumerate(scores)]
    assert won == [True, True, True, False, False, False]
    assert (best.index, best.item, best.score, best.count) == (2, "c2", 0.5, 6)
    assert best.index == best_index(scores)


def test_all_nan_keeps_the_first_candidate_with_a_nan_score() -> None:
    best: BestSoFar[int] = BestSoFar(maximize=False)
    for i in range(3):
        best.offer(NAN, i)
    assert best.item == 0 and math.isnan(best.score)


def test_no_candidate_is_an_error() -> None:
    with pytest.raises(ValueError, match="no candidates"):
        best_index([])
    with pytest.raises(LookupError, match="no candidate"):
        _ = BestSoFar[int]().item


def test_beats_needs_a_strict_improvement_and_a_number() -> None:
    assert beats(0.6, 0.5) and not beats(0.5, 0.5) and not beats(0.4, 0.5)
    assert beats(0.4, 0.5, maximize=False) and not beats(0.5, 0.5, maximize=False)
    assert beats(0.0, NAN) and not beats(NAN, 0.0) and not beats(NAN, NAN)


def test_only_losses_are_minimised() -> None:
    assert higher_is_better("accuracy") and higher_is_better("f1")
    assert not higher_is_better("loss") and not higher_is_better("val-loss")


@given(st.lists(st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=16), st.just(NAN)),
                min_size=1, max_size=12), st.booleans())
def test_best_index_is_the_first_best_number(scores: list[float], maximize: bool) -> None:
    numbers = [s for s in scores if not math.isnan(s)]
    got = best_index(scores, maximize=maximize)
    if not numbers:
        assert got == 0
    else:
        top = max(numbers) if maximize else min(numbers)
        assert got == next(i for i, s in enumerate(scores) if s == top)


# ----------------------------------------------------------------------- where it is used

SPEC = WORKED_SPEC
UPLOADS = worked_uploads()  # the paper's Appendix G: aligned J = 9 < identity J = 83
DEFAULT = Candidate(rho=1.0, lam=1.0, reference=0)
CONFIG = FedFiOTConfig(rho=1.0, lam=1.0, reference=0)
GRID = SweepGrid(rhos=(0.5, 1.0), lams=(1.0, 0.1), references=("largest",))


def test_the_sweep_keeps_the_default_on_a_tie_and_skips_nan_scores() -> None:
    tie = sweep_candidates(UPLOADS, SPEC, replace(CONFIG, sweep=GRID), RoundContext(1, validate=lambda m: {"accuracy": 0.5}))
    assert len(tie.trials) > 1 and tie.candidate == DEFAULT

    def nan_for_the_default(model: dict) -> dict[str, float]:
        # Only the default (rho = 1, lam = 1, reference 0) gives the aligned merge 0.5, 5.5, 8.5.
        return {"accuracy": NAN if np.allclose(model["w"].ravel(), [0.5, 5.5, 8.5]) else 0.1}

    out = sweep_candidates(UPLOADS, SPEC, replace(CONFIG, sweep=GRID), RoundContext(1, validate=nan_for_the_default))
    assert out.candidate != DEFAULT and out.validation == {"accuracy": 0.1}


def test_fedavg_must_score_strictly_better_than_fedfiots_own_merge() -> None:
    both = replace(CONFIG, selection="validation", fedavg_candidate=True)
    tie = sweep_candidates(UPLOADS, SPEC, both, RoundContext(1, validate=lambda m: {"accuracy": 0.5}), baseline=True)
    assert tie.variant == "aligned"  # FedFiOT's own merge comes first: it keeps a tie
    fedavg = [2.5, 3.5, 7.5]
    out = sweep_candidates(UPLOADS, SPEC, both, RoundContext(
        1, validate=lambda m: {"accuracy": 0.6 if np.allclose(m["w"].ravel(), fedavg) else 0.5}), baseline=True)
    assert out.variant == "fedavg"


def test_a_loss_metric_is_minimised_by_the_sweep() -> None:
    aligned = [0.5, 5.5, 8.5]

    def loss(model: dict) -> dict[str, float]:
        return {"loss": float(np.sum((model["w"].ravel() - aligned) ** 2))}

    config = FedFiOTConfig(rho=0.5, lam=0.1, reference=0, sweep=GRID, selection_metric="loss")
    out = sweep_candidates(UPLOADS, SPEC, config, RoundContext(1, validate=loss))
    assert out.validation is not None and out.validation["loss"] == min(t["validation"]["loss"] for t in out.trials)


def test_regmean_skips_a_nan_alpha_and_keeps_the_earlier_of_a_tie() -> None:
    from fedfiot_flwr.baselines import regmean_select
    from fedfiot_flwr.psd import InputGram

    rng = np.random.default_rng(0)
    models = [{"weight": rng.normal(size=(2, 3)), "bias": rng.normal(size=2)} for _ in range(2)]
    grams = []
    for _ in range(2):
        x = np.hstack([rng.normal(size=(8, 3)), np.ones((8, 1))])  # inputs plus the bias's ones
        grams.append({"": InputGram("weight", "bias", x.T @ x)})
    calls = iter([NAN, 0.3, 0.3])
    res = regmean_select(models, grams, [5, 7], lambda m: next(calls), alphas=(0.1, 0.5, 0.9))
    assert res.alpha == 0.5 and math.isnan(res.scores[0.1])


def test_fedfisher_skips_nan_checkpoints() -> None:
    from fedfiot_flwr.baselines import FedFisherOptions, fedfisher_diag

    rng = np.random.default_rng(1)
    models = [{"w": rng.normal(size=(3, 2))} for _ in range(2)]
    fishers = [{"w": np.abs(rng.normal(size=(3, 2))) + 0.1} for _ in range(2)]
    scores = iter([NAN, 0.2, NAN, 0.2])
    options = FedFisherOptions(steps=30, eval_every=10, device="cpu")
    res = fedfisher_diag(models, fishers, [4, 6], options, evaluate=lambda m: next(scores), dtype=torch.float64)
    assert (res.best_step, res.best_score) == (10, 0.2)
    nan_only = fedfisher_diag(models, fishers, [4, 6], options, evaluate=lambda m: NAN, dtype=torch.float64)
    assert nan_only.best_step == 0 and math.isnan(nan_only.best_score)  # the size-weighted average


def test_the_refinement_keeps_the_merge_and_starts_from_it_on_a_tie(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from fedfiot_flwr.refine import Folds, RefineOptions, candidates, refine_merged_model

    monkeypatch.setattr(candidates, "_accuracy", lambda model, loader: 0.5)  # every candidate ties
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    merged = {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
    clients = [{k: v + 0.1 * np.random.default_rng(i).normal(size=v.shape).astype(v.dtype) for k, v in merged.items()}
               for i in range(2)]
    loader = DataLoader(TensorDataset(torch.randn(12, 4), torch.arange(12) % 3), batch_size=6)
    lines: list[str] = []
    options = RefineOptions(ridges=(0.1, 1.0), finetune_epochs=1, augment_copies=0, offer_starts=True)
    _, report = refine_merged_model(merged, clients, net, Folds(loader, loader), options=options, log=lines.append)
    assert {"ls-r0.1", "ft1(merged)", "client-1"} <= set(report.selection_accuracy)
    assert report.chosen == "merged"
    assert any("fine-tuning merged" in line for line in lines)  # the merge also wins the start
