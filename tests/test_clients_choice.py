"""The clients' choice: each round's evaluation step scores the merge and FedAvg of the same uploads; the better goes on."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict

from _fedfiot_helpers import SPEC, FakeGrid, client_uploads, one_torch_thread, task_identity, zeros_model  # noqa: F401
from fedfiot_flwr import FedFiOT, FedFiOTConfig
from fedfiot_flwr.baselines.averaging import size_weighted_average
from fedfiot_flwr.options import CANDIDATE_CONFIG_KEY, FISHER_CONFIG_KEY
from fedfiot_flwr.server.shell import arrays_to_numpy, numpy_to_arrays
from fedfiot_flwr.wire import decode_reply, pack_reply

NODES = [1, 2, 3]
UPLOADS = client_uploads(3, seed=4)

Scorer = Callable[[dict[str, np.ndarray], ConfigRecord], dict[str, float]]


def fedavg_of_uploads() -> dict[str, np.ndarray]:
    """FedAvg of :data:`UPLOADS` as the server decodes them (16-bit weights, averaged by size)."""
    decoded = [decode_reply(pack_reply(w, f, n), "fisher", client=str(i), expected_shapes=None).weights
               for i, (w, f, n) in enumerate(UPLOADS)]
    return size_weighted_average(decoded, [n for _, _, n in UPLOADS])


def closeness_to(target: dict[str, np.ndarray]) -> Scorer:
    """Clients whose accuracy is higher the closer a model is to ``target``."""
    def score(model: dict[str, np.ndarray], config: ConfigRecord) -> dict[str, float]:
        distance = sum(float(np.sum((model[k] - target[k]) ** 2)) for k in target)
        return {"eval-accuracy": 1.0 / (1.0 + distance), "eval-loss": distance}
    return score


class Federation:
    """Three nodes that send :data:`UPLOADS` every round (weights alone when told to skip the Fisher) and
    evaluate with ``scorer``; it keeps what was sent."""

    def __init__(self, scorer: Scorer, broken_twin: int | None = None) -> None:
        self.scorer = scorer
        self.broken_twin = broken_twin
        self.train_configs: dict[int, list[dict]] = {}
        self.evaluations: dict[int, list[tuple[int, str]]] = {}
        self.grid = FakeGrid(NODES, self.answer)

    def answer(self, node: int, msg: Message) -> Message:
        config = msg.content["config"]
        server_round = int(config["server-round"])
        if msg.metadata.message_type == MessageType.TRAIN:
            self.train_configs.setdefault(server_round, []).append(dict(config))
            w, f, n = UPLOADS[NODES.index(node)]
            return Message(pack_reply(w, f if config.get(FISHER_CONFIG_KEY, True) else {}, n, {"train-loss": 1.0}),
                           reply_to=msg)
        candidate = str(config.get(CANDIDATE_CONFIG_KEY, "merge"))
        self.evaluations.setdefault(server_round, []).append((node, candidate))
        if candidate == "fedavg" and node == self.broken_twin:
            return Message(Error(code=0, reason="evaluation failed"), reply_to=msg)
        metrics = self.scorer(arrays_to_numpy(msg.content["arrays"]), config)
        return Message(RecordDict({"metrics": MetricRecord({**metrics, "num-examples": 10 * node})}), reply_to=msg)


def run(strategy: FedFiOT, fed: Federation, rounds: int) -> dict[int, dict[str, np.ndarray]]:
    """Flower's ``start`` loop; returns the global model ``evaluate_fn`` saw each round."""
    seen: dict[int, dict[str, np.ndarray]] = {}

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        seen[server_round] = arrays_to_numpy(arrays)
        return MetricRecord({})

    strategy.start(fed.grid, numpy_to_arrays(zeros_model()), num_rounds=rounds, evaluate_fn=evaluate_fn)
    return seen


def strategy(**changes: object) -> FedFiOT:
    return FedFiOT(spec=SPEC, config=FedFiOTConfig.default(max_iters=2, **changes), min_available_nodes=3)


def test_clients_that_prefer_fedavg_get_it_and_after_two_such_rounds_the_curvature_pass_stops() -> None:
    fedavg = fedavg_of_uploads()
    fed = Federation(closeness_to(fedavg))
    s = strategy()
    seen = run(s, fed, rounds=4)
    for r in (1, 2):
        assert sorted(fed.evaluations[r]) == sorted([(n, c) for n in NODES for c in ("merge", "fedavg")])
        assert s.server_metrics[r]["clients-kept-merge"] == 0
        for name, value in fedavg.items():  # the round's global model is FedAvg of the same uploads
            np.testing.assert_allclose(seen[r][name], value, rtol=1e-6, atol=1e-7)
        assert s.reports[r - 1]["clients_choice"]["kept"] == "fedavg"
    assert all(c[FISHER_CONFIG_KEY] is True for r in (1, 2) for c in fed.train_configs[r])
    # handed over: the clients skip the pass, one evaluate message per node
    assert all(c[FISHER_CONFIG_KEY] is False for r in (3, 4) for c in fed.train_configs[r])
    assert sorted(fed.evaluations[3]) == [(n, "merge") for n in NODES]
    assert s.server_metrics[3]["fisher-used"] == 0 and "clients-kept-merge" not in s.server_metrics[3]


