"""FedFiOT ServerApp: one-shot or few-round FedFiOT with server-side selection on validation data.

The ``strategy`` key swaps FedFiOT for one of the paper's one-shot baselines (FedFisher with
K-FAC or diagonal Fishers, RegMean); everything else (data, model, validation, results) stays.
The ServerApp owns the recording: every run writes ``results.json`` and checkpoints into a new
directory of its own (:class:`fedfiot_flwr.server.RunRecorder`); with ``resume-from`` it goes on
after the last complete round of an earlier run's directory.

Run with ``flwr run .`` (see the README); every knob is a ``[tool.flwr.app.config]`` key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from logging import ERROR, INFO
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log
from torch.utils.data import DataLoader, Dataset

from fedfiot_flwr.app_config import AppConfig
from fedfiot_flwr.batches import default_device
from fedfiot_flwr.models import permutation_spec
from fedfiot_flwr.refine import RefineOptions
from fedfiot_flwr.server import FedFiOT, FedFiOTConfig, FedFisherStrategy, MergeStrategy, RegMeanStrategy, RunRecorder
from fedfiot_flwr.server.nodes import NodeWaiter
from fedfiot_flwr.server.run_lock import RunDirectoryHeld
from fedfiot_flwr.server.selection import SweepGrid
from fedfiot_flwr.server.stop_request import RunStopped
from fedfiot_flwr.server.uploads import TooFewValidReplies
from fedfiot_flwr.task import evaluate

app = ServerApp()


class RunFailed(RuntimeError):
    """A run that cannot go on, for a reason the user can act on; its results file already says so."""


def _evaluator(cfg: AppConfig, model: torch.nn.Module, loader: DataLoader, device: torch.device):
    """``(server_round, ArrayRecord) -> MetricRecord`` evaluating a global model on ``loader``."""

    def fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, loader, device=device)
        return MetricRecord({"accuracy": float(acc), "loss": float(loss)})

    return fn


def _resolve_federation(grid: Grid, cfg: AppConfig) -> AppConfig:
    """``cfg`` once its SuperNodes are connected, with K = their number if ``num-partitions = 0``.

    Raises
    ------
    RunFailed
        If no SuperNode (``num-partitions = 0``) or fewer than the fixed K connected within
        ``node-wait-s``; the run's results file is marked failed with the same message.
    """
    if cfg.num_partitions == 0:
        connected = NodeWaiter(cfg.node_wait_s, poll_s=0.5).wait_for_stable_set(grid, cfg.node_settle_s)
        if connected > 0:
            log(INFO, "num-partitions = 0: K = %d, the number of connected SuperNodes", connected)
            return cfg.with_partitions(connected)
        msg = (
            f"no SuperNode connected after {cfg.node_wait_s:.0f}s (num-partitions = 0: K = the number of "
            'connected SuperNodes); start SuperNodes with --node-config "partition-id=<i> num-partitions=<K>"'
        )
    else:
        connected = NodeWaiter(cfg.node_wait_s).wait(grid, cfg.num_partitions, cfg.num_partitions)
        if connected >= cfg.num_partitions:
            return cfg
        msg = (
            f"only {connected} SuperNodes connected after {cfg.node_wait_s:.0f}s but num-partitions = "
            f"{cfg.num_partitions}: start one SuperNode per partition (simulation: "
            f'flwr run . --federation-config "num-supernodes={cfg.num_partitions}"), or set '
            "num-partitions=0 to use every SuperNode that connects"
        )
    RunRecorder.create(cfg.results_dir, cfg.default_run_name(), {"app": cfg.as_dict()}).finish(error=msg)
    raise RunFailed(msg)


STRATEGY_LABELS = {"fedfiot": "FedFiOT", "fedfisher-kfac": "FedFisher (K-FAC)", "fedfisher-diag": "FedFisher (diag)",
                   "regmean": "RegMean"}


def fedfiot_config(cfg: AppConfig) -> FedFiOTConfig:
    """The FedFiOT configuration the run config names: ``preset`` plus the merge keys."""
    lists = cfg.sweep_lists()
    base = FedFiOTConfig.named(cfg.preset)
    scalings = lists["fisher_scalings"] or (base.sweep.fisher_scalings if base.sweep is not None else ("none",))
    sweep = SweepGrid(rhos=lists["rhos"], lams=lists["lams"], references=lists["references"],
                      fisher_scalings=scalings) if cfg.sweep else None
    return FedFiOTConfig.named(
        cfg.preset, rho=cfg.rho, lam=cfg.lam, reference=cfg.reference_value(), fisher_scaling=cfg.fisher_scaling,
        max_iters=cfg.max_iters, matching=cfg.matching, aggregation=cfg.aggregation,
        selection=cfg.fallback or base.selection, sweep=sweep, curvature=cfg.curvature, gram_alpha=cfg.gram_alpha,
        gram_ridge=cfg.gram_ridge,
        fisher_rounds={-1: base.fisher_rounds, 0: None}.get(cfg.fisher_rounds, cfg.fisher_rounds),
        round_choice=cfg.round_choice or base.round_choice,
        reprobe_after={-1: base.reprobe_after, 0: None}.get(cfg.reprobe_after, cfg.reprobe_after),
    )


def build_strategy(
    cfg: AppConfig,
    model: torch.nn.Module,
    validation: Dataset[Any] | None,
    min_train: int,
) -> MergeStrategy:
    """The strategy the ``strategy`` key names, with the run's sampling.

    ``fedfiot``: :class:`~fedfiot_flwr.FedFiOT` with :func:`fedfiot_config`; ``fedfisher-kfac`` /
    ``fedfisher-diag``: :class:`~fedfiot_flwr.FedFisherStrategy` (``fedfisher-steps``,
    ``fisher-kind``); ``regmean``: :class:`~fedfiot_flwr.RegMeanStrategy`. All get the validation
    set as their ``server_data`` (it chooses their knobs) and, with ``server-refine``, the same
    refinement stage; all compute FedAvg of the same uploads next to their own model, given the
    same stage.
    """
    has_data = validation is not None and len(validation) > 0  # type: ignore[arg-type]
    common: dict[str, Any] = dict(
        model=model,
        fraction_train=cfg.fraction_train,
        fraction_evaluate=cfg.fraction_evaluate,
        min_train_nodes=min_train,
        min_evaluate_nodes=min_train,
        min_available_nodes=cfg.num_partitions,
        min_valid_replies=min(cfg.min_valid_replies, min_train),
        node_wait_s=cfg.node_wait_s,  # a lost SuperNode must not stop the later rounds
        server_data=validation if has_data else None,
        refine=RefineOptions() if cfg.server_refine and has_data else None,
    )
    if cfg.strategy == "fedfiot":
        return FedFiOT(spec=permutation_spec(model), config=fedfiot_config(cfg), **common)
    if cfg.strategy in ("fedfisher-kfac", "fedfisher-diag"):
        return FedFisherStrategy(
            cfg.strategy.removeprefix("fedfisher-"), steps=cfg.fedfisher_steps, fisher_kind=cfg.client_fisher_kind(),
            **common,
        )
    return RegMeanStrategy(**common)


def _record_bad_config(run_config: Mapping[str, Any], error: str) -> str:
    """Mark a run whose ``--run-config`` was refused as failed; return where (or why not)."""
    results_dir = str(run_config.get("results-dir") or AppConfig.results_dir)
    run_name = str(run_config.get("run-name") or f"bad-run-config-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        recorder = RunRecorder.create(results_dir, run_name, {"app": dict(run_config)})
        recorder.finish(error=error)
    except (OSError, ValueError) as exc:
        return f"no results file: {exc}"
    return str(recorder.path)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the app; a refused run config or a round without enough valid replies ends the run with one line.

    The results file is marked failed with the same reason, and the line is the run's last, without a
    traceback (a bug in the app still raises, with its traceback).
    """
    try:
        run(grid, context)
    except RunFailed as exc:
        log(ERROR, "FedFiOT run failed: %s", exc)


