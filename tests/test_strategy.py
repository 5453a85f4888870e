"""The Message-API strategy shell with the FedFiOT aggregator: decode once, exclude, attribute,
select, report server metrics apart from client metrics, and a recorded ``start`` on an in-process Grid."""

from __future__ import annotations

import inspect
import json
import math
import stat

import numpy as np
import pytest
import torch
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import SHAPES, SPEC, FakeGrid, answer, client_uploads, configure_round, packed, reply
from flwr.app import ConfigRecord, Error, Message
from flwr.serverapp.strategy import FedAvg

from fedfiot_flwr import FedFiOT, FedFiOTConfig, SweepGrid
from fedfiot_flwr.app_config import AppConfig, parse_float_list
from fedfiot_flwr.merge import MergeOptions, merge
from fedfiot_flwr.server import RunRecorder
from fedfiot_flwr.server.rounds import jsonable
from fedfiot_flwr.server.selection import Candidate
from fedfiot_flwr.server.shell import arrays_to_numpy, numpy_to_arrays
from fedfiot_flwr.wire import unpack_reply

PAPER_ONCE = FedFiOTConfig.paper(sweep=None)


def _replies(uploads, first_node: int = 1):
    return [reply(first_node + i, packed(w, f, n)) for i, (w, f, n) in enumerate(uploads)]


def _engine_merge(contents, **kw):
    ups = [unpack_reply(c) for c in contents]
    return merge([u.weights for u in ups], [u.fisher for u in ups], SPEC, MergeOptions(**kw),
                 num_examples=[u.num_examples for u in ups])


def test_aggregate_train_equals_engine_merge_and_keeps_client_metric_names() -> None:
    replies = _replies(client_uploads(3, seed=1))
    strategy = FedFiOT(spec=SPEC, config=FedFiOTConfig.paper(lam=1e-3, max_iters=4, sweep=None))
    arrays, train_metrics = strategy.aggregate_train(1, replies)
    expected = _engine_merge([m.content for m in replies], lam=1e-3, rho=0.5, max_iters=4)
    got = arrays_to_numpy(arrays)
    assert list(got) == list(SHAPES)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected.model[k], rtol=1e-6, atol=1e-7)
    # client metrics: the clients' own names, nothing else
    assert dict(train_metrics) == {"train-loss": pytest.approx(1.0)}
    server = strategy.server_metrics[1]
    assert server["num-valid"] == 3 and server["num-rejected"] == 0 and server["bytes-received"] > 0
    assert server["objective-aligned"] == pytest.approx(expected.aligned_objective)
    assert server["objective-identity"] == pytest.approx(expected.identity_objective)
    assert server["kept-aligned"] == int(expected.aligned)
    assert server["alignment-moved-fraction"] == pytest.approx(expected.fraction_permuted)
    report = strategy.reports[0]
    assert isinstance(report["server_metrics"]["inner-iterations"], list)
    assert len(report["server_metrics"]["inner-iterations"]) == len(SPEC.perm_names)


