"""The broadcast model as an alignment reference in round 1 (``FedFiOTConfig.broadcast_in_round_one``),
and the aggregator's merge (:meth:`FedFiOTAggregator.merge`) that :meth:`~FedFiOTAggregator.aggregate` reports."""

from __future__ import annotations

import numpy as np
import pytest
from _fedfiot_helpers import SHAPES, SPEC, client_uploads, packed

from fedfiot_flwr import FedFiOTConfig, SweepGrid
from fedfiot_flwr.server.aggregators import FedFiOTAggregator, RoundContext
from fedfiot_flwr.server.outcome import RoundOutcome
from fedfiot_flwr.server.selection import Candidate
from fedfiot_flwr.server.uploads import CollectedUploads, collect_uploads

GRID = SweepGrid(rhos=(0.3, 0.7), lams=(1e-4,), references=("largest", "broadcast"))


def _uploads(seed: int = 2) -> CollectedUploads:
    return collect_uploads([(str(i), packed(w, f, n)) for i, (w, f, n) in enumerate(client_uploads(3, seed=seed))],
                           None)


def _broadcast(uploads: CollectedUploads) -> dict[str, np.ndarray]:
    """A shared start the clients moved away from: their mean plus a little noise."""
    rng = np.random.default_rng(7)
    return {k: (np.mean([w[k] for w in uploads.weights], axis=0) + 0.1 * rng.normal(size=s)).astype(np.float32)
            for k, s in SHAPES.items()}


def _validate(target: dict[str, np.ndarray]):  # noqa: ANN202
    def validate(model: dict[str, np.ndarray]) -> dict[str, float]:
        return {"accuracy": -float(sum(np.sum((model[k] - target[k]) ** 2) for k in SHAPES))}

    return validate


def _merge(config: FedFiOTConfig, server_round: int, uploads: CollectedUploads) -> RoundOutcome:
    broadcast = _broadcast(uploads)
    context = RoundContext(server_round, broadcast=broadcast, validate=_validate(broadcast))
    return FedFiOTAggregator(SPEC, config).aggregate(uploads, context)


def test_the_sweep_keeps_the_broadcast_reference_in_round_one_only_when_asked() -> None:
    default = Candidate(0.5, 1e-4)
    assert {c.reference for c in GRID.candidates(default, 1)} == {"largest"}
    assert GRID.candidates(default, 1, broadcast_in_round_one=True) == GRID.candidates(default, 2)
    assert GRID.candidates(Candidate(0.5, 1e-4, "broadcast"), 1, broadcast_in_round_one=True)[0].reference == "broadcast"


def test_round_one_with_the_option_tries_what_round_two_tries() -> None:
    uploads = _uploads()
    offered = _merge(FedFiOTConfig.paper(sweep=GRID, max_iters=3, broadcast_in_round_one=True), 1, uploads)
    later = _merge(FedFiOTConfig.paper(sweep=GRID, max_iters=3), 2, uploads)
    plain = _merge(FedFiOTConfig.paper(sweep=GRID, max_iters=3), 1, uploads)
    assert {t["reference"] for t in offered.trials} == {"largest", "broadcast"}
    assert {t["reference"] for t in plain.trials} == {"largest"}
    assert offered.candidate == later.candidate and len(offered.trials) == len(later.trials) == 5
    for k in SHAPES:
        np.testing.assert_array_equal(offered.model[k], later.model[k])


def test_a_broadcast_default_without_a_sweep_stays_broadcast_with_the_option() -> None:
    uploads = _uploads(seed=3)
    once = {"sweep": None, "reference": "broadcast", "max_iters": 3}
    assert _merge(FedFiOTConfig.paper(**once, broadcast_in_round_one=True), 1, uploads).candidate.reference == "broadcast"
    assert _merge(FedFiOTConfig.paper(**once), 1, uploads).candidate.reference == "largest"


def test_the_option_is_off_in_both_presets_and_recorded() -> None:
    for config in (FedFiOTConfig.paper(), FedFiOTConfig.default()):
        assert config.broadcast_in_round_one is False
        assert config.as_dict()["broadcast_in_round_one"] is False
    assert FedFiOTConfig.default(broadcast_in_round_one=True).as_dict()["broadcast_in_round_one"] is True


def test_aggregate_reports_the_aggregators_merge() -> None:
    uploads = _uploads(seed=4)
    config = FedFiOTConfig.default(sweep=GRID, max_iters=3, broadcast_in_round_one=True)
    broadcast = _broadcast(uploads)
    context = RoundContext(1, broadcast=broadcast, validate=_validate(broadcast))
    aggregator = FedFiOTAggregator(SPEC, config)
    merged, reported = aggregator.aggregate(uploads, context), aggregator.aggregate(uploads, context)
    for k in SHAPES:
        np.testing.assert_array_equal(merged.model[k], reported.model[k])
    cand = merged.candidate
    assert reported.chosen == {"rho": cand.rho, "lam": cand.lam, "reference": cand.reference,
                               "fisher_scaling": cand.fisher_scaling, "variant": merged.variant}
    untimed = [[{k: v for k, v in t.items() if k != "merge_seconds"} for t in trials]
               for trials in (reported.record["trials"], merged.trials)]
    assert untimed[0] == untimed[1] and len(merged.trials) > 1
    assert reported.metrics["alignment-moved-fraction"] == pytest.approx(list(merged.engine_result.fraction_permuted))
