"""FedFiOT with K-FAC's curvature (the input Gram with a diagonal output factor): the client's output factor is
the bias's empirical Fisher, the engine equals the reference form, no alternation step raises J, a large damping
gives the Gram curvature's merge, the strategy asks for and merges the factors within FedAvg's bytes, a reply
without them or with a broken one is excluded naming the client, one client's inflated output factors leave the
merge as it was, and its inflated Gram is capped."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from flwr.app import Array

from _fedfiot_helpers import SPEC, configure_round, one_torch_thread, task_identity  # noqa: F401
from test_gram_strategy import _client, _replies
from test_merge_gram import _loader, _model, _uploads, assert_same_merge
from fedfiot_flwr import FedFiOT, FedFiOTConfig, fisher_reply
from fedfiot_flwr.algorithm import GramCurvature, fedfiot_gram_merge
from fedfiot_flwr.curvature import input_grams
from fedfiot_flwr.fisher import diagonal_fisher
from fedfiot_flwr.merge import MergeOptions, merge
from fedfiot_flwr.merge.kfac import row_weights
from fedfiot_flwr.options import CURVATURE_CONFIG_KEY, DEFAULT_GRAM_RIDGE
from fedfiot_flwr.wire import ARRAYS_RECORD, decode_reply
from fedfiot_flwr.wire.sizes import fedavg_payload_bytes, payload_bytes


def _with_outputs(kind: str, seed: int = 0) -> tuple:
    """Random client uploads with skewed output factors (some units near zero, some large)."""
    models, grams, sizes, spec = _uploads(kind)
    rng = np.random.default_rng(seed)
    grams = [{l: replace(g, output=rng.gamma(0.5, size=models[k][g.weight].shape[0])) for l, g in gk.items()}
             for k, gk in enumerate(grams)]
    return models, grams, sizes, spec


@pytest.fixture(scope="module", params=("mlp", "cnn", "resnet"))
def uploads(request: pytest.FixtureRequest) -> tuple:
    return (request.param, *_with_outputs(request.param))


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_the_output_factor_is_the_empirical_fisher_of_each_layers_bias(kind: str) -> None:
    model, shape = _model(kind, 0)
    loader = _loader(0, shape)
    grams = input_grams(model, loader, convolutions=True, outputs=True)
    fisher = diagonal_fisher(model, loader, "empirical")
    plain = input_grams(model, loader, convolutions=True)
    for name, g in grams.items():
        np.testing.assert_array_equal(g.gram, plain[name].gram)  # the backward pass leaves the Grams as they were
        assert g.output is not None and g.output.shape == (model.state_dict()[g.weight].shape[0],)
        np.testing.assert_allclose(g.output, fisher[g.bias].numpy(), rtol=1e-5, err_msg=name)


def test_the_engine_equals_the_reference_form(uploads: tuple) -> None:
    _, models, grams, sizes, spec = uploads
    ridge = 0.1  # well conditioned: the per-row solves agree to rounding (singular sums below)
    ref = fedfiot_gram_merge(models, grams, sizes, spec, curvature=GramCurvature(0.9, ridge, 0.3))
    out = merge(models, grams, spec, MergeOptions(curvature="kfac", gram_alpha=0.9, gram_ridge=ridge, kfac_damping=0.3),
                num_examples=sizes)
    assert_same_merge(out, ref, spec, 1e-9)


def test_with_singular_sums_the_engine_reaches_the_reference_forms_alignment_and_objective(uploads: tuple) -> None:
    _, models, grams, sizes, spec = uploads
    ref = fedfiot_gram_merge(models, grams, sizes, spec, curvature=GramCurvature(1.0, 0.0, 0.3))
    out = merge(models, grams, spec, MergeOptions(curvature="kfac", kfac_damping=0.3), num_examples=sizes)
    for p in spec.perm_names:
        assert all(np.array_equal(a, b) for a, b in zip(out.permutations[p], ref.permutations[p])), p
    np.testing.assert_allclose([out.aligned_objective, out.identity_objective], ref.objectives, rtol=1e-8)


def test_no_step_of_the_alternation_raises_the_objective(uploads: tuple) -> None:
    kind, models, grams, sizes, spec = uploads
    ref = fedfiot_gram_merge(models, grams, sizes, spec, curvature=GramCurvature(1.0, 0.0, 0.3), reference=0)
    for group, steps in ref.steps.items():
        assert len(steps) >= 2, group
        for before, after in zip(steps, steps[1:]):
            assert after <= before + 1e-9 * max(1.0, abs(before)), (kind, group, steps)
    out = merge(models, grams, spec, MergeOptions(curvature="kfac", kfac_damping=0.3, reference=0), num_examples=sizes)
    for group, report in out.reports.items():
        for before, after in zip(report.objectives, report.objectives[1:]):
            assert after <= before + 1e-9 * max(1.0, abs(before)), (kind, group, report.objectives)


def test_the_output_factor_changes_the_merge_and_a_large_damping_gives_the_gram_curvatures() -> None:
    models, grams, sizes, spec = _with_outputs("cnn")
    gram = merge(models, grams, spec, MergeOptions(curvature="gram"), num_examples=sizes).model
    flat = merge(models, grams, spec, MergeOptions(curvature="kfac", kfac_damping=1e9), num_examples=sizes).model
    kfac = merge(models, grams, spec, MergeOptions(curvature="kfac", kfac_damping=0.1), num_examples=sizes).model
    for name, value in gram.items():
        np.testing.assert_allclose(flat[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    assert max(float(np.max(np.abs(kfac[n] - gram[n]))) for n in gram) > 1e-2


def test_a_unit_only_one_client_uses_takes_that_clients_weights() -> None:
    """One Linear layer, two clients with the same inputs: a unit whose output factor is zero on client 1 and
    large on client 0 lands near client 0's row, and the other way round."""
    rng = np.random.default_rng(3)
    a = rng.normal(size=(50, 4))
    gram = a.T @ a / 50
    w = [rng.normal(size=(2, 4)) for _ in range(2)]
    spec_one = type(SPEC)({"l.weight": (None, None)})
    from fedfiot_flwr.psd import InputGram
    grams = [{"l": InputGram("l.weight", None, gram, np.array([100.0, 0.0]))},
             {"l": InputGram("l.weight", None, gram, np.array([0.0, 100.0]))}]
    out = merge([{"l.weight": x} for x in w], grams, spec_one,
                MergeOptions(curvature="kfac", kfac_damping=0.01, matching="none"), num_examples=[1, 1]).model
    h = row_weights(np.array([100.0, 0.0]), 0.01)
    expected_row0 = (h[0] * w[0][0] + h[1] * w[1][0]) / (h[0] + h[1])  # same Gram: the weighted mean of the rows
    np.testing.assert_allclose(out["l.weight"][0], expected_row0, rtol=1e-10)
    assert np.linalg.norm(out["l.weight"][0] - w[0][0]) < 0.02 * np.linalg.norm(w[0][0] - w[1][0])
    assert np.linalg.norm(out["l.weight"][1] - w[1][1]) < 0.02 * np.linalg.norm(w[0][1] - w[1][1])


