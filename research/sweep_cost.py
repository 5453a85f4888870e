"""Cost of one round of the default selection (the validation sweep), with and without each piece of shared work.

On the benchmark's cached one-shot uploads (trained on first use, see :mod:`benchmarks.harness`),
for each setting this runs, in one process:

- one merge of the default candidate with the baseline engine (the unit, "merges' worth"):
  after one warm-up call, the minimum of three;
- the baseline engine's ``merge_round`` (``--baseline-rev``, "baseline": every candidate validates and converts the
  uploads, tempers the Fisher, builds each cost-GEMM input every inner iteration, validates every
  model);
- the ``merge_round`` of ``--previous-rev`` ("shared preparation": shared preparation, tempering, identity
  merges and validations, but every candidate aligns from scratch);
- the current ``sweep_candidates``: float64 (exact: alignment iterations and aligned merges shared
  between candidates that reach the same state, bit-identical); with certified warm-started
  assignments (``certify=True``); with float32 costs + LAPJV + certify; and with warm starts
  across candidates (``warm_start=True``, opt-in, not the paper's cold start); and with the
  validation of :func:`fedfiot_flwr.validation.make_validate_fn` (the fold kept on the device,
  scored in chunks, hardest examples first), scored in full (``race=False``) or raced (the
  default: a candidate stops being scored once it provably cannot be chosen).

It checks that the choices are identical to the baseline's (candidate, variant and the returned
model's bytes), counts the trials whose validation differs, and writes
``research/results/sweep_cost.md``.

Usage::

    python research/sweep_cost.py [--datasets digits fashion-mnist] [--inits shared independent]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from benchmarks.portable import command_line  # noqa: E402
from research import RESULTS_DIR  # noqa: E402
from fedfiot_flwr.merge.lap import lapjv_available  # noqa: E402
from fedfiot_flwr.server.config import FedFiOTConfig  # noqa: E402
from fedfiot_flwr.server.outcome import RoundContext  # noqa: E402
from fedfiot_flwr.server.selection import Candidate, sweep_candidates  # noqa: E402
from fedfiot_flwr.task import default_device  # noqa: E402
from fedfiot_flwr.validation import make_validate_fn  # noqa: E402

RESULT = RESULTS_DIR / "sweep_cost.md"
PREVIOUS_REV = "88e66d2"  # shared sweep work, but every candidate aligned from scratch
EPOCHS = {"digits": 20, "fashion-mnist": 5}
VALIDATION = {"digits": 200, "fashion-mnist": 500}


class CountingValidator:
    """Wraps a validation function; counts calls and their time."""

    def __init__(self, validate: Any) -> None:
        self.validate, self.calls, self.seconds, self.cut = validate, 0, 0.0, 0

    def __call__(self, model: Any) -> Any:
        t0 = time.process_time()
        out = self.validate(model)
        self.calls += 1
        self.seconds += time.process_time() - t0
        return out


class CountingScorer(CountingValidator):
    """A :class:`CountingValidator` that also offers (and counts) the wrapped scorer's bounded entry."""

    def validate_bounded(self, model: Any, metric: str, threshold: float, maximize: bool) -> Any:
        """The scorer's ``validate_bounded``; a cut (``None``) is counted in ``cut``."""
        t0 = time.process_time()
        out = self.validate.validate_bounded(model, metric, threshold, maximize)
        self.calls += 1
        self.cut += out is None
        self.seconds += time.process_time() - t0
        return out


def round_options(config: FedFiOTConfig, uploads: H.Uploads, current: bool) -> dict[str, Any]:
    """How a ``merge_round`` is told to offer the shared initialisation as a reference in round 1.

    The current one by ``broadcast_in_round_one``; the revisions compared with it predate that
    option and offer the broadcast model from round 2 on, so they are called as in round 2.
    """
    if current:
        return {"server_round": 1, "broadcast_in_round_one": config.broadcast_in_round_one}
    offers = (config.sweep is not None and "broadcast" in config.sweep.references
              and config.broadcast_in_round_one and uploads.broadcast is not None)
    return {"server_round": 2 if offers else 1}


def run_sweep(fn: Any, uploads: H.Uploads, spec: Any, buffers: Any, config: FedFiOTConfig, validate: Any,
              current: bool = True, **speed: Any) -> tuple[Any, float, CountingValidator]:
    """One sweep (``fn``: the current one or a compared revision's) of ``config``'s sweep, timed."""
    counter = (CountingScorer if hasattr(validate, "validate_bounded") else CountingValidator)(validate)
    if current:  # the current sweep takes the configuration itself: no cap, the engine's speed defaults, ``speed``
        plain = dataclasses.replace(config, **{"fisher_cap": None, "certify": False, "cost_dtype": "float64",
                                               "lap_solver": "scipy", "lap_threads": None, "backend": "numpy", **speed})
        t0 = time.process_time()
        out = fn(uploads.quantized, spec, plain, RoundContext(1, uploads.broadcast, tuple(buffers), counter))
        return out, time.process_time() - t0, counter
    default = Candidate(config.rho, config.lam, config.reference, config.fisher_scaling)
    t0 = time.process_time()
    out = fn(uploads.quantized, spec, default, max_iters=config.max_iters, matching=config.matching,
             aggregation=config.aggregation, fallback=config.selection, buffers=buffers, broadcast=uploads.broadcast,
             sweep=config.sweep, validate=counter, metric=config.selection_metric, baseline=False,
             fedavg_candidate=config.fedavg_candidate, **round_options(config, uploads, current), **speed)
    return out, time.process_time() - t0, counter


