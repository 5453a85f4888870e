"""Benchmark rows that use the server's data beyond selection: floors/ceilings and the refined FedFiOT merge.

Rows (method names in the result records):

- ``best-single-client``: the client model with the best accuracy on the whole server
  validation set (a rival: one upload, no merge).
- ``mean-client``: the clients' mean test accuracy (a floor; selects nothing).
- ``ensemble``: averaged logits of the K client models (a ceiling: K times the model).
- ``centralized``: one model trained on the union of the clients' data, same epochs and
  optimiser, from the broadcast initialisation (a ceiling: no federation).
- ``fedfiot-refined``: FedFiOT's default merge followed by
  :class:`fedfiot_flwr.refine.RefinementStage` (the strategies' own stage). The 500 validation examples are
  split once (seeded) into a fitting fold and a selection fold of 250 each: the merge's
  knobs (rho x lam x reference x Fisher scaling, aligned vs identity) and the refinement's
  candidate are chosen on the selection fold; only the refinement's least squares / REPAIR
  statistics use the fitting fold (no labels).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader

from benchmarks import harness as H
from fedfiot_flwr.choose import best_index
from fedfiot_flwr.data import FederatedSplit
from fedfiot_flwr.merge import PermutationSpec
from fedfiot_flwr.options import Model
from fedfiot_flwr.refine import RefineOptions
from fedfiot_flwr.refine.stage import RefinementStage, fold_subsets
from fedfiot_flwr.server.outcome import RoundOutcome
from fedfiot_flwr.task import train

SERVER_DATA_METHODS = ("best-single-client", "mean-client", "ensemble", "centralized", "fedfiot-refined")
LABELS = {
    "best-single-client": "Best single client (chosen on validation)",
    "mean-client": "Mean client",
    "ensemble": "Ensemble of the K clients (averaged logits)",
    "centralized": "Centralized (union of the clients' data)",
    "fedfiot-refined": "FedFiOT default merge + refine=RefineOptions() (trains on 250 server examples)",
}


def fold_loaders(split: FederatedSplit, batch_size: int = 500) -> tuple[DataLoader, DataLoader]:
    """DataLoaders of the fitting and selection folds of the server validation set (the strategy's
    own split, :func:`fedfiot_flwr.refine.stage.split_folds`)."""
    fit, sel = fold_subsets(split.validation)
    return DataLoader(fit, batch_size=batch_size), DataLoader(sel, batch_size=batch_size)


def selection_evaluator(split: FederatedSplit, build: Callable[[], torch.nn.Module],
                        device: torch.device | None = None) -> H.Evaluator:
    """An :class:`~benchmarks.harness.Evaluator` whose ``validate`` sees the selection fold only."""
    return H.Evaluator(replace(split, validation=fold_subsets(split.validation)[1]), build, device)


def _logits(model: torch.nn.Module, batches: Iterable[Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, labels)`` of ``model`` on every batch of ``batches``, on the CPU."""
    outs, ys = [], []
    model.eval()
    with torch.no_grad():
        for x, y in batches:
            outs.append(model(x.to(device)).cpu())
            ys.append(y.cpu())
    return torch.cat(outs), torch.cat(ys)


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return float((logits.argmax(1) == labels).float().mean())


def floors_and_ceilings(uploads: H.Uploads, build: Callable[[], torch.nn.Module], ev: H.Evaluator,
                        methods: Sequence[str]) -> list[dict[str, Any]]:
    """Records of ``best-single-client``, ``mean-client`` and ``ensemble`` (whichever are asked for).

    Every row has a validation accuracy (the ensemble's from its averaged logits on the
    validation set), so that a choice among runs (e.g. of the local epochs) can use it.
    """
    q = uploads.quantized
    t0 = time.perf_counter()
    val = [ev.validate(w)["accuracy"] for w in q.weights]
    logits = val_logits = y = val_y = None
    tests = []
    for w in q.weights:
        model = H.load_numpy(build(), w).to(ev.device)
        lg, y = _logits(model, ev._test_batches(), ev.device)
        vlg, val_y = _logits(model, ev.validation, ev.device)
        tests.append(_accuracy(lg, y))
        logits = lg if logits is None else logits + lg
        val_logits = vlg if val_logits is None else val_logits + vlg
    assert logits is not None and y is not None and val_logits is not None and val_y is not None
    seconds = time.perf_counter() - t0
    best = best_index(val)
    out = []
    if "best-single-client" in methods:
        out.append({"method": "best-single-client", "test_accuracy": tests[best], "validation_accuracy": val[best],
                    "knobs": {"client": best, "swept": ["client"]}, "sweep_seconds": seconds})
    if "mean-client" in methods:
        out.append({"method": "mean-client", "test_accuracy": float(np.mean(tests)),
                    "validation_accuracy": float(np.mean(val)), "knobs": {}, "sweep_seconds": 0.0})
    if "ensemble" in methods:
        out.append({"method": "ensemble", "test_accuracy": _accuracy(logits, y),
                    "validation_accuracy": _accuracy(val_logits, val_y), "knobs": {}, "sweep_seconds": 0.0})
    return out


