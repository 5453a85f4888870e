"""The refinement's cheaper passes return what the reference passes return.

One forward pass per client for the label weights, the layer targets and the teacher; forward
passes that end at the layer being refitted; the first layer's least-squares sums shared by the
refits; ``torch.inference_mode`` where nothing is trained. ``RefineOptions(reference=True)`` keeps the separate passes reachable, and these tests hold the two to float
tolerance on small fixed-seed problems.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfiot_flwr.models import build_model, permutation_spec
from fedfiot_flwr.refine import ClientModels, Folds, RefineOptions, refine_merged_model
from fedfiot_flwr.refine.ops import (
    Capture,
    client_outputs,
    client_targets,
    collect_fit,
    example_weights,
    fit_batches,
    layer_modules,
    least_squares_refine,
)


def _state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _clients(k: int = 3, arch: str = "mlp", side: int = 8) -> list[dict[str, np.ndarray]]:
    return [_state(build_model(arch, (1, side, side), 10, seed=i)) for i in range(k)]


def _loader(n: int, seed: int, side: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, side, side, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 10, (n,), generator=g)), batch_size=64)


def _merged(clients: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.mean([c[k] for c in clients], axis=0) for k in clients[0]}


def test_fit_batches_are_collect_fits_rows_with_the_examples_first() -> None:
    loader = _loader(130, 1)
    batches, labels, n = fit_batches(loader, 3, seed=4, batch=50)
    old_x, old_y = collect_fit(loader, 3, seed=4, batch=50)
    base_x, _ = collect_fit(loader, 0, seed=4, batch=50)
    torch.testing.assert_close(torch.cat(batches), torch.cat(old_x), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(labels), torch.cat(old_y), rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(batches[:n]), torch.cat(base_x), rtol=0, atol=0)
    assert sum(len(b) for b in batches[:n]) == 130


@pytest.mark.parametrize("mode", ["label", "uniform", "size"])
def test_one_pass_per_client_gives_the_separate_passes_weights_targets_and_teacher(mode: str) -> None:
    clients = _clients()
    model = build_model("mlp", (1, 8, 8), 10)
    batches, labels, n = fit_batches(_loader(150, 2), 2, seed=0, batch=64)
    layers = layer_modules(model, batches[0])
    sizes = [10, 30, 60]
    got = client_outputs(model, clients, batches, labels, layers, mode, sizes, n, teacher=True)
    weights = example_weights(model, clients, batches, labels, mode, sizes)
    targets = client_targets(model, clients, [w[:n] for w in weights], layers, batches[:n])
    teacher = client_targets(model, clients, weights, layers[-1:], batches)
    assert len(got.targets) == n and len(got.teacher) == len(batches)
    for mine, theirs in zip(got.targets, targets):
        assert set(mine) == {name for name, _ in layers}
        for name in mine:
            torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat(got.teacher), torch.cat([t[layers[-1][0]] for t in teacher]),
                               rtol=1e-5, atol=1e-6)


def test_a_stopping_capture_records_the_same_input_and_runs_nothing_after_it() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    x = next(iter(_loader(40, 3)))[0]
    layers = layer_modules(model, x)
    name, mod = layers[1]
    full = Capture([(name, mod)], inputs=True, outputs=False)
    with torch.no_grad():
        model(x)
    full.close()
    called: list[str] = []
    after = [m.register_forward_hook(lambda *a, n=n: called.append(n)) for n, m in layers[1:]]
    stop = Capture([(name, mod)], inputs=True, outputs=False, stop=True)
    with torch.no_grad():
        Capture.run(model, x)
    stop.close()
    for h in after:
        h.remove()
    assert called == []
    torch.testing.assert_close(stop.inputs[name], full.inputs[name], rtol=0, atol=0)
    with pytest.raises(ValueError, match="inputs only"):
        Capture([(name, mod)], inputs=True, outputs=True, stop=True)


def test_shared_first_layer_sums_and_early_stops_refit_as_the_full_passes() -> None:
    clients = _clients()
    batches = [x for x, _ in _loader(200, 4)]
    scratch = build_model("mlp", (1, 8, 8), 10)
    weights = [[torch.full((len(x),), 1 / 3) for x in batches] for _ in clients]
    targets = client_targets(scratch, clients, weights, layer_modules(scratch, batches[0]), batches)
    shared: dict = {}
    for ridge in (1e-2, 1e-1):
        refits = []
        for cache, reference in ((None, True), (shared, False)):
            model = build_model("mlp", (1, 8, 8), 10)
            model.load_state_dict({k: torch.as_tensor(v) for k, v in _merged(clients).items()})
            errors = least_squares_refine(model, layer_modules(model, batches[0]), batches, targets, ridge,
                                          cache, reference=reference)
            refits.append((errors, _state(model)))
        np.testing.assert_allclose(refits[1][0], refits[0][0], rtol=1e-10)
        for k, v in refits[0][1].items():
            np.testing.assert_array_equal(refits[1][1][k], v)
    assert len(shared) == 1  # the first layer's sums, computed once for both ridges


@pytest.mark.parametrize(("mode", "arch", "side"), [("label", "mlp", 8), ("uniform", "mlp", 8), ("label", "lenet", 28)])
def test_the_refinement_returns_the_reference_model(mode: str, arch: str, side: int) -> None:
    clients = _clients(3, arch, side)
    model = build_model(arch, (1, side, side), 10)
    opts = RefineOptions(ridges=(1e-2, 1e-1), repair=True, target_weights=mode, finetune_epochs=2,
                         augment_copies=2, checkpoint_every=1, keep_candidates=True, offer_starts=True,
                         finetune_lr=0.005)
    runs = [refine_merged_model(_merged(clients), ClientModels(clients, permutation_spec(model)), model,
                                Folds(_loader(120, 5, side), _loader(80, 6, side)),
                                options=replace(opts, reference=reference))
            for reference in (True, False)]
    (ref_model, ref_rep), (new_model, new_rep) = runs
    assert new_rep.chosen == ref_rep.chosen
    assert new_rep.selection_accuracy == pytest.approx(ref_rep.selection_accuracy, abs=1e-12)
    assert set(new_rep.candidates) == set(ref_rep.candidates) and len(new_rep.candidates) >= 8
    for name, cand in ref_rep.candidates.items():
        for k, v in cand.items():
            np.testing.assert_allclose(new_rep.candidates[name][k], v, rtol=1e-4, atol=1e-5, err_msg=name)
    for k, v in ref_model.items():
        np.testing.assert_allclose(new_model[k], v, rtol=1e-4, atol=1e-5)
        assert new_model[k].flags["C_CONTIGUOUS"] and new_model[k].dtype == v.dtype
    np.testing.assert_allclose(new_rep.fit_errors["ls-r0.1"], ref_rep.fit_errors["ls-r0.1"], rtol=1e-5)


def test_the_refit_on_both_folds_returns_the_reference_model() -> None:
    clients = _clients()
    model = build_model("mlp", (1, 8, 8), 10)
    opts = RefineOptions(ridges=(1e-1,), finetune_epochs=1, augment_copies=1, client_candidates=False, refit=True)
    runs = [refine_merged_model(_merged(clients), clients, model, Folds(_loader(100, 7), _loader(60, 8)),
                                options=replace(opts, reference=reference)) for reference in (True, False)]
    assert runs[0][1].refit_examples == runs[1][1].refit_examples == 160
    for k, v in runs[0][0].items():
        np.testing.assert_allclose(runs[1][0][k], v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "50"])
def test_finetune_batch_must_be_a_positive_integer(bad: object) -> None:
    with pytest.raises(ValueError, match="finetune_batch"):
        RefineOptions(finetune_batch=bad)  # type: ignore[arg-type]


def test_the_fine_tuning_batch_sets_the_steps() -> None:
    clients = _clients(2)
    model = build_model("mlp", (1, 8, 8), 10)

    def tuned(batch: int) -> dict[str, np.ndarray]:
        opts = RefineOptions(ridges=(), finetune_epochs=1, augment_copies=0, client_candidates=False,
                             keep_candidates=True, finetune_batch=batch, finetune_lr=0.05)
        rep = refine_merged_model(_merged(clients), clients, model, Folds(_loader(120, 9), _loader(40, 10)),
                                  options=opts)[1]
        return rep.candidates["ft1(merged)"]

    small, one_step = tuned(10), tuned(120)
    assert any(not np.allclose(small[k], one_step[k]) for k in small)
    np.testing.assert_array_equal(tuned(120)["fc1.weight"], one_step["fc1.weight"])
