"""Fuzzed replies: the server never crashes and never merges a reply it should have excluded.

Seeded reply sets are built with the real packing (``pack_reply``), corrupted (duplicates and
replays, huge / NaN / inf / negative Fisher, bad ``num-examples``, bad scales, wrong shapes,
dtypes and stypes, missing or extra tensors, unknown records and metrics, truncated bytes, error
replies) and sent to ``FedFiOT.aggregate_train`` as real Flower Messages and to
``FedFiOTLegacy.aggregate_fit`` as FitRes. Each round must either return exactly the merge of
the valid replies alone (the same strategy, called on the valid subset) or, when fewer than
``min_valid_replies`` remain, fail with the documented RuntimeError.

A strategy that caps the Fishers (the default preset) must also accept a finite Fisher above
``MAX_FISHER_MAGNITUDE`` (up to float32's maximum), which the paper preset excludes. Its round
must equal the merge of the valid replies re-packed with the Fishers capped
(:func:`fedfiot_flwr.merge.robust.cap_fishers` over the round's valid Fishers), merged by the same
configuration without the cap.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import FakeGrid
from _fuzz_replies import (
    CORRUPTIONS,
    WHEN_CAPPED,
    Sent,
    TinyBN,
    TinyMLP,
    corrupt,
    corrupted_round,
    honest_upload,
    mark_duplicates,
    reply,
)
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedfiot_flwr import FedFiOT, FedFiOTConfig, FedFiOTLegacy, SweepGrid
from fedfiot_flwr.merge.robust import cap_fishers
from fedfiot_flwr.reply_limits import MAX_FISHER_MAGNITUDE
from fedfiot_flwr.server.legacy_envelope import reply_to_ndarrays
from fedfiot_flwr.wire import pack_reply, unpack_reply

MODELS = {"mlp": TinyMLP, "bn": TinyBN}
CONFIGS = {
    "paper": {"config": FedFiOTConfig.paper(max_iters=2, sweep=None), "fedavg_baseline": False},
    "default": {"config": FedFiOTConfig.default(max_iters=2)},
    "euclidean-size": {"config": FedFiOTConfig(matching="euclidean", aggregation="size", reference="broadcast",
                                               fisher_scaling="normalized", max_iters=2), "fedavg_baseline": False},
}
SETS_PER_STRATEGY = 150  # x 2 models x 3 configs = 900 Message-API reply sets (+ 150 legacy + 20 sweep)
LEGACY_SETS = 150
TOO_FEW = r"only \d+ valid replies, at least 2 needed"


def make_strategy(model_name: str, config: dict, results: Path, **extra: object) -> FedFiOT:
    """A strategy that has broadcast its model to nodes 1..5 (as a real round does)."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    strategy = FedFiOT(model=model, min_train_nodes=2, min_available_nodes=2, **config, **extra)  # type: ignore[arg-type]
    strategy.configure_train(1, ArrayRecord(model.state_dict()), ConfigRecord(), FakeGrid(range(1, 6), None))
    return strategy


def uncapped_twin(model_name: str, config: dict, results: Path, **extra: object) -> FedFiOT | None:
    """The same strategy without the Fisher cap (``None`` when ``config`` has no cap)."""
    if config["config"].fisher_cap is None:
        return None
    return make_strategy(model_name, {**config, "config": replace(config["config"], fisher_cap=None)}, results, **extra)


def capped_references(valid: list[Sent], cap: float, rule: str) -> list[Message]:
    """The valid replies re-packed with the Fishers a capping server merges: ``cap_fishers`` over the
    round's valid Fishers (decoded as the server decodes them)."""
    ups = [unpack_reply(s.reference_message().content, fisher_bound=None) for s in valid]
    capped = cap_fishers([u.fisher for u in ups], cap, rule=rule)
    for fisher in capped:  # what the uncapped twin accepts
        assert max(float(np.max(f)) for f in fisher.values()) <= MAX_FISHER_MAGNITUDE
    return [reply(s.node, pack_reply(u.weights, f, u.num_examples, u.metrics)) for s, u, f in zip(valid, ups, capped)]


