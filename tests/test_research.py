"""The research scripts (``research/``): each one's smoke run on tiny settings, and the folder's boundary.

The scripts answered a question once; these runs keep them working as the package changes (marked
slow: CI runs them). ``research/`` imports the package and ``benchmarks/``; nothing in the package,
the benchmarks or the apps imports it, and the wheel does not ship it.
"""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from _fedfiot_helpers import one_torch_thread  # noqa: F401 - fixture
import torch

from benchmarks import harness as H
from fedfiot_flwr.merge.spec import apply_permutations, invert_permutation
from fedfiot_flwr.models import build_model, permutation_spec
from fedfiot_flwr.refine import RefineOptions
from research import alignment_cause as AC

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def _threads(one_torch_thread):  # noqa: ANN001, ANN202
    yield


def _imported_modules(path: Path) -> set[str]:
    """Every module a Python file imports, by its full dotted name."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names


def test_nothing_in_the_product_imports_research() -> None:
    product = [*ROOT.glob("fedfiot_flwr/**/*.py"), *ROOT.glob("benchmarks/**/*.py"), ROOT / "server_app.py",
               ROOT / "client_app.py", *ROOT.glob("scripts/**/*.py")]
    assert len(product) > 20
    offenders = [p.relative_to(ROOT).as_posix() for p in product
                 if any(n == "research" or n.startswith("research.") for n in _imported_modules(p))]
    assert offenders == []
    research = sorted(ROOT.glob("research/*.py"))
    assert any("benchmarks.harness" in _imported_modules(p) or "benchmarks" in _imported_modules(p) for p in research)


def test_every_result_file_the_research_index_names_exists() -> None:
    index = (ROOT / "research" / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"\]\(((?:results|notes)/[^)#]+|[a-z_]+\.py)\)", index))
    assert len(named) >= 15
    missing = sorted(n for n in named if not (ROOT / "research" / n).is_file())
    assert missing == []
    scripts = {p.name for p in (ROOT / "research").glob("*.py") if p.name != "__init__.py"}
    assert scripts <= named, sorted(scripts - named)


@pytest.mark.slow
def test_fedavg_gap_smoke(tmp_path: Path) -> None:
    from research import fedavg_gap

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


@pytest.mark.slow
def test_reference_choice_runs_every_client_and_the_identity_merge_as_the_reference(tmp_path: Path) -> None:
    from research import reference_choice

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


def _digits_analysis(tmp_path: Path, name: str) -> list[str]:
    """An analysis script's command line on digits: 3 clients, 1 epoch, 2 knob settings, both inits."""
    return ["--dataset", "digits", "--model", "mlp", "--validation-size", "200", "--clients", "3", "--alphas", "0.5",
            "--epochs", "1", "--knobs", "2", "--inits", "independent", "shared", "--out", str(tmp_path),
            "--cache-dir", str(tmp_path / "cache"), "--name", name]


@pytest.mark.slow
def test_alignment_cause_probes_every_alignment_and_picks_knobs_on_validation(tmp_path: Path) -> None:
    from research import alignment_cause

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


@pytest.mark.slow
def test_long_epochs_gap_runs_every_merge_and_the_shared_init_needs_no_alignment(tmp_path: Path) -> None:
    from research import long_epochs_gap

    payload = long_epochs_gap.main(_digits_analysis(tmp_path, "long"))
    independent, shared = payload["rows"]
    for row in payload["rows"]:
        merges = row["merges"]
        assert all(math.isfinite(m["test_accuracy"]) for m in merges.values())
        assert merges["RegMean, diagonal Grams only (alpha 0)"]["alpha"] == 0.0
    # REPAIR needs corresponding neurons: not offered on unaligned independent clients
    assert "RegMean + REPAIR" in shared["merges"] and "RegMean + REPAIR" not in independent["merges"]
    # one shared initialisation: both alignments are the identity, so RegMean after either is RegMean
    weight = shared["merges"]["FedFiOT weight alignment"]
    assert weight["moved"] == 0.0 and set(weight["agreement_with_activation"].values()) == {1.0}
    for after in ("RegMean after FedFiOT's weight alignment", "RegMean after activation alignment"):
        assert shared["merges"][after]["test_accuracy"] == shared["merges"]["RegMean"]["test_accuracy"]
    assert independent["merges"]["FedFiOT weight alignment"]["moved"] > 0.0
    assert "| best single client |" in (tmp_path / "long.md").read_text()


