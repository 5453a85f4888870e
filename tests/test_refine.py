"""Server-side refinement: least squares, REPAIR, BatchNorm recalibration, fold discipline, sampled Fisher."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfiot_flwr.fisher import output_vectors
from fedfiot_flwr.merge import MergeOptions, merge
from fedfiot_flwr.refine.linalg import LayerMoments, NeuronStats, reconstruction_error, repair_rescale, ridge_refit
from fedfiot_flwr.models import build_model, permutation_spec
from fedfiot_flwr.refine import ClientModels, Folds, RefineOptions, refine_merged_model
from fedfiot_flwr.refine.finetune import distill_finetune
from fedfiot_flwr.refine.ops import (
    add_rows,
    client_neuron_stats,
    client_targets,
    layer_modules,
    least_squares_refine,
    recalibrate_batchnorm,
    repair,
)


def _state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _clients(k: int = 3, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], nn.Module]:
    models = [build_model("mlp", (1, 8, 8), 10, seed=seed + i) for i in range(k)]
    return [_state(m) for m in models], models[0]


def _loader(n: int, seed: int, poison: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    if poison:
        x[:] = float("nan")
    return DataLoader(TensorDataset(x, torch.randint(0, 10, (n,), generator=g)), batch_size=64)


# ------------------------------------------------------------------------------- linear algebra


def test_ridge_refit_lowers_reconstruction_error_and_tends_to_least_squares() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 12))
    w_true = rng.normal(size=(5, 12))
    y = x @ w_true.T + 0.01 * rng.normal(size=(400, 5))
    mom = LayerMoments(12, 5)
    mom.add(x[:200], y[:200])
    mom.add(x[200:], y[200:])
    w0 = np.zeros((5, 12))
    w = ridge_refit(mom, w0, ridge=1e-8)
    assert reconstruction_error(mom, w) < 1e-3 * reconstruction_error(mom, w0)
    np.testing.assert_allclose(w, np.linalg.lstsq(x, y, rcond=None)[0].T, atol=1e-5)
    # A huge ridge keeps the merged weights.
    np.testing.assert_allclose(ridge_refit(mom, w_true * 0.5, ridge=1e9), w_true * 0.5, atol=1e-6)
    # The moments-based error equals the direct one.
    assert reconstruction_error(mom, w_true) == pytest.approx(np.mean(np.sum((x @ w_true.T - y) ** 2, 1)), rel=1e-9)


def test_layer_moments_reject_non_finite_rows() -> None:
    mom = LayerMoments(3, 2)
    with pytest.raises(ValueError, match="non-finite"):
        mom.add(np.full((4, 3), np.nan), np.zeros((4, 2)))
    with pytest.raises(ValueError, match="ridge"):
        ridge_refit(mom, np.zeros((2, 3)), 0.0)


def test_rows_added_as_tensors_give_the_same_moments_as_numpy_rows() -> None:
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(50, 6)).astype(np.float32), rng.normal(size=(50, 3)).astype(np.float32)
    direct, from_tensors = LayerMoments(6, 3), LayerMoments(6, 3)
    direct.add(x, y)
    add_rows(from_tensors, torch.as_tensor(x), torch.as_tensor(y))
    np.testing.assert_allclose(from_tensors.xtx, direct.xtx, rtol=1e-12)
    np.testing.assert_allclose(from_tensors.ytx, direct.ytx, rtol=1e-12)
    assert (from_tensors.yty, from_tensors.rows) == pytest.approx((direct.yty, direct.rows), rel=1e-12)
    with pytest.raises(ValueError, match="non-finite"):
        add_rows(from_tensors, torch.full((2, 6), float("nan")), torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"\(n, 6\) inputs"):
        add_rows(from_tensors, torch.zeros(2, 5), torch.zeros(2, 3))


def test_repair_rescale_restores_target_statistics() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(500, 6)) + 0.3
    w, b = rng.normal(size=(4, 6)), rng.normal(size=4)
    stats = NeuronStats(4)
    stats.add(x @ w.T + b)
    target_mean, target_std = np.array([0.5, -1.0, 2.0, 0.0]), np.array([1.0, 0.5, 3.0, 2.0])
    w2, b2 = repair_rescale(w, b, stats, target_mean, target_std)
    z = x @ w2.T + b2
    np.testing.assert_allclose(z.mean(0), target_mean, atol=1e-9)
    np.testing.assert_allclose(z.std(0), target_std, atol=1e-9)
    # Bias-free: the std is restored, the mean only scaled.
    w3, none = repair_rescale(w, None, stats, target_mean, target_std)
    assert none is None
    np.testing.assert_allclose((x @ w3.T).std(0), target_std, rtol=1e-9)


# ----------------------------------------------------------------------------------- torch side


def test_repair_restores_per_neuron_statistics_of_a_merged_mlp() -> None:
    clients, model = _clients()
    merged = {k: np.mean([c[k] for c in clients], axis=0) for k in clients[0]}
    batches = [next(iter(_loader(256, 3)))[0]]
    layers = layer_modules(model, batches[0])
    scratch = build_model("mlp", (1, 8, 8), 10)
    targets = client_neuron_stats(scratch, clients, [1 / 3] * 3, layer_modules(scratch, batches[0]), batches)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in merged.items()})
    before = client_neuron_stats(model, [merged], [1.0], layers, batches)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in merged.items()})
    repair(model, layers, batches, targets)
    after = client_neuron_stats(model, [_state(model)], [1.0], layers, batches)
    for name, _ in layers[:-1]:  # hidden layers only
        gap_before = np.abs(before[name][1] - targets[name][1]).max()
        np.testing.assert_allclose(after[name][0], targets[name][0], atol=1e-4)
        np.testing.assert_allclose(after[name][1], targets[name][1], atol=1e-4)
        assert gap_before > 1e-2  # there was something to repair


def test_least_squares_refine_lowers_every_layer_error_on_the_fitting_fold() -> None:
    clients, model = _clients()
    merged = {k: np.mean([c[k] for c in clients], axis=0) for k in clients[0]}
    batches = [x for x, _ in _loader(300, 4)]
    layers = layer_modules(model, batches[0])
    scratch = build_model("mlp", (1, 8, 8), 10)
    weights = [[torch.full((len(x),), 1 / 3) for x in batches] for _ in clients]
    targets = client_targets(scratch, clients, weights, layer_modules(scratch, batches[0]), batches)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in merged.items()})
    errors = least_squares_refine(model, layers, batches, targets, ridge=1e-3)
    before, after = errors[0::2], errors[1::2]
    assert len(before) == len(layers)
    assert all(a < b for a, b in zip(after, before))


def test_refinement_never_fits_on_the_selection_fold() -> None:
    clients, model = _clients()
    spec = permutation_spec(model)
    fishers = [{k: np.ones_like(v) for k, v in c.items()} for c in clients]
    res = merge(clients, fishers, spec, MergeOptions(reference=0))
    opts = RefineOptions(ridges=(1e-2,), repair=True, client_candidates=False, keep_candidates=True,
                         finetune_epochs=2, augment_copies=1)
    fit = _loader(200, 5)
    aligned = ClientModels(clients, spec, res.permutations)
    clean, rep_clean = refine_merged_model(res.model, aligned, model, Folds(fit, _loader(100, 6)), options=opts)
    # NaN in every selection example: a fit that touched it would raise (non-finite rows).
    _, rep_poison = refine_merged_model(res.model, aligned, model, Folds(fit, _loader(100, 6, poison=True)),
                                        options=opts)
    tuned = [n for n in rep_clean.candidates if n.startswith("ft")]
    assert tuned  # fine-tuned checkpoints were offered
    for name in ("repair", "ls-r0.01", "repair+ls-r0.01", *tuned):
        for k, v in rep_clean.candidates[name].items():
            assert np.all(np.isfinite(v))
            np.testing.assert_array_equal(v, rep_poison.candidates[name][k])
    assert rep_clean.fit_examples == 200 and rep_clean.select_examples == 100
    assert set(clean) == set(res.model)


def test_refine_offers_clients_and_picks_the_best_on_selection() -> None:
    clients, model = _clients()
    merged = {k: np.zeros_like(v) for k, v in clients[0].items()}  # a useless merge
    x = torch.randn(120, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    teacher = build_model("mlp", (1, 8, 8), 10, seed=1)
    teacher.load_state_dict({k: torch.as_tensor(v) for k, v in clients[1].items()})
    y = teacher(x).argmax(1).detach()  # client 1 is right on every selection example
    select = DataLoader(TensorDataset(x, y), batch_size=64)
    out, rep = refine_merged_model(merged, clients, model, Folds(_loader(100, 8), select),
                                   options=RefineOptions(ridges=(), client_candidates=True, finetune_epochs=0))
    assert rep.chosen == "client-1" and rep.selection_accuracy["client-1"] == 1.0
    np.testing.assert_array_equal(out["fc1.weight"], clients[1]["fc1.weight"])


def _ensemble_loader(clients: list[dict[str, np.ndarray]], n: int, seed: int) -> DataLoader:
    """Inputs labelled by the clients' averaged logits (what the refinement's targets reproduce)."""
    x = torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))
    net = build_model("mlp", (1, 8, 8), 10)
    logits = 0
    for c in clients:
        net.load_state_dict({k: torch.as_tensor(v) for k, v in c.items()})
        logits = logits + net(x).detach()
    return DataLoader(TensorDataset(x, logits.argmax(1)), batch_size=64)


def _both_folds(fit: DataLoader, select: DataLoader) -> DataLoader:
    x = torch.cat([b[0] for b in (*fit, *select)])
    y = torch.cat([b[1] for b in (*fit, *select)])
    return DataLoader(TensorDataset(x, y), batch_size=64)


@pytest.mark.parametrize("epochs", [0, 2])
def test_refit_keeps_the_choice_and_rebuilds_the_recipe_on_both_folds(epochs: int) -> None:
    clients, model = _clients()
    merged = {k: np.zeros_like(v) for k, v in clients[0].items()}  # a useless merge: a fitted candidate wins
    fit, select = _ensemble_loader(clients, 200, 5), _ensemble_loader(clients, 100, 6)
    opts = RefineOptions(ridges=(1e-3,), client_candidates=False, finetune_epochs=epochs, augment_copies=1,
                         keep_candidates=True)
    plain, rep_plain = refine_merged_model(merged, clients, model, Folds(fit, select), options=opts)
    refit, rep = refine_merged_model(merged, clients, model, Folds(fit, select), options=replace(opts, refit=True))
    assert rep.chosen == rep_plain.chosen != "merged"
    assert rep.selection_accuracy == rep_plain.selection_accuracy
    assert rep_plain.refit_examples == 0 and rep.refit_examples == 300
    # The refit is the chosen recipe fitted on both folds' rows, as a run on their union builds it.
    _, rep_union = refine_merged_model(merged, clients, model, Folds(_both_folds(fit, select), select), options=opts)
    for k in refit:
        np.testing.assert_array_equal(refit[k], rep_union.candidates[rep.chosen][k])
        np.testing.assert_array_equal(plain[k], rep_plain.candidates[rep.chosen][k])
    assert any(not np.array_equal(refit[k], plain[k]) for k in refit)


def _finetune_run(options: RefineOptions, stop_after: int | None = None) -> list[tuple[int, dict[str, np.ndarray]]]:
    """Checkpoints of :func:`distill_finetune` from one fixed MLP on fixed rows, labels and teacher."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(120, 1, 8, 8, generator=g)
    labels = torch.randint(0, 10, (120,), generator=g)
    teacher = torch.randn(120, 10, generator=g)
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    return list(distill_finetune(model, list(torch.split(x, 50)), labels, list(torch.split(teacher, 50)),
                                 options, stop_after=stop_after))


