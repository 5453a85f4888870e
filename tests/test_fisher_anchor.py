"""The refinement's Fisher anchor: the clients' Laplace approximations as a fine-tuning penalty.

``RefineOptions(fisher_anchor=(...))`` adds fine-tuning runs whose loss also holds
``strength / 2 * sum_k (n_k / n) * sum_c F_k[c] (theta_c - w_k[c])^2`` over the clients put in the
merge's neuron order. These tests check the penalty against that sum, the alignment of the
Fishers with their clients, that the anchored run really is pulled toward the clients, and the
errors a caller gets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfiot_flwr.merge.spec import apply_permutations
from fedfiot_flwr.models import build_model, permutation_spec
from fedfiot_flwr.refine import ClientModels, Folds, RefineOptions, refine_merged_model
from fedfiot_flwr.refine.candidates import align_clients
from fedfiot_flwr.refine.finetune import laplace_anchor


def _state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 10, (n,), generator=g)), batch_size=64)


def _fishers(clients: list[dict[str, np.ndarray]], seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{k: rng.gamma(0.5, 1.0, size=v.shape) for k, v in c.items()} for c in clients]


def test_penalty_is_the_clients_summed_quadratics_up_to_a_constant() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    clients = [_state(build_model("mlp", (1, 8, 8), 10, seed=i)) for i in range(1, 4)]
    fishers = _fishers(clients, 0)
    sizes, rows, strength = [30, 50, 20], 40, 0.7
    anchor = laplace_anchor(clients, fishers, sizes, rows, strength)

    def direct(theta: dict[str, np.ndarray]) -> float:
        return strength / 2 * sum(n / rows * float(np.sum(f[k] * (theta[k] - w[k]) ** 2))
                                  for w, f, n in zip(clients, fishers, sizes) for k in f)

    other = build_model("mlp", (1, 8, 8), 10, seed=9)
    got = float(anchor.penalty(model).detach()) - float(anchor.penalty(other).detach())
    want = direct(_state(model)) - direct(_state(other))
    assert got == pytest.approx(want, rel=1e-4)


def test_fishers_are_aligned_with_their_clients() -> None:
    spec = permutation_spec(build_model("mlp", (1, 8, 8), 10, seed=0))
    base = _state(build_model("mlp", (1, 8, 8), 10, seed=1))
    fisher = _fishers([base], 3)[0]
    rng = np.random.default_rng(0)
    sizes = {p: base[spec.neuron_tensors(p)[0]].shape[0] for p in spec.perm_names}
    perms = {p: rng.permutation(n) for p, n in sizes.items()}
    inverse = {p: np.argsort(q) for p, q in perms.items()}
    shuffled, shuffled_f = apply_permutations(base, spec, perms), apply_permutations(fisher, spec, perms)
    # The merge's alignment of client 1 undoes the shuffle; client 0 is the original.
    alignment = {p: [np.arange(n), inverse[p]] for p, n in sizes.items()}
    aligned = align_clients([base, shuffled], spec, alignment)
    aligned_f = align_clients([fisher, shuffled_f], spec, alignment)
    anchor = laplace_anchor(aligned, aligned_f, [10, 10], 10, 1.0)
    for k in fisher:
        np.testing.assert_allclose(anchor.center[k].numpy(), base[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(anchor.precision[k].numpy(), 2 * fisher[k], rtol=1e-5)
    unaligned = laplace_anchor([base, shuffled], [fisher, shuffled_f], [10, 10], 10, 1.0)
    assert any(not np.allclose(unaligned.center[k].numpy(), base[k], atol=1e-3) for k in fisher)


def _refine(options: RefineOptions, fishers: list[dict[str, np.ndarray]] | None):
    clients = [_state(build_model("mlp", (1, 8, 8), 10, seed=i)) for i in range(3)]
    merged = {k: np.mean([c[k] for c in clients], axis=0) for k in clients[0]}
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    out = refine_merged_model(merged, ClientModels(clients, num_examples=[40, 40, 40], fishers=fishers), model,
                              Folds(_loader(60, 1), _loader(60, 2)), options=options)
    return clients, out


def test_the_anchored_run_is_pulled_toward_the_clients() -> None:
    options = RefineOptions(ridges=(), augment_copies=0, finetune_epochs=8, fisher_anchor=(2.0,),
                            keep_candidates=True, client_candidates=False)
    clients = [_state(build_model("mlp", (1, 8, 8), 10, seed=i)) for i in range(3)]
    fishers = _fishers(clients, 5)
    _, (_, report) = _refine(options, fishers)
    plain, anchored = report.candidates["ft8(merged)"], report.candidates["ft8a2(merged)"]
    anchor = laplace_anchor(clients, fishers, [40, 40, 40], 60, 2.0)

    def penalty(state: dict[str, np.ndarray]) -> float:
        return sum(float(np.sum(anchor.precision[k].numpy() * (state[k] - anchor.center[k].numpy()) ** 2))
                   for k in anchor.precision)

    assert penalty(anchored) < 0.9 * penalty(plain)
    assert set(report.selection_accuracy) >= {"merged", "ft8(merged)", "ft8a2(merged)"}


def test_without_fishers_the_anchored_runs_are_skipped_and_a_missing_one_is_an_error() -> None:
    options = RefineOptions(ridges=(), augment_copies=0, finetune_epochs=1, fisher_anchor=(1.0,))
    _, (_, report) = _refine(options, None)
    assert "ft1(merged)" in report.selection_accuracy
    assert not any("a1(" in name for name in report.selection_accuracy)
    clients = [_state(build_model("mlp", (1, 8, 8), 10, seed=i)) for i in range(3)]
    with pytest.raises(ValueError, match="client 1: no Fisher"):
        _refine(options, [_fishers(clients, 0)[0], {}, _fishers(clients, 1)[0]])
    with pytest.raises(ValueError, match="2 Fishers, 3 sizes for 3 clients"):
        _refine(options, _fishers(clients, 0)[:2])


def test_a_bad_fisher_names_its_client_and_tensor() -> None:
    clients = [_state(build_model("mlp", (1, 8, 8), 10, seed=i)) for i in range(2)]
    fishers = _fishers(clients, 0)
    name = next(iter(fishers[1]))
    fishers[1][name] = fishers[1][name] * np.nan
    with pytest.raises(ValueError, match=f"client 1: Fisher '{name}'"):
        laplace_anchor(clients, fishers, [1, 1], 1, 1.0)


@pytest.mark.parametrize("bad", [(0.0,), (-1.0,), (float("inf"),)])
def test_options_reject_a_bad_strength(bad: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="fisher_anchor"):
        RefineOptions(fisher_anchor=bad)


def test_without_the_anchor_the_candidates_are_unchanged() -> None:
    base = RefineOptions(ridges=(), augment_copies=0, finetune_epochs=2, client_candidates=False)
    clients = [_state(build_model("mlp", (1, 8, 8), 10, seed=i)) for i in range(3)]
    _, (plain_model, plain) = _refine(base, None)
    _, (anchored_model, anchored) = _refine(RefineOptions(**{**base.as_dict(), "ridges": (),
                                                             "fisher_anchor": (1.0,)}), _fishers(clients, 0))
    assert plain.selection_accuracy["ft2(merged)"] == anchored.selection_accuracy["ft2(merged)"]
    assert "ft2a1(merged)" in anchored.selection_accuracy and "ft2a1(merged)" not in plain.selection_accuracy