def centralized(setting: H.Setting, split: FederatedSplit, uploads: H.Uploads, ev: H.Evaluator,
                cache_dir: Path | None, device: torch.device | None = None) -> dict[str, Any]:
    """Train one model on the union of the clients' data (same epochs, batch size, lr, init); cached."""
    cfg = setting.app_config()
    path = None if cache_dir is None else Path(cache_dir) / setting.cache_key() / "centralized.npz"
    if path is not None and path.is_file():
        with np.load(path) as data:
            state = {k[2:]: data[k] for k in data.files if k.startswith("w/")}
            seconds = float(data["seconds"])
    else:
        model = cfg.build_model(split) if uploads.broadcast is None else H.load_numpy(cfg.build_model(split),
                                                                                        uploads.broadcast)
        seed = H.client_seed(cfg.seed, 1, 10_000)
        gen = torch.Generator().manual_seed(seed)
        loader = DataLoader(ConcatDataset(split.clients), batch_size=cfg.batch_size, shuffle=True, generator=gen)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        train(model, loader, cfg.local_epochs, lr=cfg.lr, device=device or ev.device, progress=False)
        seconds = time.perf_counter() - t0
        state = H.state_numpy(model)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.savez(path, seconds=np.array(seconds), **{f"w/{k}": v for k, v in state.items()})
    _, acc = ev.test(state)
    return {"method": "centralized", "test_accuracy": acc, "validation_accuracy": ev.validate(state)["accuracy"],
            "knobs": {"train_seconds": seconds}, "sweep_seconds": 0.0}


def fedfiot_merge_on_fold(uploads: H.Uploads, spec: PermutationSpec, buffers: Sequence[str], sel_ev: H.Evaluator,
                          grid: str = "small", init: str = "shared") -> RoundOutcome:
    """FedFiOT's default-preset merge as the strategy runs it with a refinement after it (no FedAvg
    candidate: :meth:`FedFiOTConfig.for_server`), knobs chosen on the selection fold."""
    config = H.method_config("fedfiot-default", init, grid).for_server(has_validation=True, refining=True)
    return H.merge_outcome(config, uploads, spec, buffers, sel_ev.validate)


def refined(uploads: H.Uploads, split: FederatedSplit, build: Callable[[], torch.nn.Module], spec: PermutationSpec,
            buffers: Sequence[str], ev: H.Evaluator, sel_ev: H.Evaluator, options: RefineOptions,
            grid: str = "small", init: str = "shared", log: Callable[[str], None] | None = None,
            merge_outcome: RoundOutcome | None = None) -> dict[str, Any]:
    """The ``fedfiot-refined`` record: FedFiOT's merge (knobs on the selection fold), then the refinement."""
    t0 = time.perf_counter()
    outcome = merge_outcome or fedfiot_merge_on_fold(uploads, spec, buffers, sel_ev, grid, init)
    merge_seconds = time.perf_counter() - t0
    res = outcome.engine_result
    perms = res.permutations if outcome.variant == "aligned" else None
    stage = RefinementStage(build(), split.validation, options, spec=spec)  # the strategies' own stage and folds
    stage.progress = log
    model, report = stage.refine(outcome.model, uploads.quantized.weights, perms, uploads.quantized.num_examples)
    _, acc = ev.test(model)
    frac = float(np.mean(res.fraction_permuted)) if res.fraction_permuted else 0.0
    return {
        "method": "fedfiot-refined", "test_accuracy": acc,
        "validation_accuracy": report.selection_accuracy[report.chosen],
        "knobs": {**{k: v for k, v in vars(outcome.candidate).items()}, "variant": outcome.variant,
                  "refinement": report.chosen, "selection_accuracy": report.selection_accuracy,
                  "swept": ["rho", "lam", "reference", "fisher_scaling", "variant", "refinement"]},
        "fraction_permuted": frac if outcome.variant == "aligned" else 0.0,
        "alignment_fraction_permuted": frac,
        "merge_seconds": merge_seconds, "refine_seconds": report.seconds,
        "sweep_seconds": merge_seconds + report.seconds, "fold_sizes": [report.fit_examples, report.select_examples],
    }


DEFAULT_REFINE = RefineOptions()
"""The refinement as it ships (`RefineOptions()`, what `refine=RefineOptions()` runs; research/one_shot_analysis.md says why)."""

RIVALS = ("fedavg", "fisher-merge", "otfusion", "wb-fusion", "regmean", "fedfisher-diag", "fedfisher-kfac",
          "best-single-client")
"""Methods the default preset must beat by 2 points (FedFiOT's own presets and ablations are not rivals)."""