def test_cosine_fine_tuning_settles_and_a_shorter_run_is_an_exact_prefix() -> None:
    base = RefineOptions(finetune_epochs=6, checkpoint_every=1, finetune_lr=0.05, finetune_schedule="constant")
    cosine = _finetune_run(replace(base, finetune_schedule="cosine"))
    constant = _finetune_run(base)
    assert [e for e, _ in cosine] == [1, 2, 3, 4, 5, 6]

    def last_step(run: list[tuple[int, dict[str, np.ndarray]]]) -> float:
        (_, before), (_, after) = run[-2], run[-1]
        return sum(float(np.abs(after[k] - before[k]).sum()) for k in after)

    # The cosine's last epoch runs at a learning rate near 0: the model has settled; the constant one has not.
    assert last_step(cosine) < 0.1 * last_step(constant)
    assert any(not np.array_equal(cosine[2][1][k], constant[2][1][k]) for k in cosine[2][1])
    # Stopping after 3 epochs keeps the 6-epoch schedule, so it is the full run's epoch-3 state (what the refit rebuilds).
    prefix = _finetune_run(replace(base, finetune_schedule="cosine"), stop_after=3)
    assert [e for e, _ in prefix] == [1, 2, 3]
    for k, v in prefix[-1][1].items():
        np.testing.assert_array_equal(v, cosine[2][1][k])