def test_broken_and_duplicate_replies_are_excluded_and_the_merge_equals_that_of_the_valid_ones() -> None:
    from _fedfiot_helpers import corrupt_missing_fisher, corrupt_nan_fisher

    uploads = client_uploads(4, seed=2)
    good = _replies(uploads[:3])
    w, f, n = uploads[3]
    bad_shape = {**w, "fc1.weight": np.zeros((7, 4), np.float32)}
    bad_shape_f = {**f, "fc1.weight": np.zeros((7, 4), np.float32)}
    strategy = FedFiOT(spec=SPEC, config=PAPER_ONCE, fedavg_baseline=False)
    # Round 1 as Flower runs it: the zero model goes to nodes 1-3 and 11-14, their answers come back.
    sent = configure_round(strategy, [1, 2, 3, 11, 12, 13, 14])
    assert sorted(sent) == [1, 2, 3, 11, 12, 13, 14]
    answers = [
        (11, corrupt_nan_fisher(packed(w, f, n), "fc2.weight")),
        (1, good[0].content),
        (12, packed(bad_shape, bad_shape_f, n)),  # checked against the broadcast model's shapes
        (2, good[1].content),
        (13, corrupt_missing_fisher(packed(w, f, n), "fc3.bias")),
        (3, good[2].content),
        (14, Error(code=1, reason="client crashed")),
        (1, packed(w, f, n)),  # a second reply of node 1: the first one counts
    ]
    arrays, _ = strategy.aggregate_train(1, [answer(sent[node], content) for node, content in answers])
    expected = _engine_merge([m.content for m in good])
    got = arrays_to_numpy(arrays)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected.model[k], rtol=1e-6, atol=1e-7)
    assert strategy.server_metrics[1]["num-valid"] == 3 and strategy.server_metrics[1]["num-rejected"] == 5
    rejected = {}
    for r in strategy.reports[0]["rejected"]:
        rejected.setdefault(r["client"], []).append(r["reason"])
    assert set(rejected) == {"1", "11", "12", "13", "14"}
    assert "fc2.weight" in rejected["11"][0] and ("nan" in rejected["11"][0].lower() or "finite" in rejected["11"][0].lower())
    assert "fc1.weight" in rejected["12"][0] and "shape" in rejected["12"][0]
    assert "fc3.bias" in rejected["13"][0]
    assert "client crashed" in rejected["14"][0]
    assert "duplicate" in rejected["1"][0]


def test_replies_are_attributed_to_the_node_the_instruction_went_to() -> None:
    (w, f, n), = client_uploads(1, seed=7)
    strategy = FedFiOT(spec=SPEC, config=PAPER_ONCE, min_valid_replies=1)
    sent = configure_round(strategy, [42, 7])
    error = answer(sent[42], Error(code=2, reason="node lost"))
    error.metadata.__dict__["_src_node_id"] = 0  # what the SuperLink fills in for its own error replies
    strategy.aggregate_train(1, [error, answer(sent[7], packed(w, f, n))])
    assert strategy.reports[0]["rejected"] == [{"client": "42", "reason": "error reply: node lost (code 2)"}]
    assert strategy.reports[0]["clients"] == ["7"]


def test_too_few_valid_replies_fail_the_round_with_a_clear_error() -> None:
    from _fedfiot_helpers import corrupt_nan_fisher

    (w, f, n), (w2, f2, n2) = client_uploads(2)
    replies = [reply(1, packed(w, f, n)), reply(2, corrupt_nan_fisher(packed(w2, f2, n2), "fc1.bias"))]
    strategy = FedFiOT(spec=SPEC, config=PAPER_ONCE, min_train_nodes=2)
    with pytest.raises(RuntimeError, match=r"only 1 valid replies, at least 2 needed.*client 2.*fc1\.bias"):
        strategy.aggregate_train(1, replies)
    assert strategy.reports[0]["failed"] is True and strategy.reports[0]["rejected"][0]["client"] == "2"


def test_selection_keeps_the_candidate_with_the_best_validation_score() -> None:
    replies = _replies(client_uploads(3, seed=3))
    contents = [m.content for m in replies]
    target = {k: np.full(s, 0.05, np.float32) for k, s in SHAPES.items()}

    def score(model) -> float:
        return -float(sum(np.sum((model[k] - target[k]) ** 2) for k in SHAPES))

    seen: list[float] = []

    def validate_fn(model):
        seen.append(score(model))
        return {"accuracy": seen[-1], "loss": -seen[-1]}

    grid = SweepGrid(rhos=(0.2, 1.0), lams=(1e-4, 1e-1), references=("largest", "broadcast"))
    strategy = FedFiOT(spec=SPEC, validate_fn=validate_fn, config=FedFiOTConfig.paper(sweep=grid))
    arrays, _ = strategy.aggregate_train(1, replies)
    # round 1: "broadcast" (the random init) is skipped -> default + 4 grid points, deduplicated
    cands = grid.candidates(Candidate(0.5, 1e-4), 1)
    assert all(c.reference == "largest" for c in cands) and len(cands) == 5
    scores = {c: score(_engine_merge(contents, lam=c.lam, rho=c.rho).model) for c in cands}
    best = max(scores.values())
    server = strategy.server_metrics[1]
    assert scores[Candidate(server["rho"], server["lam"], "largest")] == pytest.approx(best)
    assert server["val-accuracy"] == pytest.approx(best)
    assert score(arrays_to_numpy(arrays)) == pytest.approx(best)
    assert server["num-trials"] == 5 and len(seen) == 5 + 1  # + FedAvg of the same uploads
    assert "fedavg-val-accuracy" in server


