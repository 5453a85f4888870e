"""FedFiOT on a GPU: the client, the merge and the server refinement on CUDA, against the CPU.

One prepared run, section by section (``--sections``); the results file is rewritten after
every measurement, so a run cut short keeps what it measured:

- ``client``: the paper's CNN on Fashion-MNIST (1x28x28) and torchvision's ResNet-18 on 32x32x3
  inputs (synthetic: CIFAR-10 is not shipped): seconds of one local epoch (:func:`fedfiot_flwr.task.train`)
  and of the empirical Fisher pass (:func:`fedfiot_flwr.fisher.diagonal_fisher`) on CUDA and on the
  same machine's CPU (the CPU on ``--cpu-examples`` examples, scaled to the client's size), and the
  Fisher's largest relative difference between the two on the same weights and batches
  (``max |cuda - cpu| / max |cpu|`` per tensor, the largest over tensors; with torch's default
  TF32 convolutions on CUDA and with TF32 off);
- ``merge``: the merge engine with numpy against ``MergeSpeed(backend="torch")`` on CUDA, on the
  same uploads: the paper's CNN (K = 6, S = 8), ResNet-18 (K = 6), vgg11_bn (129M parameters,
  K = 6, S = 1, float32 costs) and one wide layer (m = 4096, d = 1024, K = 6, float32 costs,
  certify): wall seconds, peak GPU memory, whether the permutations are the same and the models'
  largest absolute difference;
- ``refine``: one round of ``RefineOptions()`` (:class:`fedfiot_flwr.refine.RefinementStage`)
  after the paper CNN's FedFiOT merge of 6 Fashion-MNIST clients, on CUDA and on the CPU;
- ``tests`` (run first): ``pytest -m cuda`` (the tests that exercise CUDA), their pass/fail lines.

Writes ``gpu.json`` and ``gpu.md`` under ``--out-dir`` (default ``benchmarks/results``).
``--quick`` runs every section at toy sizes (a smoke run; without CUDA the "CUDA" side runs on
the CPU). Usage::

    python benchmarks/gpu_check.py                       # on a CUDA machine, about 5 minutes on an H200
    python benchmarks/gpu_check.py --quick --out-dir /tmp/gpu   # anywhere: the code path only
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.merge_scale import cnn_clients, vgg_uploads, wide_layer_uploads  # noqa: E402
from benchmarks.portable import REPO_ROOT, command_line  # noqa: E402
from fedfiot_flwr.data.loaders import read_idx  # noqa: E402
from fedfiot_flwr.fisher import diagonal_fisher  # noqa: E402
from fedfiot_flwr.merge import (  # noqa: E402
    MergeOptions,
    MergeSpeed,
    PermutationSpec,
    cnn_spec,
    merge,
    prepare_clients,
    spec_from_module,
)
from fedfiot_flwr.models import build_model, permutation_spec  # noqa: E402
from fedfiot_flwr.refine import RefineOptions  # noqa: E402
from fedfiot_flwr.refine.stage import RefinementStage  # noqa: E402
from fedfiot_flwr.task import train  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SECTIONS = ("tests", "merge", "client", "refine")
EXTRA_SECTIONS = ("profile-vgg",)
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
CUDA_TESTS = ("tests/test_cuda.py", "tests/test_fisher.py")
Model = dict[str, np.ndarray]


class Report:
    """The run's results, written to ``gpu.{json,md}`` after every measurement."""

    def __init__(self, out_dir: Path, deadline: float, header: dict[str, Any], profile: bool = False) -> None:
        self.out_dir, self.deadline, self.profile = out_dir, deadline, profile
        self.payload: dict[str, Any] = {**header, "client": [], "merge": [], "refine": [], "tests": {}, "skipped": []}

    def profiled(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` under cProfile; its 25 costliest functions (own time) appended to ``profile.txt``."""
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        value = prof.runcall(fn)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "profile.txt", "a") as f:
            f.write(f"==== {what}\n{portable_profile(text.getvalue())}\n")
        return value

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def add(self, section: str, row: dict[str, Any]) -> None:
        self.payload[section].append(row)
        print(json.dumps({section: row}, default=str), flush=True)
        self.write()

    def skip(self, what: str, why: str) -> None:
        self.payload["skipped"].append(f"{what}: {why}")
        print(f"skipped {what}: {why}", flush=True)
        self.write()

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "gpu.json").write_text(json.dumps(self.payload, indent=1, default=str) + "\n")
        (self.out_dir / "gpu.md").write_text(markdown(self.payload))


def portable_profile(text: str) -> str:
    """A profile table with the repository's and the interpreter's paths written as placeholders."""
    import site
    import sysconfig

    roots = [(str(REPO_ROOT) + os.sep, ""), *((d + os.sep, "<site-packages>/") for d in site.getsitepackages()),
             (sysconfig.get_paths()["stdlib"] + os.sep, "<python>/")]
    for root, placeholder in roots:
        text = text.replace(root, placeholder)
    return text


# ----------------------------------------------------------------------------- timing


def synced(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall seconds of ``fn()`` with the device's queue drained before and after, and its value."""
    synced(device)
    start = time.perf_counter()
    value = fn()
    synced(device)
    return time.perf_counter() - start, value


def environment(device: torch.device) -> dict[str, Any]:
    """The GPU, torch, CUDA and the host, as the results record them."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (the CUDA side ran on the CPU)"
    return {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "numpy": np.__version__, "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
            "cpu_cores": os.cpu_count(), "torch_cpu_threads": torch.get_num_threads()}


# ----------------------------------------------------------------------------- client


def fashion_arrays(data_dir: Path, n: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first ``n`` Fashion-MNIST examples of ``split`` as ``(x in [0, 1], labels)``, or None when absent."""
    stem = "train" if split == "train" else "t10k"
    images, labels = data_dir / f"{stem}-images-idx3-ubyte.gz", data_dir / f"{stem}-labels-idx1-ubyte.gz"
    if not (images.is_file() and labels.is_file()):
        return None
    x = torch.as_tensor(read_idx(images)[:n].copy()).float().div_(255.0).unsqueeze(1)
    return x, torch.as_tensor(read_idx(labels)[:n].astype(np.int64))


def synthetic_arrays(shape: tuple[int, ...], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` Gaussian inputs of ``shape`` labelled by a fixed random linear map (learnable labels)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *shape), generator=gen)
    w = torch.randn(int(np.prod(shape)), 10, generator=gen)
    return x, (x.flatten(1) @ w).argmax(1)