def _strategy(growth: float | None = None) -> FedFiOT:
    config = FedFiOTConfig.default(curvature="kfac", fisher_rounds=None, max_iters=3, gram_growth=growth)
    return FedFiOT(spec=SPEC, config=config, min_valid_replies=2)


def test_a_kfac_round_asks_for_the_factors_and_returns_the_engines_merge_within_fedavgs_bytes() -> None:
    strategy = _strategy()
    sent = configure_round(strategy, [1, 2, 3])
    assert {msg.content["config"][CURVATURE_CONFIG_KEY] for msg in sent.values()} == {"kfac"}
    replies = _replies(sent)
    model, _ = _client(0)
    for msg in replies:
        assert payload_bytes(msg.content)["total"] <= fedavg_payload_bytes(model.state_dict())
    arrays, _ = strategy.aggregate_train(1, replies)
    decoded = [decode_reply(m.content, "gram-output", client=str(i), expected_shapes=None) for i, m in enumerate(replies)]
    assert all(g.output is not None for d in decoded for g in d.grams.values())
    expected = merge([d.weights for d in decoded], [d.grams for d in decoded], SPEC,
                     MergeOptions(curvature="kfac", gram_alpha=0.9, gram_ridge=DEFAULT_GRAM_RIDGE, max_iters=3),
                     num_examples=[d.num_examples for d in decoded])
    got = {k: v.numpy() for k, v in arrays.items()}
    for name, value in expected.model.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    assert strategy.server_metrics[1]["num-valid"] == 3


