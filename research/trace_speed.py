"""Time ``spec_from_module``: the previous permutation check against the current one, in one process.

For every model, the spec is derived from the same module object by the previous path (the body
of ``spec_from_module`` with ``_failing_permutations_reference``: a deep copy converted to float64,
every permutation copied into the tensors and back, torch's own thread count) and by
``spec_from_module`` itself, interleaved. The example input is guessed, as
``FedFiOT(model=...)`` does. Every row also says whether the two specs agree in every tensor,
axis entry and order. Timings are process CPU seconds (``time.process_time``: every thread of the
process) and wall seconds, the minimum over the repeats; the machine is shared, so compare the
ratios of one run rather than absolute seconds across runs.

Run:  .venv/bin/python research/trace_speed.py [--threads N ...] [--repeats R] [--models NAME ...]
Writes research/results/trace_speed.md (``--out`` for another file), one table per thread count
(``--threads 2 1``: torch's count for the whole process, so for the previous path; the current one
always probes on one thread).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedfiot_flwr.merge import PermutationSpec, spec_from_module  # noqa: E402
from fedfiot_flwr.merge import trace  # noqa: E402
from fedfiot_flwr.models import build_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

MODELS: dict[str, Callable[[], nn.Module]] = {
    "resnet18": lambda: torchvision.models.resnet18(num_classes=10),
    "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
    "vgg11_bn": lambda: torchvision.models.vgg11_bn(num_classes=10),
    "resnet20": lambda: build_model("resnet20", (3, 32, 32), 10, seed=0),
    "fednet": lambda: build_model("fednet", (3, 32, 32), 10, seed=0),
    "mlp": lambda: build_model("mlp", (1, 8, 8), 10, seed=0),
}


def content(spec: PermutationSpec) -> tuple[list[tuple[str, Any]], list[str]]:
    """Everything a spec holds, in order."""
    return list(spec.axes.items()), list(spec.perm_names)


def old_path(model: nn.Module) -> PermutationSpec:
    return trace._derive_spec(model, "P_", None, True, reference=True)


def timed(fn: Callable[[nn.Module], PermutationSpec], model: nn.Module) -> tuple[float, float, PermutationSpec]:
    cpu, wall = time.process_time(), time.perf_counter()
    spec = fn(model)
    return time.process_time() - cpu, time.perf_counter() - wall, spec


def measure(name: str, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MODELS[name]()
    runs: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    specs: dict[str, PermutationSpec] = {}
    paths = {"old": old_path, "new": spec_from_module}
    for r in range(repeats):
        for path in (("old", "new") if r % 2 == 0 else ("new", "old")):
            cpu, wall, specs[path] = timed(paths[path], model)
            runs[path].append((cpu, wall))
    best = {path: (min(c for c, _ in values), min(w for _, w in values)) for path, values in runs.items()}
    return {
        "model": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "permutations": len(specs["new"].perm_names),
        "old_cpu": best["old"][0], "new_cpu": best["new"][0],
        "old_wall": best["old"][1], "new_wall": best["new"][1],
        "same": content(specs["old"]) == content(specs["new"]),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                        help="torch.set_num_threads before timing both paths; one table per value")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each path per model (minimum reported)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--out", type=Path, default=RESULTS / "trace_speed.md")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    warm = MODELS["mlp"]()  # one-time costs of torch.fx (its operator tables) paid before any timing
    old_path(warm)
    spec_from_module(warm)
    tables: list[str] = []
    rows: list[dict[str, Any]] = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        tables += [
            "", f"## torch threads: {threads}", "",
            "| model | parameters | permutations | previous: process s | current: process s | previous / current "
            "| previous: wall s | current: wall s | same spec |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in args.models:
            row = {"threads": threads, **measure(name, args.repeats)}
            rows.append(row)
            print(f"[{threads} threads] {name}: old {row['old_cpu']:.2f} s, new {row['new_cpu']:.2f} s process time "
                  f"(x{row['old_cpu'] / row['new_cpu']:.1f}); wall {row['old_wall']:.2f} s -> "
                  f"{row['new_wall']:.2f} s; same spec: {row['same']}", flush=True)
            tables.append(
                f"| {row['model']} | {row['parameters']:,} | {row['permutations']} | {row['old_cpu']:.3g} "
                f"| {row['new_cpu']:.3g} | {row['old_cpu'] / row['new_cpu']:.1f} | {row['old_wall']:.3g} "
                f"| {row['new_wall']:.3g} | {'yes' if row['same'] else '**no**'} |")
    command = "research/trace_speed.py" + "".join(
        f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    lines = [
        "# spec_from_module: previous vs current permutation check",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(load average {os.getloadavg()[0]:.1f} at the end: shared with other jobs); torch {torch.__version__}, "
        f"torchvision {torchvision.__version__}. Command: `.venv/bin/python {command}` "
        f"({time.perf_counter() - start:.0f} s).",
        "",
        "Process CPU seconds (all threads) and wall seconds of one derivation with a guessed input, "
        f"minimum of {args.repeats} interleaved run(s) per path, both paths in this one process on the same "
        "module object. The previous path runs on the table's torch thread count, the current one probes on "
        "one thread. Same spec: every tensor, axis entry and permutation, in order.",
        *tables,
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