def test_sweep_grid_order_dedup_and_broadcast_rule() -> None:
    grid = SweepGrid(rhos=(0.5, 0.7), lams=(1e-4,), references=("largest", "broadcast"))
    default = Candidate(0.5, 1e-4, "largest")
    assert grid.candidates(default, 1) == [default, Candidate(0.7, 1e-4, "largest")]
    r2 = grid.candidates(default, 2)
    assert r2[0] == default and len(r2) == 4 and {c.reference for c in r2} == {"largest", "broadcast"}
    with pytest.raises(ValueError, match="rho"):
        Candidate(1.5, 1e-4)
    with pytest.raises(ValueError, match="reference"):
        Candidate(0.5, 1e-4, "smallest")


def test_validation_selection_prefers_the_identity_merge_when_it_validates_better() -> None:
    replies = _replies(client_uploads(3, seed=4))
    ident = _engine_merge([m.content for m in replies], fallback="none").identity_model

    def validate_fn(model):
        return {"accuracy": -sum(float(np.sum((model[k] - ident[k]) ** 2)) for k in SHAPES)}

    config = FedFiOTConfig.default(sweep=None, fedavg_candidate=False, fisher_cap=None)
    strategy = FedFiOT(spec=SPEC, validate_fn=validate_fn, config=config, fedavg_baseline=False)
    arrays, _ = strategy.aggregate_train(1, replies)
    got = arrays_to_numpy(arrays)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], ident[k], rtol=1e-6)
    assert strategy.server_metrics[1]["kept-aligned"] == 0
    assert strategy.last_round is not None and strategy.last_round.chosen["variant"] == "identity"


def test_defaults_equal_fedavgs_for_every_fedavg_option() -> None:
    ours, flower = FedFiOT(spec=SPEC), FedAvg()
    for name in inspect.signature(FedAvg.__init__).parameters:
        if name == "self":
            continue
        attr = {"train_metrics_aggr_fn": "train_metrics_aggr_fn", "evaluate_metrics_aggr_fn": "evaluate_metrics_aggr_fn"}.get(name, name)
        assert getattr(ours, attr) == getattr(flower, attr), name
    custom = FedFiOT(spec=SPEC, fraction_evaluate=0.25, min_train_nodes=4, weighted_by_key="n")
    assert (custom.fraction_evaluate, custom.min_train_nodes, custom.weighted_by_key) == (0.25, 4, "n")
    assert custom.min_valid_replies == 4


def test_without_validation_one_rule_is_announced_once(caplog) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy = FedFiOT(spec=SPEC)
        strategy.summary()
        strategy.aggregate_train(1, _replies(client_uploads(2, seed=5)))
        strategy.aggregate_train(2, _replies(client_uploads(2, seed=6)))
    notices = [r.getMessage() for r in caplog.records if "no server data" in r.getMessage()]
    assert len(notices) == 1 and "(default)" in notices[0] and "the paper's rule" in notices[0]
    for server_round in (1, 2):  # one merge, kept or not by the objective
        server = strategy.server_metrics[server_round]
        assert server["num-trials"] == 1 and server["kept-aligned"] == server["paper-rule-aligned"]
    assert strategy.requested_config == FedFiOTConfig.default()
    assert not any("fallback" in r.getMessage() for r in caplog.records)


