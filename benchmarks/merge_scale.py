"""Merge scale: time and memory against the number of clients K, wide layers, and a 129M-parameter model.

Sections (each timed in one process, the baseline engine (``--baseline-rev``) interleaved with this one):

- ``--clients``: the paper's CNN (conv 32-64, fc 512-128-10, 940k parameters), float32 uploads
  around a shared model, S = 8, K in {6, 20, 50, 100}: seconds per merge and tracemalloc peak
  of the merge's extra memory, as a multiple of the uploads' bytes;
- ``--wide``: one layer, m = 4096 neurons, d = 1024 inputs, K = 6 independent clients
  (the Hungarian dominates): exact solvers and float32 costs, objective against the exact merge;
- ``--vgg``: torchvision ``vgg11_bn`` (129M parameters, random weights, no download) with K = 6
  float16 uploads, merged with streamed clients and float32 costs in a child process whose peak
  resident memory is reported.

Writes ``benchmarks/results/merge_scale.md`` (sections that were not run are kept from the
previous file). Usage::

    python benchmarks/merge_scale.py --clients [--ks 6 20 50 100] --wide --vgg
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.baseline_code import DEFAULT_BASELINE_REV, load_baseline  # noqa: E402
from benchmarks.merge_speed import cpu_timed  # noqa: E402
from benchmarks.portable import command_line  # noqa: E402
from fedfiot_flwr.merge import MergeOptions, MergeSpeed, PermutationSpec, cnn_spec, merge  # noqa: E402

RESULT = Path(__file__).resolve().parent / "results" / "merge_scale.md"
CNN_SHAPES = {"conv1.weight": (32, 3, 5, 5), "conv1.bias": (32,), "conv2.weight": (64, 32, 5, 5), "conv2.bias": (64,),
              "fc1.weight": (512, 1600), "fc1.bias": (512,), "fc2.weight": (128, 512), "fc2.bias": (128,),
              "fc3.weight": (10, 128), "fc3.bias": (10,)}


def upload_bytes(models: list[dict[str, np.ndarray]], fishers: list[dict[str, np.ndarray]]) -> int:
    return sum(x.nbytes for m in (*models, *fishers) for x in m.values())


def cnn_clients(k: int, noise: float = 0.1, seed: int = 0) -> tuple[list, list]:
    rng = np.random.default_rng(seed)
    base = {n: rng.normal(size=s).astype(np.float32) for n, s in CNN_SHAPES.items()}
    models = [{n: (v + noise * rng.normal(size=v.shape)).astype(np.float32) for n, v in base.items()} for _ in range(k)]
    fishers = [{n: (rng.exponential(size=v.shape) ** 2).astype(np.float32) for n, v in base.items()} for _ in range(k)]
    return models, fishers


def peak_extra(fn: Any) -> int:
    """tracemalloc peak (bytes) of ``fn``'s allocations (numpy's included)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def best_of(repeats: int, fns: dict[str, Any]) -> dict[str, tuple[float, Any]]:
    """Minimum time of each function over ``repeats`` interleaved rounds (and its last result)."""
    out: dict[str, tuple[float, Any]] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            t, res = cpu_timed(fn)
            out[name] = (min(t, out[name][0]) if name in out else t, res)
    return out


