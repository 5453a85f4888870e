"""FedFiOT with the Gram curvature, as the reference writes it: the alternation never raises its objective,
the identity rule compares the same objective, a permuted copy is recovered, and without alignment the
merge is RegMean's."""

from __future__ import annotations

import numpy as np
import pytest

from fedfiot_flwr.algorithm import GramCurvature, fedfiot_gram_merge
from fedfiot_flwr.baselines.regmean import regmean_merge
from fedfiot_flwr.merge.spec import PermutationSpec, mlp_spec
from fedfiot_flwr.psd import InputGram

WIDTHS = (5, 7, 6, 3)  # inputs, two hidden layers, classes
LAYERS = ("fc1", "fc2", "fc3")


def _relu(z: np.ndarray) -> np.ndarray:
    return np.maximum(z, 0.0)


def _client(rng: np.random.Generator, n: int, inputs: list | None = None) -> tuple[dict[str, np.ndarray], dict[str, InputGram]]:
    """A random MLP and the Grams of its layers' inputs on n random examples of its own (a bias's input of ones
    last); with ``inputs``, each layer's inputs are appended to it."""
    model = {}
    for name, d_in, d_out in zip(LAYERS, WIDTHS[:-1], WIDTHS[1:]):
        model[f"{name}.weight"] = rng.normal(size=(d_out, d_in)).astype(np.float32)
        model[f"{name}.bias"] = rng.normal(size=d_out).astype(np.float32)
    x = rng.normal(loc=rng.normal(size=WIDTHS[0]), size=(n, WIDTHS[0]))
    grams = {}
    for name in LAYERS:
        if inputs is not None:
            inputs.append(x)
        xa = np.concatenate([x, np.ones((n, 1))], axis=1)
        grams[name] = InputGram(f"{name}.weight", f"{name}.bias", xa.T @ xa / n)
        x = _relu(x @ model[f"{name}.weight"].T.astype(np.float64) + model[f"{name}.bias"])
    return model, grams


def _clients(seed: int, k: int = 3) -> tuple[list, list, list[int]]:
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(20, 60, size=k)]
    models, grams = zip(*(_client(rng, n) for n in sizes))
    return list(models), list(grams), sizes


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("curvature", [GramCurvature(), GramCurvature(alpha=0.5, ridge=1e-3)], ids=["exact", "scaled"])
def test_no_step_of_the_alternation_raises_the_objective(seed: int, curvature: GramCurvature) -> None:
    models, grams, sizes = _clients(seed)
    out = fedfiot_gram_merge(models, grams, sizes, mlp_spec(list(LAYERS)), curvature=curvature, max_iters=20)
    for group, trace in out.steps.items():
        assert len(trace) >= 3, group  # the starting point, an assignment and an aggregation at least
        rises = [b - a for a, b in zip(trace, trace[1:]) if b > a + 1e-9 * max(1.0, abs(a))]
        assert not rises, f"{group}: the objective rose by {rises} along {trace}"
        assert trace[-1] < trace[0]  # random clients: the alternation gains something


@pytest.mark.parametrize("seed", range(6))
def test_the_identity_rule_keeps_the_merge_with_the_lower_objective(seed: int) -> None:
    models, grams, sizes = _clients(seed)
    spec = mlp_spec(list(LAYERS))
    out = fedfiot_gram_merge(models, grams, sizes, spec, reference=0)
    aligned, identity = out.objectives
    assert out.aligned == (aligned <= identity)
    assert sum(out.layer_objectives[0].values()) == aligned and sum(out.layer_objectives[1].values()) == identity
    assert set(out.layer_objectives[0]) == set(LAYERS)
    unaligned = fedfiot_gram_merge(models, grams, sizes, PermutationSpec({n: (None,) * models[0][n].ndim
                                                                          for n in models[0]}))
    assert unaligned.objectives[0] == pytest.approx(identity, rel=1e-10)  # the same J, measured without alignment
    kept = out.model if out.aligned else unaligned.model
    assert all(np.array_equal(out.model[n], kept[n]) for n in kept)