def test_without_validation_the_presets_merge_alike_but_for_the_fisher_cap() -> None:
    """What else tells the presets apart needs validation data (``test_selection_presets``: the
    paper's rule against validation's choice, FedAvg as a candidate, the size-scaled Fisher in the
    grid) or an inflated Fisher (``test_robust_weighting``: the cap)."""
    replies = _replies(client_uploads(3, seed=4))
    merged = {}
    for name, config in (("paper", FedFiOTConfig.paper()), ("default", FedFiOTConfig.default(fisher_cap=None))):
        strategy = FedFiOT(spec=SPEC, config=config)
        merged[name] = arrays_to_numpy(strategy.aggregate_train(1, replies)[0])
        assert strategy.server_metrics[1]["num-trials"] == 1
    for k in SHAPES:
        np.testing.assert_array_equal(merged["default"][k], merged["paper"][k])
    # The paper's knobs and rule, merged directly.
    expected = _engine_merge([m.content for m in replies], fallback="objective")
    for k in SHAPES:
        np.testing.assert_allclose(merged["paper"][k], expected.model[k], rtol=1e-6, atol=1e-7)


def test_bad_configurations_are_refused() -> None:
    with pytest.raises(ValueError, match="selection"):
        FedFiOTConfig(selection="accuracy")
    with pytest.raises(ValueError, match="lam"):
        FedFiOTConfig.paper(lam=0.0)


def test_the_speed_options_reach_the_merge_and_certify_leaves_the_model_unchanged(monkeypatch) -> None:
    from fedfiot_flwr.server import aggregators

    seen: list[dict] = []
    real = aggregators.sweep_candidates

    def spy(*args, **kwargs):
        speed = args[2].speed  # the configuration the aggregator passes down
        seen.append({k: getattr(speed, k) for k in ("certify", "cost_dtype", "lap_solver")})
        return real(*args, **kwargs)

    monkeypatch.setattr(aggregators, "sweep_candidates", spy)
    replies = _replies(client_uploads(4, seed=3))
    models = []
    for certify in (True, False):
        config = FedFiOTConfig.default(sweep=None, max_iters=4, certify=certify, lam=1e-3)
        models.append(arrays_to_numpy(FedFiOT(spec=SPEC, config=config).aggregate_train(1, replies)[0]))
    assert seen == [{"certify": True, "cost_dtype": "float64", "lap_solver": "scipy"},
                    {"certify": False, "cost_dtype": "float64", "lap_solver": "scipy"}]
    for k in SHAPES:
        np.testing.assert_array_equal(models[0][k], models[1][k])
    FedFiOT(spec=SPEC, config=FedFiOTConfig.default(sweep=None, cost_dtype="float32")).aggregate_train(1, replies)
    assert seen[-1]["cost_dtype"] == "float32"
    # The default preset certifies its assignments (the same model, faster); the paper's solves every one.
    for preset, certify in (("default", True), ("paper", False)):
        FedFiOT(spec=SPEC, config=FedFiOTConfig.named(preset, max_iters=4)).aggregate_train(1, replies)
        assert seen[-1]["certify"] is certify, preset
    with pytest.raises(ValueError, match="cost_dtype"):
        FedFiOTConfig.default(cost_dtype="float16")
    with pytest.raises(ValueError, match="backend"):
        FedFiOTConfig.paper(backend="jax")


def test_the_torch_backend_chosen_in_the_config_merges_like_numpy() -> None:
    pytest.importorskip("torch")
    replies = _replies(client_uploads(4, seed=3))
    merged = {}
    for backend in ("numpy", "torch"):
        config = FedFiOTConfig.paper(sweep=None, max_iters=4, backend=backend)
        merged[backend] = arrays_to_numpy(FedFiOT(spec=SPEC, config=config).aggregate_train(1, replies)[0])
    for k in SHAPES:
        np.testing.assert_allclose(merged["torch"][k], merged["numpy"][k], rtol=1e-6, atol=1e-7)


