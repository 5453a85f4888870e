"""Server speed: a wide layer's assignments in threads, and FedFisher K-FAC through its low-rank roots.

Two sections, each timing an exact path against the faster one **in the same process,
interleaved** (minimum of the repeats), and checking that they agree:

- ``--wide``: one layer of m neurons (d = 1024 inputs, K = 6 independent clients, S = 8), merged
  with the clients' assignments solved one after another (``lap_threads=1``) and in threads
  (``lap_threads=None``: one per core); the permutations and the merged model must be
  bit-identical. Wall-clock seconds (threads save wall time, not CPU time).
- ``--kfac``: FedFisher's K-FAC merge of K = 6 FedNet uploads (28x28x1 inputs, the Fashion-MNIST
  model) whose factors went through the wire at FedAvg's upload size (8-bit rank-capped codes),
  with the dense factors (``low_rank=False``) and with the factors' roots (default); the models
  must agree to float32 rounding.

Run:  .venv/bin/python benchmarks/server_speed.py --wide --kfac
Writes benchmarks/results/server_speed.md and .json (a section not run keeps its last result).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import portable
from benchmarks.merge_scale import wide_layer_uploads
from fedfiot_flwr.merge import MergeOptions, MergeSpeed, merge
from fedfiot_flwr.merge.parallel import lap_workers

RESULTS = Path(__file__).parent / "results"
NAME = "server_speed"


def timed(fn: Callable[[], Any]) -> tuple[float, float, Any]:
    """``(wall seconds, process CPU seconds, value)`` of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, value


def _load() -> float:
    """The 1-minute load average (how busy the machine was)."""
    return float(os.getloadavg()[0])


# ----------------------------------------------------------------------------------- wide layer

WIDE_VARIANTS = {
    "exact": ("float64 costs, scipy (the paper preset's path)", {}),
    "certify": ("float64 costs, scipy, certify (the default preset's path)", {"certify": True}),
    "f32-certify": ("float32 costs, scipy, certify", {"cost_dtype": "float32", "certify": True}),
    "lapjv-avx": ("float64 costs, the lapjv package's LAPJV", {"lap_solver": "lapjv-avx"}),
    "f32-lapjv-avx-certify": ("float32 costs, the lapjv package's LAPJV, certify",
                              {"cost_dtype": "float32", "lap_solver": "lapjv-avx", "certify": True}),
}
EXACT = "exact"
"""The variant every other one's permutations are compared with (the paper preset's path, one thread)."""


