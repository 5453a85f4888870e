"""Opt-in recording of a run: a results JSON and model checkpoints in a directory of its own.

The strategies keep their per-round reports in memory (``strategy.reports``) and Flower's
``Result`` carries the metrics; :class:`RunRecorder` is what a ServerApp uses to put them on
disk. Every run gets a new directory (an existing one is never reused: ``name``, ``name-2``,
...); files are written atomically with mode 0644::

    recorder = RunRecorder.create("results", "my-run", config={"lr": 0.01})
    result = recorder.run(strategy, grid=grid, initial_arrays=arrays, num_rounds=1, evaluate_fn=test_fn)
    # recorder.path -> results/my-run/results.json; recorder.run_dir / "checkpoints" / "final.pt"
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedfiot_flwr.server.rounds import jsonable
from fedfiot_flwr.server.shell import MergeStrategy, numpy_to_arrays

__all__ = ["RunRecorder", "save_checkpoint", "unique_run_dir"]

FILE_MODE = 0o644


def unique_run_dir(results_dir: str | os.PathLike[str], name: str) -> Path:
    """Create and return ``results_dir/name`` (absolute), or ``name-2``, ``name-3``, ... if taken."""
    root = Path(results_dir).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    for i in range(1, 10_000):
        candidate = root / (name if i == 1 else f"{name}-{i}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run directory for {name!r} under {root}")


def save_checkpoint(model: Mapping[str, np.ndarray], path: str | os.PathLike[str]) -> Path:
    """Save a numpy state dict as a torch ``state_dict`` file (``model.load_state_dict(torch.load(path))``)."""
    import torch  # only needed when checkpointing

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save({k: torch.from_numpy(np.array(v, copy=True)) for k, v in model.items()}, target)
    os.chmod(target, FILE_MODE)
    return target


def _scalars(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if metrics is None else jsonable(dict(metrics))


class RunRecorder:
    """A run's ``results.json`` (rewritten atomically after every change) and its checkpoints.

    Layout: ``{"status": "running" | "finished" | "failed", "error", "config", "rounds": [...],
    "final": {...}, "started", "updated"}``; each round holds the strategy's report (clients,
    rejections with reasons, chosen knobs, server metrics, validation) and the test results.

    Parameters
    ----------
    run_dir : Path
        The run's own directory (see :func:`unique_run_dir`).
    config : mapping, optional
        The run configuration, stored under ``"config"``.
    """

    def __init__(self, run_dir: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "results.json"
        self.data: dict[str, Any] = {
            "status": "running", "error": None, "config": jsonable(dict(config or {})),
            "rounds": [], "final": {}, "started": time.time(), "updated": time.time(),
        }

    @classmethod
    def create(cls, results_dir: str | os.PathLike[str], name: str, config: Mapping[str, Any] | None = None) -> RunRecorder:
        """A recorder in a new directory ``results_dir/name[-N]``."""
        return cls(unique_run_dir(results_dir, name), config)

    # -- the file ---------------------------------------------------------------------------

    def round(self, server_round: int) -> dict[str, Any]:
        """The record of ``server_round``, created if missing."""
        for rec in self.data["rounds"]:
            if rec.get("round") == server_round:
                return rec
        rec: dict[str, Any] = {"round": server_round}
        self.data["rounds"].append(rec)
        return rec

    def update_round(self, server_round: int, values: Mapping[str, Any]) -> None:
        """Merge ``values`` into the record of ``server_round`` and write the file."""
        self.round(server_round).update(jsonable(dict(values)))
        self.write()

    def finish(self, final: Mapping[str, Any] | None = None, error: str | None = None) -> None:
        """Mark the run finished (or failed, with ``error``) and write the file."""
        self.data["final"].update(jsonable(dict(final or {})))
        self.data["status"] = "failed" if error else "finished"
        self.data["error"] = error
        self.write()

    def write(self) -> None:
        """Write ``results.json`` atomically (temp file + rename), mode 0644."""
        self.data["updated"] = time.time()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.run_dir, prefix="results.json.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(self.data, fh, indent=2, allow_nan=False)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, self.path)

    # -- a recorded run ---------------------------------------------------------------------

    def _sync_reports(self, strategy: MergeStrategy) -> None:
        for report in strategy.reports:
            self.round(int(report["round"])).update(report)

    def run(
        self,
        strategy: MergeStrategy,
        *,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        checkpoints: bool = True,
    ) -> Result:
        """Run ``strategy.start(...)`` and record it.

        ``evaluate_fn`` (the test evaluation, Flower's signature) is applied to the global model
        as Flower does, and also to the alternatives of each round (FedAvg of the same uploads,
        FedFiOT's own merge when FedAvg won the validation choice). With ``checkpoints`` the
        global model of every round and the final one are saved under ``run_dir/checkpoints``.
        A failing run is recorded as failed with the error, then the error is raised.
        """
        self.data["config"].update(jsonable({"num_rounds": num_rounds, "strategy": type(strategy).__name__,
                                             "aggregator": strategy.aggregator.config()}))
        self.write()

        def recorded_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            res = evaluate_fn(server_round, arrays) if evaluate_fn is not None else None
            if server_round == 0:
                self.data["initial_test"] = _scalars(res)
                self.write()
                return res
            self._sync_reports(strategy)
            values: dict[str, Any] = {"test": _scalars(res)}
            last = strategy.last_round
            if evaluate_fn is not None and last is not None and last.report.get("round") == server_round:
                for name, model in last.alternatives.items():
                    key = {"fedavg": "fedavg_test", "fedfiot-own": "own_test"}.get(name, f"{name}_test")
                    values[key] = _scalars(evaluate_fn(server_round, numpy_to_arrays(model, list(arrays.keys()))))
            if checkpoints:
                model = {k: np.asarray(v.numpy()) for k, v in arrays.items()}
                values["checkpoint"] = str(save_checkpoint(model, self.run_dir / "checkpoints" / f"round-{server_round:03d}.pt"))
            self.update_round(server_round, values)
            return res

        t0 = time.perf_counter()
        try:
            result = strategy.start(grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds, timeout=timeout,
                                    train_config=train_config, evaluate_config=evaluate_config,
                                    evaluate_fn=recorded_evaluate)
        except BaseException as exc:
            self._sync_reports(strategy)
            self.finish(error=f"{type(exc).__name__}: {exc}")
            raise
        self._sync_reports(strategy)
        final: dict[str, Any] = {"rounds": num_rounds, "seconds": time.perf_counter() - t0}
        if self.data["rounds"]:
            last_rec = self.data["rounds"][-1]
            final.update({k: last_rec[k] for k in ("test", "fedavg_test", "own_test", "validation", "chosen")
                          if k in last_rec})
        final["train_metrics_clientapp"] = {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()}
        final["evaluate_metrics_clientapp"] = {str(r): dict(m) for r, m in result.evaluate_metrics_clientapp.items()}
        final["aggregation_metrics_serverapp"] = {str(r): dict(m) for r, m in
                                                  getattr(result, "aggregation_metrics_serverapp", {}).items()}
        if checkpoints and len(result.arrays) > 0:
            model = {k: np.asarray(v.numpy()) for k, v in result.arrays.items()}
            final["checkpoint"] = str(save_checkpoint(model, self.run_dir / "checkpoints" / "final.pt"))
        self.finish(final)
        return result
