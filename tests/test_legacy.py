"""The legacy-API twin (``flwr.server.strategy``): ``aggregate_fit`` over ``FitRes`` runs the
Message-API strategy's round (decoding, validation, exclusion, aggregator)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pytest
import torch
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import SHAPES, SPEC, client_uploads, packed, reply
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from fedfiot_flwr import FedFiOT, FedFiOTConfig, FedFiOTLegacy
from fedfiot_flwr.client import train_and_pack
from fedfiot_flwr.merge import merge
from fedfiot_flwr.server.legacy_envelope import fitres_to_reply, ndarrays_to_reply, reply_to_ndarrays
from fedfiot_flwr.server.shell import arrays_to_numpy
from fedfiot_flwr.wire import unpack_reply

PAPER_ONCE = FedFiOTConfig.paper(sweep=None)

NAMES = list(SHAPES)


class Proxy(ClientProxy):
    """A connected client that is sampled but never called (the round's results are built by the test)."""

    def _never_called(self, *args: object, **kwargs: object) -> None:
        raise AssertionError(f"client {self.cid} was called; the test answers for it")

    get_properties = get_parameters = fit = evaluate = reconnect = _never_called


def _sampled(strategy: FedFiOTLegacy, cids: Iterable[str],
             broadcast: Mapping[str, np.ndarray] | None = None) -> dict[str, ClientProxy]:
    """Round 1's ``initialize_parameters`` and ``configure_fit`` on a client manager holding ``cids``.

    The global model is ``broadcast`` (default: the strategy's own ``initial_parameters``).
    Returns the sampled clients by id; each got the global model.
    """
    manager = SimpleClientManager()
    for cid in cids:
        manager.register(Proxy(cid))
    if broadcast is None:
        params = strategy.initialize_parameters(manager)
    else:
        params = ndarrays_to_parameters(list(broadcast.values()))
    assert params is not None
    sampled = strategy.configure_fit(1, params, manager)
    for _, ins in sampled:
        assert ins.parameters == params
    return {proxy.cid: proxy for proxy, _ in sampled}


def _fitres(content, n: int = 10) -> FitRes:
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(reply_to_ndarrays(content)), n, {})


def _to_dict(params: Parameters) -> dict[str, np.ndarray]:
    return dict(zip(NAMES, parameters_to_ndarrays(params)))


def test_payload_round_trip_keeps_the_reply() -> None:
    (w, f, n), = client_uploads(1)
    content = packed(w, f, n)
    nd = reply_to_ndarrays(content)
    assert len(nd) == 1 and nd[0].dtype == np.uint8
    back = unpack_reply(ndarrays_to_reply(nd))
    ref = unpack_reply(content)
    assert back.num_examples == ref.num_examples == n
    for k in SHAPES:
        np.testing.assert_array_equal(back.weights[k], ref.weights[k])
        np.testing.assert_array_equal(back.fisher[k], ref.fisher[k])
    with pytest.raises(ValueError, match="exactly one uint8 array"):
        ndarrays_to_reply([np.zeros(3, np.float32)], "c9")
    with pytest.raises(ValueError, match="c9"):
        ndarrays_to_reply([np.frombuffer(b"\xff\x00garbage", np.uint8)], "c9")
    assert unpack_reply(fitres_to_reply(_fitres(content), "c1")).num_examples == n
    with pytest.raises(ValueError, match="c2.*FIT_NOT_IMPLEMENTED"):
        fitres_to_reply(FitRes(Status(Code.FIT_NOT_IMPLEMENTED, "no"), Parameters([], ""), 0, {}), "c2")