@pytest.mark.slow
def test_gram_alignment_runs_every_merge_and_its_gram_merge_is_regmean_when_the_identity_is_kept(tmp_path: Path) -> None:
    from research import gram_alignment

    payload = gram_alignment.main(_digits_analysis(tmp_path, "gram"))
    assert len(payload["rows"]) == 2
    for row in payload["rows"]:
        merges = row["merges"]
        assert all(math.isfinite(m["test_accuracy"]) for m in merges.values())
        gram = merges["FedFiOT, Gram curvature"]
        assert gram["alpha"] in gram_alignment.ALPHAS and gram["aligned"] == (gram["objective_aligned"]
                                                                            <= gram["objective_identity"])
        if not gram["aligned"] and gram["alpha"] == merges["RegMean"]["alpha"]:  # the same merge, no alignment
            assert gram["test_accuracy"] == merges["RegMean"]["test_accuracy"]
    assert "| FedFiOT, Gram curvature |" in (tmp_path / "gram.md").read_text()


def test_repair_restores_the_clients_average_neuron_statistics() -> None:
    from research import long_epochs_gap

    torch.manual_seed(0)
    build = lambda: build_model("mlp", (1, 8, 8), 10)  # noqa: E731
    clients = [H.state_numpy(build()) for _ in range(3)]
    merged = {n: np.mean([c[n] for c in clients], axis=0) for n in clients[0]}
    batches = [torch.randn(64, 1, 8, 8) for _ in range(3)]
    fixed = long_epochs_gap.repaired(merged, clients, build, batches)

    def first_layer_std(state: dict[str, np.ndarray]) -> np.ndarray:
        x = torch.cat(batches).flatten(1).double().numpy()
        return (x @ state["fc1.weight"].T.astype(np.float64) + state["fc1.bias"]).std(0)

    target = np.mean([first_layer_std(c) for c in clients], axis=0)
    assert not np.allclose(first_layer_std(merged), target, rtol=1e-2)  # averaging shrank the neurons
    np.testing.assert_allclose(first_layer_std(fixed), target, rtol=1e-4)
    np.testing.assert_array_equal(fixed["fc3.weight"], merged["fc3.weight"])  # the logits are left alone


@pytest.mark.slow
def test_merge_many_matches_each_client_to_the_others_and_picks_knobs_on_validation(tmp_path: Path) -> None:
    from research import merge_many

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


@pytest.mark.slow
def test_fisher_kind_recomputes_the_clients_fisher_and_merges_every_kind(tmp_path: Path) -> None:
    from research import fisher_kind

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


@pytest.mark.slow
def test_the_audit_folds_split_the_selection_fold_in_two() -> None:
    from research.audit_folds import three_folds
    from fedfiot_flwr.refine.stage import split_folds

    fit, select, audit = three_folds(500)
    assert fit.tolist() == split_folds(500)[0].tolist()  # the strategy's own fitting fold
    assert len(select) == len(audit) == 125
    assert not set(select.tolist()) & set(audit.tolist())
    assert sorted(np.concatenate([select, audit]).tolist()) == split_folds(500)[1].tolist()