def run(grid: Grid, context: Context) -> None:
    """Build the data split, the model and the strategy, run it recorded, and report it against FedAvg.

    Raises
    ------
    RunFailed
        For a refused run config, too few SuperNodes, a resume from a directory that another live
        run holds, a round left with too few valid replies, or a stop request (a signal) during a round.
    """
    try:
        cfg = AppConfig.from_run_config(context.run_config)
    except ValueError as exc:
        raise RunFailed(f"{exc} (results: {_record_bad_config(context.run_config, str(exc))})") from None
    cfg = _resolve_federation(grid, cfg)
    device = default_device()
    split = cfg.split()
    model = cfg.build_model(split)
    eval_model = cfg.build_model(split)
    test_fn = _evaluator(cfg, eval_model, DataLoader(split.test, batch_size=512), device)
    min_train = max(1, round(cfg.fraction_train * cfg.num_partitions))

    strategy = build_strategy(cfg, model, split.validation, min_train)
    try:
        recorder = RunRecorder.create(cfg.results_dir, cfg.default_run_name(), {"app": cfg.as_dict()},
                                      resume_from=cfg.resume_from or None,
                                      may_differ=[f"app.{k}" for k in AppConfig.RUN_ONLY_KEYS])
    except RunDirectoryHeld as exc:  # the new directory's results.json says so too
        raise RunFailed(f"cannot resume: {exc}") from None
    log(INFO, "FedFiOT app (%s): %s; results in %s", type(strategy).__name__, json.dumps(cfg.as_dict()),
        recorder.run_dir)
    if recorder.resume is not None:
        log(INFO, "Resuming after round %d of %s (%s)", recorder.resume.round, recorder.resume.run_dir,
            recorder.resume.state_path.name)

    train_config = ConfigRecord(
        {
            "local-epochs": cfg.local_epochs,
            "lr": cfg.lr,
            "batch-size": cfg.batch_size,
            "init": cfg.init,
            "seed": cfg.seed,
        }
    )
    try:
        recorder.run(
            strategy,
            grid=grid,
            initial_arrays=ArrayRecord(model.state_dict()),
            num_rounds=cfg.num_server_rounds,
            train_config=train_config,
            evaluate_fn=test_fn,
        )
    except (TooFewValidReplies, RunStopped) as exc:
        raise RunFailed(f"{exc} (results: {recorder.path})") from None
    final = recorder.data["final"]
    ours = (final.get("test") or {}).get("accuracy")
    base = (final.get("fedavg_test") or {}).get("accuracy")
    own = (final.get("own_test") or {}).get("accuracy")
    log(
        INFO,
        "FINAL test accuracy after %d round(s): %s %s | FedAvg on the same uploads%s %s%s | results: %s",
        cfg.num_server_rounds,
        STRATEGY_LABELS[cfg.strategy] + (" + server refinement" if strategy.post_merge is not None else ""),
        "n/a" if ours is None else f"{100 * ours:.2f}%",
        " + the same refinement" if strategy.post_merge is not None else "",
        "n/a" if base is None else f"{100 * base:.2f}%",
        "" if own is None else f" (FedAvg won the validation choice; FedFiOT's own merge: {100 * own:.2f}%)",
        recorder.path,
    )