def test_aggregate_fit_matches_message_api_and_excludes_broken_fitres() -> None:
    from _fedfiot_helpers import corrupt_missing_fisher, corrupt_nan_fisher

    uploads = client_uploads(4, seed=7)
    contents = [packed(w, f, n) for w, f, n in uploads[:3]]
    w, f, n = uploads[3]
    wrong = packed({**w, "fc2.weight": np.zeros((5, 7), np.float32)}, {**f, "fc2.weight": np.zeros((5, 7), np.float32)}, n)
    broadcast = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    legacy = FedFiOTLegacy(spec=SPEC, names=NAMES, config=PAPER_ONCE, fedavg_baseline=False,
                           fit_metrics_aggregation_fn=lambda pairs: {"clients": len(pairs)})
    # Round 1 as Flower's legacy server runs it: configure_fit sends the zero model to every client.
    clients = _sampled(legacy, ["a", "nan", "b", "shape", "nofisher", "garbage", "c", "status"], broadcast)
    assert len(clients) == 8
    results = [
        (clients["a"], _fitres(contents[0])),
        (clients["nan"], _fitres(corrupt_nan_fisher(packed(w, f, n), "fc1.weight"))),
        (clients["b"], _fitres(contents[1])),
        (clients["shape"], _fitres(wrong)),  # checked against the broadcast model's shapes
        (clients["nofisher"], _fitres(corrupt_missing_fisher(packed(w, f, n), "fc2.bias"))),
        (clients["garbage"], FitRes(Status(Code.OK, ""), ndarrays_to_parameters([np.arange(4.0)]), 5, {})),
        (clients["c"], _fitres(contents[2])),
    ]
    failures = [RuntimeError("connection lost"),
                (clients["status"], FitRes(Status(Code.FIT_NOT_IMPLEMENTED, "nope"), Parameters([], ""), 0, {}))]
    params, metrics = legacy.aggregate_fit(1, results, failures)
    got = _to_dict(params)

    ups = [unpack_reply(c) for c in contents]
    expected = merge([u.weights for u in ups], [u.fisher for u in ups], SPEC, num_examples=[u.num_examples for u in ups])
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected.model[k], rtol=1e-6, atol=1e-7)

    # same answer as the Message-API strategy on the same contents
    message_api = FedFiOT(spec=SPEC, config=PAPER_ONCE, fedavg_baseline=False)
    arrays, _ = message_api.aggregate_train(1, [reply(i + 1, c) for i, c in enumerate(contents)])
    for k, v in arrays_to_numpy(arrays).items():
        np.testing.assert_array_equal(got[k], v)

    assert metrics == {"clients": 3}  # the user's fit_metrics_aggregation_fn, as in FedAvg
    server = legacy.server_metrics[1]
    assert server["num-valid"] == 3 and server["num-rejected"] == 6
    reasons = {r["client"]: r["reason"] for r in legacy.reports[0]["rejected"]}
    assert {"nan", "shape", "nofisher", "garbage", "status", "?"} <= set(reasons)
    assert "fc1.weight" in reasons["nan"] and "fc2.weight" in reasons["shape"] and "fc2.bias" in reasons["nofisher"]
    assert "connection lost" in reasons["?"] and "nope" in reasons["status"]


def test_legacy_twin_on_a_tiny_torch_model_with_selection() -> None:
    torch.manual_seed(0)

    def make() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    global_model = make()
    names = list(global_model.state_dict())
    x = torch.randn(48, 4)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    init = ndarrays_to_parameters([v.numpy() for v in global_model.state_dict().values()])

    calls = []

    def validate_fn(model):
        assert list(model) == names
        m = make()
        m.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in model.items()})
        with torch.no_grad():
            logits = m(x)
        acc = float((logits.argmax(1) == y).float().mean())
        calls.append(acc)
        return {"accuracy": acc, "loss": float(torch.nn.functional.cross_entropy(logits, y))}

    legacy = FedFiOTLegacy(model=global_model, validate_fn=validate_fn, min_fit_clients=3, config=FedFiOTConfig.paper(),
                           initial_parameters=init)
    clients = _sampled(legacy, ["n0", "n1", "n2"])
    results = []
    for k in range(3):
        model = make()
        model.load_state_dict(global_model.state_dict())
        part = slice(16 * k, 16 * (k + 1))
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[part], y[part]), batch_size=8)
        content = train_and_pack(model, loader, 2, device="cpu")
        results.append((clients[f"n{k}"], _fitres(content, 16)))
    params, _ = legacy.aggregate_fit(1, results, [])
    assert len(parameters_to_ndarrays(params)) == len(names)
    server = legacy.server_metrics[1]
    assert server["num-trials"] == 18  # the paper's 6 x 3 grid, "broadcast" skipped in round 1
    assert server["val-accuracy"] == pytest.approx(max(calls[:18]))
    assert "fedavg-val-accuracy" in server and isinstance(server["alignment-moved-fraction"], list)