def test_a_client_that_is_a_permuted_copy_is_recovered_exactly() -> None:
    rng = np.random.default_rng(3)
    model, grams = _client(rng, 40)
    p1, p2 = rng.permutation(WIDTHS[1]), rng.permutation(WIDTHS[2])
    copy = {"fc1.weight": model["fc1.weight"][p1], "fc1.bias": model["fc1.bias"][p1],
            "fc2.weight": model["fc2.weight"][p2][:, p1], "fc2.bias": model["fc2.bias"][p2],
            "fc3.weight": model["fc3.weight"][:, p2], "fc3.bias": model["fc3.bias"]}
    gram2 = grams["fc2"].gram[np.ix_([*p1, WIDTHS[1]], [*p1, WIDTHS[1]])]
    gram3 = grams["fc3"].gram[np.ix_([*p2, WIDTHS[2]], [*p2, WIDTHS[2]])]
    copy_grams = {"fc1": grams["fc1"], "fc2": InputGram("fc2.weight", "fc2.bias", gram2),
                  "fc3": InputGram("fc3.weight", "fc3.bias", gram3)}
    out = fedfiot_gram_merge([model, copy], [grams, copy_grams], [40, 40], mlp_spec(list(LAYERS)), reference=0)
    assert out.aligned and out.objectives[0] == pytest.approx(0.0, abs=1e-8)
    assert np.array_equal(out.permutations["P_fc1"][1], np.argsort(p1))
    assert np.array_equal(out.permutations["P_fc2"][1], np.argsort(p2))
    assert all(np.allclose(out.model[n], model[n], atol=1e-5) for n in model)


@pytest.mark.parametrize("alpha", [0.1, 0.9, 1.0])
def test_without_alignment_the_merge_is_regmean(alpha: float) -> None:
    models, grams, sizes = _clients(11, k=4)
    models = [{n: t.astype(np.float64) for n, t in m.items()} for m in models]  # compared beyond float32's rounding
    no_groups = PermutationSpec({n: (None,) * models[0][n].ndim for n in models[0]})
    ours = fedfiot_gram_merge(models, grams, sizes, no_groups, curvature=GramCurvature(alpha=alpha)).model
    theirs = regmean_merge(models, grams, sizes, alpha=alpha)
    for name in theirs:
        a, b = ours[name].astype(np.float64), theirs[name].astype(np.float64)
        assert np.max(np.abs(a - b)) <= 1e-10 * max(1.0, float(np.max(np.abs(b)))), name


def test_a_bad_gram_is_refused_naming_the_client_and_the_layer() -> None:
    models, grams, sizes = _clients(0)
    bad = dict(grams[2], fc2=InputGram("fc2.weight", "fc2.bias", grams[2]["fc2"].gram[:-1, :-1]))
    with pytest.raises(ValueError, match=r"client 2, Gram of 'fc2'"):
        fedfiot_gram_merge(models, [grams[0], grams[1], bad], sizes, mlp_spec(list(LAYERS)))
    nan = grams[1]["fc1"].gram.copy()
    nan[0, 0] = np.nan
    with pytest.raises(ValueError, match=r"client 1, Gram of 'fc1': not finite"):
        fedfiot_gram_merge(models, [grams[0], dict(grams[1], fc1=InputGram("fc1.weight", "fc1.bias", nan)), grams[2]],
                           sizes, mlp_spec(list(LAYERS)))
    with pytest.raises(ValueError, match="alpha"):
        GramCurvature(alpha=1.5)


def test_the_objective_is_the_squared_pre_activation_difference_on_each_clients_own_inputs() -> None:
    """J from its definition, with no Gram: each client's inputs of each layer, in the merge's order, through the
    merged layer and through the client's aligned layer, weighted by the client's share of the examples."""
    rng = np.random.default_rng(5)
    sizes = [30, 45, 25]
    inputs: list[list[np.ndarray]] = [[] for _ in sizes]
    models, grams = zip(*(_client(rng, n, inputs[k]) for k, n in enumerate(sizes)))
    out = fedfiot_gram_merge(list(models), list(grams), sizes, mlp_spec(list(LAYERS)), reference=1)
    assert out.aligned
    merged, perms = out.model, [out.permutations["P_fc1"], out.permutations["P_fc2"]]
    J = 0.0
    for k, (model, xs) in enumerate(zip(models, inputs)):
        rows = [perms[0][k], perms[1][k], np.arange(WIDTHS[3])]
        cols = [np.arange(WIDTHS[0]), perms[0][k], perms[1][k]]
        for name, x, r, c in zip(LAYERS, xs, rows, cols):
            w, b = model[f"{name}.weight"].astype(np.float64)[r][:, c], model[f"{name}.bias"].astype(np.float64)[r]
            diff = x[:, c] @ (merged[f"{name}.weight"].astype(np.float64) - w).T + (merged[f"{name}.bias"] - b)
            J += sizes[k] / sum(sizes) * float(np.mean(np.sum(diff**2, axis=1)))
    assert out.objectives[0] == pytest.approx(J, rel=1e-4)  # the merged model is float32