def test_a_reply_without_output_factors_or_with_a_broken_one_is_excluded_naming_the_client() -> None:
    strategy = _strategy()
    sent = configure_round(strategy, [1, 2, 3, 4, 5])
    nodes = sorted(sent)
    grams_only = fisher_reply(*_client(9), {"train-loss": 1.0}, config={CURVATURE_CONFIG_KEY: "gram"})

    def broken(value: float):  # noqa: ANN202
        def edit(content):  # noqa: ANN001, ANN202
            arrays = content.array_records[ARRAYS_RECORD]
            key = next(k for k in arrays if k.endswith("/output"))
            arr = arrays[key]
            arrays[key] = Array(dtype=arr.dtype, shape=tuple(arr.shape), stype=arr.stype,
                                data=np.float32(value).tobytes() + arr.data[4:])
            return content
        return edit

    replies = _replies(sent, {0: lambda c: grams_only, 1: broken(np.nan), 2: broken(-1.0)})
    arrays, _ = strategy.aggregate_train(1, replies)
    rejected = {r["client"]: r["reason"] for r in strategy.reports[0]["rejected"]}
    assert set(rejected) == {str(n) for n in nodes[:3]}
    assert "output factors" in rejected[str(nodes[0])]
    for node in nodes[1:3]:
        assert "output factor 'curvature/" in rejected[str(node)] and "NaN, inf or negative" in rejected[str(node)]
    assert arrays is not None  # the round goes on with the two valid replies
    assert strategy.server_metrics[1]["num-valid"] == 2


@pytest.mark.parametrize("inflate", [1e3, 1e6])
def test_one_clients_inflated_output_factors_leave_the_merge_as_it_was(inflate: float) -> None:
    models, grams, sizes, spec = _with_outputs("cnn")
    inflated = [dict(gk) for gk in grams]
    inflated[1] = {l: replace(g, output=g.output * inflate) for l, g in grams[1].items()}
    options = MergeOptions(curvature="kfac", kfac_damping=0.3, gram_ridge=0.01)
    honest = merge(models, grams, spec, options, num_examples=sizes).model
    attacked = merge(models, inflated, spec, options, num_examples=sizes).model
    for name, value in honest.items():
        np.testing.assert_allclose(attacked[name], value, rtol=1e-7, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("inflate", [1e3, 1e6, float(np.finfo(np.float32).max) / 1e3])
def test_one_inflated_gram_under_kfac_is_capped_to_the_other_clients_median(inflate: float) -> None:
    from fedfiot_flwr.server.outcome import RoundContext
    from fedfiot_flwr.server.selection import sweep_candidates
    from fedfiot_flwr.server.uploads import CollectedUploads

    decoded = []
    for k in range(4):
        content = fisher_reply(*_client(k), {}, config={CURVATURE_CONFIG_KEY: "kfac"})
        decoded.append(decode_reply(content, "gram-output", client=str(k), expected_shapes=None))

    def merged(attack: float | None, cap: float | None) -> dict:
        grams = [dict(d.grams) for d in decoded]
        if attack is not None:
            grams[3] = {l: replace(g, gram=g.gram * attack) for l, g in grams[3].items()}
        collected = CollectedUploads(client_ids=[str(i) for i in range(4)], weights=[d.weights for d in decoded],
                                     num_examples=[d.num_examples for d in decoded], grams=grams)
        config = FedFiOTConfig.default(curvature="kfac", gram_cap=cap, gram_growth=None).without_validation()
        return sweep_candidates(collected, SPEC, config, RoundContext(server_round=1)).model

    def distance(a: dict, b: dict) -> float:
        return float(np.sqrt(sum(np.sum((np.asarray(a[n], float) - b[n]) ** 2) for n in a)))

    honest = merged(None, 100.0)
    assert distance(merged(inflate, 100.0), honest) < 0.25 * distance(merged(inflate, None), honest)
