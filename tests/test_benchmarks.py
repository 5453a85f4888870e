"""Smoke runs of the benchmarks on digits (1 seed, 1 local epoch) and checks of the harness."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
from _fedfiot_helpers import one_torch_thread  # noqa: F401 - fixture
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from benchmarks import few_round, one_shot
from benchmarks import harness as H
from fedfiot_flwr.client import unpack_reply

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _threads(one_torch_thread):  # noqa: ANN001, ANN202
    yield


@pytest.fixture(scope="module")
def one_shot_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("one_shot")
    payload = one_shot.main(["--quick", "--out", str(root / "out"), "--cache-dir", str(root / "cache"), "--quiet"])
    return payload, root


def _setting(init: str) -> H.Setting:
    return H.Setting("digits", "mlp", 6, 0.1, init, 0, 1, validation_size=200)


def test_one_shot_every_method_has_a_finite_accuracy(one_shot_run: tuple[dict, Path]) -> None:
    payload, root = one_shot_run
    records = payload["records"]
    for init in H.INITS:
        got = {r["method"]: r for r in records if r["init"] == init}
        assert sorted(got) == sorted([*H.ONE_SHOT_METHODS, *H.DERIVED_METHODS])
        for method, rec in got.items():
            assert math.isfinite(rec["test_accuracy"]) and 0.0 <= rec["test_accuracy"] <= 1.0, method
            assert math.isfinite(rec["validation_accuracy"]), method
            assert rec["candidates"] >= 1 and rec["merge_seconds"] >= 0.0
    # The markdown table has one row per method with a number in every column.
    table = (root / "out" / "one_shot.md").read_text().split("## Validation")[0]
    for method in [*H.ONE_SHOT_METHODS, *H.DERIVED_METHODS]:
        row = next(line for line in table.splitlines() if line.startswith(f"| {H.METHOD_LABELS[method]} |"))
        cells = [c.strip().strip("*") for c in row.strip("|").split("|")[1:]]
        assert len(cells) == 2 and all(math.isfinite(float(c.split()[0])) for c in cells), row
    on_disk = json.loads((root / "out" / "one_shot.json").read_text())
    assert len(on_disk["records"]) == len(records) and on_disk["timing"]["complete"]
    assert (root / "out" / "one_shot.png").is_file()
    # Alignment methods on independently initialised clients do permute neurons.
    indep = {r["method"]: r for r in records if r["init"] == "independent"}
    assert indep["fedfiot"]["alignment_fraction_permuted"] > 0.2
    assert indep["fedavg"]["fraction_permuted"] == 0.0
    # The default preset is never below FedAvg on validation; its own merge is reported too.
    for init in H.INITS:
        got = {r["method"]: r for r in records if r["init"] == init}
        assert got["fedfiot-default"]["validation_accuracy"] >= got["fedavg"]["validation_accuracy"]
        assert got["fedfiot-own"]["knobs"]["variant"] in ("aligned", "identity")


def test_harness_fedavg_equals_flower_aggregate_arrayrecords(one_shot_run: tuple[dict, Path]) -> None:
    _, root = one_shot_run
    setting = _setting("independent")
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    uploads = H.one_shot_uploads(setting, split, buffers, root / "cache")
    assert uploads.cached  # the smoke run's uploads, not new ones
    config = H.method_config("fedavg", setting.init)
    ours = H.apply_method("fedavg", config, uploads, spec, buffers, lambda m: {"accuracy": 0.0}).model
    # Flower's FedAvg on the same dequantized uploads, built from the packed replies directly.
    records = []
    for reply in uploads.replies:
        up = unpack_reply(reply)
        records.append(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in up.weights.items()}),
                                   "metrics": MetricRecord({"num-examples": up.num_examples})}))
    flower = aggregate_arrayrecords(records, "num-examples")
    assert sorted(flower.keys()) == sorted(ours)
    for k, v in flower.items():
        np.testing.assert_allclose(ours[k], v.numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    # ... and they are not trivially equal to one client's model.
    assert not np.allclose(ours["fc1.weight"], uploads.quantized.weights[0]["fc1.weight"])


Model = Mapping[str, np.ndarray]


def _favouring(index: int) -> tuple[Callable[[Model], dict[str, float]], list[Model]]:
    """A validation function that scores the ``index``-th model it is shown 1 and every other 0.

    Returns the function and the list of the models it was shown, in order.
    """
    shown: list[Model] = []

    def validate(model: Model) -> dict[str, float]:
        shown.append(model)
        return {"accuracy": 1.0 if len(shown) - 1 == index else 0.0}

    return validate, shown


def test_the_knobs_and_the_model_are_those_validation_prefers(one_shot_run: tuple[dict, Path]) -> None:
    _, root = one_shot_run
    setting = _setting("shared")
    split = setting.app_config().split()
    build, spec, buffers = H.model_tools(setting, split)
    uploads = H.one_shot_uploads(setting, split, buffers, root / "cache")
    config = H.method_config("fedfiot", "shared", "tiny")
    ev = H.Evaluator(split, build)
    res = H.apply_method("fedfiot", config, uploads, spec, buffers, ev.validate)
    references = {t["reference"] for t in res.outcome.record["trials"]}
    assert references == {"largest", "broadcast"}  # shared init offers the init
    assert res.validation_accuracy == pytest.approx(ev.validate(res.model)["accuracy"])
    # Validation's favourite is returned with its knobs, whichever it is: the first and the last model shown.
    chosen: list[dict[str, object]] = []
    index = 0
    for _ in ("first", "last"):
        validate, shown = _favouring(index)
        favoured = H.apply_method("fedfiot", config, uploads, spec, buffers, validate)
        assert len(shown) > 1 and favoured.validation_accuracy == 1.0
        assert all(np.array_equal(favoured.model[k], v) for k, v in shown[index].items())
        favourite = next(t for t in favoured.outcome.record["trials"] if t["validation"]["accuracy"] == 1.0)
        chosen.append({k: favoured.knobs[k] for k in ("rho", "lam", "reference")})
        assert chosen[-1] == {k: favourite[k] for k in ("rho", "lam", "reference")}
        index = len(shown) - 1
    assert chosen[0] != chosen[1]


def test_cached_uploads_are_the_trained_ones(tmp_path: Path) -> None:
    setting = _setting("shared")
    split = setting.app_config().split()
    _, _, buffers = H.model_tools(setting, split)
    fresh = H.one_shot_uploads(setting, split, buffers, tmp_path)
    again = H.one_shot_uploads(setting, split, buffers, tmp_path)
    assert not fresh.cached and again.cached
    for a, b in zip(fresh.quantized.weights + fresh.quantized.fishers + fresh.float32.weights,
                    again.quantized.weights + again.quantized.fishers + again.float32.weights):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    assert fresh.quantized.num_examples == again.quantized.num_examples == split.client_sizes
    # 16-bit uploads are within the quantizer's error bound (plus float32 output rounding) of the float32 ones.
    for q, f in zip(fresh.quantized.weights, fresh.float32.weights):
        for k in q:
            amax = float(np.max(np.abs(f[k])))
            assert np.max(np.abs(q[k].astype(np.float64) - f[k])) <= amax / (2 * (2**15 - 1)) + 2 * np.spacing(np.float32(amax))


def test_few_round_smoke(tmp_path: Path) -> None:
    payload = few_round.main(["--quick", "--rounds", "2", "--fedavg-rounds", "3", "--out", str(tmp_path), "--quiet",
                              "--cache-dir", str(tmp_path / "cache")])
    recs = payload["records"]
    rounds = {m: 3 if m == "fedavg" else 2 for m in few_round.FEW_ROUND_METHODS}
    assert sorted({(r["method"], r["round"]) for r in recs if not r["method"].startswith("ablation:")}) == sorted(
        (m, r) for m, n in rounds.items() for r in range(1, n + 1))
    ablated = {(r["method"], r["round"]) for r in recs if r["method"].startswith("ablation:")}
    assert ablated == {(f"ablation:{m}", r) for m in few_round.ABLATIONS for r in (1, 2)}
    for r in recs:
        assert math.isfinite(r["test_accuracy"]) and math.isfinite(r["alignment_fraction_permuted"]), r["method"]
        assert r["upload_bytes_per_client"] > 0, r["method"]
    # Round 1 is the same uploads for every method: the ablation's FedAvg equals FedAvg's own round 1.
    first = {r["method"]: r["test_accuracy"] for r in recs if r["round"] == 1}
    assert first["ablation:fedavg"] == first["fedavg"]
    assert (tmp_path / "few_round.png").is_file()
    text = (tmp_path / "few_round.md").read_text()
    assert f"| {few_round.LABELS['fedfiot']} |" in text and "FedAvg rounds" in text
    # A second call with --resume keeps every trajectory and trains nothing new.
    again = few_round.main(["--quick", "--rounds", "2", "--fedavg-rounds", "3", "--out", str(tmp_path), "--quiet",
                            "--resume"])
    assert len(again["records"]) == len(recs)


def test_gpu_check_quick_runs_every_section_and_writes_its_page(tmp_path: Path) -> None:
    from benchmarks import gpu_check

    payload = gpu_check.main(["--quick", "--sections", "client", "merge", "refine", "--out-dir", str(tmp_path)])
    assert [r["model"] for r in payload["client"]] == ["fednet", "resnet18"]
    for r in payload["client"]:
        assert r["epoch_s"] > 0 and r["fisher_s"] > 0 and r["fisher_rel_diff_no_tf32"] < 1e-4, r["model"]
    assert [r["case"] for r in payload["merge"]] == ["paper CNN", "ResNet-18", "wide layer"]
    for r in payload["merge"]:  # the torch backend on this machine's device finds the numpy merge
        assert r["same_permutations"] and r["max_abs_diff"] < 1e-5, r["case"]
    devices = {r["device"] for r in payload["refine"]}
    assert "cpu" in devices and all(0 <= r["selection_fold_accuracy"] <= 1 for r in payload["refine"])
    page = (tmp_path / "gpu.md").read_text()
    assert "## Merge" in page and "| paper CNN |" in page and "gpu_check.py --quick" in page
    assert json.loads((tmp_path / "gpu.json").read_text())["merge"] == payload["merge"]


def test_equal_terms_runs_the_shipped_refinement_after_every_start(tmp_path: Path) -> None:
    import json

    from benchmarks import equal_terms

    equal_terms.main(["--dataset", "digits", "--model", "mlp", "--clients", "3", "--alphas", "0.5", "--inits", "independent",
                      "--epochs", "1", "--anchor", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path),
                      "--name", "eq"])
    recs = json.loads((tmp_path / "eq.json").read_text())["records"]
    assert {r["method"] for r in recs} == set(equal_terms.METHODS)
    # The anchored rows tried the anchored fine-tuning next to the plain one; the others did not.
    for r in recs:
        anchored = any("a1(" in name for name in r["candidates_selection"])
        assert anchored == (r["method"] in equal_terms.ANCHORED), r["method"]
    assert all(0.0 <= r["test_accuracy"] <= 1.0 and r["returned"] for r in recs)
    # The selection fold's score of what each row returned is what the refinement reported choosing.
    assert all(0.0 <= r["selection_accuracy"] <= 1.0 for r in recs)
    page = (tmp_path / "eq.md").read_text()
    assert "server-only" in page and str(tmp_path) not in page
    assert "margin on the mean" in page and "Fisher anchor" in page


def test_the_harness_validates_with_the_shipped_scorer_and_scores_as_the_trainer_does(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from fedfiot_flwr.task import evaluate
    from fedfiot_flwr.validation import SelectionScorer

    setting = _setting("shared")
    split = setting.app_config().split()
    build, _, buffers = H.model_tools(setting, split)
    ev = H.Evaluator(split, build, torch.device("cpu"))
    assert isinstance(ev.validate, SelectionScorer) and hasattr(ev.validate, "validate_bounded")
    uploads = H.one_shot_uploads(setting, split, buffers, tmp_path).quantized
    for weights in uploads.weights[:3]:
        loss, acc = evaluate(H.load_numpy(build(), weights), DataLoader(split.validation, batch_size=1000), device="cpu")
        got = ev.validate(weights)
        assert got["accuracy"] == pytest.approx(acc, abs=1e-12)
        assert got["loss"] == pytest.approx(loss, rel=1e-5)


def test_the_gram_and_kfac_curvature_rows_and_their_cost_page(tmp_path: Path) -> None:
    from benchmarks import curvature_cost

    payload = one_shot.main(["--quick", "--methods", "fedavg", "fedfiot-gram", "regmean-gram", "fedfiot-kfac", "--out",
                             str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--quiet", "--no-plots"])
    rows = [r for r in payload["records"] if r["method"] == "fedfiot-gram"]
    assert rows and all(0 <= r["test_accuracy"] <= 1 and r["knobs"]["curvature"] == "gram" for r in rows)
    assert all(r["upload_bytes"] <= r["fedavg_bytes"] for r in rows)
    # RegMean merges the very replies FedFiOT's Gram row merged (read back from the cache), unaligned
    regmean = [r for r in payload["records"] if r["method"] == "regmean-gram"]
    assert len(regmean) == len(rows) and all(r["curvature_cached"] for r in regmean)
    assert all(r["fraction_permuted"] == 0 and r["knobs"]["alpha"] in (0.1, 0.5, 0.9, 1.0) for r in regmean)
    assert [r["upload_bytes"] for r in regmean] == [r["upload_bytes"] for r in rows]
    cost = curvature_cost.main(["--clients", "2", "--examples", "64", "--repeats", "1", "--out",
                                str(tmp_path / "cost.md")])
    kfac = [r for r in payload["records"] if r["method"] == "fedfiot-kfac"]
    assert len(kfac) == len(rows) and all(r["knobs"]["curvature"] == "kfac" for r in kfac)
    assert all(r["upload_bytes"] <= r["fedavg_bytes"] for r in kfac)
    assert cost["gram_bytes_per_fedavg"] <= 1.0 and cost["gram_merge_per_diagonal_merge"] > 0
    assert cost["kfac_bytes_per_fedavg"] <= 1.0 and cost["kfac_merge_per_diagonal_merge"] > 0
    page = (tmp_path / "cost.md").read_text()
    assert "Gram merge / diagonal merge" in page and "K-FAC merge / diagonal merge" in page