@pytest.mark.slow
def test_finetune_check_rules_match_what_the_refinement_returns() -> None:
    """The rules ``finetune_check.py`` reads off one run's scores are the library's own choices."""
    from dataclasses import replace

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from research.finetune_check import LONGER, choices
    from fedfiot_flwr.models import build_model
    from fedfiot_flwr.refine import Folds, refine_merged_model

    models = [build_model("mlp", (1, 8, 8), 10, seed=i) for i in range(3)]
    clients = [{k: v.detach().numpy().copy() for k, v in m.state_dict().items()} for m in models]

    def loader(n: int, seed: int) -> DataLoader:
        x = torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))
        y = sum(m(x).detach() for m in models).argmax(1)  # labelled by the clients' ensemble
        return DataLoader(TensorDataset(x, y), batch_size=64)

    fit, select = loader(200, 5), loader(100, 6)
    merged = {k: np.zeros_like(v) for k, v in clients[0].items()}  # a useless merge: fitted candidates win
    small = replace(LONGER, finetune_epochs=4, augment_copies=1, keep_candidates=True)
    _, scored = refine_merged_model(merged, clients, build_model("mlp", (1, 8, 8), 10), Folds(fit, select), options=small)
    picked = choices(scored.selection_accuracy)
    assert picked["cosine, every 2"] == scored.chosen  # the run's own rule
    for rule, overrides in (("cosine, last", {"checkpoint_every": 0}),
                            ("cosine, last, starts only", {"checkpoint_every": 0, "offer_starts": False})):
        _, rep = refine_merged_model(merged, clients, build_model("mlp", (1, 8, 8), 10), Folds(fit, select),
                                     options=replace(small, **overrides))
        assert picked[rule] == rep.chosen, rule
    assert picked["cosine, last, starts only"].startswith("ft4(")


