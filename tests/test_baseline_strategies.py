"""FedFisher and RegMean in the strategy shell: aggregation equals the core merges, broken replies
are excluded and named, the app's ``strategy`` key builds the right pair, the benchmark runs them."""

from __future__ import annotations

import json
import math
import stat
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from _fedfiot_helpers import task_identity  # noqa: F401 - autouse fixture
from _fedfiot_helpers import SHAPES, FakeGrid, answer, configure_round
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from torch import nn

from fedfiot_flwr import FedFiOT, FedFisherStrategy, RegMeanStrategy
from fedfiot_flwr.app_config import AppConfig
from fedfiot_flwr.baselines import FedFisherOptions, fedfisher_diag, fedfisher_kfac, regmean_select
from fedfiot_flwr.client import curvature_reply
from fedfiot_flwr.server import MergeStrategy, RunRecorder
from fedfiot_flwr.server.shell import arrays_to_numpy, numpy_to_arrays
from fedfiot_flwr.server.uploads import collect_uploads
from fedfiot_flwr.wire import FACTOR_PREFIX, fedavg_payload_bytes, unpack_curvature_reply, unpack_reply


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class Tiny(nn.Module):
    """The helpers' MLP (``SHAPES``) as a torch module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _clients(k: int, seed: int = 0) -> list[tuple[Tiny, list[tuple[torch.Tensor, torch.Tensor]], int]]:
    """``k`` (model, unaugmented batches, n) triples: perturbed copies of one init, own data."""
    torch.manual_seed(seed)
    base = Tiny()
    out = []
    for i in range(k):
        model = Tiny()
        model.load_state_dict({n: v + 0.3 * torch.randn_like(v) for n, v in base.state_dict().items()})
        n = 16 + 8 * i
        x, y = torch.randn(n, 4), torch.randint(0, 3, (n,))
        out.append((model, [(x[j : j + 8], y[j : j + 8]) for j in range(0, n, 8)], n))
    return out


def _contents(kind: str, k: int = 3, seed: int = 0) -> list[RecordDict]:
    """The replies of ``k`` clients (:func:`_clients`) that send the ``kind`` upload."""
    return [curvature_reply(kind, m, data, num_examples=n, metrics={"train-loss": 1.0}, device="cpu")
            for m, data, n in _clients(k, seed)]


def _round(
    strategy: MergeStrategy, answers: Sequence[tuple[int, RecordDict | Error]]
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """Round 1 as Flower's ``start`` runs it, on the answering nodes.

    ``configure_train`` broadcasts the zero model of ``SHAPES`` to every node in ``answers``, then
    ``aggregate_train`` gets each node's answer to its instruction, in the order given.
    """
    sent = configure_round(strategy, dict.fromkeys(node for node, _ in answers))
    return strategy.aggregate_train(1, [answer(sent[node], content) for node, content in answers])


def _numbered(contents: Sequence[RecordDict], first_node: int = 1) -> list[tuple[int, RecordDict]]:
    """``contents`` as the answers of nodes ``first_node``, ``first_node + 1``, ..."""
    return [(first_node + i, c) for i, c in enumerate(contents)]


def _validate(model: dict[str, np.ndarray]) -> dict[str, float]:
    """A deterministic score with an interior optimum (so selection matters)."""
    d = sum(float(np.sum((model[k] - 0.05) ** 2)) for k in SHAPES)
    return {"accuracy": 1.0 / (1.0 + d), "loss": d}


def _score(model: dict[str, np.ndarray]) -> float:
    return _validate(model)["accuracy"]


def _test_fn(server_round: int, arrays: ArrayRecord):  # noqa: ANN202
    from flwr.app import MetricRecord

    return MetricRecord(_validate(arrays_to_numpy(arrays)))


def _assert_same(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert list(got) == list(SHAPES)
    for k in SHAPES:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-6, atol=1e-7, err_msg=k)


# ----------------------------------------------------------------- aggregate_train == core merge


def test_fedfisher_kfac_aggregate_train_equals_the_core_merge() -> None:
    contents = _contents("fedfisher-kfac")
    strategy = FedFisherStrategy("kfac", steps=30, eval_every=10, validate_fn=_validate, fisher_kind="true",
                                 fedavg_baseline=False, device="cpu")
    arrays, _ = _round(strategy, _numbered(contents))
    ups = [unpack_curvature_reply(c) for c in contents]
    expected = fedfisher_kfac([u.weights for u in ups], [u.factors for u in ups], [u.num_examples for u in ups],
                              FedFisherOptions(steps=30, eval_every=10, device="cpu"), evaluate=_score)
    _assert_same(arrays_to_numpy(arrays), expected.model)
    metrics = strategy.server_metrics[1]
    assert metrics["num-valid"] == 3 and metrics["num-rejected"] == 0 and metrics["best-step"] == expected.best_step
    rec = strategy.reports[0]
    assert rec["fisher_kind"] == "true" and rec["best_step"] == expected.best_step
    assert rec["chosen"]["best_step"] == expected.best_step and len(rec["history"]) == 4
    assert rec["validation"]["accuracy"] == pytest.approx(_score(expected.model))
    # The upload stays within FedAvg's float32 payload of the same model.
    assert set(rec["bytes_per_client"]) == {"1", "2", "3"}
    assert all(b <= fedavg_payload_bytes(ups[0].weights) for b in rec["bytes_per_client"].values())
    assert all(b > 0 for b in rec["curvature_bytes_per_client"].values())


def test_fedfisher_diag_aggregate_train_equals_the_core_merge() -> None:
    contents = _contents("fedfisher-diag", seed=1)
    strategy = FedFisherStrategy("diag", steps=20, eval_every=5, validate_fn=_validate, fisher_kind="true",
                                 device="cpu")
    arrays, _ = _round(strategy, _numbered(contents))
    metrics = strategy.server_metrics[1]
    ups = [unpack_reply(c) for c in contents]
    expected = fedfisher_diag([u.weights for u in ups], [u.fisher for u in ups], [u.num_examples for u in ups],
                              FedFisherOptions(steps=20, eval_every=5, device="cpu"), evaluate=_score)
    _assert_same(arrays_to_numpy(arrays), expected.model)
    assert metrics["best-step"] == expected.best_step
    # FedAvg of the same uploads is reported next to it (fedavg_baseline=True by default).
    assert "fedavg-val-accuracy" in metrics and strategy.reports[0]["fisher_kind"] == "true"


def test_regmean_aggregate_train_equals_the_core_merge() -> None:
    contents = _contents("regmean", seed=2)
    strategy = RegMeanStrategy(alphas=(0.1, 0.9), validate_fn=_validate, fedavg_baseline=False)
    arrays, _ = _round(strategy, _numbered(contents))
    metrics = strategy.server_metrics[1]
    ups = [unpack_curvature_reply(c) for c in contents]
    expected = regmean_select([u.weights for u in ups], [u.grams for u in ups], [u.num_examples for u in ups],
                              _score, alphas=(0.1, 0.9))
    _assert_same(arrays_to_numpy(arrays), expected.model)
    assert metrics["alpha"] == expected.alpha
    rec = strategy.reports[0]
    assert rec["chosen"] == {"alpha": expected.alpha} and set(rec["alpha_scores"]) == {"0.1", "0.9"}
    assert rec["merged_layers"] == ["fc1", "fc2", "fc3"]


# ---------------------------------------------------------------------- broken replies


def _nan_scale(content: RecordDict, key: str) -> RecordDict:
    arr = content["fedfiot"][key]
    data = struct.pack("<f", float("nan")) + arr.data[4:]
    content["fedfiot"][key] = Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=arr.stype, data=data)
    return content


def test_broken_replies_are_excluded_and_named() -> None:
    good = _contents("fedfisher-kfac", k=3, seed=3)
    broken_factor = _nan_scale(_contents("fedfisher-kfac", k=1, seed=4)[0], f"{FACTOR_PREFIX}fc2/G")
    wrong_kind = _contents("regmean", k=1, seed=5)[0]
    truncated = _contents("fedfisher-kfac", k=1, seed=6)[0]
    arr = truncated["fedfiot"][f"{FACTOR_PREFIX}fc1/A"]
    truncated["fedfiot"][f"{FACTOR_PREFIX}fc1/A"] = Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=arr.stype,
                                                          data=arr.data[:-3])
    crashed = Error(code=1, reason="client crashed")
    strategy = FedFisherStrategy("kfac", steps=10, eval_every=5, fedavg_baseline=False, device="cpu")
    arrays, _ = _round(strategy, [(11, broken_factor), (1, good[0]), (12, wrong_kind), (2, good[1]), (13, truncated),
                                  (3, good[2]), (14, crashed)])
    ups = [unpack_curvature_reply(c) for c in good]
    expected = fedfisher_kfac([u.weights for u in ups], [u.factors for u in ups], [u.num_examples for u in ups],
                              FedFisherOptions(steps=10, eval_every=5, device="cpu"))
    _assert_same(arrays_to_numpy(arrays), expected.model)
    assert strategy.server_metrics[1]["num-valid"] == 3 and strategy.server_metrics[1]["num-rejected"] == 4
    rejected = {r["client"]: r["reason"] for r in strategy.reports[0]["rejected"]}
    assert set(rejected) == {"11", "12", "13", "14"}
    assert "curvature/fc2/G" in rejected["11"] and "client 11" in rejected["11"]
    assert "'gram'" in rejected["12"] and "'kfac'" in rejected["12"]
    assert "curvature/fc1/A" in rejected["13"] and "bytes" in rejected["13"]
    assert "client crashed" in rejected["14"]


def test_too_few_valid_replies_fail_the_round() -> None:
    good = _contents("regmean", k=1, seed=7)[0]
    bad = _nan_scale(_contents("regmean", k=1, seed=8)[0], "fc1.weight")
    strategy = RegMeanStrategy(min_train_nodes=2)
    with pytest.raises(RuntimeError, match=r"RegMean round 1: only 1 valid replies, at least 2 needed.*client 2"):
        _round(strategy, [(1, good), (2, bad)])
    assert strategy.reports[0]["failed"] and strategy.reports[0]["rejected"][0]["client"] == "2"


def test_fedfisher_rejects_a_fisher_kind_other_than_the_configured_one() -> None:
    (m, data, n), = _clients(1)
    content = curvature_reply("fedfisher-kfac", m, data, num_examples=n, fisher_kind="empirical", device="cpu")
    uploads = collect_uploads([("5", content)], None, kind="kfac", fisher_kind="true")
    assert len(uploads) == 0 and "'empirical'" in uploads.rejections[0].reason


def test_recorded_start_runs_a_round_and_writes_results_and_checkpoints(tmp_path: Path) -> None:
    clients = {101 + i: c for i, c in enumerate(_clients(3, seed=9))}

    def client_fn(node: int, msg: Message) -> Message:
        model, data, n = clients[node]
        return Message(content=curvature_reply("regmean", model, data, num_examples=n, device="cpu"), reply_to=msg)

    strategy = RegMeanStrategy(validate_fn=_validate, min_train_nodes=3, min_available_nodes=3, fraction_evaluate=0.0)
    recorder = RunRecorder.create(tmp_path, "regmean", {"app": {"x": 1}})
    init = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    result = recorder.run(strategy, grid=FakeGrid(list(clients), client_fn), initial_arrays=numpy_to_arrays(init),
                          num_rounds=1, train_config=ConfigRecord({"lr": 0.1}), evaluate_fn=_test_fn)
    data = json.loads(recorder.path.read_text())
    assert stat.S_IMODE(recorder.path.stat().st_mode) == 0o644
    assert data["status"] == "finished" and data["config"]["strategy"] == "RegMeanStrategy"
    assert data["config"]["app"] == {"x": 1} and data["config"]["aggregator"]["alphas"] == [0.1, 0.9]
    final = data["final"]
    assert final["test"]["accuracy"] > 0 and final["fedavg_test"]["accuracy"] > 0 and "alpha" in final["chosen"]
    saved = torch.load(recorder.run_dir / "checkpoints" / "final.pt")
    for k in SHAPES:
        np.testing.assert_array_equal(saved[k].numpy(), result.arrays[k].numpy())
    assert (recorder.run_dir / "checkpoints" / "round-001.pt").exists()


def test_bad_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="variant"):
        FedFisherStrategy("full")
    with pytest.raises(ValueError, match="fisher_kind"):
        FedFisherStrategy("kfac", fisher_kind="exact")
    with pytest.raises(ValueError, match="steps"):
        FedFisherStrategy("kfac", steps=-1)
    with pytest.raises(ValueError, match="alphas"):
        RegMeanStrategy(alphas=(1.5,))
    with pytest.raises(ValueError, match="unknown strategy"):
        curvature_reply("fedprox", Tiny(), [])


# ------------------------------------------------------------------------------------ the app


def test_strategy_key_builds_the_right_server_strategy() -> None:
    import server_app

    from torch.utils.data import TensorDataset

    from fedfiot_flwr.refine.stage import RefinementStage

    model = Tiny()
    validation = TensorDataset(torch.randn(20, 4), torch.randint(0, 3, (20,)))
    built = {}
    for key in ("fedfiot", "fedfisher-kfac", "fedfisher-diag", "regmean"):
        cfg = AppConfig.from_run_config({"strategy": key, "num-partitions": 3, "fedfisher-steps": 50})
        built[key] = server_app.build_strategy(cfg, model, validation, 3)
    assert type(built["fedfiot"]) is FedFiOT
    # By default the validation set only chooses, for every strategy; server-refine trains on it, for every one.
    assert all(built[k].validate_fn is not None and built[k].post_merge is None for k in built)
    for key in built:
        refined = AppConfig.from_run_config({"strategy": key, "num-partitions": 3, "server-refine": True})
        assert isinstance(server_app.build_strategy(refined, model, validation, 3).post_merge, RefinementStage), key
    paper = AppConfig.from_run_config({"num-partitions": 3, "preset": "paper"})
    assert server_app.build_strategy(paper, model, validation, 3).fedfiot_config.name == "paper"
    kfac, diag = built["fedfisher-kfac"].aggregator, built["fedfisher-diag"].aggregator
    assert isinstance(built["fedfisher-kfac"], FedFisherStrategy) and kfac.variant == "kfac"
    assert diag.variant == "diag" and diag.steps == 50
    assert kfac.fisher_kind == "true"  # FedFisher's own default
    assert isinstance(built["regmean"], RegMeanStrategy)
    for s in built.values():
        assert s.min_valid_replies == 2 and s.fraction_evaluate == 1.0
    assert AppConfig(strategy="fedfisher-kfac", fisher_kind="empirical").client_fisher_kind() == "empirical"
    assert AppConfig().client_fisher_kind() == "empirical" and AppConfig().strategy == "fedfiot"
    with pytest.raises(ValueError, match="strategy='fedprox'"):
        AppConfig.from_run_config({"strategy": "fedprox"})
    with pytest.raises(ValueError, match="fisher-kind='exact'"):
        AppConfig.from_run_config({"fisher-kind": "exact"})


@pytest.mark.parametrize("key", ["fedfisher-kfac", "fedfisher-diag", "regmean"])
def test_client_app_sends_the_upload_its_strategy_reads(key: str) -> None:
    import client_app

    run_config = {"strategy": key, "num-partitions": 2, "local-epochs": 1, "validation-size": 100}
    cfg = AppConfig.from_run_config(run_config)
    split = cfg.split()
    model = cfg.build_model(split)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "config": ConfigRecord({"server-round": 1})})
    msg = Message(content=content, dst_node_id=7, message_type=MessageType.TRAIN)
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 1, "num-partitions": 2}, state=RecordDict(),
                      run_config=run_config)
    out = client_app.train(msg, context).content
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    aggregator = server_strategy(key, model).aggregator
    uploads = collect_uploads([("7", out)], shapes, kind=aggregator.reply_kind, fisher_kind=aggregator.fisher_kind)
    assert len(uploads) == 1, [r.reason for r in uploads.rejections]
    assert uploads.num_examples == [len(split.client_indices[1])]
    if key == "fedfisher-kfac":
        assert uploads.fisher_kinds == ["true"] and set(uploads.factors[0]) == {"fc1", "fc2", "fc3"}
    if key == "regmean":
        assert uploads.fisher_kinds == [None] and set(uploads.grams[0]) == {"fc1", "fc2", "fc3"}
    if key != "fedfisher-diag":
        assert uploads.bytes_per_client["7"] <= fedavg_payload_bytes(model.state_dict())
    # The trained weights differ from the broadcast model (the client did train).
    assert not np.allclose(uploads.weights[0]["fc1.weight"], model.state_dict()["fc1.weight"].numpy())


def server_strategy(key: str, model: nn.Module):  # noqa: ANN201
    if key == "regmean":
        return RegMeanStrategy(model=model)
    return FedFisherStrategy(key.removeprefix("fedfisher-"), model=model)


# ------------------------------------------------------------------------------- benchmark


def test_benchmark_runs_the_baselines_on_digits(tmp_path: Path) -> None:
    from benchmarks import harness as H
    from benchmarks import one_shot

    methods = ["fedavg", *H.CURVATURE_METHODS]
    argv = ["--quick", "--inits", "shared", "--methods", *methods, "--fedfisher-steps", "20", "--out",
            str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--quiet", "--no-plots"]
    payload = one_shot.main(argv)
    got = {r["method"]: r for r in payload["records"]}
    assert sorted(got) == sorted(methods)
    for m in H.CURVATURE_METHODS:
        assert math.isfinite(got[m]["test_accuracy"]) and 0.0 <= got[m]["test_accuracy"] <= 1.0, m
        assert got[m]["upload_bytes"] > 0 and got[m]["fedavg_bytes"] > 0
    assert got["fedfisher-kfac"]["upload_bytes"] <= got["fedfisher-kfac"]["fedavg_bytes"]
    assert got["regmean"]["knobs"]["alpha"] in (0.1, 0.9)
    assert 0 <= got["fedfisher-kfac"]["knobs"]["best_step"] <= 20
    md = (tmp_path / "out" / "one_shot.md").read_text()
    assert "## Upload size per client" in md and "| FedFisher (K-FAC) |" in md
    # The curvature is cached next to the uploads; a second run reads it back.
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.npz"))
    assert any("kfac" in n for n in cached) and any("gram" in n for n in cached)
    again = one_shot.main(argv)
    twin = {r["method"]: r for r in again["records"]}
    for m in H.CURVATURE_METHODS:
        assert twin[m]["test_accuracy"] == got[m]["test_accuracy"] and twin[m]["curvature_cached"]


def test_the_fedfisher_strategy_hands_its_knobs_to_the_aggregator_unchanged() -> None:
    from fedfiot_flwr.baselines import FedFisherOptions

    strategy = FedFisherStrategy("diag", lr=0.5, damping=0.1, eval_every=7, fraction_evaluate=0.5)
    assert strategy.aggregator.options == FedFisherOptions("diag", lr=0.5, damping=0.1, eval_every=7)
    assert strategy.fraction_evaluate == 0.5  # a FedAvg option still reaches Flower's FedAvg
    with pytest.raises(ValueError, match="optimizer must be one of"):
        FedFisherStrategy("kfac", optimizer="sgd")
