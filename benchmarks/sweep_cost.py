"""Cost of one round of the default selection (the validation sweep), before and after sharing work.

On the benchmark's cached one-shot uploads (trained on first use, see :mod:`benchmarks.harness`),
for each setting this runs, in one process and interleaved:

- the baseline revision's ``merge_round`` (every candidate validates and converts the uploads,
  tempers the Fisher, builds each cost-GEMM input every inner iteration and validates every
  model);
- the current ``merge_round`` (float64, the paper's arithmetic), and with ``cost_dtype="float32"``;
- one merge of the default candidate with the baseline engine (the unit: "merges' worth").

It checks that the choices are identical (candidate, variant and the returned model's bytes)
and writes ``benchmarks/results/sweep_cost.md``.

Usage::

    python benchmarks/sweep_cost.py [--datasets digits fashion-mnist] [--inits shared independent]
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import harness as H  # noqa: E402
from benchmarks.baseline_code import DEFAULT_BASELINE_REV, load_baseline  # noqa: E402
from fedfiot_flwr.merge.lap import lapjv_available  # noqa: E402
from fedfiot_flwr.server.selection import merge_round  # noqa: E402
from fedfiot_flwr.task import default_device  # noqa: E402

RESULT = H.RESULTS_DIR / "sweep_cost.md"
EPOCHS = {"digits": 20, "fashion-mnist": 2}
VALIDATION = {"digits": 200, "fashion-mnist": 500}


class CountingValidator:
    """Wraps a validation function; counts calls and their time."""

    def __init__(self, validate: Any) -> None:
        self.validate, self.calls, self.seconds = validate, 0, 0.0

    def __call__(self, model: Any) -> Any:
        t0 = time.process_time()
        out = self.validate(model)
        self.calls += 1
        self.seconds += time.process_time() - t0
        return out


def run_sweep(fn: Any, uploads: H.Uploads, spec: Any, buffers: Any, plan: H.MethodPlan, validate: Any,
              **speed: Any) -> tuple[Any, float, CountingValidator]:
    counter = CountingValidator(validate)
    offers_broadcast = plan.grid is not None and "broadcast" in plan.grid.references and uploads.broadcast is not None
    t0 = time.process_time()
    out = fn(uploads.quantized, spec, plan.default, max_iters=8, matching="fisher", aggregation="fisher",
             fallback=plan.fallback, buffers=buffers, broadcast=uploads.broadcast,
             server_round=2 if offers_broadcast else 1, sweep=plan.grid, validate=counter, metric="accuracy",
             baseline=False, fedavg_candidate=plan.fedavg_candidate, **speed)
    return out, time.process_time() - t0, counter


def same_choice(a: Any, b: Any) -> bool:
    """Same candidate, same variant, bit-identical model."""
    return (a.candidate == b.candidate and a.variant == b.variant
            and all(np.array_equal(a.model[n], b.model[n]) for n in a.model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["digits"])
    parser.add_argument("--inits", nargs="+", default=["shared", "independent"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE_REV)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    torch.set_num_threads(1)  # process CPU time then measures the work, whatever else runs on the machine
    base = load_baseline(args.baseline_rev)
    base_round = importlib.import_module(f"{base.__name__}.selection").merge_round
    base_merge = importlib.import_module(f"{base.__name__}.merge").merge
    device = default_device()
    rows = []
    for dataset in args.datasets:
        for init in args.inits:
            setting = H.Setting(dataset, H.DEFAULT_MODELS[dataset], 6, 0.1, init, args.seed, EPOCHS[dataset],
                                validation_size=VALIDATION[dataset])
            split = setting.app_config().split()
            build, spec, buffers = H.model_tools(setting, split)
            ev = H.Evaluator(split, build, device)
            uploads = H.one_shot_uploads(setting, split, buffers, H.CACHE_DIR, device, print)
            plan = H.method_plans(["fedfiot-default"], init)[0]
            up = uploads.quantized
            t0 = time.process_time()
            base_merge(up.weights, up.fishers, spec, lam=plan.default.lam, rho=plan.default.rho, max_iters=8,
                       reference="largest", num_examples=up.num_examples, buffers=buffers, client_ids=up.client_ids)
            t_merge = time.process_time() - t0
            old, t_old, c_old = run_sweep(base_round, uploads, spec, buffers, plan, ev.validate)
            new, t_new, c_new = run_sweep(merge_round, uploads, spec, buffers, plan, ev.validate)
            f32, t_f32, c_f32 = run_sweep(merge_round, uploads, spec, buffers, plan, ev.validate, cost_dtype="float32")
            fast, t_fast, _ = (run_sweep(merge_round, uploads, spec, buffers, plan, ev.validate, cost_dtype="float32",
                                         lap_solver="lapjv") if lapjv_available() else (f32, float("nan"), None))
            rows.append({
                "setting": f"{dataset} ({setting.model}) {init}", "params": sum(x.size for x in up.weights[0].values()),
                "merge": t_merge, "old": t_old, "new": t_new, "f32": t_f32, "fast": t_fast, "same_fast": same_choice(old, fast),
                "trials": len(old.trials), "val_old": c_old.calls, "val_new": c_new.calls, "val_s": c_old.seconds / max(1, c_old.calls),
                "same": same_choice(old, new), "same32": same_choice(old, f32),
                "choice": f"{new.candidate.label()} ({new.variant})",
            })
            print(rows[-1], flush=True)
    lines = [
        "# One round of the default selection: cost before and after sharing work (benchmarks/sweep_cost.py)",
        "",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, numpy {np.__version__}",
        f"- baseline: revision `{args.baseline_rev}` of this repository, run in the same process, interleaved",
        "- uploads: the one-shot benchmark's cached 16-bit uploads (K = 6, alpha = 0.1, seed "
        f"{args.seed}); plan `fedfiot-default` (the default preset: rho x lam x reference x Fisher scaling, "
        "aligned / identity / FedAvg chosen on validation)",
        "- unit: one merge of the default candidate with the baseline engine (\"merges' worth\")",
        "- times: process CPU seconds, one thread (numpy and torch): robust to the other jobs on the machine",
        "",
        "| setting | params | trials | one merge (s) | sweep before (s) | = merges | sweep after (s) | = merges "
        "| speed-up | after, float32 costs (s) | = merges | validations before / after | s per validation "
        "| after, float32 + LAPJV (s) | = merges | same choice (f64 / f32 / f32+LAPJV) | choice |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['params']:,} | {r['trials']} | {r['merge']:.3f} | {r['old']:.2f} | "
            f"{r['old'] / r['merge']:.0f} | {r['new']:.2f} | {r['new'] / r['merge']:.1f} | {r['old'] / r['new']:.1f}x | "
            f"{r['f32']:.2f} | {r['f32'] / r['merge']:.1f} | {r['val_old']} / {r['val_new']} | {r['val_s']:.3f} | "
            f"{r['fast']:.2f} | {r['fast'] / r['merge']:.1f} | "
            f"{'yes' if r['same'] else 'NO'} / {'yes' if r['same32'] else 'NO'} / {'yes' if r['same_fast'] else 'NO'} | "
            f"{r['choice']} |"
        )
    lines += ["", f"Command: `python benchmarks/sweep_cost.py {' '.join(sys.argv[1:])}`".rstrip(), ""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
