"""The alignment probe of ``benchmarks/alignment_cause.py``: it finds a known permutation, and measures movement."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import alignment_cause as AC
from benchmarks import harness as H
from fedfiot_flwr.merge.spec import apply_permutations, invert_permutation
from fedfiot_flwr.models import build_model, permutation_spec


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


def test_weight_movement_reports_distance_and_cosine_of_weight_tensors_only() -> None:
    w0 = {"w": np.array([[1.0, 0.0], [0.0, 1.0]]), "b": np.zeros(2)}
    moved = AC.weight_movement({"w": np.array([[1.0, 1.0], [0.0, 1.0]]), "b": np.ones(2)}, w0)
    assert set(moved) == {"w"}
    assert moved["w"]["relative_distance"] == pytest.approx(1 / np.sqrt(2))
    assert moved["w"]["cosine"] == pytest.approx(2 / np.sqrt(2) / np.sqrt(3))