def test_clients_that_prefer_the_merge_keep_it_every_round() -> None:
    fedavg = fedavg_of_uploads()
    fed = Federation(lambda model, config: {"eval-accuracy": 0.5 if config.get(CANDIDATE_CONFIG_KEY) else 0.9,
                                            "eval-loss": 1.0})
    s = strategy()
    seen = run(s, fed, rounds=3)
    assert [s.server_metrics[r]["clients-kept-merge"] for r in (1, 2, 3)] == [1, 1, 1]
    assert all(c[FISHER_CONFIG_KEY] is True for r in (1, 2, 3) for c in fed.train_configs[r])
    assert any(not np.allclose(seen[3][k], fedavg[k]) for k in fedavg)  # the merge, not FedAvg
    assert s.server_metrics[3]["clients-merge-score"] == pytest.approx(0.9)
    assert s.history.evaluate_metrics_clientapp[3]["eval-accuracy"] == pytest.approx(0.9)  # the chosen model's


def test_a_loss_decides_when_the_clients_report_no_accuracy_and_only_paired_nodes_count() -> None:
    fedavg = fedavg_of_uploads()
    closer = closeness_to(fedavg)
    fed = Federation(lambda model, config: {"eval-loss": closer(model, config)["eval-loss"]}, broken_twin=2)
    s = strategy()
    run(s, fed, rounds=1)
    assert s.server_metrics[1]["clients-kept-merge"] == 0
    assert s.reports[0]["clients_choice"]["key"] == "eval-loss" and s.server_metrics[1]["clients-choice-nodes"] == 2


def test_without_a_score_the_merge_goes_on_and_a_warning_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    fed = Federation(lambda model, config: {"seconds": 1.0})
    s = strategy()
    with caplog.at_level("WARNING"):
        run(s, fed, rounds=2)
    assert sum("no node scored both" in r.getMessage() for r in caplog.records) == 1
    assert all(c[FISHER_CONFIG_KEY] is True for c in fed.train_configs[2])


def test_without_an_evaluation_step_the_fixed_fisher_rounds_apply_and_the_paper_never_asks() -> None:
    s = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(fisher_rounds=1), fraction_evaluate=0.0)
    assert s.choice is None and s.fedfiot_config.fisher_rounds == 1
    assert "from round 2 on" in s.plan
    paper = FedFiOT(spec=SPEC, config=FedFiOTConfig.paper(max_iters=2), min_available_nodes=3)
    fed = Federation(closeness_to(fedavg_of_uploads()))
    run(paper, fed, rounds=1)
    assert paper.choice is None and sorted(fed.evaluations[1]) == [(n, "merge") for n in NODES]


def curvature_rounds(fed: Federation) -> list[int]:
    """The rounds whose train config asked every client for its curvature."""
    return sorted(r for r, configs in fed.train_configs.items() if all(c[FISHER_CONFIG_KEY] for c in configs))


def test_probe_rounds_ask_for_the_curvature_again_ever_more_rarely_while_fedavg_keeps_winning(
        caplog: pytest.LogCaptureFixture) -> None:
    fed = Federation(closeness_to(fedavg_of_uploads()))
    s = strategy()  # hand over after 2 FedAvg wins, for 2 rounds, then 4, then 8
    with caplog.at_level("INFO"):
        run(s, fed, rounds=11)
    assert curvature_rounds(fed) == [1, 2, 5, 10]
    assert [r for r in range(1, 12) if "clients-kept-merge" in s.server_metrics[r]] == [1, 2, 5, 10]
    said = [r.getMessage() for r in caplog.records]
    assert sum("round 5 asks for the curvature again" in m for m in said) == 2  # the choice's line, the hand-over's
    assert sum("skip the curvature pass" in m and "round 3:" in m for m in said) == 1


def test_a_probe_round_the_merge_wins_ends_the_hand_over() -> None:
    fedavg = fedavg_of_uploads()
    closer = closeness_to(fedavg)

    def scorer(model: dict[str, np.ndarray], config: ConfigRecord) -> dict[str, float]:
        if int(config["server-round"]) < 5:  # FedAvg wins rounds 1-2; from round 5 on the merge does
            return closer(model, config)
        return {"eval-accuracy": 0.5 if config.get(CANDIDATE_CONFIG_KEY) else 0.9}

    fed = Federation(scorer)
    s = strategy()
    run(s, fed, rounds=7)
    assert curvature_rounds(fed) == [1, 2, 5, 6, 7]
    assert [s.server_metrics[r].get("clients-kept-merge") for r in range(1, 8)] == [0, 0, None, None, 1, 1, 1]