def test_checkpoint_every_zero_offers_only_the_last_epoch() -> None:
    clients, model = _clients()
    merged = {k: np.zeros_like(v) for k, v in clients[0].items()}
    fit, select = _ensemble_loader(clients, 200, 5), _ensemble_loader(clients, 100, 6)
    opts = RefineOptions(ridges=(1e-3,), client_candidates=False, finetune_epochs=4, augment_copies=1,
                         finetune_schedule="cosine", checkpoint_every=2)
    _, every2 = refine_merged_model(merged, clients, model, Folds(fit, select), options=opts)
    _, final = refine_merged_model(merged, clients, model, Folds(fit, select), options=replace(opts, checkpoint_every=0))
    assert sorted(n for n in every2.selection_accuracy if n.startswith("ft")) == ["ft2(ls-r0.001)", "ft4(ls-r0.001)"]
    assert [n for n in final.selection_accuracy if n.startswith("ft")] == ["ft4(ls-r0.001)"]
    assert final.selection_accuracy["ft4(ls-r0.001)"] == every2.selection_accuracy["ft4(ls-r0.001)"]
    # Bad options are refused when they are built, not when the refinement runs.
    with pytest.raises(ValueError, match="finetune_schedule"):
        replace(opts, finetune_schedule="step")
    with pytest.raises(ValueError, match="checkpoint_every"):
        replace(opts, checkpoint_every=-1)