def refine_options(args: Any, setting: H.Setting | None) -> RefineOptions:
    """The benchmark's refinement options from ``one_shot.py``'s arguments (seeded by the setting)."""
    return replace(DEFAULT_REFINE, ridges=tuple(args.refine_ridges), augment_copies=int(args.refine_augment),
                   repair=bool(args.refine_repair), finetune_epochs=int(args.refine_finetune_epochs),
                   seed=0 if setting is None else setting.seed)


def _refined_candidates(options: RefineOptions) -> list[str]:
    """The refinement's own candidates besides the clients, as the results page names them."""
    names = ["the merge"]
    if options.offer_starts or not options.finetune_epochs:
        names.append("the refits")
    if options.finetune_epochs:
        every = f" (every {options.checkpoint_every} epochs)" if options.checkpoint_every else ""
        names.append("the fine-tuned model" + every)
    return names


def knobs_text(method: str, options: RefineOptions) -> str:
    """Grid description of a server-data method (for the results page)."""
    if method == "fedfiot-refined":
        return (f"FedFiOT default grid (no FedAvg candidate) chosen on the 250-example selection fold; then "
                f"least squares at relative ridges {list(options.ridges)}"
                + f" toward the clients' outputs weighted per example by '{options.target_weights}'"
                + (", REPAIR" if options.repair else "")
                + (f", then {options.finetune_epochs} epochs of distillation + cross-entropy fine-tuning "
                   f"({options.finetune_schedule} learning rate, {options.augment_copies} augmented copies) from the "
                   "better refit" if options.finetune_epochs else "")
                + ", all fitted on the other 250 examples; " + ", ".join(_refined_candidates(options))
                + " and each client chosen on the selection fold")
    if method == "best-single-client":
        return "the client with the best accuracy on all 500 validation examples"
    if method == "centralized":
        return "one model on the union of the clients' data, same epochs, batch size, lr and initialisation"
    return "none"


def run_server_methods(methods: Sequence[str], setting: H.Setting, split: FederatedSplit, uploads: H.Uploads,
                       build: Callable[[], torch.nn.Module], spec: PermutationSpec, buffers: Sequence[str],
                       ev: H.Evaluator, options: RefineOptions, grid: str, cache_dir: Path | None,
                       device: torch.device | None, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Records of the requested server-data methods on one setting."""
    out = floors_and_ceilings(uploads, build, ev, methods)
    if "centralized" in methods:
        out.append(centralized(setting, split, uploads, ev, cache_dir, device))
    if "fedfiot-refined" in methods:
        sel_ev = selection_evaluator(split, build, device)
        out.append(refined(uploads, split, build, spec, buffers, ev, sel_ev, options, grid, setting.init))
    for r in out:
        log(f"  {r['method']:18s} test {100 * r['test_accuracy']:5.1f}%  {H.knob_text(r.get('knobs', {}))} "
            f"{r['knobs'].get('refinement', '')}")
    return out


def _cell(recs: Sequence[Mapping[str, Any]], method: str, col: tuple[Any, ...]) -> list[Mapping[str, Any]]:
    return [r for r in recs if r["method"] == method and (r["dataset"], r["alpha"], r["init"], r["epochs"]) == col]


def default_comparison(payload: Mapping[str, Any], ours: str = "fedfiot-refined") -> str:
    """Markdown: per column, the default preset against the best rival (mean over seeds) and the best client.

    The last column counts the seeds on which the default preset scored at least the best single
    client of the same uploads.
    """
    recs = payload["records"]
    if not any(r["method"] == ours for r in recs):
        return "(no fedfiot-refined rows)"
    lines = ["| setting | seeds | default preset | best rival | rival | margin (points) "
             "| seeds at or above the best single client |", "|---|---|---|---|---|---|---|"]
    for col in H.setting_columns(recs):
        mine = _cell(recs, ours, col)
        if not mine:
            continue
        mu = float(np.mean([r["test_accuracy"] for r in mine]))
        rivals = {m: float(np.mean([r["test_accuracy"] for r in _cell(recs, m, col)]))
                  for m in RIVALS if _cell(recs, m, col)}
        best_m = max(rivals, key=rivals.get) if rivals else "–"
        best = rivals.get(best_m, math.nan)
        clients = {b["seed"]: b["test_accuracy"] for b in _cell(recs, "best-single-client", col)}
        at_or_above = sum(r["test_accuracy"] >= clients[r["seed"]] for r in mine if r["seed"] in clients)
        versus_client = f"{at_or_above}/{sum(r['seed'] in clients for r in mine)}" if clients else "–"
        lines.append(f"| {H.column_label(col)} | {len(mine)} | {100 * mu:.1f} | {100 * best:.1f} | "
                     f"{H.METHOD_LABELS.get(best_m, best_m)} | {100 * (mu - best):+.1f} | {versus_client} |")
    lines += ["", "Rivals: " + ", ".join(H.METHOD_LABELS.get(m, m) for m in RIVALS) + " (those present in the run)."]
    return "\n".join(lines)