@pytest.mark.slow
def test_the_cost_benchmark_reads_recipes_and_relates_every_path_to_the_reference() -> None:
    from research import refine_cost

    base = RefineOptions()
    assert refine_cost.recipe_options("c3e10b100", base) == RefineOptions(augment_copies=3, finetune_epochs=10,
                                                                            finetune_batch=100)
    assert refine_cost.recipe_options("c2e6", base).finetune_batch == base.finetune_batch
    with pytest.raises(ValueError, match="c<copies>e<epochs>"):
        refine_cost.recipe_options("e10", base)
    names = [p.name for p in refine_cost.paths(["c2e6"], quick=False)]
    assert names[:2] == ["reference", "same recipe"] and names[-1] == "c2e6"
    assert ("shipped" in names) == (RefineOptions() != refine_cost.TODAY)

    def run(cpu: float, test: float) -> dict:
        return {"cpu_seconds": cpu, "wall_seconds": 2 * cpu, "audit": test, "test": test}

    records = [{"runs": {"reference": run(30.0, 0.80), "shipped": run(10.0, 0.79)}},
               {"runs": {"reference": run(10.0, 0.70), "shipped": run(5.0, 0.72)}}]
    rows = {r["path"]: r for r in refine_cost.summary(records, ["reference", "shipped"])}
    assert rows["reference"]["cpu_ratio"] == 1.0
    assert rows["shipped"]["cpu_ratio"] == pytest.approx(15 / 40)
    assert (rows["shipped"]["cell_cpu_ratio_min"], rows["shipped"]["cell_cpu_ratio_max"]) == pytest.approx((1 / 3, 0.5))
    assert rows["shipped"]["test_vs_reference"] == pytest.approx(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("name, shape", [("mlp", (1, 8, 8)), ("fednet", (1, 28, 28))])
def test_activation_alignment_undoes_a_hidden_permutation(name: str, shape: tuple[int, int, int]) -> None:
    model = build_model(name, shape, 10, seed=0)
    spec = permutation_spec(model)
    original = H.state_numpy(model)
    rng = np.random.default_rng(1)
    sizes = spec.sizes({k: v.shape for k, v in original.items()})
    shuffle = {p: rng.permutation(n) for p, n in sizes.items()}
    shuffled = apply_permutations(original, spec, shuffle)
    inputs = torch.randn(64, *shape, generator=torch.Generator().manual_seed(2))
    acts = [AC.hidden_activations(H.load_numpy(build_model(name, shape, 10), m), spec, inputs)
            for m in (original, shuffled)]
    # the two models compute the same function, so the probe must find the shuffle's inverse
    perms = AC.activation_alignment(acts, reference=0)
    assert all(np.array_equal(perms[p][0], np.arange(sizes[p])) for p in sizes)
    for p in sizes:  # units silent on every input carry no signal: only the active ones are pinned down
        active = acts[0][p].std(1) > 0
        assert active.mean() > 0.5
        np.testing.assert_array_equal(perms[p][1][active], invert_permutation(shuffle[p])[active])
    assert not all(np.array_equal(shuffled[k], original[k]) for k in original)


@pytest.mark.slow
def test_weight_movement_reports_distance_and_cosine_of_weight_tensors_only() -> None:
    w0 = {"w": np.array([[1.0, 0.0], [0.0, 1.0]]), "b": np.zeros(2)}
    moved = AC.weight_movement({"w": np.array([[1.0, 1.0], [0.0, 1.0]]), "b": np.ones(2)}, w0)
    assert set(moved) == {"w"}
    assert moved["w"]["relative_distance"] == pytest.approx(1 / np.sqrt(2))
    assert moved["w"]["cosine"] == pytest.approx(2 / np.sqrt(2) / np.sqrt(3))


@pytest.fixture(scope="module")
def digits_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One upload cache shared by the smoke runs below (digits, 3 clients, 1 epoch: trained once)."""
    return tmp_path_factory.mktemp("research_cache")


def _digits_cells(cache: Path, out: Path) -> list[str]:
    """The audit scripts' options for one tiny digits cell."""
    return ["--cells", "0.5:shared:0:1", "--dataset", "digits", "--model", "mlp", "--clients", "3",
            "--validation-size", "200", "--cache-dir", str(cache), "--out", str(out)]


@pytest.mark.slow
def test_fisher_inflation_runs_the_honest_and_the_inflated_round_through_the_strategy(tmp_path: Path,
                                                                                      digits_cache: Path) -> None:
    from research import fisher_inflation

    fisher_inflation.main(["--datasets", "digits", "--factors", "1e3", "--caps", "none", "--attackers", "0",
                           "--clients", "3", "--epochs", "1", "--grid", "tiny", "--cache-dir", str(digits_cache),
                           "--out", str(tmp_path), "--name", "fi"])
    rows = json.loads((tmp_path / "fi.json").read_text())["rows"]
    assert [(r["factor"], r["attacker"]) for r in rows] == [("honest", None), ("1e3", 0)]
    honest, inflated = rows
    assert honest["attacker_share"] == 0.0 and 0.0 <= inflated["attacker_share"] <= 1.0
    assert all(0.0 <= r["test_accuracy"] <= 1.0 for r in rows)
    assert "| digits |" in (tmp_path / "fi.md").read_text()


@pytest.mark.slow
def test_refit_check_scores_selection_only_and_refit_on_the_audit_fold(tmp_path: Path, digits_cache: Path) -> None:
    from research import refit_check

    (rec,) = refit_check.main(_digits_cells(digits_cache, tmp_path))
    assert rec["dataset"] == "digits" and rec["validation_size"] == 200
    assert rec["refit_examples"] == 150  # the fitting fold (100) and the selection fold (50) of 200
    for key in ("selection_only_audit", "refit_audit", "selection_only_test", "refit_test"):
        assert 0.0 <= rec[key] <= 1.0, key
    assert "Mean gain of the refit" in (tmp_path / "refit_check.md").read_text()


@pytest.mark.slow
def test_finetune_check_scores_every_rule_of_one_cell(tmp_path: Path, digits_cache: Path) -> None:
    from research import finetune_check

    (rec,) = finetune_check.main(_digits_cells(digits_cache, tmp_path))
    assert {"previous", "cosine, every 2", "cosine, last", "cosine, last, starts only"} <= set(rec["rules"])
    page = (tmp_path / "finetune_check.md").read_text()
    assert "| 0.5 | shared | 1 | 0 |" in page
    assert json.loads((tmp_path / "finetune_check.json").read_text())["command"].endswith("--cells 0.5:shared:0:1")


@pytest.mark.slow
def test_refine_gap_reports_every_group_on_the_fitting_fold(tmp_path: Path, digits_cache: Path) -> None:
    from research import refine_gap

    payload = refine_gap.main(["--dataset", "digits", "--model", "mlp", "--clients", "3", "--validation-size", "200",
                               "--alphas", "0.5", "--inits", "shared", "--epochs", "1", "--ridges", "0.1",
                               "--augment", "0", "--bary-iters", "1", "--finetune-epochs", "1", "--grid", "tiny",
                               "--cache-dir", str(digits_cache), "--out", str(tmp_path), "--name", "gap"])
    groups = {r["group"] for r in payload["records"]}
    assert "merge" in groups and len(groups) >= 3
    assert all(0.0 <= r["test_accuracy"] <= 1.0 for r in payload["records"])
    assert (tmp_path / "gap.md").is_file()


@pytest.mark.slow
def test_trace_speed_finds_the_same_spec_by_both_paths(tmp_path: Path) -> None:
    from research import trace_speed

    rows = trace_speed.main(["--models", "mlp", "fednet", "--repeats", "1", "--threads", "1",
                             "--out", str(tmp_path / "trace.md")])
    assert [r["model"] for r in rows] == ["mlp", "fednet"]
    assert all(r["same"] for r in rows)
    assert "| mlp |" in (tmp_path / "trace.md").read_text()


@pytest.mark.slow
def test_resnet_channel_groups_finds_no_failing_group_of_ours(tmp_path: Path) -> None:
    from research import resnet_channel_groups

    payload = resnet_channel_groups.main(["--models", "layernorm_mlp", "resnet20", "--out", str(tmp_path)])
    rows = {r["model"]: r for r in payload["rows"]}
    assert set(rows) == {"layernorm_mlp", "resnet20"}
    assert all(r["ours_groups"] >= 1 and r["ours_failing"] == [] for r in rows.values())
    page = (tmp_path / "resnet20_channel_groups.md").read_text()
    assert "| layernorm_mlp |" in page  # without torch-pruning its columns say why


@pytest.mark.slow
def test_refine_cost_quick_runs_the_reference_and_the_shipped_passes(tmp_path: Path) -> None:
    from research import refine_cost

    (record,) = refine_cost.main(["--quick", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path),
                                  "--name", "cost"])
    assert list(record["runs"])[:2] == ["reference", "same recipe"]
    assert ("shipped" in record["runs"]) == (RefineOptions() != refine_cost.TODAY)
    for run in record["runs"].values():
        assert run["cpu_seconds"] > 0 and 0.0 <= run["test"] <= 1.0
    assert "| reference |" in (tmp_path / "cost.md").read_text()