def test_recorded_start_runs_rounds_writes_results_and_checkpoints(tmp_path) -> None:
    rng = np.random.default_rng(5)
    nodes = [101, 102, 103]

    def client_fn(node: int, msg: Message) -> Message:
        if msg.metadata.message_type == "evaluate":
            from flwr.app import MetricRecord, RecordDict

            return Message(RecordDict({"metrics": MetricRecord({"eval-acc": 0.5, "num-examples": 10})}), reply_to=msg)
        assert msg.content["config"]["lr"] == 0.5
        arrays = arrays_to_numpy(msg.content["arrays"])
        w = {k: (v + rng.normal(scale=0.1, size=v.shape)).astype(np.float32) for k, v in arrays.items()}
        f = {k: (rng.random(v.shape) ** 2).astype(np.float32) for k, v in arrays.items()}
        return Message(content=packed(w, f, 10 * node), reply_to=msg)

    def accuracy(model) -> float:
        return 1.0 / (1.0 + float(np.abs(model["fc3.bias"]).sum()))

    def evaluate_fn(server_round: int, arrays):
        from flwr.app import MetricRecord

        return MetricRecord({"accuracy": accuracy(arrays_to_numpy(arrays)), "loss": 0.5})

    grid = FakeGrid(nodes, client_fn)
    init = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    strategy = FedFiOT(spec=SPEC, validate_fn=lambda m: {"accuracy": accuracy(m)},
                       config=FedFiOTConfig.default(sweep=SweepGrid(rhos=(0.5,), lams=(1e-4,))),
                       min_train_nodes=3, min_evaluate_nodes=3, min_available_nodes=3)
    recorder = RunRecorder.create(tmp_path, "run", {"app": {"x": 1}})
    again = RunRecorder.create(tmp_path, "run")
    assert again.run_dir.name == "run-2" and recorder.run_dir.name == "run"
    result = recorder.run(strategy, grid=grid, initial_arrays=numpy_to_arrays(init), num_rounds=2,
                          train_config=ConfigRecord({"lr": 0.5}), evaluate_fn=evaluate_fn)
    assert stat.S_IMODE(recorder.path.stat().st_mode) == 0o644
    data = json.loads(recorder.path.read_text())
    assert data["status"] == "finished" and data["error"] is None
    assert data["config"]["app"] == {"x": 1} and data["config"]["num_rounds"] == 2
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    r1, r2 = data["rounds"]
    assert r1["chosen"]["reference"] == "largest"  # round 1 never uses the random init
    assert {c["reference"] for c in r2["trials"]} == {"largest", "broadcast"}
    for r in (r1, r2):
        assert set(r["alignment_moved_fraction"]) == {str(n) for n in nodes}
        assert r["test"]["accuracy"] > 0 and r["fedavg_test"]["accuracy"] > 0
        assert r["validation"]["accuracy"] > 0 and r["bytes_received"] > 0
        assert isinstance(r["server_metrics"]["alignment-moved-fraction"], list)
        assert set(r["inner_iterations"]) == set(SPEC.perm_names)
    assert data["final"]["test"] == r2["test"] and "initial_test" in data
    final = torch.load(recorder.run_dir / "checkpoints" / "final.pt")
    assert list(final) == list(SHAPES)
    for k in SHAPES:
        np.testing.assert_array_equal(final[k].numpy(), result.arrays[k].numpy())
    assert (recorder.run_dir / "checkpoints" / "round-002.pt").exists()
    # Flower's Result: client metrics only under the train metrics; federated evaluation ran
    assert dict(result.train_metrics_clientapp[1]) == {"train-loss": pytest.approx(1.0)}
    assert set(result.evaluate_metrics_clientapp) == {1, 2}
    assert len([m for m in grid.sent if m.metadata.message_type == "train"]) == 6


def test_a_failing_run_is_recorded_as_failed(tmp_path) -> None:
    def client_fn(node: int, msg: Message) -> Message:
        return Message(Error(code=3, reason="out of memory"), reply_to=msg)

    strategy = FedFiOT(spec=SPEC, config=PAPER_ONCE)
    recorder = RunRecorder.create(tmp_path, "fail")
    init = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    with pytest.raises(RuntimeError, match="out of memory"):
        recorder.run(strategy, grid=FakeGrid([1, 2], client_fn), initial_arrays=numpy_to_arrays(init), num_rounds=1)
    data = json.loads(recorder.path.read_text())
    assert data["status"] == "failed" and "out of memory" in data["error"]
    assert data["rounds"][0]["rejected"][0]["client"] in ("1", "2")