def as_numpy(arrays: ArrayRecord) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in arrays.items()}


def check_round(strategy: FedFiOT, sent: list[Sent], results: Path, twin: FedFiOT | None = None) -> None:
    """The round merges exactly the valid replies, or fails with the clear error when too few remain.

    ``twin``: for a strategy that caps the Fishers, the same strategy without the cap; the round
    must then equal the twin's merge of the valid replies with their Fishers capped.
    """
    valid = [s for s in sent if s.valid]
    labels = [s.label for s in sent]
    if len(valid) < 2:
        with pytest.raises(RuntimeError, match=TOO_FEW):
            strategy.aggregate_train(1, [s.message() for s in sent])
        return
    arrays, _ = strategy.aggregate_train(1, [s.message() for s in sent])
    rejected = strategy.reports[-1]["rejected"]
    metrics = strategy.server_metrics[1]
    assert sorted(int(r["client"]) for r in rejected) == sorted(s.node for s in sent if not s.valid), labels
    assert all(r["reason"] for r in rejected)
    assert metrics["num-valid"] == len(valid) and metrics["num-rejected"] == len(sent) - len(valid), labels
    got = as_numpy(arrays)
    if twin is not None:
        cap = strategy.fedfiot_config.fisher_cap
        assert cap is not None
        rule = strategy.fedfiot_config.fisher_cap_rule
        want = as_numpy(twin.aggregate_train(1, capped_references(valid, cap, rule))[0])
        assert twin.server_metrics[1]["num-rejected"] == 0, labels
    elif len(valid) == len(sent) and all(s.clean is None for s in sent):
        want = got  # nothing to exclude or ignore: the reference call would repeat this one
    else:
        want = as_numpy(strategy.aggregate_train(1, [s.reference_message() for s in valid])[0])
    assert list(got) == list(want)
    for name in want:
        assert np.all(np.isfinite(got[name])), (name, labels)
        if twin is None:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}: {labels}")
        else:  # re-quantizing a capped Fisher rounds it to 16 bits (an outlier's mapped values are not
            # proportional to its codes, so its smallest entries lose relative precision)
            # and tempering amplifies that; a wrong merge (a reply too many or too few, no cap) is off
            # by tenths, so a percent still tells the two apart)
            np.testing.assert_allclose(got[name], want[name], rtol=1e-2, atol=1e-3, err_msg=f"{name}: {labels}")


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model_name", list(MODELS))
def test_fuzzed_replies_merge_exactly_the_valid_ones(model_name: str, config: str, tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    strategy = make_strategy(model_name, CONFIGS[config], results)
    twin = uncapped_twin(model_name, CONFIGS[config], results)
    rng = np.random.default_rng([17, list(MODELS).index(model_name), list(CONFIGS).index(config)])
    seen: set[str] = set()
    huge_merged = 0
    for _ in range(SETS_PER_STRATEGY):
        sent = corrupted_round(MODELS[model_name](), rng, capped=twin is not None)
        seen.update(s.label for s in sent)
        huge_merged += sum(s.valid and s.content_valid == WHEN_CAPPED for s in sent)
        check_round(strategy, sent, results, twin)
    # the seeded draw exercises most corruptions on every strategy
    assert len(seen & set(CORRUPTIONS)) >= 0.8 * len(CORRUPTIONS)
    # a capping strategy merged finite Fishers above the bound; the others merged none
    assert (huge_merged > 0) == (twin is not None)


def test_fuzzed_replies_with_a_validation_sweep(tmp_path: Path) -> None:
    def validate(model: dict[str, np.ndarray]) -> dict[str, float]:
        return {"accuracy": -float(np.sum(model["fc1.weight"] ** 2))}

    results = tmp_path / "results.json"
    grid = SweepGrid(rhos=(0.5, 1.0), lams=(1e-4,), references=("largest",), fisher_scalings=("none", "size"))
    config = {"config": FedFiOTConfig.default(max_iters=2, sweep=grid)}
    strategy = make_strategy("bn", config, results, validate_fn=validate)
    twin = uncapped_twin("bn", config, results, validate_fn=validate)
    rng = np.random.default_rng(23)
    for _ in range(20):
        check_round(strategy, corrupted_round(TinyBN(), rng, capped=True), results, twin)


# --------------------------------------------------------------------------------- legacy


class Proxy:
    """Stands in for a ClientProxy (aggregate_fit reads ``cid``)."""

    def __init__(self, cid: str) -> None:
        self.cid = cid


def _fitres(sent: Sent, reference: bool = False) -> FitRes:
    if sent.content is None:
        return FitRes(Status(Code.FIT_NOT_IMPLEMENTED, "client crashed"), Parameters([], ""), 0, {})
    content = sent.clean if reference and sent.clean is not None else sent.content
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(reply_to_ndarrays(content)), 10, {})


