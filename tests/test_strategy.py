"""The Message-API strategy: unpack + validate + merge, exclusion of broken replies, selection,
results file, checkpoints, and a full ``strategy.start`` on an in-process Grid."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import SHAPES, SPEC, FakeGrid, client_uploads, instruction, packed, reply
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MetricRecord

from fedfiot_flwr import FedFiOT, SweepGrid
from fedfiot_flwr.app_config import AppConfig
from fedfiot_flwr.client import unpack_reply
from fedfiot_flwr.merge import merge
from fedfiot_flwr.results import ResultsFile
from fedfiot_flwr.selection import Candidate
from fedfiot_flwr.strategy import arrays_to_numpy, numpy_to_arrays
from fedfiot_flwr.strategy_utils import aggregate_client_metrics, parse_float_list


def _replies(uploads, first_node: int = 1):
    return [reply(first_node + i, packed(w, f, n)) for i, (w, f, n) in enumerate(uploads)]


def _engine_merge(contents, **kw):
    ups = [unpack_reply(c) for c in contents]
    return merge([u.weights for u in ups], [u.fisher for u in ups], SPEC,
                 num_examples=[u.num_examples for u in ups], **kw)


def test_aggregate_train_equals_engine_merge_of_dequantized_uploads() -> None:
    uploads = client_uploads(3, seed=1)
    replies = _replies(uploads)
    strategy = FedFiOT(spec=SPEC, lam=1e-3, rho=0.5, max_iters=4, baseline=False, fisher_cap=0)  # Fishers as uploaded
    arrays, metrics = strategy.aggregate_train(1, replies)
    expected = _engine_merge([m.content for m in replies], lam=1e-3, rho=0.5, max_iters=4)
    got = arrays_to_numpy(arrays)
    assert list(got) == list(SHAPES)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected.model[k], rtol=1e-6, atol=1e-7)
    assert metrics["num-valid"] == 3 and metrics["num-rejected"] == 0
    assert metrics["objective-aligned"] == pytest.approx(expected.aligned_objective)
    assert metrics["objective-identity"] == pytest.approx(expected.identity_objective)
    assert metrics["fallback-taken"] == int(not expected.aligned)
    assert metrics["fraction-permuted"] == pytest.approx(expected.fraction_permuted)
    assert len(metrics["inner-iterations"]) == len(SPEC.perm_names)
    assert metrics["bytes-received"] > 0
    assert metrics["train-loss"] == pytest.approx(1.0)


def test_quantized_upload_costs_16_bits_per_entry() -> None:
    (w, f, n), = client_uploads(1)
    reply_msg = reply(1, packed(w, f, n))
    strategy = FedFiOT(spec=SPEC, baseline=False, min_valid_replies=1)
    _, metrics = strategy.aggregate_train(1, [reply_msg])
    entries = sum(int(np.prod(s)) for s in SHAPES.values())
    # weights + Fisher at 2 bytes per entry, plus per-tensor scales and Flower's array headers
    assert 4 * entries <= metrics["bytes-received"] < 4 * entries + 200 * 2 * len(SHAPES)


def test_broken_replies_are_excluded_and_merge_equals_merge_of_valid_ones(tmp_path) -> None:
    from _fedfiot_helpers import corrupt_missing_fisher, corrupt_nan_fisher

    uploads = client_uploads(4, seed=2)
    good = _replies(uploads[:3])
    w, f, n = uploads[3]
    bad_shape = {**w, "fc1.weight": np.zeros((7, 4), np.float32)}
    bad_shape_f = {**f, "fc1.weight": np.zeros((7, 4), np.float32)}
    broken = [
        reply(11, corrupt_nan_fisher(packed(w, f, n), "fc2.weight")),
        reply(12, packed(bad_shape, bad_shape_f, n)),
        reply(13, corrupt_missing_fisher(packed(w, f, n), "fc3.bias")),
        Message(Error(code=1, reason="client crashed"), reply_to=instruction(14)),
    ]
    strategy = FedFiOT(spec=SPEC, baseline=False, results_path=tmp_path / "r.json", fisher_cap=0)
    strategy._broadcast = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    arrays, metrics = strategy.aggregate_train(1, [broken[0], good[0], broken[1], good[1], broken[2], good[2], broken[3]])
    expected = _engine_merge([m.content for m in good])
    got = arrays_to_numpy(arrays)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected.model[k], rtol=1e-6, atol=1e-7)
    assert metrics["num-valid"] == 3 and metrics["num-rejected"] == 4
    rejected = {r["client"]: r["reason"] for r in json.loads((tmp_path / "r.json").read_text())["rounds"][0]["rejected"]}
    assert set(rejected) == {"11", "12", "13", "14"}
    assert "fc2.weight" in rejected["11"] and ("nan" in rejected["11"].lower() or "finite" in rejected["11"].lower())
    assert "fc1.weight" in rejected["12"] and "shape" in rejected["12"]
    assert "fc3.bias" in rejected["13"]
    assert "client crashed" in rejected["14"]


def test_too_few_valid_replies_fail_the_round_with_a_clear_error(tmp_path) -> None:
    from _fedfiot_helpers import corrupt_nan_fisher

    (w, f, n), (w2, f2, n2) = client_uploads(2)
    replies = [reply(1, packed(w, f, n)), reply(2, corrupt_nan_fisher(packed(w2, f2, n2), "fc1.bias"))]
    strategy = FedFiOT(spec=SPEC, min_train_nodes=2, results_path=tmp_path / "r.json")
    with pytest.raises(RuntimeError, match=r"only 1 valid replies, at least 2 needed.*client 2.*fc1\.bias"):
        strategy.aggregate_train(1, replies)
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["status"] == "failed" and "only 1 valid" in data["error"]


def test_selection_keeps_the_candidate_with_the_best_validation_score() -> None:
    uploads = client_uploads(3, seed=3)
    replies = _replies(uploads)
    contents = [m.content for m in replies]
    target = {k: np.full(s, 0.05, np.float32) for k, s in SHAPES.items()}

    def score(model: dict[str, np.ndarray]) -> float:
        return -float(sum(np.sum((model[k] - target[k]) ** 2) for k in SHAPES))

    seen: list[float] = []

    def validate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        s = score(arrays_to_numpy(arrays))
        seen.append(s)
        return MetricRecord({"accuracy": s, "loss": -s})

    grid = SweepGrid(rhos=(0.2, 1.0), lams=(1e-4, 1e-1), references=("largest", "broadcast"))
    strategy = FedFiOT(spec=SPEC, validate_fn=validate_fn, sweep=grid, baseline=True, preset="paper")
    arrays, metrics = strategy.aggregate_train(1, replies)
    # round 1: "broadcast" (the random init) is skipped -> default + 4 grid points, deduplicated
    cands = grid.candidates(strategy.default_candidate, 1)
    assert all(c.reference == "largest" for c in cands) and len(cands) == 5
    scores = {c: score(_engine_merge(contents, lam=c.lam, rho=c.rho).model) for c in cands}
    best = max(scores.values())
    chosen = Candidate(metrics["rho"], metrics["lam"], "largest")
    assert scores[chosen] == pytest.approx(best)
    assert metrics["val-accuracy"] == pytest.approx(best)
    assert score(arrays_to_numpy(arrays)) == pytest.approx(best)
    assert metrics["num-trials"] == 5 and len(seen) == 5 + 1  # + the FedAvg baseline
    assert "fedavg-val-accuracy" in metrics


def test_sweep_grid_order_dedup_and_broadcast_rule() -> None:
    grid = SweepGrid(rhos=(0.5, 0.7), lams=(1e-4,), references=("largest", "broadcast"))
    default = Candidate(0.5, 1e-4, "largest")
    r1 = grid.candidates(default, 1)
    assert r1 == [default, Candidate(0.7, 1e-4, "largest")]
    r2 = grid.candidates(default, 2)
    assert r2[0] == default and len(r2) == 4 and {c.reference for c in r2} == {"largest", "broadcast"}
    with pytest.raises(ValueError, match="rho"):
        Candidate(1.5, 1e-4)
    with pytest.raises(ValueError, match="reference"):
        Candidate(0.5, 1e-4, "smallest")


def test_validation_fallback_prefers_identity_merge_when_it_validates_better() -> None:
    uploads = client_uploads(3, seed=4)
    replies = _replies(uploads)
    ident = _engine_merge([m.content for m in replies], fallback="none").identity_model

    def validate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        m = arrays_to_numpy(arrays)
        d = sum(float(np.sum((m[k] - ident[k]) ** 2)) for k in SHAPES)
        return MetricRecord({"accuracy": -d})

    strategy = FedFiOT(spec=SPEC, validate_fn=validate_fn, fallback="validation", baseline=False, fisher_cap=0)
    arrays, metrics = strategy.aggregate_train(1, replies)
    got = arrays_to_numpy(arrays)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], ident[k], rtol=1e-6)
    assert metrics["fallback-taken"] == 1
    assert strategy.last_outcome is not None and strategy.last_outcome.variant == "identity"


def test_start_runs_rounds_writes_results_and_checkpoints(tmp_path) -> None:
    rng = np.random.default_rng(5)
    nodes = [101, 102, 103]

    def client_fn(node: int, msg: Message) -> Message:
        assert msg.content["config"]["lr"] == 0.5
        arrays = arrays_to_numpy(msg.content["arrays"])
        w = {k: (v + rng.normal(scale=0.1, size=v.shape)).astype(np.float32) for k, v in arrays.items()}
        f = {k: (rng.random(v.shape) ** 2).astype(np.float32) for k, v in arrays.items()}
        return Message(content=packed(w, f, 10 * node), reply_to=msg)

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        m = arrays_to_numpy(arrays)
        return MetricRecord({"accuracy": 1.0 / (1.0 + float(np.abs(m["fc3.bias"]).sum())), "loss": 0.5})

    grid = FakeGrid(nodes, client_fn)
    init = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    strategy = FedFiOT(
        spec=SPEC, validate_fn=evaluate_fn, sweep=SweepGrid(rhos=(0.5,), lams=(1e-4,)),
        min_train_nodes=3, min_available_nodes=3,
        results_path=tmp_path / "results.json", checkpoint_dir=tmp_path / "ckpt", run_info={"app": {"x": 1}},
    )
    result = strategy.start(grid=grid, initial_arrays=numpy_to_arrays(init), num_rounds=2,
                            train_config=ConfigRecord({"lr": 0.5}), evaluate_fn=evaluate_fn)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["status"] == "finished" and data["error"] is None
    assert data["config"]["app"] == {"x": 1} and data["config"]["num_rounds"] == 2
    assert [r["round"] for r in data["rounds"]] == [1, 2]
    r1, r2 = data["rounds"]
    assert r1["chosen"]["reference"] == "largest"  # round 1 never uses the random init
    assert {c["reference"] for c in r2["trials"]} == {"largest", "broadcast"}
    for r in (r1, r2):
        assert set(r["fraction_permuted"]) == {str(n) for n in nodes}
        assert r["test"]["accuracy"] > 0 and r["fedavg_test"]["accuracy"] > 0
        assert r["validation"]["accuracy"] > 0 and r["bytes_received"] > 0
        assert isinstance(r["fallback_taken"], bool) and r["merge_seconds"] >= 0
        assert set(r["inner_iterations"]) == set(SPEC.perm_names)
    assert data["final"]["test"] == r2["test"] and "initial_test" in data
    # checkpoints: torch state_dict files, loadable, equal to the global model
    final = torch.load(tmp_path / "ckpt" / "final.pt")
    assert list(final) == list(SHAPES)
    for k in SHAPES:
        np.testing.assert_array_equal(final[k].numpy(), result.arrays[k].numpy())
    assert (tmp_path / "ckpt" / "round-001.pt").exists() and (tmp_path / "ckpt" / "round-002.pt").exists()
    assert set(result.train_metrics_clientapp) == {1, 2}
    assert "fraction-permuted" in result.train_metrics_clientapp[1]
    assert len(grid.sent) == 6 and all(m.content["config"]["server-round"] in (1, 2) for m in grid.sent)


def test_start_records_failure_in_results_file(tmp_path) -> None:
    def client_fn(node: int, msg: Message) -> Message:
        return Message(Error(code=3, reason="out of memory"), reply_to=msg)

    strategy = FedFiOT(spec=SPEC, results_path=tmp_path / "results.json")
    init = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    with pytest.raises(RuntimeError, match="out of memory"):
        strategy.start(grid=FakeGrid([1, 2], client_fn), initial_arrays=numpy_to_arrays(init), num_rounds=1)
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["status"] == "failed" and "out of memory" in data["error"]


def test_strategy_needs_a_spec_and_valid_options() -> None:
    with pytest.raises(ValueError, match="permutation spec"):
        FedFiOT()
    with pytest.raises(ValueError, match="lam"):
        FedFiOT(spec=SPEC, lam=0.0)
    with pytest.raises(ValueError, match="fallback"):
        FedFiOT(spec=SPEC, fallback="accuracy")


def test_spec_and_buffers_from_a_torch_model() -> None:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 6 * 6, 3),
    )
    strategy = FedFiOT(model=model)
    assert set(strategy.buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert set(strategy.spec.names) == set(model.state_dict())


def test_results_file_is_json_safe(tmp_path) -> None:
    rf = ResultsFile(tmp_path / "x.json", {"a": np.float32(1.5)})
    rf.update_round(1, {"v": math.nan, "arr": np.arange(3), "flag": np.bool_(True)})
    rf.finish({"acc": np.float64(0.25)})
    data = json.loads((tmp_path / "x.json").read_text())
    assert data["rounds"][0] == {"round": 1, "v": None, "arr": [0, 1, 2], "flag": True}
    assert data["final"] == {"acc": 0.25} and data["status"] == "finished"


def test_client_metric_aggregation_and_list_parsing() -> None:
    agg = aggregate_client_metrics([{"a": 1.0, "b": "x", "num-examples": 3}, {"a": 3.0, "b": "y"}], [1, 3])
    assert agg == {"a": pytest.approx(2.5)}
    assert parse_float_list("0.2, 0.3", "k") == (0.2, 0.3)
    with pytest.raises(ValueError, match="sweep-rho"):
        parse_float_list("0.2,abc", "sweep-rho")


def test_app_config_parses_run_config_and_rejects_typos() -> None:
    cfg = AppConfig.from_run_config({"alpha": 0.2, "sweep": False, "num-partitions": 6, "reference": "2"})
    assert cfg.alpha == 0.2 and cfg.sweep is False and cfg.reference_value() == 2
    assert cfg.sweep_grid().rhos == (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
    with pytest.raises(ValueError, match="unknown run config keys.*'lamda'"):
        AppConfig.from_run_config({"lamda": 1e-4})
    with pytest.raises(ValueError, match="init"):
        AppConfig.from_run_config({"init": "random"})
    with pytest.raises(ValueError, match="local-epochs"):
        AppConfig.from_run_config({"local-epochs": "many"})


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
