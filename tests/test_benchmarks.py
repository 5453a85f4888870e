"""Smoke runs of the benchmarks on digits (1 seed, 1 local epoch) and checks of the harness."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from benchmarks import few_round, one_shot
from benchmarks import harness as H
from fedfiot_flwr.client import unpack_reply

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


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
    payload = few_round.main(["--quick", "--rounds", "2", "--fedavg-rounds", "3", "--out", str(tmp_path), "--quiet"])
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


def test_fedavg_gap_smoke(tmp_path: Path) -> None:
    from benchmarks import fedavg_gap

    payload = fedavg_gap.main(["--dataset", "digits", "--alphas", "0.1", "--epochs", "1", "--remedies", "fedavg",
                               "paper", "aligned", "identity", "default", "--true-fisher", "--out", str(tmp_path),
                               "--cache-dir", str(tmp_path / "cache"), "--name", "gap"])
    recs = {(r["remedy"], r["fisher"]): r for r in payload["records"]}
    assert ("fedavg", "empirical") in recs and ("paper", "true") in recs
    for r in recs.values():
        assert math.isfinite(r["test_accuracy"])
    # the default preset is at least FedAvg on validation (FedAvg is one of its candidates)
    assert recs[("default", "empirical")]["validation_accuracy"] >= recs[("fedavg", "empirical")]["validation_accuracy"]
    # the paper's rule is the objective comparison, visible in the record
    paper = recs[("paper", "empirical")]
    assert paper["paper_rule_keeps_aligned"] == (not paper["objective_aligned"] > paper["objective_identity"])
    assert all("true_fisher_mass" in c for c in payload["clients"])
    assert (tmp_path / "gap.md").read_text().count("| default |") == 1


def test_reference_choice_runs_every_client_and_the_identity_merge_as_the_reference(tmp_path: Path) -> None:
    from benchmarks import reference_choice

    payload = reference_choice.main(["--dataset", "digits", "--model", "mlp", "--validation-size", "200",
                                     "--clients", "3", "--alphas", "0.5", "--epochs", "1", "--knobs", "1",
                                     "--out", str(tmp_path), "--cache-dir", str(tmp_path / "cache"), "--name", "ref"])
    rows = payload["rows"]
    assert [r["reference"] for r in rows] == ["none", 0, 1, 2, "identity"]
    assert sum(r["largest"] for r in rows) == 1
    assert all(math.isfinite(r["test_accuracy"]) and r["objective"] >= 0 for r in rows)
    # a client as its own reference: the merge starts from that client, so the references differ
    assert len({round(r["objective"], 9) for r in rows[1:4]}) > 1
    (rule,) = reference_choice.rule_rows(rows)
    lowest = min(rows[1:4], key=lambda r: r["objective"])
    assert rule["chosen"]["lowest objective"] == (lowest["reference"], lowest["test_accuracy"])
    paper = next(r for r in rows if r["largest"])
    kept = paper if paper["objective"] < rows[0]["objective"] else rows[0]
    assert rule["chosen"]["the paper's rule"] == (kept["reference"], kept["test_accuracy"])
    assert "best validation" in (tmp_path / "ref.md").read_text()


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


def _digits_analysis(tmp_path: Path, name: str) -> list[str]:
    """An analysis script's command line on digits: 3 clients, 1 epoch, 2 knob settings, both inits."""
    return ["--dataset", "digits", "--model", "mlp", "--validation-size", "200", "--clients", "3", "--alphas", "0.5",
            "--epochs", "1", "--knobs", "2", "--inits", "independent", "shared", "--out", str(tmp_path),
            "--cache-dir", str(tmp_path / "cache"), "--name", name]


def test_alignment_cause_probes_every_alignment_and_picks_knobs_on_validation(tmp_path: Path) -> None:
    from benchmarks import alignment_cause

    payload = alignment_cause.main(_digits_analysis(tmp_path, "cause"))
    independent, shared = payload["rows"]
    for row in payload["rows"]:
        assert len(row["movement"]) == 3 and all(set(m) == {"fc1.weight", "fc2.weight", "fc3.weight"}
                                                 for m in row["movement"])
        for method, candidates in row["candidates"].items():
            assert len(candidates) == 2
            assert row["chosen"][method]["validation_accuracy"] == max(c["validation_accuracy"] for c in candidates)
        # FedFiOT's alignment does not depend on the order the clients' units arrive in: started from
        # the activation order it returns to the weight alignment's merge
        for weight, again in zip(row["candidates"]["weight"], row["candidates"]["activation-then-weight"]):
            assert again["objective"] == pytest.approx(weight["objective"], rel=1e-6)
            assert again["test_accuracy"] == weight["test_accuracy"]
    # one shared initialisation: the units already correspond, and training barely moved them
    assert all(m["fc1.weight"]["cosine"] > 0.9 for m in shared["movement"])
    assert all(a == 1.0 for a in shared["candidates"]["weight"][0]["agreement"].values())
    assert "How far local training moved the weights" in (tmp_path / "cause.md").read_text()