def test_without_probes_the_hand_over_is_for_good() -> None:
    fed = Federation(closeness_to(fedavg_of_uploads()))
    s = strategy(reprobe_after=0)
    assert s.fedfiot_config.reprobe_after is None
    assert "probe round" in strategy().plan and "probe round" not in s.plan
    run(s, fed, rounds=6)
    assert curvature_rounds(fed) == [1, 2]


def test_the_hand_over_survives_a_resume() -> None:
    fed = Federation(closeness_to(fedavg_of_uploads()))
    first = strategy()
    run(first, fed, rounds=2)
    resumed = strategy()
    resumed.restore(first.carried_state(), after_round=2)
    assert [resumed.aggregator.wants_fisher(r) for r in (3, 4, 5)] == [False, False, True]  # round 5 probes
    assert strategy().aggregator.wants_fisher(3) is True


@pytest.mark.parametrize(("changes", "field"), [({"round_choice": "server"}, "round_choice"),
                                                ({"handover_after": 0}, "handover_after"),
                                                ({"reprobe_after": -1}, "reprobe_after"),
                                                ({"reprobe_after": True}, "reprobe_after")])
def test_bad_choice_options_are_refused_when_built(changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FedFiOTConfig.default(**changes)


@pytest.mark.parametrize(("preset", "key", "expected"), [("default", "", "clients"), ("paper", "", "none"),
                                                         ("default", "none", "none"), ("paper", "clients", "clients")])
def test_the_run_config_key_reaches_the_strategy(preset: str, key: str, expected: str) -> None:
    from fedfiot_flwr.app_config import AppConfig
    from server_app import fedfiot_config

    assert fedfiot_config(AppConfig.from_run_config({"preset": preset, "round-choice": key})).round_choice == expected
    with pytest.raises(ValueError, match="round-choice"):
        AppConfig.from_run_config({"round-choice": "server"})


@pytest.mark.parametrize(("key", "expected"), [(-1, 2), (0, None), (5, 5)])
def test_the_reprobe_run_config_key_reaches_the_strategy(key: int, expected: int | None) -> None:
    from fedfiot_flwr.app_config import AppConfig
    from server_app import fedfiot_config

    assert fedfiot_config(AppConfig.from_run_config({"reprobe-after": key})).reprobe_after == expected


def test_the_choice_works_with_the_gram_curvature_and_real_fisher_reply_clients(one_torch_thread: None) -> None:  # noqa: F811
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from _fedfiot_helpers import tiny_mlp
    from fedfiot_flwr import fisher_reply

    asked: dict[int, list] = {}

    def client(node: int, msg: Message) -> Message:
        config = msg.content["config"]
        torch.manual_seed(node)
        model = tiny_mlp()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        if msg.metadata.message_type == MessageType.EVALUATE:  # these clients prefer FedAvg's model
            accuracy = 0.8 if config.get(CANDIDATE_CONFIG_KEY) == "fedavg" else 0.6
            return Message(RecordDict({"metrics": MetricRecord({"eval-accuracy": accuracy, "num-examples": 5})}),
                           reply_to=msg)
        asked.setdefault(int(config["server-round"]), []).append(dict(config))
        with torch.no_grad():  # "training": each client moves its own way
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        x = torch.randn(40, 4) + 0.3 * node
        loader = DataLoader(TensorDataset(x, torch.randint(0, 3, (40,))), batch_size=16)
        return Message(fisher_reply(model, loader, {"train-loss": 1.0}, config=config), reply_to=msg)

    from fedfiot_flwr.server.shell import numpy_to_arrays as to_arrays

    torch.manual_seed(0)
    initial = {k: v.numpy() for k, v in tiny_mlp().state_dict().items()}
    s = FedFiOT(spec=SPEC, config=FedFiOTConfig.default(curvature="gram", max_iters=2), min_available_nodes=3)
    s.start(FakeGrid(NODES, client), to_arrays(initial), num_rounds=3)
    assert [s.server_metrics[r]["clients-kept-merge"] for r in (1, 2)] == [0, 0]
    assert all(c[FISHER_CONFIG_KEY] is True and c["fedfiot-curvature"] == "gram" for c in asked[1] + asked[2])
    assert all(c[FISHER_CONFIG_KEY] is False for c in asked[3]) and s.server_metrics[3]["num-valid"] == 3


def test_the_many_round_benchmark_offers_the_hand_over_for_good_next_to_the_default() -> None:
    import torch

    from benchmarks.many_rounds import METHODS, make_strategy

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    built = {m: make_strategy(m, model, 1.0, None) for m in METHODS}
    assert built["fedfiot"].fedfiot_config.reprobe_after == 2
    assert built["fedfiot-for-good"].fedfiot_config.reprobe_after is None
    assert all(built[m].fraction_evaluate == 1.0 for m in METHODS)