def same_choice(a: Any, b: Any) -> bool:
    """Same candidate, same variant, bit-identical model."""
    return (a.candidate == b.candidate and a.variant == b.variant
            and all(np.array_equal(a.model[n], b.model[n]) for n in a.model))


def differing_trials(a: Any, b: Any, metric: str) -> int:
    """Trials (in the same order) scored in full by both whose selection ``metric`` differs.

    A trial that the race cut (``"validation_cut"``) is reported as cut, not as differing.
    """
    def score(t: dict[str, Any]) -> Any:
        return None if t["validation"] is None else t["validation"].get(metric)

    return sum(1 for x, y in zip(a.trials, b.trials) if not (x.get("validation_cut") or y.get("validation_cut"))
               and score(x) != score(y)) + abs(len(a.trials) - len(b.trials))


DEVICE_FOLD = "fold on the device"
"""Variants scored by :func:`fedfiot_flwr.validation.make_validate_fn` rather than the harness' evaluator."""

VARIANTS = {  # label -> options of the current sweep_candidates (FedFiOTConfig fields) (DEVICE_FOLD in the label: make_validate_fn)
    "float64": {},
    "certify": {"certify": True},
    "f32 + LAPJV + certify": {"cost_dtype": "float32", "lap_solver": "lapjv", "certify": True},
    "warm starts (opt-in) + f32 + LAPJV + certify": {"cost_dtype": "float32", "lap_solver": "lapjv",
                                                         "certify": True, "warm_start": True},
    f"certify + {DEVICE_FOLD}, scored in full": {"certify": True, "race": False},
    f"certify + {DEVICE_FOLD}, raced (the default)": {"certify": True},
    f"f32 + LAPJV + certify + {DEVICE_FOLD}, raced": {"cost_dtype": "float32", "lap_solver": "lapjv",
                                                       "certify": True},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--datasets", nargs="+", default=["digits"])
    parser.add_argument("--inits", nargs="+", default=["shared", "independent"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-rev", default=DEFAULT_BASELINE_REV)
    parser.add_argument("--previous-rev", default=PREVIOUS_REV)
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    parser.add_argument("--append", action="store_true",
                        help="keep the rows already in --out (those of the settings run again are replaced)")
    args = parser.parse_args(argv)
    args.argv = argv  # the page records the command line it was given
    torch.set_num_threads(1)  # process CPU time then measures the work, whatever else runs on the machine
    base = load_baseline(args.baseline_rev)
    base_round = importlib.import_module(f"{base.__name__}.selection").merge_round
    base_merge = importlib.import_module(f"{base.__name__}.merge").merge
    prev = load_baseline(args.previous_rev, "fedfiot_flwr_previous")
    prev_round = importlib.import_module(f"{prev.__name__}.server.selection").merge_round
    device = default_device()
    variants = {k: v for k, v in VARIANTS.items() if "lap_solver" not in v or lapjv_available()}
    rows = []
    for dataset in args.datasets:
        for init in args.inits:
            setting = H.Setting(dataset, H.DEFAULT_MODELS[dataset], 6, 0.1, init, args.seed, EPOCHS[dataset],
                                validation_size=VALIDATION[dataset])
            split = setting.app_config().split()
            build, spec, buffers = H.model_tools(setting, split)
            ev = H.Evaluator(split, build, device)
            uploads = H.one_shot_uploads(setting, split, buffers, args.cache_dir, device, print)
            config = H.method_config("fedfiot-default", init)
            up = uploads.quantized
            units = []
            for _ in range(4):  # the first call pays one-off imports and allocations: dropped
                t0 = time.process_time()
                base_merge(up.weights, up.fishers, spec, lam=config.lam, rho=config.rho, max_iters=8,
                           reference="largest", num_examples=up.num_examples, buffers=buffers,
                           client_ids=up.client_ids)
                units.append(time.process_time() - t0)
            t_merge = min(units[1:])
            old, t_old, c_old = run_sweep(base_round, uploads, spec, buffers, config, ev.validate, current=False)
            runs = {"shared preparation": run_sweep(prev_round, uploads, spec, buffers, config, ev.validate,
                                                    current=False)}
            for label, options in variants.items():
                validate = (make_validate_fn(build(), ev.validation, device) if DEVICE_FOLD in label
                            else ev.validate)  # a fresh scorer: it orders its fold on its first model
                runs[label] = run_sweep(sweep_candidates, uploads, spec, buffers, config, validate, **options)
            row = {
                "setting": f"{dataset} ({setting.model}) {init}", "params": sum(x.size for x in up.weights[0].values()),
                "merge": t_merge, "old": t_old, "val_old": c_old.calls, "trials": len(old.trials),
                "val_s": c_old.seconds / max(1, c_old.calls),
                "runs": {label: {"s": t, "val": c.calls, "cut": c.cut, "val_s": c.seconds,
                                 "same": same_choice(old, out),
                                 "differ": differing_trials(old, out, config.selection_metric)}
                         for label, (out, t, c) in runs.items()},
                "choice": f"{runs['float64'][0].candidate.label()} ({runs['float64'][0].variant})",
            }
            rows.append(row)
            print(row, flush=True)
    write(rows, args)


def write(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Append the rows' lines to the result file's tables (or start them)."""
    header = [
        "# One round of the default selection: cost of each shared-work option (research/sweep_cost.py)",
        "",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, numpy {np.__version__}",
        "- baseline: the engine of `--baseline-rev` (default set in `benchmarks/baseline_code.py`): every candidate checks and converts the uploads, tempers the Fisher, "
        "rebuilds each cost-GEMM input every inner iteration and validates every model; shared preparation: the "
        "engine of `--previous-rev` (preparation, tempering, identity merges and validations shared; every "
        "candidate aligned from scratch); both run in the same process as this engine",
        "- uploads: the one-shot benchmark's cached 16-bit uploads (K = 6, alpha = 0.1, seed "
        f"{args.seed}; digits {EPOCHS['digits']} local epochs, Fashion-MNIST {EPOCHS['fashion-mnist']}); plan "
        "`fedfiot-default` (the default preset: rho x lam x reference x Fisher scaling, aligned / identity / "
        "FedAvg chosen on validation)",
        "- unit: one merge of the default candidate with the baseline engine (\"merges' worth\"; minimum of 3 "
        "after a warm-up call)",
        "- times: process CPU seconds, one thread (numpy and torch): robust to the other jobs on the machine",
        "- validation: the harness' evaluator (the fold in one batch), or, for the 'fold on the device' rows, "
        "`make_validate_fn` (the fold kept on the device in chunks of 50 examples, ordered by the first scored "
        "model's errors and losses); 'raced': a candidate stops being scored once its accuracy provably "
        "cannot beat the best fully scored one ('validations': distinct models scored, '(n cut)': how many "
        "of them were stopped early)",
        "- same choice: candidate, variant and model bytes equal to the baseline's; 'trials differing': trials "
        "scored in full whose selection metric (accuracy) differs from the baseline's",
        "",
    ]
    table = ["| setting | variant | sweep (s) | = merges | validations | validation (s) | = merges without "
             "validation | same choice | trials differing |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    summary = ["| setting | params | trials | one merge (s) | s per validation | choice |",
               "|---|---:|---:|---:|---:|---|"]
    previous_lines: list[str] = []
    if args.append and args.out.exists():
        previous_lines = args.out.read_text().splitlines()
    for r in rows:
        summary.append(f"| {r['setting']} | {r['params']:,} | {r['trials']} | {r['merge']:.3f} | "
                       f"{r['val_s']:.3f} | {r['choice']} |")
        old_val = r["val_s"] * r["val_old"]
        table.append(f"| {r['setting']} | baseline | {r['old']:.2f} | {r['old'] / r['merge']:.1f} | {r['val_old']} | "
                     f"{old_val:.2f} | {(r['old'] - old_val) / r['merge']:.1f} | - | - |")
        for label, v in r["runs"].items():
            val = f"{v['val']} ({v['cut']} cut)" if v["cut"] else f"{v['val']}"
            table.append(f"| {r['setting']} | {label} | {v['s']:.2f} | {v['s'] / r['merge']:.1f} | {val} | "
                         f"{v['val_s']:.2f} | {(v['s'] - v['val_s']) / r['merge']:.1f} | "
                         f"{'yes' if v['same'] else 'NO'} | {v['differ']} |")
    if previous_lines:  # merge: keep the old rows of both tables but those of the settings run again
        rerun = tuple(f"| {r['setting']} |" for r in rows)
        old_summary = [ln for ln in previous_lines if ln.startswith("| ") and ln.count("|") == 7
                       and not ln.startswith(("| setting", *rerun))]
        old_table = [ln for ln in previous_lines if ln.startswith("| ") and ln.count("|") == 10
                     and not ln.startswith(("| setting", *rerun))]
        summary = summary[:2] + old_summary + summary[2:]
        table = table[:2] + old_table + table[2:]
    lines = [*header, *summary, "", *table, "",
             f"Command: `{command_line(args.argv, __file__, interpreter='python')}`", ""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
