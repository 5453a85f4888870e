"""The Gram curvatures' growth bound: no kept merge has a tensor longer than ``gram_growth`` times the largest
client's norm of it; a grown merge is recorded with the tensor named and never chosen; when every merge grows,
the round is FedAvg of the uploads (which meets the bound) and the server says why; options are validated."""

from __future__ import annotations

import numpy as np
import pytest

from _fedfiot_helpers import SPEC, configure_round, one_torch_thread, task_identity  # noqa: F401
from test_gram_strategy import _replies, _uploads
from fedfiot_flwr import FedFiOT, FedFiOTConfig
from fedfiot_flwr.server.outcome import RoundContext
from fedfiot_flwr.server.selection import sweep_candidates
from fedfiot_flwr.server.uploads import CollectedUploads
from fedfiot_flwr.wire import decode_reply


def _collected() -> CollectedUploads:
    uploads = _uploads(None)
    return CollectedUploads(client_ids=[str(i) for i in range(4)], weights=[u[0] for u in uploads],
                            num_examples=[u[2] for u in uploads], grams=[u[1] for u in uploads])


def _longest(collected: CollectedUploads) -> dict[str, float]:
    return {n: max(float(np.linalg.norm(w[n])) for w in collected.weights) for n in collected.weights[0]}


def _growth(model: dict, longest: dict[str, float]) -> float:
    return max(float(np.linalg.norm(model[n])) / longest[n] for n in longest)


def _validate(model: dict) -> dict[str, float]:  # prefers the merge with the largest weights
    return {"accuracy": float(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in model.values()))}


def test_with_validation_no_kept_merge_grows_beyond_the_bound_and_grown_merges_are_recorded() -> None:
    collected = _collected()
    longest = _longest(collected)
    free = sweep_candidates(collected, SPEC, FedFiOTConfig.default(curvature="gram", gram_growth=None,
                                                                   fedavg_candidate=False).for_server(True),
                            RoundContext(server_round=1, validate=_validate))
    bound = 0.9 * _growth(free.model, longest)  # the unbounded choice grows beyond it
    assert bound >= 1
    config = FedFiOTConfig.default(curvature="gram", gram_growth=bound, fedavg_candidate=False).for_server(True)
    out = sweep_candidates(collected, SPEC, config, RoundContext(server_round=1, validate=_validate))
    grown = [t for t in out.trials if "grown" in t]
    assert grown and all(t["validation"] is None for t in grown)
    assert _growth(out.model, longest) <= bound
    assert out.metrics["merges-grown"] == len(grown) < len(out.trials)
    kept = [t["validation"]["accuracy"] for t in out.trials if "grown" not in t and t["validation"] is not None]
    assert _validate(out.model)["accuracy"] == pytest.approx(max(kept))


def test_without_validation_the_kept_merge_is_within_the_bound() -> None:
    collected = _collected()
    longest = _longest(collected)
    for bound in (1.0, 1.2, 1.5, 3.0):
        out = sweep_candidates(collected, SPEC, FedFiOTConfig.default(curvature="gram", gram_growth=bound)
                               .without_validation(), RoundContext(server_round=1))
        assert _growth(out.model, longest) <= bound + 1e-12
        if out.variant == "fedavg":
            assert all("grown" in t for t in out.trials)


def test_when_every_merge_grows_the_round_is_fedavg_of_the_uploads_and_the_server_says_why(
        caplog: pytest.LogCaptureFixture) -> None:
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(curvature="kfac", fisher_rounds=None, max_iters=3,
                                                                gram_growth=1.0), min_valid_replies=2)
    sent = configure_round(strategy, [1, 2, 3])
    replies = _replies(sent)
    with caplog.at_level("INFO"):
        arrays, _ = strategy.aggregate_train(1, replies)
    decoded = [decode_reply(m.content, "gram-output", client=str(i), expected_shapes=None) for i, m in enumerate(replies)]
    fedavg = CollectedUploads(client_ids=[str(m.metadata.src_node_id) for m in replies],
                              weights=[d.weights for d in decoded], num_examples=[d.num_examples for d in decoded],
                              grams=[d.grams for d in decoded]).fedavg()
    for name, value in fedavg.items():
        np.testing.assert_allclose(arrays[name].numpy(), value, rtol=1e-6, atol=1e-7, err_msg=name)
    metrics = strategy.server_metrics[1]
    assert metrics["merges-grown"] == metrics["num-trials"] >= 1
    text = caplog.text
    assert "every merge grew a tensor beyond 1 times the largest client's norm" in text
    assert text.count("every merge grew a tensor") == 2  # the selection's warning and the round's summary, once each


@pytest.mark.parametrize("bad", [0.5, -1.0, float("inf"), float("nan")])
def test_a_growth_bound_below_one_or_not_finite_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="gram_growth"):
        FedFiOTConfig.default(curvature="gram", gram_growth=bad)


def test_zero_turns_the_bound_off() -> None:
    assert FedFiOTConfig.default(curvature="gram", gram_growth=0).gram_growth is None
