"""The merge engine with the Gram curvature: equal to the reference form on an MLP, a CNN and a small ResNet,
no step of its alternation raises the objective, the objective is the clients' pre-activation differences,
RegMean is its case without alignment, and bad Grams are refused naming the client and the layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedfiot_flwr.algorithm import GramCurvature, fedfiot_gram_merge
from fedfiot_flwr.baselines.regmean import regmean_merge
from fedfiot_flwr.curvature import input_grams
from fedfiot_flwr.merge import MergeOptions, PermutationSpec, apply_permutations, merge, prepare_clients
from fedfiot_flwr.merge.gram import input_order, prepare_grams
from fedfiot_flwr.models import ConvNet, build_model, permutation_spec
from fedfiot_flwr.psd import InputGram


def _loader(seed: int, shape: tuple[int, ...], n: int = 24) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=gen) + torch.randn(shape, generator=gen)
    y = torch.randint(0, 3, (n,), generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _model(kind: str, seed: int) -> tuple[torch.nn.Module, tuple[int, ...]]:
    torch.manual_seed(seed)
    if kind == "mlp":
        return build_model("mlp", (1, 4, 4), 3, seed=seed), (1, 4, 4)
    if kind == "cnn":
        return ConvNet((1, 10, 10), 3, (4, 5), (6, 5), 3, True), (1, 10, 10)
    model = build_model("resnet20-w2", (3, 8, 8), 3, seed=seed)
    with torch.no_grad():  # BatchNorm statistics of a trained model, not the initial ones
        model.train()
        for x, _ in _loader(seed + 100, (3, 8, 8)):
            model(x)
    return model, (3, 8, 8)


def _uploads(kind: str, k: int = 3, seed: int = 0) -> tuple[list, list, list[int], PermutationSpec]:
    """Independent random client models, the Grams of their Linear and Conv2d inputs on data of their own."""
    models, grams, sizes = [], [], []
    for c in range(k):
        model, shape = _model(kind, 10 * seed + c)
        loader = _loader(10 * seed + c, shape, n=16 + 8 * c)
        grams.append(input_grams(model, loader, convolutions=True))
        models.append({n: t.detach().numpy().copy() for n, t in model.state_dict().items()})
        sizes.append(16 + 8 * c)
    return models, grams, sizes, permutation_spec(model)


KINDS = ("mlp", "cnn", "resnet")


@pytest.fixture(scope="module", params=KINDS)
def uploads(request: pytest.FixtureRequest) -> tuple:
    return (request.param, *_uploads(request.param))


@pytest.mark.parametrize("knobs", [(1.0, 0.0), (0.5, 0.1)])
def test_the_engine_equals_the_reference_form(uploads: tuple, knobs: tuple[float, float]) -> None:
    _, models, grams, sizes, spec = uploads
    alpha, ridge = knobs
    ref = fedfiot_gram_merge(models, grams, sizes, spec, curvature=GramCurvature(alpha, ridge))
    out = merge(models, grams, spec, MergeOptions(curvature="gram", gram_alpha=alpha, gram_ridge=ridge),
                num_examples=sizes)
    assert_same_merge(out, ref, spec, 1e-10)


def assert_same_merge(out, ref, spec: PermutationSpec, tol: float) -> None:  # noqa: ANN001
    """The engine's merge ``out`` is the reference form's ``ref``: identity decision, permutations, models (to
    ``tol`` of each tensor's scale, same dtypes) and objectives (to ``tol`` relative)."""
    assert out.aligned == ref.aligned
    for p in spec.perm_names:
        assert all(np.array_equal(a, b) for a, b in zip(out.permutations[p], ref.permutations[p])), p
    for name, value in ref.model.items():
        scale = max(1.0, float(np.max(np.abs(value))))
        np.testing.assert_allclose(out.model[name], value, rtol=0, atol=tol * scale, err_msg=name)
        assert out.model[name].dtype == value.dtype
    np.testing.assert_allclose([out.aligned_objective, out.identity_objective], ref.objectives, rtol=tol)


def test_no_step_of_the_alternation_raises_the_objective(uploads: tuple) -> None:
    kind, models, grams, sizes, spec = uploads
    out = merge(models, grams, spec, MergeOptions(curvature="gram", reference=0), num_examples=sizes)
    moved = 0.0
    for name, report in out.reports.items():
        steps = [report.initial_objective]
        for aligned, aggregated in zip(report.alignment_objectives, report.objectives):
            steps += [aligned, aggregated]
        tol = 1e-9 * max(steps)
        assert all(b <= a + tol for a, b in zip(steps, steps[1:])), (kind, name, steps)
        moved += sum(report.fraction_permuted)
    assert moved > 0  # independent models: the alignment moved units
    assert out.aligned == (out.aligned_objective <= out.identity_objective)


def test_each_distinct_summed_gram_is_factorised_once_per_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first layer's inputs are never permuted: its summed Gram is the same in every alternation pass and in
    both final merges, and its pseudo-inverse (an eigendecomposition) is computed once; the merge is unchanged."""
    _, models, grams, sizes, spec = ("cnn", *_uploads("cnn"))
    first = next(iter(grams[0].values())).gram.shape[0]
    options = MergeOptions(curvature="gram", max_iters=3)
    fresh = merge(models, grams, spec, options, num_examples=sizes)
    eigh, sizes_seen = np.linalg.eigh, []
    monkeypatch.setattr(np.linalg, "eigh", lambda a, *x, **k: (sizes_seen.append(a.shape[0]), eigh(a, *x, **k))[1])
    out = merge(models, grams, spec, options, num_examples=sizes)
    assert sizes_seen.count(first) == 1 and len(sizes_seen) > 1
    assert sum(len(r.objectives) for r in out.reports.values()) > len(out.reports)  # several passes ran
    assert all(np.array_equal(out.model[n], fresh.model[n]) for n in fresh.model)


def test_a_permuted_copy_of_a_cnn_is_recovered_exactly() -> None:
    models, grams, sizes, spec = _uploads("cnn", k=1)
    rng = np.random.default_rng(0)
    perm = {p: rng.permutation(n) for p, n in spec.sizes({k: v.shape for k, v in models[0].items()}).items()}
    copy = apply_permutations(models[0], spec, perm)
    copy_grams = {}
    for name, g in grams[0].items():
        entry = spec.axes[g.weight][1]
        order = np.argsort(input_order(entry, perm, models[0][g.weight].shape, g.bias is not None))
        copy_grams[name] = InputGram(g.weight, g.bias, g.gram[np.ix_(order, order)])
    out = merge([models[0], copy], [grams[0], copy_grams], spec, MergeOptions(curvature="gram", reference=0),
                num_examples=[10, 30])
    assert out.aligned and out.objective < 1e-8 * out.identity_objective
    for name, value in models[0].items():
        np.testing.assert_allclose(out.model[name], value, atol=1e-5, err_msg=name)


def test_a_convolutions_term_is_its_squared_pre_activation_differences_on_each_clients_patches() -> None:
    torch.manual_seed(0)
    convs = [torch.nn.Conv2d(2, 3, 3, padding=1, stride=2) for _ in range(2)]
    loaders = [_loader(c, (2, 7, 7), n=12) for c in range(2)]
    grams = [input_grams(torch.nn.Sequential(conv, torch.nn.Flatten()), loader, convolutions=True)
             for conv, loader in zip(convs, loaders)]
    models = [{f"0.{n}": t.detach().numpy().astype(np.float64) for n, t in conv.state_dict().items()} for conv in convs]
    out = merge(models, grams, PermutationSpec({}), MergeOptions(curvature="gram", matching="none"),
                num_examples=[12, 12])
    merged = torch.nn.Conv2d(2, 3, 3, padding=1, stride=2).double()
    merged.load_state_dict({n[2:]: torch.from_numpy(np.asarray(v, dtype=np.float64)) for n, v in out.model.items()})
    expected = 0.0
    for conv, loader in zip(convs, loaders):
        x = torch.cat([b for b, _ in loader]).double()
        with torch.no_grad():
            diff = merged(x) - conv.double()(x)  # (N, C_out, H', W')
        expected += 0.5 * float(diff.pow(2).sum(dim=1).mean())  # share 1/2, mean over examples and positions
    np.testing.assert_allclose(out.objective, expected, rtol=1e-5)


def test_regmean_is_the_engine_without_alignment_and_fits_the_union_of_the_inputs_in_least_squares() -> None:
    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(n, 4)) for n in (10, 30)]
    ws = [rng.normal(size=(2, 4)) for _ in xs]
    models = [{"l.weight": w} for w in ws]
    grams = [{"l": InputGram("l.weight", None, x.T @ x / len(x))} for x in xs]
    merged = regmean_merge(models, grams, [10, 30], alpha=1.0)["l.weight"]
    lstsq = np.linalg.lstsq(np.concatenate(xs), np.concatenate([x @ w.T for x, w in zip(xs, ws)]), rcond=None)[0].T
    np.testing.assert_allclose(merged, lstsq, rtol=1e-10)
    engine = merge(models, grams, PermutationSpec({}), MergeOptions(curvature="gram", matching="none"),
                   num_examples=[10, 30])
    np.testing.assert_allclose(engine.model["l.weight"], merged, rtol=1e-12)


def _one_layer() -> tuple[list, list]:
    models = [{"l.weight": np.ones((2, 3)), "l.bias": np.zeros(2)} for _ in range(2)]
    grams = [{"l": InputGram("l.weight", "l.bias", np.eye(4))} for _ in range(2)]
    return models, grams


@pytest.mark.parametrize(
    "gram, message",
    [
        (np.full((4, 4), np.nan), "contains NaN or inf"),
        (np.eye(3), r"shape \(3, 3\) differs from \(4, 4\)"),
        (np.triu(np.ones((4, 4))), "not symmetric positive semi-definite"),
        (-np.eye(4), "not symmetric positive semi-definite"),
    ],
)
def test_a_bad_gram_is_refused_naming_the_client_and_the_layer(gram: np.ndarray, message: str) -> None:
    models, grams = _one_layer()
    grams[1] = {"l": InputGram("l.weight", "l.bias", gram)}
    with pytest.raises(ValueError, match=rf"client 'b', Gram of 'l': {message}"):
        prepare_grams(models, grams, num_examples=[1, 1], client_ids=["a", "b"])


def test_the_gram_curvature_refuses_fishers_and_options_it_cannot_weigh() -> None:
    models, grams = _one_layer()
    spec = PermutationSpec({})
    with pytest.raises(ValueError, match="needs num_examples"):
        merge(models, grams, spec, MergeOptions(curvature="gram"))
    with pytest.raises(ValueError, match="needs the clients' input Grams"):
        merge(prepare_clients(models, [{n: np.ones_like(t) for n, t in m.items()} for m in models]), None, spec,
              MergeOptions(curvature="gram"))
    with pytest.raises(ValueError, match="matching must be 'fisher' or 'none'"):
        MergeOptions(curvature="gram", matching="euclidean")
    with pytest.raises(ValueError, match="gram_alpha must lie in"):
        MergeOptions(curvature="gram", gram_alpha=1.5)