@pytest.mark.slow
def test_sweep_cost_finds_the_baselines_choice_on_digits(tmp_path: Path) -> None:
    from research import sweep_cost

    sweep_cost.main(["--datasets", "digits", "--inits", "shared", "--cache-dir", str(tmp_path / "cache"),
                     "--out", str(tmp_path / "sweep.md")])
    page = (tmp_path / "sweep.md").read_text()
    assert "| digits (mlp) shared |" in page and "research/sweep_cost.py" in page
    assert "| NO |" not in page  # every variant returns the baseline's choice, model bytes included


def test_gram_weight_norms_reports_each_merges_norms_and_the_next_epoch(tmp_path: Path) -> None:
    from research import gram_weight_norms as GW

    rows = GW.main(["--dataset", "digits", "--clients", "3", "--epochs", "1", "--knobs", "1,0", "1,0.5",
                    "--out", str(tmp_path / "norms.md"), "--cache-dir", str(tmp_path / "cache")])
    assert rows[0]["merge"].startswith("FedAvg") and len(rows) == 1 + 2 * 2
    assert all(r["norms"] and all(v > 0 for v in r["norms"].values()) for r in rows)
    assert all(r["next_epoch"] and all(math.isfinite(v) for v in r["next_epoch"]) for r in rows)
    # a ridge only shrinks the closed form: the ridge-0.5 aligned merge has the smaller norms
    plain, ridged = rows[1], rows[3]
    assert sum(ridged["norms"].values()) < sum(plain["norms"].values())
    assert "next epoch's loss" in (tmp_path / "norms.md").read_text()
    assert rows[0]["growth"] <= 1 + 1e-9  # FedAvg is no longer than the longest client: a weighted mean
    assert all(r["growth"] > 0 for r in rows)
