"""One-shot benchmark: every method on the SAME client uploads, knobs chosen on the same validation set.

For each (data set, alpha, init, local epochs, seed) the K clients are trained once with the
library's client code (training, empirical Fisher, 16-bit packing); their uploads are cached
under ``benchmarks/cache/``. Every method then merges those uploads, picks its own knobs on the
server validation set, and only the chosen model is scored on the full test set.

Run (the full Fashion-MNIST table; see README for the time it takes):

    .venv/bin/python benchmarks/one_shot.py --datasets fashion-mnist --alphas 0.1 0.2 \
        --inits shared independent --seeds 0 1 2

Quick check on the embedded digits data (seconds):

    .venv/bin/python benchmarks/one_shot.py --quick

The paper's protocol, local epochs chosen per method on validation (``--select-epochs``; the
uploads of each E are trained once and cached, so E = 25, 50 and 100 cost one training each):

    .venv/bin/python benchmarks/one_shot.py --datasets fashion-mnist --alphas 0.1 \
        --inits shared independent --seeds 0 --epochs 25 50 100 --select-epochs \
        --methods fedavg fisher-merge otfusion regmean fedfisher-diag fedfiot fedfiot-default \
        best-single-client ensemble --name select_epochs

Per method and per (data set, alpha, init, seed), the E whose chosen model validates best is
kept (ties: the smaller E) and only its test accuracy enters the table, which names the E
(``81.2 (E=50)``); see :mod:`benchmarks.epoch_selection`. ``fedfisher-diag`` computes the
true Fisher of every client from its cached weights (``--fisher-kind empirical`` reuses the
uploads' Fisher instead).

Outputs (``--out``, default ``benchmarks/results``): ``<name>.md`` (tables, command, machine,
timing), ``<name>.json`` (one record per data set, alpha, init, epochs, seed and method under
``records``; per cell, E and seed, ``diagnostics``: FedFiOT's permuted fractions and kept merge,
the per-layer cosine between trained and initial weights; with ``--select-epochs``,
``epoch_selection``: the rule and one choice per method, cell and seed), ``<name>.png``, with
several epoch counts ``<name>_epochs.png``, and with ``--select-epochs``
``<name>_select_epochs.png`` (test accuracy against E).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import epoch_selection as E  # noqa: E402
from benchmarks import harness as H  # noqa: E402
from benchmarks import server_methods as S  # noqa: E402

H.METHOD_LABELS.update(S.LABELS)
from fedfiot_flwr.data import DatasetUnavailableError, canonical_name  # noqa: E402
from fedfiot_flwr.task import default_device  # noqa: E402

DEFAULT_EPOCHS = {"digits": 20, "fashion-mnist": 2, "cifar10": 25, "svhn": 25, "cinic10": 25}
DEFAULT_VALIDATION = {"digits": 200}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=["fashion-mnist"])
    p.add_argument("--model", action="append", default=[], metavar="DATASET=MODEL",
                   help=f"override the model of a data set (defaults: {H.DEFAULT_MODELS})")
    p.add_argument("--alphas", nargs="+", type=float, default=[0.1, 0.2])
    p.add_argument("--inits", nargs="+", choices=H.INITS, default=list(H.INITS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epochs", nargs="+", type=int, default=None,
                   help=f"local epochs (a sweep axis; uploads are cached per count). Default per data set: {DEFAULT_EPOCHS}")
    p.add_argument("--select-epochs", action="store_true",
                   help="also choose the local epochs per method on validation (per data set, alpha, init and seed; "
                        "ties: the smaller E) and report the chosen model's test accuracy")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--partition-seed", type=int, default=0)
    p.add_argument("--validation-size", type=int, default=None,
                   help="server validation examples (default 500; 200 for digits, whose training set has 1347)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--methods", nargs="+", default=list(H.ONE_SHOT_METHODS),
                   help=f"rows of the table; also available: {list(H.EXTRA_METHODS)} and the curvature "
                        f"baselines {list(H.CURVATURE_METHODS)} (slow on CPU: the clients' curvature is computed "
                        "from the cached trained weights, and FedFisher runs --fedfisher-steps server steps)")
    p.add_argument("--fedfisher-steps", type=int, default=H.FEDFISHER_STEPS,
                   help="FedFisher's server steps, validation every 100 (default: the paper's 2000; each step is "
                        "cheap, but the validation passes and, for K-FAC, the factors add up on CPU)")
    p.add_argument("--fisher-kind", choices=("true", "empirical"), default="true",
                   help="Fisher of the FedFisher baselines (default: true, as FedFisher's code; 'empirical' "
                        "makes fedfisher-diag reuse FedFiOT's uploads)")
    p.add_argument("--refine-ridges", nargs="+", type=float, default=list(S.DEFAULT_REFINE.ridges),
                   help="relative ridges of fedfiot-refined's least-squares candidates")
    p.add_argument("--refine-augment", type=int, default=S.DEFAULT_REFINE.augment_copies,
                   help="augmented copies of the fitting fold for fedfiot-refined")
    p.add_argument("--refine-finetune-epochs", type=int, default=S.DEFAULT_REFINE.finetune_epochs,
                   help="fine-tuning epochs of fedfiot-refined (0: least squares only)")
    p.add_argument("--refine-repair", action=argparse.BooleanOptionalAction, default=S.DEFAULT_REFINE.repair,
                   help="offer REPAIR candidates in fedfiot-refined")
    p.add_argument("--grid", choices=sorted(H.GRIDS), default="paper",
                   help="rho x lam grid of FedFiOT and the ablations (paper: 6 x 3; small: 3 x 2; tiny: 1 x 2)")
    p.add_argument("--no-broadcast-reference", action="store_true",
                   help="do not offer the shared initialisation as a reference candidate")
    p.add_argument("--data-root", default="")
    p.add_argument("--cache-dir", type=Path, default=H.CACHE_DIR)
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--out", type=Path, default=H.RESULTS_DIR)
    p.add_argument("--name", default="one_shot", help="output file stem")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="digits, alpha 0.1, seed 0, 1 epoch, tiny grid (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.datasets, args.alphas, args.seeds, args.grid = ["digits"], [0.1], [0], "tiny"
        args.epochs = args.epochs or [1]
    args.datasets = [canonical_name(d) for d in args.datasets]
    overrides = {}
    for item in args.model:
        if "=" not in item:
            p.error(f"--model expects DATASET=MODEL, got {item!r}")
        d, m = item.split("=", 1)
        overrides[canonical_name(d)] = m
    args.models = {d: overrides.get(d, H.DEFAULT_MODELS[d]) for d in args.datasets}
    return args


def settings_of(args: argparse.Namespace, dataset: str) -> list[H.Setting]:
    """All settings of one data set, in run order (alpha, init, epochs, seed)."""
    epochs = args.epochs or [DEFAULT_EPOCHS[dataset]]
    vsize = args.validation_size if args.validation_size is not None else DEFAULT_VALIDATION.get(dataset, 500)
    return [
        H.Setting(dataset, args.models[dataset], args.clients, a, init, seed, e, args.partition_seed, vsize,
                  args.batch_size, args.lr, args.data_root)
        for a in args.alphas for init in args.inits for e in epochs for seed in args.seeds
    ]


def merge_methods(methods: Sequence[str]) -> list[str]:
    """The methods of ``methods`` that the FedFiOT aggregator runs (not the curvature or server-data rows)."""
    return [m for m in methods if m not in H.CURVATURE_METHODS + S.SERVER_DATA_METHODS]


def run_setting(setting: H.Setting, args: argparse.Namespace, state: dict[str, Any], log: Any) -> dict[str, Any]:
    """Train (or load) one setting's uploads and apply every method; returns the setting's summary."""
    cfg = setting.app_config()
    split = cfg.split()
    build, spec, buffers = H.model_tools(setting, split)
    key = (setting.dataset, setting.alpha, setting.partition_seed, setting.validation_size)
    if state.get("evaluator_key") != key:
        state["evaluator"] = H.Evaluator(split, build, state["device"])
        state["evaluator_key"] = key
    ev: H.Evaluator = state["evaluator"]
    t0 = time.perf_counter()
    uploads = H.one_shot_uploads(setting, split, buffers, None if args.no_cache else args.cache_dir, state["device"], log)
    load_seconds = time.perf_counter() - t0
    base = H.record_fields(setting)
    summary: dict[str, Any] = {
        **base, "client_sizes": list(uploads.quantized.num_examples), "cached": uploads.cached,
        "train_seconds": uploads.train_seconds, "fisher_seconds": uploads.fisher_seconds,
        "upload_seconds_this_run": load_seconds,
        "client_train_accuracy": [m.get("train-accuracy") for m in uploads.quantized.metrics],
    }
    configs = H.method_configs(merge_methods(args.methods), setting.init, args.grid, not args.no_broadcast_reference)
    merge_total = test_total = 0.0
    records = []
    for name, config in configs.items():
        res = H.apply_method(name, config, uploads, spec, buffers, ev.validate)
        t1 = time.perf_counter()
        res.test_loss, res.test_accuracy = ev.test(res.model)
        res.test_seconds = time.perf_counter() - t1
        merge_total += res.sweep_seconds
        test_total += res.test_seconds
        records.append({**base, **res.record(), "upload": res.upload})
        if config.fedavg_candidate:  # FedFiOT's own merge, reported next to a FedAvg win
            own = res.own_model
            own_loss, own_acc = (res.test_loss, res.test_accuracy) if own is res.model else ev.test(own)
            records.append({**base, **res.record(), "method": "fedfiot-own", "upload": res.upload,
                            "test_accuracy": own_acc, "test_loss": own_loss,
                            "validation_accuracy": res.own_validation_accuracy,
                            "knobs": {**res.knobs, "variant": res.own_variant}})
            log(f"  {'fedfiot-own':13s} test {100 * own_acc:5.1f}%  (FedAvg won: {res.knobs.get('fedavg_won')})")
        if name == "fedavg":
            flower = H.flower_fedavg(uploads.replies, uploads.quantized)
            diff = max(float(np.max(np.abs(flower[k].astype(np.float64) - res.model[k].astype(np.float64))))
                       for k in flower)
            summary["fedavg_vs_flower_max_abs_diff"] = diff
        log(f"  {name:13s} test {100 * res.test_accuracy:5.1f}%  val {100 * res.validation_accuracy:5.1f}%  "
            f"{H.knob_text(res.knobs):32s} permuted {100 * res.fraction_permuted:4.1f}%  "
            f"{res.candidates} cand. {res.sweep_seconds:.1f}s")
    curvature_methods = [m for m in args.methods if m in H.CURVATURE_METHODS]
    if curvature_methods:  # FedFiOT's upload size, for the upload table
        summary["fedfiot_upload_bytes"] = float(np.mean([sum(len(a.data) for a in r["fedfiot"].values())
                                                         for r in uploads.replies]))
    for method in curvature_methods:
        cres = H.apply_curvature_method(
            method, setting, split, uploads, build, buffers, ev.validate, args.fedfisher_steps, args.fisher_kind,
            None if args.no_cache else args.cache_dir, state["device"], log)
        t1 = time.perf_counter()
        cres.test_loss, cres.test_accuracy = ev.test(cres.model)
        cres.test_seconds = time.perf_counter() - t1
        merge_total += cres.merge_seconds
        test_total += cres.test_seconds
        records.append({**base, **cres.record(), "upload": cres.upload})
        log(f"  {method:13s} test {100 * cres.test_accuracy:5.1f}%  val {100 * cres.validation_accuracy:5.1f}%  "
            f"{H.knob_text(cres.knobs):32s} upload {cres.upload_bytes / cres.fedavg_bytes:.2f}x FedAvg  "
            f"curvature {cres.curvature_seconds:.1f}s  merge {cres.merge_seconds:.1f}s")
    server_methods = [m for m in args.methods if m in S.SERVER_DATA_METHODS]
    if server_methods:
        for rec in S.run_server_methods(server_methods, setting, split, uploads, build, spec, buffers, ev,
                                        S.refine_options(args, setting), args.grid,
                                        None if args.no_cache else args.cache_dir, state["device"], log):
            merge_total += float(rec.get("sweep_seconds", 0.0))
            records.append({**base, "fraction_permuted": 0.0, "alignment_fraction_permuted": 0.0, **rec})
    summary.update(merge_sweep_seconds=merge_total, test_seconds=test_total)
    diagnostics = E.cell_diagnostics(base, records, uploads.float32.weights, H.initial_weights(setting, split), buffers)
    return {"summary": summary, "records": records, "diagnostics": diagnostics}


def table_methods(methods: Sequence[str]) -> list[str]:
    """Table rows: the methods plus the rows derived from them (after their source)."""
    out: list[str] = []
    for m in methods:
        out.append(m)
        out += [d for d, src in H.DERIVED_METHODS.items() if src == m]
    return out


def _equal_terms_section(payload: dict[str, Any]) -> list[str]:
    """The "server data may also fit" protocol's table and margins, when the payload holds its records."""
    recs = payload.get("equal_terms")
    if not recs:
        return []
    from benchmarks import equal_terms  # the page's second protocol; equal_terms does not import this module

    return ["## Server data may also fit: the same refinement after every method (`equal_terms.py`)", "",
            "Every row below: the same uploads, the 500 server examples split into 250 that fit and 250 that "
            "choose, the same stage after every start; `server-only` is the 250 fitting labels alone.", "",
            equal_terms.table(recs), "", "Test accuracy (%), mean ± sample std over the seeds run.", "",
            equal_terms.margins(recs), ""]


