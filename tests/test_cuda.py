"""On a CUDA device: the client's training and Fisher pass, the torch merge backend and the server
refinement run there and agree with the CPU. Skipped without a GPU (marked ``cuda``).

These tests import no Flower module, so they also run where only torch, numpy and scipy are
installed (``pytest -m cuda tests/test_cuda.py``).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfiot_flwr.fisher import diagonal_fisher
from fedfiot_flwr.merge import MergeSpeed, merge
from fedfiot_flwr.models import build_model, permutation_spec
from fedfiot_flwr.refine import RefineOptions
from fedfiot_flwr.refine.candidates import ClientModels, Folds, refine_merged_model
from fedfiot_flwr.refine.stage import RefinementStage, split_folds
from fedfiot_flwr.task import train

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SHAPE = (1, 16, 16)


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPE, generator=g)
    return TensorDataset(x, (x.flatten(1)[:, :10] * 3).argmax(1))


def _clients(k: int = 3, epochs: int = 2) -> tuple[list[dict], list[dict], list[int]]:
    """``k`` LeNet clients trained on the CPU from one initialisation, with their Fishers."""
    models, fishers, sizes = [], [], []
    for c in range(k):
        torch.manual_seed(c)
        model = build_model("lenet", SHAPE, 10, seed=0)
        data = _data(96, seed=10 + c)
        train(model, DataLoader(data, batch_size=32, shuffle=True), epochs, device="cpu", progress=False)
        fisher = diagonal_fisher(model, DataLoader(data, batch_size=32), progress=False)
        models.append({n: v.detach().numpy().copy() for n, v in model.state_dict().items()})
        fishers.append({n: v.numpy() for n, v in fisher.items()})
        sizes.append(len(data))
    return models, fishers, sizes


@pytest.fixture(autouse=True)
def no_tf32():
    """Full float32 on CUDA (torch's cuDNN default would use TF32 convolutions), restored afterwards."""
    flags = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = flags


def test_training_on_cuda_leaves_the_model_there_and_its_fisher_matches_the_cpu() -> None:
    model = build_model("fednet", (1, 28, 28), 10, seed=0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(128, 1, 28, 28, generator=g), torch.randint(0, 10, (128,), generator=g))
    metrics = train(model, DataLoader(data, batch_size=64), 1, device="cuda", progress=False)
    assert np.isfinite(metrics["train-loss"])
    assert next(model.parameters()).device.type == "cuda"
    loader = DataLoader(data, batch_size=64)
    on_gpu = diagonal_fisher(model, loader, progress=False)
    on_cpu = diagonal_fisher(copy.deepcopy(model).cpu(), loader, progress=False)
    assert next(model.parameters()).device.type == "cuda"
    for name, f in on_cpu.items():
        assert on_gpu[name].device.type == "cpu"
        torch.testing.assert_close(on_gpu[name], f, rtol=1e-4, atol=1e-6 * float(f.abs().max()))


@pytest.mark.parametrize("cost_dtype", ["float64", "float32"])
def test_torch_merge_on_cuda_equals_numpy(cost_dtype: str) -> None:
    models, fishers, sizes = _clients()
    spec = permutation_spec(build_model("lenet", SHAPE, 10, seed=0))
    ref = merge(models, fishers, spec, num_examples=sizes, speed=MergeSpeed(cost_dtype=cost_dtype))
    out = merge(models, fishers, spec, num_examples=sizes,
                speed=MergeSpeed(cost_dtype=cost_dtype, backend="torch", device="cuda"))
    for p, perms in ref.permutations.items():
        for a, b in zip(perms, out.permutations[p]):
            np.testing.assert_array_equal(a, b)
    for n, v in ref.model.items():
        np.testing.assert_allclose(out.model[n], v, rtol=0, atol=1e-5)
    assert out.aligned == ref.aligned


def test_least_squares_refinement_on_cuda_matches_the_cpu() -> None:
    models, fishers, sizes = _clients()
    spec = permutation_spec(build_model("lenet", SHAPE, 10, seed=0))
    merged = merge(models, fishers, spec, num_examples=sizes)
    data = _data(80, seed=99)
    fit, select = split_folds(len(data))
    loaders = (DataLoader(torch.utils.data.Subset(data, fit.tolist()), batch_size=40),
               DataLoader(torch.utils.data.Subset(data, select.tolist()), batch_size=40))
    options = RefineOptions(finetune_epochs=0, keep_candidates=True, client_candidates=False)
    results = {}
    for device in ("cpu", "cuda"):
        module = build_model("lenet", SHAPE, 10, seed=0).to(device)
        results[device] = refine_merged_model(merged.model, ClientModels(models, spec, merged.permutations, sizes),
                                              module, Folds(*loaders), options=options)
    (cpu_model, cpu_rep), (gpu_model, gpu_rep) = results["cpu"], results["cuda"]
    assert gpu_rep.candidates.keys() == cpu_rep.candidates.keys()
    for name, cand in cpu_rep.candidates.items():
        for n, v in cand.items():
            np.testing.assert_allclose(gpu_rep.candidates[name][n], v, rtol=1e-4, atol=1e-5, err_msg=f"{name} {n}")
    for layer in cpu_rep.fit_errors:
        np.testing.assert_allclose(gpu_rep.fit_errors[layer], cpu_rep.fit_errors[layer], rtol=1e-4)


def test_refinement_stage_runs_on_cuda_with_the_fisher_anchor() -> None:
    models, fishers, sizes = _clients()
    spec = permutation_spec(build_model("lenet", SHAPE, 10, seed=0))
    merged = merge(models, fishers, spec, num_examples=sizes)
    options = RefineOptions(finetune_epochs=3, augment_copies=1, fisher_anchor=(1.0,), keep_candidates=True)
    out = {}
    for device in ("cpu", "cuda"):
        stage = RefinementStage(build_model("lenet", SHAPE, 10, seed=0), _data(80, seed=99), options, spec=spec,
                                device=device)
        stage.progress = None
        out[device] = stage(merged.model, models, merged.permutations, sizes, fishers=fishers)
    cpu, gpu = out["cpu"].record["selection_accuracy"], out["cuda"].record["selection_accuracy"]
    assert gpu.keys() == cpu.keys() and any(name.startswith("ft3a1") for name in gpu)
    for name, acc in cpu.items():  # 40 selection examples: at most one flipped prediction
        assert abs(gpu[name] - acc) <= 1 / 40 + 1e-9, name
    assert all(np.all(np.isfinite(v)) for v in out["cuda"].model.values())


def test_fine_tuning_steps_on_cuda_follow_the_cpu() -> None:
    """The fine-tuning's shuffles are drawn on the CPU, so both devices take the same steps."""
    from fedfiot_flwr.refine.finetune import distill_finetune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(256, 10))
    data = _data(60, seed=5)
    x, y = data.tensors
    teacher = torch.randn(60, 10, generator=torch.Generator().manual_seed(3))
    options = RefineOptions(finetune_epochs=3, finetune_batch=16)
    states = {}
    for device in ("cpu", "cuda"):
        m = copy.deepcopy(model).to(device)
        states[device] = list(distill_finetune(m, [x.to(device)], y.to(device), [teacher.to(device)], options))[-1][1]
    for n, v in states["cpu"].items():
        np.testing.assert_allclose(states["cuda"][n], v, rtol=1e-4, atol=1e-5)