def test_fuzzed_fitres_merge_exactly_the_valid_ones() -> None:
    torch.manual_seed(0)
    model = TinyBN()
    names = list(model.state_dict())
    strategy = FedFiOTLegacy(model=model, min_fit_clients=2, config=FedFiOTConfig.paper(max_iters=2, sweep=None),
                             fedavg_baseline=False)
    rng = np.random.default_rng(29)
    for _ in range(LEGACY_SETS):
        drawn = corrupted_round(TinyBN(), rng)
        # legacy Flower lists results and failures apart: results first, then failures
        sent = mark_duplicates([s for s in drawn if s.content is not None] + [s for s in drawn if s.content is None])
        results = [(Proxy(str(s.node)), _fitres(s)) for s in sent if s.content is not None]
        failures = [(Proxy(str(s.node)), _fitres(s)) for s in sent if s.content is None]
        valid = [s for s in sent if s.valid]
        if len(valid) < 2:
            with pytest.raises(RuntimeError, match=TOO_FEW):
                strategy.aggregate_fit(1, results, failures)
            continue
        params, _ = strategy.aggregate_fit(1, results, failures)
        metrics = strategy.server_metrics[1]
        expected, _ = strategy.aggregate_fit(1, [(Proxy(str(s.node)), _fitres(s, reference=True)) for s in valid], [])
        assert metrics["num-valid"] == len(valid) and metrics["num-rejected"] == len(sent) - len(valid)
        for name, got, want in zip(names, parameters_to_ndarrays(params), parameters_to_ndarrays(expected)):
            assert np.all(np.isfinite(got)), name
            np.testing.assert_array_equal(got, want, err_msg=f"{name}: {[s.label for s in sent]}")


# ---------------------------------------------------------------------------- properties

@pytest.fixture
def property_strategy(tmp_path: Path) -> tuple[FedFiOT, FedFiOT | None, Path]:
    """One capping strategy and its uncapped twin for every generated example (hypothesis reuses
    function-scoped fixtures)."""
    results = tmp_path / "results.json"
    return make_strategy("bn", CONFIGS["default"], results), uncapped_twin("bn", CONFIGS["default"], results), results


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    plan=st.lists(
        st.tuples(st.integers(1, 5), st.sampled_from(["honest", "error", *CORRUPTIONS])),
        min_size=1, max_size=7,
    ),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_mix_of_corruptions_merges_exactly_the_valid_replies(
    plan: list[tuple[int, str]], seed: int, property_strategy: tuple[FedFiOT, FedFiOT | None, Path]
) -> None:
    strategy, twin, results = property_strategy
    rng = np.random.default_rng(seed)
    sent = []
    for node, label in plan:
        up = honest_upload(TinyBN(), rng)
        if label == "honest":
            sent.append(Sent(node, up.pack(), True, label))
        elif label == "error":
            sent.append(Sent(node, None, False, label))
        else:
            sent.append(corrupt(label, up, rng, node))
    check_round(strategy, mark_duplicates(sent, capped=twin is not None), results, twin)