def test_merge_many_matches_each_client_to_the_others_and_picks_knobs_on_validation(tmp_path: Path) -> None:
    from benchmarks import merge_many

    payload = merge_many.main(_digits_analysis(tmp_path, "mm"))
    independent, shared = payload["rows"]
    for row in payload["rows"]:
        for method, candidates in row["candidates"].items():
            assert len(candidates) == 2
            assert row["chosen"][method]["validation_accuracy"] == max(c["validation_accuracy"] for c in candidates)
    # Two clients that are the same trained model with its hidden units shuffled: the sweeps undo the
    # shuffle exactly and stop, and the two aligned models are the same model.
    setting = H.Setting("digits", "mlp", 3, 0.5, "independent", 0, 1, validation_size=200)
    split = setting.app_config().split()
    _, spec, buffers = H.model_tools(setting, split)
    q = H.one_shot_uploads(setting, split, buffers, tmp_path / "cache", None, lambda s: None).quantized
    rng = np.random.default_rng(0)
    identity = merge_many.identity_permutations(spec, q.weights[0], 2)
    shuffle = {g: rng.permutation(len(p[0])) for g, p in identity.items()}
    model, fisher = q.weights[0], q.fishers[0]
    shuffled = merge_many.apply_permutations(model, spec, shuffle)
    clients = merge_many.Clients([model, shuffled], [fisher, merge_many.apply_permutations(fisher, spec, shuffle)],
                                 [100, 100], spec, buffers)
    perms, sweeps, converged = merge_many.merge_many(clients, identity, 5, rho=0.5, lam=1e-3)
    assert converged and sweeps == 2
    aligned = [merge_many.apply_permutations(m, spec, {g: perms[g][k] for g in perms})
               for k, m in enumerate([model, shuffled])]
    assert all(np.array_equal(aligned[0][n], aligned[1][n]) for n in model)
    assert any(not np.array_equal(p, np.arange(len(p))) for arrays in perms.values() for p in arrays)
    # One shared initialisation: the units already correspond and nothing moves.
    assert all(c["fraction_permuted"] == 0.0 for c in shared["candidates"]["merge-many"])
    assert "MergeMany" in (tmp_path / "mm.md").read_text()


def test_fisher_kind_recomputes_the_clients_fisher_and_merges_every_kind(tmp_path: Path) -> None:
    from benchmarks import fisher_kind

    setting = H.Setting("digits", "mlp", 3, 0.5, "shared", 0, 1, validation_size=200)
    split = setting.app_config().split()
    build, _, buffers = H.model_tools(setting, split)
    cached = H.one_shot_uploads(setting, split, buffers, tmp_path / "cache", None, lambda s: None)
    # the empirical kind recomputed from the trained weights is what the clients uploaded
    again = fisher_kind.uploads_with_fisher(cached, setting, split, build, buffers, "empirical")
    for sent, recomputed in zip(cached.quantized.fishers, again.quantized.fishers):
        assert set(sent) == set(recomputed)
        for k in sent:
            np.testing.assert_allclose(recomputed[k], sent[k], rtol=2e-3, atol=1e-12)
    sampled = fisher_kind.uploads_with_fisher(cached, setting, split, build, buffers, "sampled")
    assert any(not np.allclose(s[k], e[k]) for s, e in zip(sampled.quantized.fishers, cached.quantized.fishers)
               for k in s)
    assert [w["fc1.weight"].tobytes() for w in sampled.quantized.weights] == \
        [w["fc1.weight"].tobytes() for w in cached.quantized.weights]

    payload = fisher_kind.main(["--dataset", "digits", "--model", "mlp", "--validation-size", "200", "--clients",
                                "3", "--alphas", "0.5", "--epochs", "1", "--inits", "shared", "--out", str(tmp_path),
                                "--cache-dir", str(tmp_path / "cache"), "--name", "kinds"])
    assert {(r["fisher_kind"], r["method"]) for r in payload["rows"]} == \
        {(k, m) for k in fisher_kind.KINDS for m in fisher_kind.METHODS}
    page = (tmp_path / "kinds.md").read_text()
    assert all(f"| {kind} |" in page for kind in fisher_kind.KINDS)
