"""The round reports how close the clients still are to the broadcast model, and says it in words once."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from _fedfiot_helpers import SPEC, answer, client_uploads, configure_round, packed, task_identity  # noqa: F401
from fedfiot_flwr import FedFiOT, FedFiOTConfig
from fedfiot_flwr.server.closeness import CLOSE_COSINE, broadcast_cosines, describe_closeness


def _round(strategy: FedFiOT, server_round: int, broadcast: dict, spread: float) -> None:
    """Three clients that moved ``spread`` (relative) away from ``broadcast``."""
    sent = configure_round(strategy, [1, 2, 3], broadcast=broadcast, server_round=server_round)
    rng = np.random.default_rng(server_round)
    replies = []
    for node, (_, fisher, n) in zip(sorted(sent), client_uploads(3)):
        moved = {k: (v + spread * np.abs(v).mean() * rng.normal(size=v.shape)).astype(np.float32)
                 for k, v in broadcast.items()}
        replies.append(answer(sent[node], packed(moved, fisher, n)))
    strategy.aggregate_train(server_round, replies)


def test_cosines_are_per_layer_means_over_clients() -> None:
    rng = np.random.default_rng(0)
    ref = {"a": rng.normal(size=(4, 3)), "b": rng.normal(size=(2, 4))}
    clients = [ref, {"a": -ref["a"], "b": 2 * ref["b"]}]
    cos = broadcast_cosines(clients, ref, ["a", "b"])
    assert cos == pytest.approx({"a": 0.0, "b": 1.0})
    assert describe_closeness({"a": 0.99, "b": 0.97}) is not None
    assert describe_closeness({"a": 0.99, "b": CLOSE_COSINE}) is None


def test_close_clients_get_one_plain_line_and_far_ones_none(caplog: pytest.LogCaptureFixture) -> None:
    (broadcast, _, _), = client_uploads(1, seed=11)
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.paper(max_iters=2, sweep=None))
    with caplog.at_level(logging.INFO, logger="flwr"):
        _round(strategy, 1, broadcast, spread=2.0)  # far from the broadcast model
        far = strategy.server_metrics[1]["client-broadcast-cosine"]
        _round(strategy, 2, broadcast, spread=0.01)
        _round(strategy, 3, broadcast, spread=0.01)
    close = strategy.server_metrics[2]["client-broadcast-cosine"]
    weight_layers = [n for n in SPEC.names if broadcast[n].ndim >= 2]
    assert len(far) == len(close) == len(weight_layers)
    assert max(far) < CLOSE_COSINE < min(close) <= 1.0
    lines = [r.getMessage() for r in caplog.records if "alignment has little to find" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("FedFiOT round 2:")
    assert strategy.reports[1]["client_broadcast_cosine"].keys() == set(weight_layers)
