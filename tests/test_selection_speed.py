"""The sweep's faster validation against the exact one: the selection fold held on the device and
scored in chunks, and the race that stops scoring a candidate once it cannot be chosen."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfiot_flwr.batches import evaluate
from fedfiot_flwr.merge import mlp_spec
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.outcome import RoundContext
from fedfiot_flwr.server.selection import SweepGrid, sweep_candidates
from fedfiot_flwr.server.uploads import CollectedUploads
from fedfiot_flwr.validation import make_validate_fn

SPEC = mlp_spec(["fc1", "fc2", "fc3"])
SIZES = [30, 10, 20, 40]
GRID = SweepGrid((0.3, 0.5, 0.7), (1e-3, 1e-5), ("largest", "broadcast"), ("none", "size"))


class Net(nn.Module):
    """An 8-16-12-4 MLP whose tensor names match ``SPEC``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 16), nn.Linear(16, 12), nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _state(net: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def _round(seed: int) -> tuple[CollectedUploads, dict[str, np.ndarray], DataLoader]:
    """Random uploads around a shared model, and a labelled fold that a teacher net labels."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    base = _state(Net())
    models = [{n: (v + 0.4 * rng.normal(size=v.shape)).astype(np.float32) for n, v in base.items()}
              for _ in SIZES]
    fishers = [{n: rng.exponential(size=v.shape).astype(np.float32) for n, v in base.items()} for _ in SIZES]
    teacher = Net()
    teacher.load_state_dict({n: torch.from_numpy(v) for n, v in models[int(rng.integers(len(SIZES)))].items()})
    x = torch.randn(150, 8)
    with torch.no_grad():
        y = (teacher(x) + torch.randn(150, 4)).argmax(1)
    uploads = CollectedUploads(weights=models, fishers=fishers, num_examples=SIZES, client_ids=list("abcd"),
                               metrics=[{}] * len(SIZES))
    return uploads, base, DataLoader(TensorDataset(x, y), batch_size=50)


def _sweep(uploads: CollectedUploads, base: dict[str, np.ndarray], validate: object, metric: str,
           race: bool = True, fallback: str = "validation"):  # noqa: ANN202
    """The default preset's sweep (or the paper's identity rule, ``fallback="objective"``, without FedAvg)."""
    config = FedFiOTConfig(rho=0.5, lam=1e-4, sweep=GRID, selection_metric=metric, selection=fallback,
                           fedavg_candidate=fallback == "validation", certify=True, race=race)
    return sweep_candidates(uploads, SPEC, config, RoundContext(2, broadcast=base, validate=validate), baseline=True)


def _same_choice(a, b) -> bool:  # noqa: ANN001
    return (a.candidate == b.candidate and a.variant == b.variant and a.validation == b.validation
            and a.own_variant == b.own_variant and a.own_validation == b.own_validation
            and all(np.array_equal(a.model[n], b.model[n]) for n in b.model))


@pytest.mark.parametrize("fallback", ["validation", "objective"])
@pytest.mark.parametrize("metric", ["accuracy", "loss"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_race_chooses_what_a_full_scoring_chooses(seed: int, metric: str, fallback: str) -> None:
    uploads, base, loader = _round(seed)
    exact = _sweep(uploads, base, make_validate_fn(Net(), loader, "cpu", chunk_size=8), metric, False, fallback)
    raced = _sweep(uploads, base, make_validate_fn(Net(), loader, "cpu", chunk_size=8), metric, True, fallback)
    assert _same_choice(raced, exact)
    assert raced.baseline_validation == exact.baseline_validation
    assert len(raced.trials) == len(exact.trials)
    maximize = metric != "loss"
    chosen = exact.own_validation[metric]
    for i, (r, e) in enumerate(zip(raced.trials, exact.trials)):
        if r.get("validation_cut"):
            # Reported as cut, not as a score; and rightly cut: it could not have been chosen.
            assert r["validation"] is None
            assert (e["validation"][metric] <= chosen) if maximize else (e["validation"][metric] >= chosen)
        else:
            assert r["validation"] == e["validation"], i
    assert not any("validation_cut" in t for t in exact.trials)


def test_the_race_cuts_candidates_on_a_fold_where_some_merges_are_poor() -> None:
    uploads, base, loader = _round(0)
    raced = _sweep(uploads, base, make_validate_fn(Net(), loader, "cpu", chunk_size=8), "accuracy")
    assert any(t.get("validation_cut") for t in raced.trials)


def test_a_plain_validate_fn_is_scored_in_full() -> None:
    uploads, base, loader = _round(1)
    scorer = make_validate_fn(Net(), loader, "cpu", chunk_size=8)
    plain = _sweep(uploads, base, lambda m: scorer(m), "accuracy")
    exact = _sweep(uploads, base, scorer, "accuracy", race=False)
    assert _same_choice(plain, exact)
    assert [t["validation"] for t in plain.trials] == [t["validation"] for t in exact.trials]


class TieScorer:
    """A validate_fn with a bounded entry whose models tie often: accuracy on 12 examples from a
    per-model hit pattern (6 to 9 hits, so that many models tie), scored in chunks of 3."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _hits(self, model: dict[str, np.ndarray]) -> np.ndarray:
        code = int(abs(float(model["fc3.bias"].sum())) * 1e6) % 7
        return np.roll(np.arange(12) < 6 + code % 4, code)

    def __call__(self, model: dict[str, np.ndarray]) -> dict[str, float]:
        self.calls.append("full")
        return {"accuracy": float(self._hits(model).mean())}

    def validate_bounded(self, model, metric, threshold, maximize):  # noqa: ANN001, ANN201
        self.calls.append("bounded")
        hits = self._hits(model)
        for seen in range(3, 12, 3):
            if not math.isnan(threshold) and (hits[:seen].sum() + 12 - seen) / 12 <= threshold:
                return None
        return {"accuracy": float(hits.mean())}