def client_model(name: str) -> torch.nn.Module:
    if name == "resnet18":
        import torchvision

        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=10)
    return build_model("fednet", (1, 28, 28), 10, seed=0)


def fisher_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest over tensors of ``max |a - b| / max |b|``."""
    return max(float((a[n].double() - b[n].double()).abs().max() / b[n].double().abs().max().clamp_min(1e-300))
               for n in b)


def client_case(name: str, data: tuple[torch.Tensor, torch.Tensor], cpu_examples: int, device: torch.device,
                report: Report) -> None:
    """One model's local epoch and Fisher pass on ``device`` and on the CPU, and their Fishers' difference."""
    x, y = data
    n = int(y.shape[0])
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    part = DataLoader(TensorDataset(x[:cpu_examples], y[:cpu_examples]), batch_size=64)
    model = client_model(name)
    train(model, part, 1, device=device, progress=False)  # warm-up: CUDA context, cuDNN's algorithm choice
    epoch_s, metrics = timed(lambda: train(model, loader, 1, device=device, progress=False), device)
    fisher_s, _ = timed(lambda: diagonal_fisher(model, loader, device=device, progress=False), device)
    if report.profile:
        report.profiled(f"Fisher pass of {name} on {device}",
                        lambda: timed(lambda: diagonal_fisher(model, loader, device=device, progress=False), device))
    on_device = diagonal_fisher(model, part, device=device, progress=False)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        strict = diagonal_fisher(model, part, device=device, progress=False)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    cpu_model = copy.deepcopy(model).cpu()
    cpu_fisher_s, on_cpu = timed(lambda: diagonal_fisher(cpu_model, part, device="cpu", progress=False),
                                 torch.device("cpu"))
    cpu_epoch_s, _ = timed(lambda: train(cpu_model, part, 1, device="cpu", progress=False), torch.device("cpu"))
    scale = n / cpu_examples
    report.add("client", {
        "model": name, "input": list(x.shape[1:]), "examples": n, "cpu_examples": cpu_examples,
        "parameters": sum(p.numel() for p in model.parameters()), "device": str(device),
        "epoch_s": epoch_s, "fisher_s": fisher_s, "fisher_per_epoch": fisher_s / epoch_s,
        "cpu_epoch_s": cpu_epoch_s * scale, "cpu_fisher_s": cpu_fisher_s * scale,
        "fisher_rel_diff_default": fisher_difference(on_device, on_cpu),
        "fisher_rel_diff_no_tf32": fisher_difference(strict, on_cpu),
        "train_accuracy": metrics["train-accuracy"]})


def client_section(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    fashion = fashion_arrays(args.fashion_dir, args.client_examples)
    cases = [("fednet", fashion or synthetic_arrays((1, 28, 28), args.client_examples, 0)),
             ("resnet18", synthetic_arrays((3, 32, 32), args.client_examples, 1))]
    report.payload["client_data"] = {"fednet": "Fashion-MNIST" if fashion else "synthetic", "resnet18": "synthetic"}
    for name, data in cases:
        if report.time_left() < 60:
            report.skip(f"client {name}", "deadline")
            continue
        cpu_examples = args.cpu_examples if name == "fednet" else max(64, args.cpu_examples // 4)
        client_case(name, data, min(cpu_examples, int(data[1].shape[0])), device, report)


# ----------------------------------------------------------------------------- merge


def resnet18_uploads(k: int) -> tuple[list[Model], list[Model], PermutationSpec, dict[str, Any]]:
    """``k`` independently initialised torchvision ResNet-18s with squared-normal Fishers, and their
    sizes and buffers (:func:`~fedfiot_flwr.merge.prepare_clients`'s keywords)."""
    import torchvision

    rng = np.random.default_rng(0)
    models = []
    for seed in range(k):
        torch.manual_seed(seed)
        models.append({n: v.numpy().copy() for n, v in torchvision.models.resnet18(num_classes=10).state_dict().items()})
    net = torchvision.models.resnet18(num_classes=10)
    params = {n for n, _ in net.named_parameters()}
    fishers = [{n: (rng.standard_normal(v.shape) ** 2).astype(np.float32) for n, v in m.items() if n in params}
               for m in models]
    spec = spec_from_module(net, example_input=torch.randn(2, 3, 32, 32))
    data = {"num_examples": [int(s) for s in rng.integers(500, 5000, k)], "buffers": [n for n in models[0] if n not in params]}
    return models, fishers, spec, data


def vgg_model_uploads(k: int) -> tuple[list[Model], list[Model], PermutationSpec, dict[str, Any]]:
    """``merge_scale.py``'s ``k`` float16 vgg11_bn uploads, with their buffers (for :func:`prepare_clients`)."""
    models, fishers, spec, buffers = vgg_uploads(k)
    return models, fishers, spec, {"buffers": buffers}


def merge_cases(quick: bool, wide_m: int) -> list[tuple[str, Callable[[], tuple], dict[str, Any], MergeSpeed, int]]:
    """``(name, uploads, MergeOptions fields, numpy speed, torch stack bytes)`` of each case."""
    k = 3 if quick else 6
    exact, f32 = MergeSpeed(), MergeSpeed(cost_dtype="float32", lap_solver="auto", stack_bytes=2**30)

    def cnn() -> tuple:
        models, fishers = cnn_clients(k)
        return models, fishers, cnn_spec(["conv1", "conv2"], ["fc1", "fc2", "fc3"], flatten_block=25), {}

    def wide() -> tuple:
        spec, models, fishers = wide_layer_uploads(wide_m, 64 if quick else 1024, k)
        return models, fishers, spec, {}

    certified = MergeSpeed(cost_dtype="float32", lap_solver="auto", certify=True)
    cases = [("paper CNN", cnn, {"max_iters": 2 if quick else 8}, exact, 2**31),
             ("ResNet-18", lambda: resnet18_uploads(k), {"max_iters": 1 if quick else 8}, exact, 2**31),
             ("wide layer", wide, {"max_iters": 8, "fallback": "none"}, certified, 2**31)]
    if not quick:
        cases.append(("vgg11_bn", lambda: vgg_model_uploads(k), {"max_iters": 1}, f32, 2**34))
    return cases


def compare_merges(a: Any, b: Any) -> tuple[bool, float]:
    """Whether two merges found the same permutations, and their models' largest absolute difference."""
    same = a.permutations.keys() == b.permutations.keys() and all(
        np.array_equal(p, q) for name in a.permutations for p, q in zip(a.permutations[name], b.permutations[name]))
    diff = max(float(np.max(np.abs(np.asarray(a.model[n], np.float64) - np.asarray(b.model[n], np.float64))))
               for n in a.model if np.asarray(a.model[n]).size)
    return same, diff


def one_off_merge(models: list[Model], fishers: list[Model], spec: PermutationSpec, data: dict[str, Any],
                  options: MergeOptions, speed: MergeSpeed) -> Any:
    """One merge as a one-off caller runs it: the uploads checked (with ``data``'s sizes and buffers,
    their Fishers tempered when read), then merged."""
    return merge(prepare_clients(models, fishers, cache_bytes=0, **data), None, spec, options, speed=speed)


def merge_section(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    warm_models, warm_fishers = cnn_clients(2)  # CUDA context and cuBLAS, outside any timing
    merge(warm_models, warm_fishers, cnn_spec(["conv1", "conv2"], ["fc1", "fc2", "fc3"], flatten_block=25),
          MergeOptions(reference=0, max_iters=1), speed=MergeSpeed(backend="torch", device=str(device)))
    for name, uploads, opts, speed, stack in merge_cases(args.quick, args.wide_m):
        if report.time_left() < (150 if name == "vgg11_bn" else 40):
            report.skip(f"merge {name}", "deadline")
            continue
        models, fishers, spec, data = uploads()
        options = MergeOptions(reference=0, **opts)
        cpu_s, on_cpu = timed(lambda: one_off_merge(models, fishers, spec, data, options, speed), torch.device("cpu"))
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        on_gpu_speed = replace(speed, backend="torch", device=str(device), stack_bytes=stack)
        gpu_s, on_gpu = timed(lambda: one_off_merge(models, fishers, spec, data, options, on_gpu_speed), device)
        same, diff = compare_merges(on_cpu, on_gpu)
        report.add("merge", {
            "case": name, "clients": len(models), "parameters": int(sum(np.size(v) for v in fishers[0].values())),
            "max_iters": options.max_iters, "cost_dtype": speed.cost_dtype, "lap_solver": speed.lap_solver,
            "certify": speed.certify, "numpy_s": cpu_s, "torch_s": gpu_s, "device": str(device),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "same_permutations": same, "max_abs_diff": diff,
            "iterations": {p: r.iterations for p, r in on_gpu.reports.items()}})
        del models, fishers, on_cpu, on_gpu


def profile_vgg_section(device: torch.device, report: Report) -> None:
    """vgg11_bn's torch merge on ``device`` under cProfile (where the time goes; no numpy run)."""
    if report.time_left() < 120:
        report.skip("vgg11_bn profile", "deadline")
        return
    models, fishers, spec, data = vgg_model_uploads(6)
    speed = MergeSpeed(cost_dtype="float32", lap_solver="auto", backend="torch", device=str(device), stack_bytes=2**34)
    seconds, _ = report.profiled(f"vgg11_bn merge, torch on {device}", lambda: timed(
        lambda: one_off_merge(models, fishers, spec, data, MergeOptions(reference=0, max_iters=1), speed), device))
    report.payload["vgg_profile_s"] = seconds
    report.write()


# ----------------------------------------------------------------------------- refine


def refine_inputs(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Six Fashion-MNIST clients (two classes each) trained from one initialisation, their FedFiOT merge
    and the server's examples: what one refinement round starts from."""
    k, per_client = (3, 200) if args.quick else (6, 2000)
    pool = fashion_arrays(args.fashion_dir, 60000) or synthetic_arrays((1, 28, 28), 12000, 2)
    server = fashion_arrays(args.fashion_dir, args.server_examples, "test") or synthetic_arrays(
        (1, 28, 28), args.server_examples, 3)
    x, y = pool
    models, fishers, sizes = [], [], []
    for c in range(k):
        idx = torch.nonzero((y == 2 * c % 10) | (y == (2 * c + 1) % 10)).flatten()[:per_client]
        data = DataLoader(TensorDataset(x[idx], y[idx]), batch_size=64, shuffle=True,
                          generator=torch.Generator().manual_seed(c))
        model = build_model("fednet", (1, 28, 28), 10, seed=0)
        train(model, data, 1 if args.quick else 3, device=device, progress=False)
        fisher = diagonal_fisher(model, DataLoader(TensorDataset(x[idx], y[idx]), batch_size=64), device=device,
                                 progress=False)
        models.append({n: v.detach().cpu().numpy() for n, v in model.state_dict().items()})
        fishers.append({n: v.numpy() for n, v in fisher.items()})
        sizes.append(int(idx.numel()))
    spec = permutation_spec(build_model("fednet", (1, 28, 28), 10, seed=0))
    merged = merge(models, fishers, spec, num_examples=sizes)
    return {"models": models, "fishers": fishers, "sizes": sizes, "spec": spec, "merged": merged,
            "server": TensorDataset(*server)}


def refine_section(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    inputs = refine_inputs(args, device)
    options = RefineOptions(finetune_epochs=2, fisher_anchor=(1.0,), augment_copies=1) if args.quick else RefineOptions()
    for where in dict.fromkeys([device, torch.device("cpu")]):
        if report.time_left() < (30 if where.type == "cuda" else 90):
            report.skip(f"refine on {where}", "deadline")
            continue
        stage = RefinementStage(build_model("fednet", (1, 28, 28), 10, seed=0), inputs["server"], options,
                                spec=inputs["spec"], device=where)
        stage.progress = None
        merged = inputs["merged"]
        def run() -> tuple[float, Any]:
            return timed(lambda: stage(merged.model, inputs["models"], merged.permutations, inputs["sizes"],
                                       fishers=inputs["fishers"]), where)

        seconds, out = (report.profiled(f"refinement on {where}", run) if report.profile and where.type == "cuda"
                        else run())
        report.add("refine", {"device": str(where), "seconds": seconds, "returned": out.record["chosen"],
                              "selection_fold_accuracy": out.metrics["selection-fold-accuracy"],
                              "fit_examples": out.record["fit_examples"], "clients": len(inputs["models"]),
                              "options": "RefineOptions(finetune_epochs=2, fisher_anchor=(1.0,), augment_copies=1)"
                              if args.quick else "RefineOptions()"})


# ----------------------------------------------------------------------------- tests


def tests_section(report: Report) -> None:
    """``pytest -m cuda`` on the tests that exercise CUDA; their pass/fail lines."""
    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-m", "cuda", "-p", "no:cacheprovider", *CUDA_TESTS]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=max(30, int(report.time_left())),
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))]
    report.payload["tests"] = {"command": "python -m pytest -q -rA -m cuda " + " ".join(CUDA_TESTS),
                               "exit_code": proc.returncode, "lines": lines,
                               "summary": (proc.stdout.strip().splitlines() or [""])[-1]}
    print(proc.stdout[-3000:], proc.stderr[-2000:], flush=True)
    report.write()


# ----------------------------------------------------------------------------- page


def _client_lines(rows: Sequence[dict[str, Any]], data: dict[str, str]) -> list[str]:
    lines = ["## Client: one local epoch and the Fisher pass", "",
             "Seconds for a client of the stated size (batch 64, SGD as the app's trainer). The CPU is the "
             "same machine's, measured on the CPU examples and scaled to the client's size. Fisher "
             "difference: max |CUDA - CPU| / max |CPU| per tensor, the largest over tensors, same weights and "
             "batches.", "",
             "| model | data | input | examples | CUDA epoch (s) | CUDA Fisher (s) | Fisher / epoch | CPU epoch (s) "
             "| CPU Fisher (s) | CPU examples | Fisher difference, TF32 convolutions (torch's default) | "
             "Fisher difference, TF32 off |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {data.get(r['model'], '')} | {'x'.join(map(str, r['input']))} | "
                     f"{r['examples']:,} | {r['epoch_s']:.2f} | {r['fisher_s']:.2f} | {r['fisher_per_epoch']:.2f} | "
                     f"{r['cpu_epoch_s']:.1f} | {r['cpu_fisher_s']:.1f} | {r['cpu_examples']:,} | "
                     f"{r['fisher_rel_diff_default']:.1e} | {r['fisher_rel_diff_no_tf32']:.1e} |")
    return lines


def _merge_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["## Merge: numpy against `MergeSpeed(backend=\"torch\")` on CUDA, same uploads", "",
             "Wall seconds of one merge (reference client 0); numpy uses every core of the host. Peak GPU "
             "memory: `torch.cuda.max_memory_allocated` during the torch merge.", "",
             "| case | parameters | K | S | costs, solver | numpy (s) | torch on CUDA (s) | numpy / torch | "
             "peak GPU memory (GiB) | same permutations | largest abs. difference |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        peak = "-" if r["peak_gpu_bytes"] is None else f"{r['peak_gpu_bytes'] / 2**30:.2f}"
        costs = f"{r['cost_dtype']}, {r['lap_solver']}" + (", certify" if r["certify"] else "")
        lines.append(f"| {r['case']} | {r['parameters']:,} | {r['clients']} | {r['max_iters']} | {costs} | "
                     f"{r['numpy_s']:.2f} | {r['torch_s']:.2f} | {r['numpy_s'] / r['torch_s']:.1f}x | {peak} | "
                     f"{'yes' if r['same_permutations'] else 'no'} | {r['max_abs_diff']:.1e} |")
    return lines


def markdown(p: dict[str, Any]) -> str:
    """The results page of a run's payload."""
    env = p["environment"]
    lines = ["# FedFiOT on a GPU (benchmarks/gpu_check.py)", "",
             f"GPU: {env['gpu']}; torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}, numpy "
             f"{env['numpy']}, Python {env['python']}; host: {env['cpu_cores']} cores ({env['cpu']}), torch "
             f"uses {env['torch_cpu_threads']} CPU threads. Run took {p.get('seconds', 0):.0f} s.", ""]
    if p["client"]:
        lines += [*_client_lines(p["client"], p.get("client_data", {})), ""]
    if p["merge"]:
        lines += [*_merge_lines(p["merge"]), ""]
    if p["refine"]:
        lines += ["## Server refinement: one round after the paper CNN's FedFiOT merge", "",
                  f"{p['refine'][0]['clients']} Fashion-MNIST clients (two classes each) trained from one "
                  f"initialisation; {p['refine'][0]['options']} on {p['refine'][0]['fit_examples']} fitting "
                  "and as many selection examples.", "",
                  "| device | seconds | returned candidate | selection-fold accuracy |", "|---|---:|---|---:|"]
        lines += [f"| {r['device']} | {r['seconds']:.1f} | `{r['returned']}` | {100 * r['selection_fold_accuracy']:.1f}% |"
                  for r in p["refine"]]
        lines.append("")
    if p["tests"]:
        t = p["tests"]
        lines += ["## Tests that exercise CUDA", "", f"`{t['command']}`: {t['summary']} (exit {t['exit_code']})", "",
                  "```", *t["lines"], "```", ""]
    if p["skipped"]:
        lines += ["Not run: " + "; ".join(p["skipped"]) + ".", ""]
    kept = p.get("kept_from_earlier_run")
    if kept:
        lines += [f"Taken from an earlier run of this script on the same machine ({kept['environment']['gpu']}, torch "
                  f"{kept['environment']['torch']}), with the same code on their path: {', '.join(kept['sections'])} "
                  f"(`{kept['command']}`).", ""]
    lines += [f"Command: `{p['command']}`", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", nargs="+", choices=SECTIONS + EXTRA_SECTIONS, default=list(SECTIONS))
    p.add_argument("--profile", action="store_true",
                   help="also profile the device's Fisher passes and refinement (cProfile, into profile.txt)")
    p.add_argument("--keep-from", type=Path, default=None,
                   help="an earlier run's gpu.json: the sections not run now are taken from it (and marked so)")
    p.add_argument("--quick", action="store_true", help="toy sizes: the code path only")
    p.add_argument("--device", default=None, help="the accelerator side (default: cuda when available, else cpu)")
    p.add_argument("--client-examples", type=int, default=None, help="a client's examples (default 10,000)")
    p.add_argument("--cpu-examples", type=int, default=None,
                   help="examples the CPU side is timed on (ResNet-18: a quarter); default 2,000")
    p.add_argument("--server-examples", type=int, default=None, help="the server's labelled examples (default 500)")
    p.add_argument("--wide-m", type=int, default=None, help="neurons of the wide layer (default 4096)")
    p.add_argument("--fashion-dir", type=Path, default=Path(os.environ.get("FEDFIOT_FASHION_MNIST_DIR", FASHION_DIR)))
    p.add_argument("--deadline-s", type=float, default=540.0,
                   help="stop starting new measurements after this many seconds (what is done is kept)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    small = {"client_examples": 192, "cpu_examples": 128, "server_examples": 100, "wide_m": 256}
    full = {"client_examples": 10000, "cpu_examples": 2000, "server_examples": 500, "wide_m": 4096}
    for key, value in (small if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.monotonic()
    report = Report(args.out_dir, start + args.deadline_s,
                    {"environment": environment(device), "command": command_line(argv, script=__file__, interpreter="python"),
                     "quick": args.quick}, profile=args.profile)
    if args.keep_from is not None:
        earlier = json.loads(args.keep_from.read_text())
        kept = [name for name in SECTIONS if name not in args.sections and earlier.get(name)]
        for name in kept:
            report.payload[name] = earlier[name]
        report.payload["kept_from_earlier_run"] = {"sections": kept, "command": earlier["command"],
                                                   "environment": earlier["environment"]}
    steps: dict[str, Callable[[], None]] = {
        "client": lambda: client_section(args, device, report), "merge": lambda: merge_section(args, device, report),
        "refine": lambda: refine_section(args, device, report), "tests": lambda: tests_section(report),
        "profile-vgg": lambda: profile_vgg_section(device, report)}
    for name in args.sections:
        steps[name]()
        report.payload["seconds"] = time.monotonic() - start
        report.write()
    return report.payload


if __name__ == "__main__":
    main()