def wide_layer(m: int, d: int, k: int, repeats: int, variants: list[str]) -> list[dict[str, Any]]:
    """Sequential against threaded assignments on one wide layer; one record per variant."""
    spec, models, fishers = wide_layer_uploads(m, d, k)
    options = MergeOptions(max_iters=8, reference=0, fallback="none")
    records = []
    exact_perms: list[np.ndarray] | None = None
    for name in [EXACT, *(v for v in variants if v != EXACT)]:
        label, extra = WIDE_VARIANTS[name]
        threads = lap_workers(None, m, k, extra.get("lap_solver", "scipy"))
        runs: dict[str, list[tuple[float, float]]] = {"sequential": [], "threaded": []}
        results: dict[str, Any] = {}
        load = [_load()]
        for _ in range(repeats):  # interleaved; the minimum is kept
            for mode, count in (("sequential", 1), ("threaded", None)):
                wall, cpu, results[mode] = timed(lambda: merge(models, fishers, spec, options,
                                                               speed=MergeSpeed(lap_threads=count, **extra)))
                runs[mode].append((wall, cpu))
                print(f"m={m} {name} {mode}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
            load.append(_load())
        seq, par = results["sequential"], results["threaded"]
        if name == EXACT:
            exact_perms = seq.permutations["P"]
        same = (all(np.array_equal(a, b) for a, b in zip(seq.permutations["P"], par.permutations["P"]))
                and all(np.array_equal(seq.model[n], par.model[n]) for n in seq.model)
                and seq.objective == par.objective)
        best = {mode: min(r, key=lambda x: x[0]) for mode, r in runs.items()}
        records.append({
            "m": m, "d": d, "K": k, "variant": name, "label": label, "threads": threads, "repeats": repeats,
            "sequential_wall_s": best["sequential"][0], "threaded_wall_s": best["threaded"][0],
            "ratio": best["threaded"][0] / best["sequential"][0],
            "sequential_cpu_s": best["sequential"][1], "threaded_cpu_s": best["threaded"][1],
            "all_runs": runs, "iterations": seq.reports["P"].iterations, "bit_identical": bool(same),
            "same_permutations_as_exact": bool(exact_perms is not None and all(
                np.array_equal(a, b) for a, b in zip(exact_perms, par.permutations["P"]))),
            "load_average": [min(load), max(load)],
        })
    return [r for r in records if r["variant"] in variants]


def wide_lines(records: list[dict[str, Any]], commands: list[str]) -> list[str]:
    lines = [
        "## A wide layer's assignments in threads (`lap_threads`)",
        "",
        "One layer, d = 1024 inputs, K = 6 independent clients, S = 8, reference client 0. Each row: "
        "the same merge with the clients' assignments of an alignment step solved one after another "
        "(`lap_threads=1`) and in threads (`lap_threads=None`, automatic: one per core), interleaved "
        "in one process; wall-clock seconds, minimum of the repeats. 'bit-identical': the same "
        "permutations, model and objective as the same variant's sequential run; 'same as exact': the "
        "threaded run's permutations equal those of the first row of its width (float64 costs, scipy, "
        "one thread).",
        "",
        "| m | variant | threads | repeats | sequential wall (s) | threaded wall (s) | threaded / sequential "
        "| CPU s sequential / threaded | cores the threaded run got (CPU / wall) | iterations | bit-identical "
        "| same as exact | load average during the runs | run |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for r in records:
        cores = r["threaded_cpu_s"] / r["threaded_wall_s"]
        lines.append(f"| {r['m']} | {r['label']} | {r['threads']} | {r['repeats']} | {r['sequential_wall_s']:.1f} | "
                     f"{r['threaded_wall_s']:.1f} | {r['ratio']:.2f} | {r['sequential_cpu_s']:.1f} / "
                     f"{r['threaded_cpu_s']:.1f} | {cores:.2f} | {r['iterations']} | "
                     f"{'yes' if r['bit_identical'] else 'NO'} | "
                     f"{_yes_no(r.get('same_permutations_as_exact'))} | "
                     f"{r['load_average'][0]:.1f}-{r['load_average'][1]:.1f} | "
                     f"{commands.index(r.get('command', commands[0])) + 1} |")
    return lines


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


# ------------------------------------------------------------------------------ FedFisher K-FAC


def kfac_uploads(k: int, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], list[dict[str, Any]], list[int],
                                                  dict[str, Any]]:
    """K FedNet (28x28x1) uploads with K-FAC factors, packed and decoded as the server gets them.

    The factors are covariances of random activations and output gradients with a decaying
    spectrum (so that the rank cap drops real, if small, directions), sent at ``rank="fedavg"``.
    """
    import torch

    from fedfiot_flwr.models import build_model
    from fedfiot_flwr.psd import KFACFactors
    from fedfiot_flwr.wire import pack_kfac_reply, unpack_curvature_reply

    rng = np.random.default_rng(seed)
    models, factors, sizes, ranks = [], [], [], set()
    for i in range(k):
        net = build_model("fednet", (1, 28, 28), 10, seed=seed + i)
        state = {n: t.detach().numpy().copy() for n, t in net.state_dict().items()}
        layers = {}
        for name, module in net.named_modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                w = state[f"{name}.weight"]
                d_out, d_in = w.shape[0], int(np.prod(w.shape[1:]))
                cov = []
                for n in (d_in, d_out):
                    x = rng.normal(size=(2 * n, n)) * (np.linspace(1.0, 0.05, n) ** 2)
                    cov.append(x.T @ x / (2 * n))
                layers[name] = KFACFactors(f"{name}.weight", None, cov[0], cov[1])
        n_examples = int(rng.integers(500, 2000))
        reply = pack_kfac_reply(state, layers, n_examples, fisher_kind="empirical", rank="fedavg")
        up = unpack_curvature_reply(reply, {n: v.shape for n, v in state.items()}, client=str(i))
        models.append(up.weights)
        factors.append(up.factors)
        sizes.append(n_examples)
        ranks.add(up.rank)
    f0 = factors[0]
    shapes = {name: {"d_out": int(f.G.shape[0]), "d_in": int(f.A.shape[0]), "rank_A": int(f.A_root.shape[1]),
                     "rank_G": int(f.G_root.shape[1])} for name, f in f0.items()}
    return models, factors, sizes, {"rank": sorted(ranks), "layers": shapes}


def kfac_section(k: int, steps: int, repeats: int, threads: int) -> dict[str, Any]:
    """Dense factors against their roots, interleaved; the models' largest relative difference."""
    import torch

    from fedfiot_flwr.baselines import FedFisherOptions, fedfisher_kfac
    from fedfiot_flwr.baselines.fedfisher import kfac_plan

    torch.set_num_threads(threads)
    models, factors, sizes, info = kfac_uploads(k)
    plans = {name: kfac_plan(s["d_out"], s["d_in"], s["rank_A"], s["rank_G"]) for name, s in info["layers"].items()}
    kw = {"options": FedFisherOptions(steps=steps, eval_every=100, device="cpu"), "checked": True}
    runs: dict[str, list[tuple[float, float]]] = {"dense": [], "roots": []}
    results: dict[str, Any] = {}
    load = [_load()]
    for _ in range(repeats):
        for mode, low_rank in (("dense", False), ("roots", True)):
            wall, cpu, results[mode] = timed(lambda: fedfisher_kfac(models, factors, sizes, low_rank=low_rank, **kw))
            runs[mode].append((wall, cpu))
            print(f"kfac {mode}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
        load.append(_load())
    dense, roots = results["dense"], results["roots"]
    diff = max(float(np.max(np.abs(dense.model[n] - roots.model[n])) / max(float(np.max(np.abs(dense.model[n]))), 1e-30))
               for n in dense.model)
    moved = max(float(np.max(np.abs(dense.model[n] - dense.initial_model[n]))) for n in dense.model)
    obj = [(h["objective"], g["objective"]) for h, g in zip(dense.history, roots.history)]
    best = {mode: min(r, key=lambda x: x[0]) for mode, r in runs.items()}
    return {
        "K": k, "steps": steps, "repeats": repeats, "torch_threads": threads, "model": "fednet (1, 28, 28)",
        "rank": info["rank"], "layers": info["layers"], "plans": {n: list(p) for n, p in plans.items()},
        "dense_wall_s": best["dense"][0], "roots_wall_s": best["roots"][0],
        "ratio": best["roots"][0] / best["dense"][0],
        "dense_cpu_s": best["dense"][1], "roots_cpu_s": best["roots"][1], "all_runs": runs,
        "max_relative_model_difference": diff, "largest_move_from_the_average": moved,
        "objectives_dense_roots": obj, "load_average": [min(load), max(load)],
    }


def kfac_lines(r: dict[str, Any]) -> list[str]:
    layers = ", ".join(f"{n} {s['d_out']}x{s['d_in']} (r_A {s['rank_A']}, r_G {s['rank_G']}: "
                       f"{'dense' if r['plans'][n][0] == 'dense' else r['plans'][n][0] + ' root'})"
                       for n, s in r["layers"].items())
    final = r["objectives_dense_roots"][-1]
    return [
        "## FedFisher K-FAC through the factors' low-rank roots (`low_rank`)",
        "",
        f"K = {r['K']} FedNet uploads (28x28x1, 643,104 weights) with K-FAC factors sent at FedAvg's upload "
        f"size (8-bit codes of rank {', '.join(str(x) for x in r['rank'])}), {r['steps']} steps of FedFisher's "
        f"update, float32 on the CPU with {r['torch_threads']} torch thread(s); dense factors "
        "(`low_rank=False`) against the roots (default), interleaved in one process, wall-clock "
        "seconds, minimum of the repeats.",
        "",
        f"Layers (d_out x d_in, the roots' ranks, what a step applies): {layers}.",
        "",
        "| steps | repeats | dense factors (s) | roots (s) | roots / dense | CPU s dense / roots "
        "| largest relative model difference | final objective dense / roots | load average |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {r['steps']} | {r['repeats']} | {r['dense_wall_s']:.1f} | {r['roots_wall_s']:.1f} | {r['ratio']:.2f} | "
        f"{r['dense_cpu_s']:.1f} / {r['roots_cpu_s']:.1f} | {r['max_relative_model_difference']:.1e} | "
        f"{final[0]:.6g} / {final[1]:.6g} | {r['load_average'][0]:.1f}-{r['load_average'][1]:.1f} |",
    ]


# ----------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wide", action="store_true", help="the wide layer, sequential against threaded")
    parser.add_argument("--wide-m", type=int, nargs="+", default=[2048, 4096], help="layer widths")
    parser.add_argument("--wide-repeats", type=int, nargs="+", default=[3, 1],
                        help="interleaved repeats per width (the last one applies to the remaining widths)")
    parser.add_argument("--wide-variants", nargs="+", choices=list(WIDE_VARIANTS), default=list(WIDE_VARIANTS))
    parser.add_argument("--kfac", action="store_true", help="FedFisher K-FAC, dense factors against roots")
    parser.add_argument("--kfac-steps", type=int, default=200)
    parser.add_argument("--kfac-repeats", type=int, default=3)
    parser.add_argument("--kfac-threads", type=int, default=1, help="torch threads of the K-FAC section")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--render", action="store_true", help="only rewrite the page from the saved json")
    args = parser.parse_args()
    if not (args.wide or args.kfac or args.render):
        parser.error("choose --wide and/or --kfac (or --render)")
    path = args.out / f"{NAME}.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    command = portable.command_line()
    machine = (f"{platform.machine()}, {os.cpu_count()} cores shared with other jobs; numpy {np.__version__}")
    if args.wide:
        start = time.perf_counter()
        records = []
        for i, m in enumerate(args.wide_m):
            repeats = args.wide_repeats[min(i, len(args.wide_repeats) - 1)]
            records += wide_layer(m, 1024, 6, repeats, args.wide_variants)
        for r in records:
            r["command"] = command
        rerun = {(r["m"], r["variant"]) for r in records}
        previous = data.get("wide", {})
        kept = [{**r, "command": r.get("command", previous.get("command", ""))}
                for r in previous.get("records", []) if (r["m"], r["variant"]) not in rerun]
        data["wide"] = {"command": command, "machine": machine, "seconds": time.perf_counter() - start,
                        "records": sorted(kept + records,
                                          key=lambda r: (r["m"], list(WIDE_VARIANTS).index(r["variant"])))}
    if args.kfac:
        start = time.perf_counter()
        data["kfac"] = {"command": command, "machine": machine, "seconds": time.perf_counter() - start,
                        "record": kfac_section(6, args.kfac_steps, args.kfac_repeats, args.kfac_threads)}
        data["kfac"]["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    lines = ["# Server speed (benchmarks/server_speed.py)", "",
             "Both sections compare an exact path with a faster one in the same process, interleaved. The "
             "machine is shared with other jobs (the 1-minute load averages during the runs are in the "
             "tables): compare the ratios, not the seconds. Threads only help while a second core is free: "
             "the column 'cores the threaded run got' says how much of one it had.", ""]
    if "wide" in data:
        wide = data["wide"]
        commands = list(dict.fromkeys(r.get("command", wide["command"]) for r in wide["records"]))
        lines += [*wide_lines(wide["records"], commands), "", f"Machine: {wide['machine']}. Runs:", "",
                  *[f"{i + 1}. `{c}`" for i, c in enumerate(commands)], "",
                  f"The last run took {wide['seconds']:.0f} s.", ""]
    if "kfac" in data:
        kfac = data["kfac"]
        lines += [*kfac_lines(kfac["record"]), "",
                  f"Machine: {kfac['machine']}. Command: `{kfac['command']}` ({kfac['seconds']:.0f} s).", ""]
    (args.out / f"{NAME}.md").write_text("\n".join(lines))
    print(f"wrote {args.out / NAME}.md and .json")


if __name__ == "__main__":
    main()