@pytest.mark.parametrize("seed", [0, 3])
def test_ties_keep_the_earliest_candidate_under_the_race(seed: int) -> None:
    uploads, base, _ = _round(seed)
    exact = _sweep(uploads, base, TieScorer(), "accuracy", race=False)
    scorer = TieScorer()
    raced = _sweep(uploads, base, scorer, "accuracy")
    assert _same_choice(raced, exact)
    assert "bounded" in scorer.calls and any(t.get("validation_cut") for t in raced.trials)


def test_the_scorer_matches_evaluate_on_the_loaders_batches() -> None:
    _, _, loader = _round(4)
    net = Net()
    weights = _state(net)
    loss, acc = evaluate(net, loader, device="cpu")
    assert make_validate_fn(Net(), loader, "cpu", chunk_size=None)(weights) == {"accuracy": acc, "loss": loss}
    chunked = make_validate_fn(Net(), loader, "cpu", chunk_size=7)(weights)
    assert chunked["accuracy"] == acc and chunked["loss"] == pytest.approx(loss, rel=1e-6)


@pytest.mark.parametrize("metric, maximize", [("accuracy", True), ("loss", False)])
def test_a_bounded_scoring_is_cut_only_when_the_model_cannot_beat_the_threshold(metric: str, maximize: bool) -> None:
    _, _, loader = _round(5)
    scorer = make_validate_fn(Net(), loader, "cpu", chunk_size=10)
    rng = np.random.default_rng(0)
    cut = kept = 0
    for i in range(30):
        torch.manual_seed(i)
        weights = _state(Net())
        full = scorer(weights)
        threshold = full[metric] + float(rng.normal(scale=0.08))
        out = scorer.validate_bounded(weights, metric, threshold, maximize)
        if out is None:
            cut += 1
            assert full[metric] <= threshold if maximize else full[metric] >= threshold
        else:
            kept += 1
            assert out == full
    assert cut > 0 and kept > 0
    assert scorer.validate_bounded(weights, metric, math.nan, maximize) == full


def test_an_unbounded_metric_is_scored_in_full() -> None:
    _, _, loader = _round(6)
    scorer = make_validate_fn(Net(), loader, "cpu", chunk_size=10)
    weights = _state(Net())
    assert scorer.validate_bounded(weights, "f1", 1.0, True) == scorer(weights)


class CountingNet(Net):
    """``Net`` that counts the examples it is run on."""

    def __init__(self) -> None:
        super().__init__()
        self.examples = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.examples += int(x.shape[0])
        return super().forward(x)


def test_hard_first_meets_a_poor_models_errors_early_and_keeps_its_metrics() -> None:
    uploads, _, loader = _round(10)
    counted = {}
    for hard_first in (False, True):
        net = CountingNet()
        scorer = make_validate_fn(net, loader, "cpu", chunk_size=10, hard_first=hard_first)
        fulls = [scorer(w) for w in uploads.weights]
        assert 0.2 < fulls[0]["accuracy"] < 0.8
        net.examples = 0
        # Against its own score the model cannot win: it may be cut once all its errors are seen.
        out = scorer.validate_bounded(uploads.weights[0], "accuracy", fulls[0]["accuracy"], True)
        counted[hard_first] = (net.examples, out, fulls)
    assert counted[True][1] is None  # the first model scored fixed the order: its errors come first
    assert counted[True][0] < counted[False][0]
    for a, b in zip(counted[True][2], counted[False][2]):
        assert a["accuracy"] == b["accuracy"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6)