def test_starts_only_leaves_the_fine_tuned_model_to_compete_unless_it_diverges() -> None:
    clients, model = _clients()
    merged = {k: np.zeros_like(v) for k, v in clients[0].items()}  # a useless merge: a fitted candidate wins
    fit, select = _ensemble_loader(clients, 200, 5), _ensemble_loader(clients, 100, 6)
    opts = RefineOptions(ridges=(1e-3, 1e-1), client_candidates=False, finetune_epochs=2, augment_copies=1,
                         checkpoint_every=0, finetune_lr=1e-6, offer_starts=False)
    # A near-zero learning rate: the fine-tuned model is its start, so on the selection fold it ties
    # with the best least-squares candidate, and only the fine-tuned one may be returned.
    out, rep = refine_merged_model(merged, clients, model, Folds(fit, select), options=opts)
    start = max(("ls-r0.001", "ls-r0.1"), key=lambda n: rep.selection_accuracy[n])
    assert rep.chosen == f"ft2({start})"
    assert {"ls-r0.001", "ls-r0.1"} <= set(rep.selection_accuracy)  # scored, to choose the start
    _, offered = refine_merged_model(merged, clients, model, Folds(fit, select), options=replace(opts, offer_starts=True))
    assert offered.chosen == start  # offered, the start wins the tie (it is scored first)
    # A fine-tuning that diverges at once yields no checkpoint: the starts compete after all.
    diverged, rep_div = refine_merged_model(merged, clients, model, Folds(fit, select),
                                            options=replace(opts, finetune_lr=1e30))
    assert not any(n.startswith("ft") for n in rep_div.selection_accuracy)
    assert rep_div.chosen == start and all(np.all(np.isfinite(v)) for v in diverged.values())


