"""FedFiOT ServerApp: one-shot or few-round FedFiOT with server-side selection on validation data.

Run with ``flwr run .`` (see the README); every knob is a ``[tool.flwr.app.config]`` key.
"""

from __future__ import annotations

import json
import time
from logging import INFO

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log
from torch.utils.data import DataLoader

from fedfiot_flwr import FedFiOT
from fedfiot_flwr.app_config import AppConfig
from fedfiot_flwr.models import permutation_spec
from fedfiot_flwr.results import ResultsFile
from fedfiot_flwr.task import evaluate

app = ServerApp()


def _evaluator(cfg: AppConfig, model: torch.nn.Module, loader: DataLoader, device: torch.device):
    """``(server_round, ArrayRecord) -> MetricRecord`` evaluating a global model on ``loader``."""

    def fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, loader, device=device)
        return MetricRecord({"accuracy": float(acc), "loss": float(loss)})

    return fn


def _wait_for_nodes(grid: Grid, needed: int, timeout_s: float) -> int:
    """Wait until ``needed`` SuperNodes are connected; return how many are."""
    deadline = time.monotonic() + timeout_s
    while (n := len(list(grid.get_node_ids()))) < needed and time.monotonic() < deadline:
        time.sleep(1.0)
    return n


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Build the data split, the model and the FedFiOT strategy, run it, and report FedFiOT vs FedAvg."""
    cfg = AppConfig.from_run_config(context.run_config)
    run_dir = cfg.run_dir().resolve()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    split = cfg.split()
    model = cfg.build_model(split)
    eval_model = cfg.build_model(split)
    validate_fn = test_fn = None
    if len(split.validation) > 0:
        validate_fn = _evaluator(cfg, eval_model, DataLoader(split.validation, batch_size=512), device)
    test_fn = _evaluator(cfg, eval_model, DataLoader(split.test, batch_size=512), device)
    min_train = max(1, round(cfg.fraction_train * cfg.num_partitions))

    strategy = FedFiOT(
        spec=permutation_spec(model),
        model=model,
        lam=cfg.lam,
        rho=cfg.rho,
        max_iters=cfg.max_iters,
        reference=cfg.reference_value(),
        matching=cfg.matching,
        aggregation=cfg.aggregation,
        fisher_scaling=cfg.fisher_scaling,
        fallback=cfg.fallback,
        validate_fn=validate_fn,
        sweep=cfg.sweep_grid() if cfg.sweep else None,
        fraction_train=cfg.fraction_train,
        fraction_evaluate=0.0,
        min_train_nodes=min_train,
        min_available_nodes=cfg.num_partitions,
        min_valid_replies=min(cfg.min_valid_replies, min_train),
        results_path=run_dir / "results.json",
        checkpoint_dir=run_dir / "checkpoints",
        run_info={"app": cfg.as_dict(), "run_dir": str(run_dir)},
    )
    log(INFO, "FedFiOT app: %s; results in %s", json.dumps(cfg.as_dict()), run_dir)

    connected = _wait_for_nodes(grid, cfg.num_partitions, cfg.node_wait_s)
    if connected < cfg.num_partitions:
        msg = (
            f"only {connected} SuperNodes connected after {cfg.node_wait_s:.0f}s but num-partitions = "
            f"{cfg.num_partitions}: start one SuperNode per partition (simulation: "
            f"flwr run . --federation-config \"num-supernodes={cfg.num_partitions}\")"
        )
        ResultsFile(run_dir / "results.json", {"app": cfg.as_dict()}).finish(error=msg)
        raise RuntimeError(msg)

    train_config = ConfigRecord(
        {
            "local-epochs": cfg.local_epochs,
            "lr": cfg.lr,
            "batch-size": cfg.batch_size,
            "init": cfg.init,
            "seed": cfg.seed,
        }
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(model.state_dict()),
        num_rounds=cfg.num_server_rounds,
        train_config=train_config,
        evaluate_fn=test_fn,
    )
    final = strategy.results.data["final"]
    ours = (final.get("test") or {}).get("accuracy")
    base = (final.get("fedavg_test") or {}).get("accuracy")
    log(
        INFO,
        "FINAL test accuracy after %d round(s): FedFiOT %s | FedAvg on the same uploads %s | results: %s",
        cfg.num_server_rounds,
        "n/a" if ours is None else f"{100 * ours:.2f}%",
        "n/a" if base is None else f"{100 * base:.2f}%",
        run_dir / "results.json",
    )
    del result