def markdown(payload: dict[str, Any], methods: Sequence[str]) -> str:
    """The results page: command, machine, timing, tables."""
    recs = payload["records"]
    sums = payload["settings"]
    t = payload["timing"]
    lines = [
        "# One-shot benchmark",
        "",
        f"Command: `{payload['command']}`",
        "",
        f"Machine: {payload['machine']}. Started {payload['started']}; wall time {t['wall_seconds'] / 60:.1f} min.",
        "",
        "Time (summed over settings): client training {:.1f} min + Fisher {:.1f} min (as measured when the uploads were "
        "produced{}), merge + validation sweep of all methods {:.1f} min ({:.1f}% of the four), test evaluation "
        "{:.1f} min.".format(
            t["train_seconds"] / 60, t["fisher_seconds"] / 60,
            "; some came from the cache" if t["cached_settings"] else "",
            t["merge_sweep_seconds"] / 60,
            100 * t["merge_sweep_seconds"] / max(1e-9, t["train_seconds"] + t["fisher_seconds"] + t["merge_sweep_seconds"]
                                                 + t["test_seconds"]),
            t["test_seconds"] / 60,
        ),
        "",
        "## Test accuracy",
        "",
        H.accuracy_table(recs, methods),
        "",
        *E.selection_section(payload, methods),
        "## FedFiOT against the published baselines",
        "",
        baseline_margins(payload, methods),
        "",
        *_refined_section(payload),
        *_equal_terms_section(payload),
        "## Validation accuracy of the chosen knobs",
        "",
        H.accuracy_table(recs, methods, "validation_accuracy").replace("Test accuracy", "Validation accuracy"),
        "",
        "## Neurons FedFiOT permuted",
        "",
        H.fraction_table(recs),
        "",
        *E.diagnostics_section(payload),
        "## Knobs chosen on validation",
        "",
        H.knob_table(recs, methods),
        "",
        "## Method knobs (grids)",
        "",
    ]
    for name, knobs in payload["grids"].items():
        lines.append(f"- {H.METHOD_LABELS.get(name, name)}: {knobs}")
    uploads = H.upload_table(recs, sums)
    if uploads:
        lines += ["", "## Upload size per client", "", uploads, "",
                  "Array payload (`len(array.data)`, Flower's record headers excluded), mean over clients and "
                  "settings. K-FAC factors and Grams are 8-bit, low rank, with the largest shared rank that keeps "
                  "the upload within FedAvg's (`rank=\"fedavg\"`)."]
    lines += ["", "## Per setting", "",
              "| setting | seed | client sizes | uploads | train (s) | Fisher (s) | merge+sweep (s) | test eval (s) "
              "| FedAvg vs Flower max abs diff |",
              "|---|---|---|---|---|---|---|---|---|"]
    for s in sums:
        lines.append(
            f"| {H.column_label((s['dataset'], s['alpha'], s['init'], s['epochs']))} | {s['seed']} | "
            f"{s['client_sizes']} | {'cache' if s['cached'] else 'trained'} | {s['train_seconds']:.0f} | "
            f"{s['fisher_seconds']:.0f} | {s['merge_sweep_seconds']:.0f} | {s['test_seconds']:.0f} | "
            f"{s.get('fedavg_vs_flower_max_abs_diff', float('nan')):.1e} |")
    if payload.get("skipped"):
        lines += ["", "Skipped: " + "; ".join(payload["skipped"])]
    return "\n".join(lines) + "\n"