def test_spec_and_buffers_from_a_torch_model() -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 3),
    )
    strategy = FedFiOT(model=model)
    assert set(strategy.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert set(strategy.spec.names) == set(model.state_dict())
    with pytest.raises(ValueError, match="permutation spec"):
        FedFiOT()


def test_jsonable_turns_numpy_and_non_finite_values_into_json() -> None:
    out = jsonable({"v": math.nan, "arr": np.arange(3), "flag": np.bool_(True), "t": (np.float32(1.5),)})
    assert json.loads(json.dumps(out)) == {"v": None, "arr": [0, 1, 2], "flag": True, "t": [1.5]}


def test_app_config_parses_run_config_and_rejects_typos() -> None:
    cfg = AppConfig.from_run_config({"alpha": 0.2, "sweep": False, "num-partitions": 6, "reference": "2"})
    assert cfg.alpha == 0.2 and cfg.sweep is False and cfg.reference_value() == 2
    assert cfg.sweep_lists()["rhos"] == (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
    assert parse_float_list("0.2, 0.3", "k") == (0.2, 0.3)
    with pytest.raises(ValueError, match="sweep-rho"):
        AppConfig.from_run_config({"sweep-rho": "0.2,abc"})
    with pytest.raises(ValueError, match="unknown run config keys.*'lamda'"):
        AppConfig.from_run_config({"lamda": 1e-4})
    with pytest.raises(ValueError, match="init"):
        AppConfig.from_run_config({"init": "random"})
    with pytest.raises(ValueError, match="local-epochs"):
        AppConfig.from_run_config({"local-epochs": "many"})


def test_the_app_builds_its_fedfiot_config_from_the_run_config() -> None:
    from server_app import fedfiot_config

    paper = fedfiot_config(AppConfig.from_run_config({"preset": "paper", "rho": 0.3}))
    assert paper == FedFiOTConfig.paper(rho=0.3)
    default = fedfiot_config(AppConfig.from_run_config({"fallback": "none", "sweep": False}))
    assert default.selection == "none" and default.sweep is None and default.fedavg_candidate


def test_pyproject_and_configs_hold_every_app_key() -> None:
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    app = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "server_app:app", "clientapp": "client_app:app"}
    assert set(app["config"]) == set(AppConfig().as_dict())
    AppConfig.from_run_config(app["config"])
    configs = sorted((root / "configs").glob("*.toml"))
    names = {p.stem for p in configs}
    for ds in ("cifar10", "svhn", "cinic10"):
        for a in ("0.2", "0.1", "0.05"):
            assert {f"{ds}-a{a}-oneshot", f"{ds}-a{a}-4rounds"} <= names
    for path in configs:
        cfg = AppConfig.from_run_config({**app["config"], **tomllib.loads(path.read_text())})
        assert cfg.num_partitions == 6


def test_a_batchnorm_model_goes_through_several_rounds_and_the_bn_hook_runs() -> None:
    from fedfiot_flwr.wire import pack_reply

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 2))

    model = make()
    params = {n for n, _ in model.named_parameters()}
    rng = np.random.default_rng(3)

    def client_fn(node: int, msg: Message) -> Message:
        state = {k: v.numpy() for k, v in msg.content["arrays"].to_torch_state_dict().items()}
        trained = {k: (v + rng.normal(scale=0.05, size=v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v + 1
                   for k, v in state.items()}
        fisher = {k: rng.random(v.shape) for k, v in trained.items() if k in params}
        return Message(content=pack_reply(trained, fisher, 10 + node), reply_to=msg)

    calls: list[int] = []

    def recalibrate(weights):
        calls.append(1)
        return {**weights, "1.running_var": np.ones_like(weights["1.running_var"])}

    strategy = FedFiOT(model=model, config=PAPER_ONCE, bn_recalibration=recalibrate, fraction_evaluate=0.0)
    result = strategy.start(grid=FakeGrid([1, 2], client_fn), initial_arrays=numpy_to_arrays(
        {k: v.numpy() for k, v in model.state_dict().items()}), num_rounds=3)
    assert [r["rejected"] for r in strategy.reports] == [[], [], []]
    assert result.arrays["1.num_batches_tracked"].numpy().shape == ()
    assert np.all(result.arrays["1.running_var"].numpy() == 1.0)
    # Each round: once for the round's model, once for FedAvg of the same uploads (compared on the same terms).
    assert len(calls) == 6 and np.all(strategy.last_round.alternatives["fedavg"]["1.running_var"] == 1.0)