def test_refit_returns_a_chosen_client_or_merge_as_it_is() -> None:
    clients, model = _clients()
    x = torch.randn(120, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    teacher = build_model("mlp", (1, 8, 8), 10, seed=1)
    teacher.load_state_dict({k: torch.as_tensor(v) for k, v in clients[1].items()})
    select = DataLoader(TensorDataset(x, teacher(x).argmax(1).detach()), batch_size=64)
    merged = {k: np.zeros_like(v) for k, v in clients[0].items()}
    out, rep = refine_merged_model(merged, clients, model, Folds(_loader(100, 8), select),
                                   options=RefineOptions(ridges=(1e-2,), finetune_epochs=0, refit=True))
    assert rep.chosen == "client-1" and rep.refit_examples == 0
    np.testing.assert_array_equal(out["fc1.weight"], clients[1]["fc1.weight"])


def test_refine_rejects_mismatched_permutations() -> None:
    clients, model = _clients()
    spec = permutation_spec(model)
    with pytest.raises(ValueError, match="entries for 3 clients"):
        refine_merged_model(clients[0], ClientModels(clients, spec, {"P0": [np.arange(128)] * 2}), model,
                            Folds(_loader(50, 1), _loader(50, 2)))


def test_recalibrate_batchnorm_sets_running_statistics_to_the_data() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))
    x = torch.randn(256, 4, generator=torch.Generator().manual_seed(0)) * 3 + 1
    assert recalibrate_batchnorm(model, list(torch.split(x, 64)))
    with torch.no_grad():
        h = model[0](x)
    torch.testing.assert_close(model[1].running_mean, h.mean(0), atol=1e-5, rtol=1e-5)
    assert not recalibrate_batchnorm(nn.Sequential(nn.Linear(2, 2)), [x[:, :2]])


def test_sampled_fisher_vectors_estimate_the_true_fisher() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 0.5, -1.0]]).repeat(40000, 1)
    labels = torch.zeros(40000, dtype=torch.long)
    v = output_vectors(logits, labels, "sampled")
    assert v.shape == (40000, 1, 3)
    sampled = torch.einsum("bri,brj->ij", v, v) / v.shape[0]
    t = output_vectors(logits[:1], labels[:1], "true")
    true = torch.einsum("bri,brj->ij", t, t)
    torch.testing.assert_close(sampled, true, atol=5e-3, rtol=0)
    # Not the empirical Fisher of the observed label.
    e = output_vectors(logits[:1], labels[:1], "empirical")
    assert (torch.einsum("bri,brj->ij", e, e) - true).abs().max() > 0.05


def test_sampled_kind_reaches_the_diagonal_fisher_and_kfac() -> None:
    from fedfiot_flwr.curvature import kfac_factors
    from fedfiot_flwr.fisher import diagonal_fisher

    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    x, y = next(iter(_loader(64, 9)))
    torch.manual_seed(0)
    sampled = diagonal_fisher(model, [(x, y)], "sampled")
    empirical = diagonal_fisher(model, [(x, y)], "empirical")
    assert set(sampled) == set(empirical)
    assert all(bool(torch.all(v >= 0)) for v in sampled.values())
    assert any(not torch.allclose(sampled[k], empirical[k]) for k in sampled)  # labels drawn, not observed
    factors = kfac_factors(model, [(x, y)], "sampled")
    assert factors and all(np.all(np.isfinite(f.G)) for f in factors.values())