def clients_section(ks: list[int], baseline_max_k: int, base_merge: Any, repeats: int) -> list[str]:
    spec = cnn_spec(["conv1", "conv2"], ["fc1", "fc2", "fc3"], flatten_block=25)
    rows = []
    for k in ks:
        models, fishers = cnn_clients(k)
        up = upload_bytes(models, fishers)
        opts = {"max_iters": 8, "reference": 0}  # the baseline engine takes them as keywords
        options = MergeOptions(**opts)
        run_base = k <= baseline_max_k
        fns = {"new": lambda: merge(models, fishers, spec, options),
               "f32": lambda: merge(models, fishers, spec, options, speed=MergeSpeed(cost_dtype="float32"))}
        if run_base:
            fns["old"] = lambda: base_merge(models, fishers, spec, **opts)
        runs = best_of(repeats, fns)
        (t_new, res), (t_f32, res32) = runs["new"], runs["f32"]
        t_old = runs["old"][0] if run_base else float("nan")
        m_old = peak_extra(lambda: base_merge(models, fishers, spec, **opts)) if run_base else float("nan")
        m_new = peak_extra(lambda: merge(models, fishers, spec, options))
        same = all(np.array_equal(res.model[n], res32.model[n]) for n in res.model)
        rows.append({"K": k, "uploads MB": up / 1e6, "old s": t_old, "new s": t_new, "f32 s": t_f32,
                     "old mem": m_old / up, "new mem": m_new / up, "f32 same": same,
                     "iters": "/".join(str(r.iterations) for r in res.reports.values())})
        print(json.dumps(rows[-1]), flush=True)
    k0 = rows[0]
    lines = [
        "## Many clients: the paper's CNN (940k parameters), float32 uploads around a shared model, S = 8",
        "",
        "Peak extra memory: tracemalloc peak during the merge / bytes of the uploads (weights + Fishers). "
        "'per client' columns: seconds / K, relative to the first row (1.0 = linear in K). "
        "Times: process CPU seconds (one thread), minimum of interleaved repeats.",
        "",
        "| K | uploads (MB) | baseline (s) | this engine (s) | float32 costs (s) | speed-up | per client vs K=%d "
        "| baseline: peak extra / uploads | this engine: peak extra / uploads | float32 = float64 model | iterations |"
        % k0["K"],
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lin = (r["new s"] / r["K"]) / (k0["new s"] / k0["K"])
        ran = r["old s"] == r["old s"]  # the baseline is skipped above --baseline-max-k (NaN)
        old_s, speed, old_mem = ((f"{r['old s']:.2f}", f"{r['old s'] / r['new s']:.1f}x", f"{r['old mem']:.1f}x") if ran
                                 else ("not run", "-", "-"))
        lines.append(f"| {r['K']} | {r['uploads MB']:.0f} | {old_s} | {r['new s']:.2f} | {r['f32 s']:.2f} | "
                     f"{speed} | {lin:.2f} | {old_mem} | {r['new mem']:.1f}x | "
                     f"{'yes' if r['f32 same'] else 'no'} | {r['iters']} |")
    return lines


WIDE_VARIANTS = {
    "exact": ("exact: float64 costs, scipy", {}),
    "f32": ("float32 costs, scipy", {"cost_dtype": "float32"}),
    "lapjv": ("float64 costs, LAPJV", {"lap_solver": "lapjv"}),
    "f32-lapjv": ("float32 costs, LAPJV", {"cost_dtype": "float32", "lap_solver": "lapjv"}),
    "certify": ("float64 costs, scipy, certify", {"certify": True}),
    "f32-lapjv-certify": ("float32 costs, LAPJV, certify", {"cost_dtype": "float32", "lap_solver": "lapjv",
                                                            "certify": True}),
}


def wide_layer_uploads(m: int, d: int, k: int, seed: int = 1) -> tuple[PermutationSpec, list, list]:
    """One hidden layer of ``m`` neurons with ``d`` inputs and 10 outputs: K independent random
    clients (float32) and exponential Fishers, with its spec (permutation ``"P"``)."""
    rng = np.random.default_rng(seed)
    spec = PermutationSpec({"w": ("P", None), "b": ("P",), "out": (None, "P")})
    models = [{"w": rng.normal(size=(m, d)).astype(np.float32), "b": rng.normal(size=m).astype(np.float32),
               "out": rng.normal(size=(10, m)).astype(np.float32)} for _ in range(k)]
    fishers = [{n: rng.exponential(size=v.shape).astype(np.float32) for n, v in mk.items()} for mk in models]
    return spec, models, fishers


def wide_section(m: int, d: int, k: int, base_merge: Any, run_baseline: bool, names: list[str] | None = None,
                 repeats: int = 1) -> list[str]:
    spec, models, fishers = wide_layer_uploads(m, d, k)
    opts = {"max_iters": 8, "reference": 0, "fallback": "none"}  # the baseline engine takes them as keywords
    names = ["exact", *[n for n in (names or list(WIDE_VARIANTS)) if n != "exact"]]
    variants = [WIDE_VARIANTS[n] for n in names]
    rows = []
    if run_baseline:
        t, res = cpu_timed(lambda: base_merge(models, fishers, spec, **opts))
        rows.append(("baseline engine: float64, scipy", t, res))
        print(rows[-1][:2], flush=True)
    best: dict[str, tuple[float, Any]] = {}
    for _ in range(repeats):  # interleaved; the minimum is kept
        for label, extra in variants:
            t, res = cpu_timed(lambda: merge(models, fishers, spec, MergeOptions(**opts), speed=MergeSpeed(**extra)))
            best[label] = min(best.get(label, (t, res)), (t, res), key=lambda x: x[0])
            print(label, t, res.objective, flush=True)
    rows += [(label, *best[label]) for label, _ in variants]
    exact = next(r for r in rows if r[0].startswith("exact"))
    lines = [
        f"## Wide layer: m = {m}, d = {d}, K = {k} independent clients, S = 8 (one layer's alignment)",
        "",
        f"Times: process CPU seconds, one thread, minimum of {repeats} interleaved run(s). certify: certified "
        "warm-started assignments (exact), the reference client's first cost matrix skipped.",
        "",
        "| variant | CPU seconds | / exact | iterations | objective J / exact J - 1 | assignments differing "
        "from exact | same permutations as exact |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label, t, res in rows:
        pairs = list(zip(res.permutations["P"], exact[2].permutations["P"]))
        same = all(np.array_equal(a, b) for a, b in pairs)
        differing = float(np.mean([np.mean(a != b) for a, b in pairs]))
        lines.append(f"| {label} | {t:.1f} | {t / exact[1]:.2f} | {res.reports['P'].iterations} | "
                     f"{res.objective / exact[2].objective - 1:.1e} | {differing:.4f} | {'yes' if same else 'no'} |")
    return lines


def vgg_uploads(k: int) -> tuple[list[dict], list[dict], PermutationSpec, list[str]]:
    """``k`` float16 vgg11_bn uploads around one random model (their wire precision), Fishers from a
    standard exponential, the traced spec and the BatchNorm buffers' names."""
    import torch
    import torchvision

    from fedfiot_flwr.merge import spec_from_module

    torch.manual_seed(0)
    net = torchvision.models.vgg11_bn(weights=None, num_classes=10)
    spec = spec_from_module(net)
    base = {n: t.detach().numpy() for n, t in net.state_dict().items()}
    buffers = [n for n in base if "running" in n or "num_batches" in n]
    rng = np.random.default_rng(0)

    def noisy(v: np.ndarray) -> np.ndarray:
        if v.dtype.kind != "f":
            return v.copy()
        out = rng.standard_normal(size=v.shape, dtype=np.float32)
        out *= 0.01
        out += v
        return out.astype(np.float16)

    models = [{n: noisy(v) for n, v in base.items()} for _ in range(k)]
    fishers = [{n: rng.standard_exponential(size=v.shape, dtype=np.float32).astype(np.float16)
                for n, v in base.items() if n not in buffers} for _ in range(k)]
    return models, fishers, spec, buffers


VGG_CHILD = r"""
import json, os, sys, threading, time
from fedfiot_flwr.merge import MergeOptions, MergeSpeed, merge, prepare_clients
from benchmarks.merge_scale import vgg_uploads
k, iters = int(sys.argv[1]), int(sys.argv[2])
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
peak = [0]
def sample(stop):
    while not stop.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.2)
models, fishers, spec, buffers = vgg_uploads(k)
params = sum(v.size for n, v in models[0].items() if n not in buffers)
uploads = sum(x.nbytes for m in (*models, *fishers) for x in m.values())
rss0 = rss()
stop = threading.Event()
watcher = threading.Thread(target=sample, args=(stop,), daemon=True)
watcher.start()
t0, c0 = time.perf_counter(), time.process_time()
res = merge(prepare_clients(models, fishers, buffers=buffers, cache_bytes=0), None, spec,
            MergeOptions(reference=0, max_iters=iters),
            speed=MergeSpeed(cost_dtype="float32", lap_solver="auto", stack_bytes=2**30))
seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
stop.set(); watcher.join()
print(json.dumps({"params": params, "uploads": uploads, "rss_before": rss0, "rss_peak": max(peak[0], rss()),
                  "seconds": seconds, "cpu": cpu,
                  "iterations": {p: r.iterations for p, r in res.reports.items()}}))
"""


def vgg_section(k: int, iters: int) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", VGG_CHILD, str(k), str(iters)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return ["## vgg11_bn", "", f"Failed (exit {out.returncode}): `{out.stderr.strip().splitlines()[-1:]}`"]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    print(r, flush=True)
    return [
        f"## A 129M-parameter model: torchvision vgg11_bn, K = {k}, S = {iters}",
        "",
        f"- parameters: {r['params']:,}; uploads held as float16 (their wire format): {r['uploads'] / 1e9:.2f} GB",
        f"- options: `MergeSpeed(cost_dtype=\"float32\", lap_solver=\"auto\", stack_bytes=2**30)` (wide layers streamed)",
        f"- peak resident memory of the process during the merge (sampled every 0.2 s): "
        f"{r['rss_peak'] / 1e9:.2f} GB, of which {r['rss_before'] / 1e9:.2f} GB before the merge "
        f"(uploads, torch); merge: {r['cpu']:.0f} CPU s, {r['seconds']:.0f} s wall",
        f"- iterations per permutation: {r['iterations']}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", action="store_true")
    parser.add_argument("--ks", nargs="+", type=int, default=[6, 20, 50, 100])
    parser.add_argument("--baseline-max-k", type=int, default=50, help="run the baseline only up to this K")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs per variant (the minimum is kept)")
    parser.add_argument("--wide", action="store_true")
    parser.add_argument("--wide-baseline", action="store_true", help="also time the baseline on the wide layer")
    parser.add_argument("--wide-m", type=int, default=4096)
    parser.add_argument("--wide-variants", nargs="+", choices=list(WIDE_VARIANTS), default=None,
                        help="variants of the wide layer (exact always runs)")
    parser.add_argument("--vgg", action="store_true")
    parser.add_argument("--vgg-iters", type=int, default=1)
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE_REV)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    base_merge = importlib.import_module(f"{load_baseline(args.baseline_rev).__name__}.merge").merge
    sections: dict[str, list[str]] = {}
    if args.out.exists():  # keep the sections not rerun
        current = None
        for line in args.out.read_text().splitlines():
            if line.startswith("## "):
                current = line
                sections[current] = []
            if current is not None:
                sections[current].append(line)
    started = time.process_time()
    for flag, make in (("clients", lambda: clients_section(args.ks, args.baseline_max_k, base_merge, args.repeats)),
                       ("wide", lambda: wide_section(args.wide_m, 1024, 6, base_merge, args.wide_baseline, args.wide_variants,
                                                     args.repeats)),
                       ("vgg", lambda: vgg_section(6, args.vgg_iters))):
        if getattr(args, flag):
            lines = make()
            lines.append(f"\nCommand: `{command_line(interpreter='python')}` "
                         f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
            sections = {h: v for h, v in sections.items() if not h.startswith(lines[0][:12])}
            sections[lines[0]] = lines
    text = "\n".join([
        "# Merge scale (benchmarks/merge_scale.py)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs, "
        f"numpy {np.__version__}; baseline: the engine of `--baseline-rev` (default set in `benchmarks/baseline_code.py`), same process. "
        f"Last run took {time.process_time() - started:.0f} s.",
        "",
        *[line for lines in sections.values() for line in (*lines, "")],
    ])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