def _refined_section(payload: dict[str, Any]) -> list[str]:
    """The refined merge against the selection-only rivals, when the run has ``fedfiot-refined`` rows."""
    if not any(r["method"] == "fedfiot-refined" for r in payload["records"]):
        return []
    return ["## FedFiOT merge + refine=RefineOptions() against every selection-only rival (it alone trains on server "
            "examples; the same refinement after every rival: equal_terms.md)", "", S.default_comparison(payload), ""]


def _col_mean(recs: Sequence[dict[str, Any]], method: str, col: tuple[Any, ...]) -> float:
    vals = [r["test_accuracy"] for r in recs if r["method"] == method and (r["dataset"], r["alpha"], r["init"], r["epochs"]) == col]
    return H.mean_std(vals)[0]


def _seed_accuracy(recs: Sequence[dict[str, Any]], method: str, seed: int) -> float | None:
    return next((r["test_accuracy"] for r in recs if r["method"] == method and r["seed"] == seed), None)


def baseline_margins(payload: dict[str, Any], methods: Sequence[str]) -> str:
    """Markdown: per setting, FedFiOT (paper preset) against the best of the methods it is compared with.

    Independent initialisations: against every other merge of the run (ablations included);
    shared initialisation: against FedAvg and Fisher merging; both: against FedFiOT on the
    float32 uploads when that row ran. Margins are means over the seeds FedFiOT ran, in points;
    the last column counts the seeds on which FedFiOT scored at least the best of them.
    """
    recs = payload["records"]
    lines = ["| setting | FedFiOT (paper preset) against | best of them | FedFiOT | margin (points) "
             "| seeds at or above |", "|---|---|---|---|---|---|"]
    others = [m for m in methods if m not in ("fedfiot", "fedfiot-fp32", "fedfiot-val", "fedfiot-default", "fedfiot-own")
              and m not in S.SERVER_DATA_METHODS]

    def row(col: tuple[Any, ...], against: str, compared: Sequence[str], on_seeds: Sequence[dict[str, Any]],
            seeds: Sequence[int]) -> None:
        means = {m: _col_mean(on_seeds, m, col) for m in compared}
        means = {m: v for m, v in means.items() if not math.isnan(v)}
        if not means:
            return
        best = max(means, key=means.get)
        ours = _col_mean(on_seeds, "fedfiot", col)
        at_or_above = 0
        for s in seeds:
            theirs = [a for m in compared if (a := _seed_accuracy(on_seeds, m, s)) is not None]
            mine = _seed_accuracy(on_seeds, "fedfiot", s)
            at_or_above += bool(theirs) and mine is not None and mine >= max(theirs)
        lines.append(f"| {H.column_label(col)} | {against} | {H.METHOD_LABELS.get(best, best)} | {100 * ours:.1f} | "
                     f"{100 * (ours - means[best]):+.1f} | {at_or_above}/{len(seeds)} |")

    if "fedfiot" in methods:
        for col in H.setting_columns(recs):
            in_col = [r for r in recs if (r["dataset"], r["alpha"], r["init"], r["epochs"]) == col]
            # Compared on the seeds where the paper preset ran.
            ran = sorted({r["seed"] for r in in_col if r["method"] == "fedfiot"})
            if not ran:
                continue
            on_seeds = [r for r in in_col if r["seed"] in ran]
            if col[2] == "independent" and others:
                row(col, "every other merge in the run", others, on_seeds, ran)
            if col[2] == "shared":
                avg = [m for m in ("fedavg", "fisher-merge") if m in methods]
                if avg:
                    row(col, "FedAvg and Fisher merging", avg, on_seeds, ran)
            if "fedfiot-fp32" in methods:
                row(col, "itself on float32 uploads", ["fedfiot-fp32"], on_seeds, ran)
    t = payload["timing"]
    total = t["train_seconds"] + t["fisher_seconds"] + t["merge_sweep_seconds"] + t["test_seconds"]
    share = 100 * t["merge_sweep_seconds"] / max(total, 1e-9)
    lines += ["", f"Merge + sweep of all methods: {share:.1f}% of training + Fisher + merging + testing; "
              f"wall time {t['wall_seconds'] / 60:.1f} min."]
    return "\n".join(lines)


