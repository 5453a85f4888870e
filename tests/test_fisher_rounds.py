"""Many rounds: after its Fisher rounds FedFiOT averages by client size and the clients skip the Fisher pass."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, Parameters, Status, ndarrays_to_parameters
from torch.utils.data import DataLoader, TensorDataset

from _fedfiot_helpers import SPEC, answer, client_uploads, configure_round, one_torch_thread, task_identity  # noqa: F401
from fedfiot_flwr import FedFiOT, FedFiOTConfig, FedFiOTLegacy, fisher_reply
from fedfiot_flwr.baselines.averaging import size_weighted_average
from fedfiot_flwr.options import DEFAULT_FISHER_ROUNDS, FISHER_CONFIG_KEY
from fedfiot_flwr.server.legacy_envelope import reply_to_ndarrays
from fedfiot_flwr.wire import decode_reply, pack_reply


def test_the_default_hands_over_after_its_fisher_rounds_and_the_paper_never_does() -> None:
    assert FedFiOTConfig.default().fisher_rounds == DEFAULT_FISHER_ROUNDS
    assert FedFiOTConfig.paper().fisher_rounds is None
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="fisher_rounds"):
            FedFiOTConfig.default(fisher_rounds=bad)
    assert "from round 4 on, the size-weighted average" in FedFiOTConfig.default(fisher_rounds=3, round_choice="none").describe(False)
    assert "size-weighted" not in FedFiOTConfig.paper().describe(False)


def _round(strategy: FedFiOT, server_round: int, with_fisher: bool) -> tuple[dict, list, dict]:
    """One round of three clients: the config each got, the uploads sent, and the returned model."""
    sent = configure_round(strategy, [1, 2, 3], server_round=server_round)
    uploads = client_uploads(3, seed=server_round)
    replies = [answer(sent[node], pack_reply(w, f if with_fisher else {}, n, {"train-loss": 1.0}))
               for node, (w, f, n) in zip(sorted(sent), uploads)]
    arrays, _ = strategy.aggregate_train(server_round, replies)
    configs = {node: dict(msg.content["config"]) for node, msg in sent.items()}
    return configs, uploads, ({} if arrays is None else {k: v.numpy() for k, v in arrays.items()})


def test_after_the_fisher_rounds_the_round_is_fedavg_of_weight_only_replies() -> None:
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(fisher_rounds=1, max_iters=2, round_choice="none"))
    configs, _, _ = _round(strategy, 1, with_fisher=True)
    assert all(c[FISHER_CONFIG_KEY] is True for c in configs.values())
    assert strategy.server_metrics[1]["fisher-used"] == 1
    configs, uploads, model = _round(strategy, 2, with_fisher=False)
    assert all(c[FISHER_CONFIG_KEY] is False for c in configs.values())
    assert strategy.server_metrics[2]["fisher-used"] == 0
    # the 16-bit weights the clients sent, averaged by size
    decoded = [decode_reply(pack_reply(w, {}, n), "weights", client=f"c{i}", expected_shapes=None).weights
               for i, (w, _, n) in enumerate(uploads)]
    expected = size_weighted_average(decoded, [n for _, _, n in uploads])
    for name, value in expected.items():
        np.testing.assert_allclose(model[name], value, rtol=1e-6, atol=1e-7)
    assert strategy.reports[-1]["strategy"] == "FedFiOT"


def test_a_client_that_ignores_the_flag_still_counts_and_a_fisher_round_refuses_weights_alone() -> None:
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(fisher_rounds=1, max_iters=2), min_train_nodes=3)
    with pytest.raises(RuntimeError, match="Fisher"):
        _round(strategy, 1, with_fisher=False)  # a Fisher round without a Fisher: every client is excluded
    _, uploads, model = _round(strategy, 2, with_fisher=True)  # the Fisher is sent anyway: not needed, not refused
    assert strategy.server_metrics[2]["num-valid"] == 3 and model


def test_the_paper_preset_merges_with_the_fisher_in_every_round() -> None:
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.paper(max_iters=2, sweep=None))
    for server_round in (1, 2, 5):
        configs, _, _ = _round(strategy, server_round, with_fisher=True)
        assert all(c[FISHER_CONFIG_KEY] is True for c in configs.values())
        assert strategy.server_metrics[server_round]["fisher-used"] == 1


def test_fisher_reply_skips_the_pass_when_the_round_does_not_use_it(one_torch_thread: None) -> None:  # noqa: F811
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    loader = DataLoader(TensorDataset(torch.randn(12, 4), torch.arange(12) % 3), batch_size=4)
    def decoded(content, kind: str):  # noqa: ANN001, ANN202
        return decode_reply(content, kind, client="c", expected_shapes=None)

    with_f = decoded(fisher_reply(model, loader, config={FISHER_CONFIG_KEY: True}, device="cpu"), "fisher")
    default = decoded(fisher_reply(model, loader, device="cpu"), "fisher")
    without = fisher_reply(model, loader, config={FISHER_CONFIG_KEY: False}, device="cpu")
    assert set(with_f.fisher) == set(default.fisher) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    weights_only = decoded(without, "weights")
    assert not weights_only.fisher
    for name in with_f.weights:
        np.testing.assert_array_equal(weights_only.weights[name], with_f.weights[name])
    with pytest.raises(ValueError, match="Fisher"):
        decoded(without, "fisher")


def test_the_legacy_strategy_tells_its_clients_too() -> None:
    from flwr.server.client_manager import SimpleClientManager
    from flwr.server.client_proxy import ClientProxy

    class Proxy(ClientProxy):
        def get_properties(self, *a, **k): ...  # noqa: ANN002, ANN003, ANN202, D102
        def get_parameters(self, *a, **k): ...  # noqa: ANN002, ANN003, ANN202, D102
        def fit(self, *a, **k): ...  # noqa: ANN002, ANN003, ANN202, D102
        def evaluate(self, *a, **k): ...  # noqa: ANN002, ANN003, ANN202, D102
        def reconnect(self, *a, **k): ...  # noqa: ANN002, ANN003, ANN202, D102

    manager = SimpleClientManager()
    for cid in ("a", "b"):
        manager.register(Proxy(cid))
    strategy = FedFiOTLegacy(spec=SPEC, config=FedFiOTConfig.default(fisher_rounds=2), min_fit_clients=2,
                             min_available_clients=2)
    (w, _, _), = client_uploads(1)
    params = ndarrays_to_parameters(list(w.values()))
    for server_round, wanted in ((2, True), (3, False)):
        instructions = strategy.configure_fit(server_round, params, manager)
        assert [ins.config[FISHER_CONFIG_KEY] for _, ins in instructions] == [wanted, wanted]
    # a weights-only legacy reply is averaged after the Fisher rounds
    uploads = client_uploads(2, seed=7)
    results = [(Proxy(str(i)), FitRes(Status(Code.OK, ""), Parameters(tensors=[], tensor_type="numpy.ndarray"), n, {}))
               for i, (_, _, n) in enumerate(uploads)]
    for (_, res), (weights, _, n) in zip(results, uploads):
        res.parameters = ndarrays_to_parameters(reply_to_ndarrays(pack_reply(weights, {}, n)))
    params_out, _ = strategy.aggregate_fit(3, results, [])
    assert params_out is not None


@pytest.mark.slow
def test_the_many_round_benchmark_runs_its_smallest_setting(tmp_path: Path, one_torch_thread: None) -> None:  # noqa: F811
    from benchmarks import many_rounds

    many_rounds.main(["--quick", "--rounds", "3", "--out", str(tmp_path), "--name", "mr", "--no-plots",
                      "--methods", "fedavg", "fedfiot", "fedfiot-r1"])
    data = json.loads((tmp_path / "mr.json").read_text())
    recs = {(r["method"], r["round"]): r for r in data["records"]}
    assert {m for m, _ in recs} == {"fedavg", "fedfiot", "fedfiot-r1"} and {r for _, r in recs} == {0, 1, 2, 3}
    # round 0 is the same initial model for every method
    assert len({recs[(m, 0)]["test_accuracy"] for m in ("fedavg", "fedfiot", "fedfiot-r1")}) == 1
    assert [recs[("fedfiot-r1", r)]["fisher_used"] for r in (1, 2, 3)] == [1, 0, 0]
    # weights alone after the Fisher rounds: about half the bytes of weights and Fisher
    assert recs[("fedfiot-r1", 3)]["bytes_received"] < 0.6 * recs[("fedfiot-r1", 1)]["bytes_received"]
    # the clients' choice: round 1's evaluation carries the merge and FedAvg of the same uploads to every node;
    # once handed over, a round sends what FedAvg's sends
    assert recs[("fedfiot", 1)]["clients_kept_merge"] in (0, 1) and recs[("fedavg", 1)]["clients_kept_merge"] is None
    for r in (1, 2, 3):
        own, base = recs[("fedfiot", r)]["bytes_sent"], recs[("fedavg", r)]["bytes_sent"]
        assert own > base if recs[("fedfiot", r)]["clients_kept_merge"] is not None else own == base
    assert all(0 <= recs[k]["test_accuracy"] <= 100 and recs[k]["test_loss"] > 0 for k in recs)
    assert "| fedfiot − fedavg |" in (tmp_path / "mr.md").read_text()


@pytest.mark.parametrize(("preset", "key", "expected"), [("default", -1, DEFAULT_FISHER_ROUNDS), ("paper", -1, None),
                                                         ("default", 0, None), ("paper", 5, 5)])
def test_the_run_config_key_reaches_the_strategy(preset: str, key: int, expected: int | None) -> None:
    from fedfiot_flwr.app_config import AppConfig
    from server_app import fedfiot_config

    cfg = AppConfig.from_run_config({"preset": preset, "fisher-rounds": key})
    assert fedfiot_config(cfg).fisher_rounds == expected


def test_the_hand_over_average_does_not_depend_on_the_order_replies_arrive_in() -> None:
    models = []
    for order in ([0, 1, 2], [2, 0, 1]):
        strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(fisher_rounds=1, round_choice="none"))
        sent = configure_round(strategy, [1, 2, 3], server_round=2)
        uploads = client_uploads(3, seed=5)
        nodes = sorted(sent)
        replies = [answer(sent[nodes[i]], pack_reply(uploads[i][0], {}, uploads[i][2])) for i in order]
        arrays, _ = strategy.aggregate_train(2, replies)
        models.append({k: v.numpy() for k, v in arrays.items()})
    for name in models[0]:
        np.testing.assert_array_equal(models[0][name], models[1][name])
