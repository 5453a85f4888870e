"""Merge speed: our cost matrices and merge against a naive broadcast version and plain averaging.

Run:  .venv/bin/python benchmarks/merge_speed.py [--quick]
Writes benchmarks/results/merge_speed.md. All timings of one table come from the same process,
so compare ratios rather than absolute seconds (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import platform
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedfiot_flwr.merge import MergeOptions, MergeSpeed, assign, cnn_spec, fisher_cost_matrix, merge
from fedfiot_flwr.merge.costs import fisher_cost_matrices
from fedfiot_flwr.merge.lap import lapjv_available

RESULTS = Path(__file__).parent / "results"
NAIVE_ELEMENTS = 2**25  # row chunk of the broadcast, so that the naive version fits in memory at all


def naive_cost_matrix(w: np.ndarray, w_k: np.ndarray, f_k: np.ndarray) -> np.ndarray:
    """C[i, j] = sum_c f_k[j, c] (w[i, c] - w_k[j, c])**2 by broadcasting (m x m x d), in row chunks."""
    m, d = w.shape
    rows = max(1, NAIVE_ELEMENTS // (m * d))
    out = np.empty((m, m))
    for start in range(0, m, rows):
        diff = w[start:start + rows, None, :] - w_k[None, :, :]
        out[start:start + rows] = np.einsum("ijc,jc->ij", diff * diff, f_k)
    return out


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def width_sweep(widths: list[int], clients: list[int], d: int, sample: int) -> list[str]:
    rows = ["| m | d | K | ours: K cost matrices (s) | naive broadcast (s) | naive / ours | assignment, K clients (s) "
            "| plain average (s) | ours / average | peak extra memory per client / (m*d*8 B) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    rng = np.random.default_rng(0)
    for m in widths:
        for k in clients:
            w = rng.normal(size=(m, d))
            layers = [rng.normal(size=(m, d)) for _ in range(k)]
            fishers = [rng.exponential(size=(m, d)) for _ in range(k)]
            t_ours, costs = timed(lambda: list(fisher_cost_matrices(w, layers, fishers)))
            # The naive version is timed on `sample` clients and scaled to K (marked with *).
            n_naive = min(k, sample)
            t_naive = sum(timed(naive_cost_matrix, w, layers[i], fishers[i])[0] for i in range(n_naive)) * k / n_naive
            n_assign = min(k, sample if m >= 4096 else k)
            t_assign = sum(timed(assign, costs[i])[0] for i in range(n_assign)) * k / n_assign
            t_avg, _ = timed(lambda: np.mean(np.stack(layers), axis=0))
            tracemalloc.start()
            fisher_cost_matrix(w, layers[0], fishers[0])
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            star = "*" if n_naive < k else ""
            astar = "*" if n_assign < k else ""
            rows.append(f"| {m} | {d} | {k} | {t_ours:.3f} | {t_naive:.2f}{star} | {t_naive / t_ours:.1f}{star} | "
                        f"{t_assign:.2f}{astar} | {t_avg:.4f} | {t_ours / t_avg:.0f} | {peak / (m * d * 8):.2f} |")
            print(rows[-1], flush=True)
    return rows


def paper_cnn(repeats: int) -> list[str]:
    shapes = {"conv1.weight": (32, 3, 5, 5), "conv1.bias": (32,), "conv2.weight": (64, 32, 5, 5), "conv2.bias": (64,),
              "fc1.weight": (512, 1600), "fc1.bias": (512,), "fc2.weight": (128, 512), "fc2.bias": (128,),
              "fc3.weight": (10, 128), "fc3.bias": (10,)}
    spec = cnn_spec(["conv1", "conv2"], ["fc1", "fc2", "fc3"], flatten_block=25)
    rng = np.random.default_rng(0)
    base = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
    rows = ["| setting | parameters | K | S | merge (s) | merge, certify (s) | certify / exact | same merge | "
            "merge, f32 + LAPJV + certify (s) | / exact | same permutations | plain average (s) | merge / average "
            "| inner iterations |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fast = {"cost_dtype": "float32", "lap_solver": "lapjv" if lapjv_available() else "scipy", "certify": True}
    for noise in (0.1, 1.0):
        models = [{n: (v + noise * rng.normal(size=v.shape)).astype(np.float32) for n, v in base.items()}
                  for _ in range(6)]
        fishers = [{n: (rng.exponential(size=v.shape) ** 2).astype(np.float32) for n, v in base.items()}
                   for _ in range(6)]
        options = MergeOptions(max_iters=8, reference=0)
        times: dict[str, list[float]] = {"exact": [], "certify": [], "fast": []}
        results = {}
        for _ in range(repeats):  # interleaved; process CPU time, minimum of the repeats
            for label, opts in (("exact", {}), ("certify", {"certify": True}), ("fast", fast)):
                t, results[label] = cpu_timed(lambda: merge(models, fishers, spec, options, speed=MergeSpeed(**opts)))
                times[label].append(t)
        t_avg = min(cpu_timed(lambda: {n: np.mean([m[n] for m in models], axis=0) for n in shapes})[0]
                    for _ in range(repeats))
        exact, cert, quick = results["exact"], results["certify"], results["fast"]
        same = all(np.array_equal(exact.model[n], cert.model[n]) for n in exact.model)
        same_p = all(np.array_equal(a, b) for p in exact.permutations
                     for a, b in zip(exact.permutations[p], quick.permutations[p]))
        iters = "/".join(str(r.iterations) for r in exact.reports.values())
        n_params = sum(int(np.prod(sh)) for sh in shapes.values())
        te, tc, tf = min(times["exact"]), min(times["certify"]), min(times["fast"])
        rows.append(f"| clients = shared base + N(0, {noise}^2) noise | {n_params:,} | 6 | 8 | {te:.2f} | {tc:.2f} | "
                    f"{tc / te:.2f} | {'yes' if same else 'NO'} | {tf:.2f} | {tf / te:.2f} | "
                    f"{'yes' if same_p else 'NO'} | {t_avg:.4f} | {te / t_avg:.0f} | {iters} |")
        print(rows[-1], flush=True)
    return rows


def cpu_timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``(process CPU seconds, value)`` of ``fn()`` (also :mod:`benchmarks.merge_scale`'s timer)."""
    start = time.process_time()
    value = fn()
    return time.process_time() - start, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small widths only (smoke run)")
    parser.add_argument("--cnn-only", action="store_true", help="only the paper's CNN (writes merge_speed_cnn.md)")
    args = parser.parse_args()
    if args.cnn_only:
        start = time.perf_counter()
        cnn = paper_cnn(5)
        out = RESULTS / "merge_speed_cnn.md"
        out.write_text("\n".join([
            "# Merge speed: the paper's CNN", "",
            f"Machine: {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores; numpy "
            f"{np.__version__}. Command: `.venv/bin/python benchmarks/merge_speed.py --cnn-only` "
            f"({time.perf_counter() - start:.0f} s). K = 6, S = 8; process CPU seconds, one thread, minimum of 5 "
            "interleaved repeats. certify: certified warm-started assignments (exact).", "", *cnn, ""]))
        print(f"wrote {out}")
        return
    widths = [64, 128] if args.quick else [256, 1024, 4096]
    d = 64 if args.quick else 1024
    start = time.perf_counter()
    sweep = width_sweep(widths, [6, 32], d, sample=2)
    cnn = paper_cnn(1 if args.quick else 3)
    lines = [
        "# Merge speed",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores; "
        f"numpy {np.__version__}. Command: `.venv/bin/python benchmarks/merge_speed.py"
        f"{' --quick' if args.quick else ''}` ({time.perf_counter() - start:.0f} s).",
        "",
        "## One alignment step of one layer (Fisher cost matrices for K clients), d = %d" % d,
        "",
        "`*`: timed on 2 clients and scaled to K (the naive m*m*d broadcast and, at m = 4096, the Hungarian "
        "solver are too slow to run for every client).",
        "",
        *sweep,
        "",
        "## The paper's CNN (conv 32-64, fc 512-128-10), K = 6, S = 8, best of repeats",
        "",
        *cnn,
        "",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("merge_speed_quick.md" if args.quick else "merge_speed.md")
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