def plot(payload: dict[str, Any], methods: Sequence[str], out: Path, name: str) -> list[Path]:
    """Bar chart per setting; accuracy and fraction permuted vs local epochs when there are several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = payload["records"]
    cols = H.setting_columns(recs)
    paths = []
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cols) * len(methods) / 4), 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        mus, sds = [], []
        for c in cols:
            vals = [r["test_accuracy"] for r in recs if r["method"] == m and (r["dataset"], r["alpha"], r["init"], r["epochs"]) == c]
            mu, sd = H.mean_std(vals)
            mus.append(100 * mu)
            sds.append(0 if math.isnan(sd) else 100 * sd)
        ax.bar(np.arange(len(cols)) + (i - (len(methods) - 1) / 2) * width, mus, width, yerr=sds,
               label=H.METHOD_LABELS.get(m, m), capsize=2)
    ax.set_xticks(np.arange(len(cols)), [H.column_label(c).replace(" ", "\n", 2) for c in cols], fontsize=8)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("One-shot, same uploads for every method (mean ± std over seeds)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    paths.append(path)

    epochs = sorted({r["epochs"] for r in recs})
    if len(epochs) > 1:
        groups = []
        for r in recs:
            g = (r["dataset"], r["alpha"], r["init"])
            if g not in groups:
                groups.append(g)
        fig, axes = plt.subplots(2, len(groups), figsize=(4.5 * len(groups), 7), squeeze=False)
        for j, g in enumerate(groups):
            for m in methods:
                ys = [H.mean_std([r["test_accuracy"] for r in recs if r["method"] == m and r["epochs"] == e
                                  and (r["dataset"], r["alpha"], r["init"]) == g])[0] * 100 for e in epochs]
                axes[0, j].plot(epochs, ys, marker="o", label=H.METHOD_LABELS.get(m, m))
            fr = [H.mean_std([r["alignment_fraction_permuted"] for r in recs if r["method"] == "fedfiot"
                              and r["epochs"] == e and (r["dataset"], r["alpha"], r["init"]) == g])[0] * 100 for e in epochs]
            axes[1, j].plot(epochs, fr, marker="o", color="k")
            axes[0, j].set_title(f"{g[0]} α={g[1]:g} {g[2]}")
            axes[0, j].set_ylabel("test accuracy (%)")
            axes[1, j].set_ylabel("hidden neurons FedFiOT permuted (%)")
            axes[1, j].set_xlabel("local epochs")
        axes[0, 0].legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{name}_epochs.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON payload (also written to ``--out``)."""
    args = parse_args(argv)
    H.set_threads(args.threads)
    log = H.setup_logging(not args.quiet)
    start = time.perf_counter()
    payload: dict[str, Any] = {
        "command": H.command_line(argv, __file__),
        "machine": H.machine_description(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "methods": list(args.methods),
        "grid": args.grid,
        "grids": {name: H.knobs_description(config, H.upload_of(name))
                  for name, config in H.method_configs(merge_methods(args.methods), "shared", args.grid,
                                                       not args.no_broadcast_reference).items()},
        "select_epochs": bool(args.select_epochs),
        "settings": [], "records": [], "diagnostics": [], "skipped": [],
    }
    for m in args.methods:
        if m in H.CURVATURE_METHODS:
            payload["grids"][m] = H.curvature_knobs(m, args.fedfisher_steps, args.fisher_kind)
        if m in S.SERVER_DATA_METHODS:
            payload["grids"][m] = S.knobs_text(m, S.refine_options(args, None))
    state: dict[str, Any] = {"device": default_device()}
    args.out.mkdir(parents=True, exist_ok=True)
    for dataset in args.datasets:
        for setting in settings_of(args, dataset):
            log(f"{setting.column()} seed {setting.seed} (K={setting.clients}, {setting.model})")
            try:
                result = run_setting(setting, args, state, log)
            except DatasetUnavailableError as err:
                log(f"  skipped {dataset}: {err}")
                payload["skipped"].append(f"{dataset}: {err}")
                break
            payload["settings"].append(result["summary"])
            payload["records"].extend(result["records"])
            payload["diagnostics"].append(result["diagnostics"])
            finish(payload, args, start, final=False)
    finish(payload, args, start, final=True)
    log(f"done in {(time.perf_counter() - start) / 60:.1f} min; wrote {args.out / (args.name + '.md')}")
    return payload


def finish(payload: dict[str, Any], args: argparse.Namespace, start: float, final: bool) -> None:
    """Update timing and write the JSON, the markdown and (at the end) the plots."""
    sums = payload["settings"]
    payload["timing"] = {
        "wall_seconds": time.perf_counter() - start,
        "train_seconds": sum(s["train_seconds"] for s in sums),
        "fisher_seconds": sum(s["fisher_seconds"] for s in sums),
        "merge_sweep_seconds": sum(s["merge_sweep_seconds"] for s in sums),
        "test_seconds": sum(s["test_seconds"] for s in sums),
        "cached_settings": sum(bool(s["cached"]) for s in sums),
        "complete": final,
    }
    if args.select_epochs:
        payload["epoch_selection"] = E.selection_payload(payload["records"])
    H.write_json(args.out / f"{args.name}.json", payload)
    if payload["records"]:
        (args.out / f"{args.name}.md").write_text(markdown(payload, table_methods(args.methods)))
        if final and not args.no_plots:
            plot(payload, table_methods(args.methods), args.out, args.name)
            if args.select_epochs:
                E.plot_selection(payload, args.out, args.name)


if __name__ == "__main__":
    main()
