"""Opt-in recording of a run: a results JSON and model checkpoints in a directory of its own.

The strategies keep their per-round reports in memory (``strategy.reports``) and Flower's
``Result`` carries the metrics; :class:`RunRecorder` is what a ServerApp uses to put them on
disk. Every run gets a new directory (an existing one is never reused: ``name``, ``name-2``,
...); files are written atomically with mode 0644::

    recorder = RunRecorder.create("results", "my-run", config={"lr": 0.01})
    result = recorder.run(strategy, grid=grid, initial_arrays=arrays, num_rounds=1, evaluate_fn=test_fn)
    # recorder.path -> results/my-run/results.json; recorder.run_dir / "checkpoints" / "final.pt"

A run directory has one writer: the recorder holds its lock (:mod:`fedfiot_flwr.server.run_lock`)
from :meth:`RunRecorder.create` to :meth:`RunRecorder.finish`. Every round leaves a checkpoint a
later run can resume from (:mod:`fedfiot_flwr.server.checkpoint`); a run that stopped goes on in a
new directory, and holds the earlier one's lock meanwhile, so that a run goes on in one place at a
time::

    recorder = RunRecorder.create("results", "my-run-resumed", config={"lr": 0.01}, resume_from="results/my-run")
    result = recorder.run(strategy, grid=grid, initial_arrays=arrays, num_rounds=4, evaluate_fn=test_fn)
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result

from fedfiot_flwr.server.checkpoint import (
    FILE_MODE,
    CheckpointError,
    ResumePoint,
    load_resume_point,
    run_dir_of,
    save_checkpoint,
    write_round_checkpoint,
)
from fedfiot_flwr.server.rounds import jsonable
from fedfiot_flwr.server.run_lock import RunDirectoryHeld, RunLock
from fedfiot_flwr.server.shell import MergeStrategy, arrays_to_numpy, numpy_to_arrays
from fedfiot_flwr.server.stop_request import (STOP_NOTICE_S, RunStopped, stop_requested_within,
                                              watch_stop_signals)

__all__ = ["RunDirectoryHeld", "RunRecorder", "save_checkpoint", "unique_run_dir"]

#: Recorded settings a resumed run may change: how many rounds the run has in all.
RESUMABLE_CHANGES = ("num_rounds",)


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


def _scalars(metrics: Mapping[str, Any] | None) -> dict[str, Any] | None:
    return None if metrics is None else jsonable(dict(metrics))


def _stopped_during(strategy: MergeStrategy, server_round: int) -> bool:
    """Whether the process was asked to stop during round ``server_round``. A round that lost replies waits up to
    :data:`STOP_NOTICE_S` for the request: the shutdown that took those clients may be heard after them."""
    return stop_requested_within(STOP_NOTICE_S if strategy.lost_replies.get(server_round) else 0.0)


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

    Attributes
    ----------
    resume : ResumePoint or None
        The checkpoint this run goes on from (:meth:`create` with ``resume_from``).
    """

    def __init__(self, run_dir: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "results.json"
        self.data: dict[str, Any] = {
            "status": "running", "error": None, "config": jsonable(dict(config or {})),
            "rounds": [], "final": {}, "started": time.time(), "updated": time.time(),
        }
        self.resume: ResumePoint | None = None
        self._may_differ: tuple[str, ...] = RESUMABLE_CHANGES
        self._locks: list[RunLock] = []

    def _hold(self, directory: str | os.PathLike[str], purpose: str) -> None:
        """Hold ``directory``'s lock unless this recorder already does (RunDirectoryHeld when a live run does)."""
        if Path(directory).resolve() not in {lock.run_dir for lock in self._locks if lock.held}:
            self._locks.append(RunLock.acquire(directory, purpose))

    def release(self) -> None:
        """Let go of every lock this recorder holds (:meth:`finish` does)."""
        for lock in self._locks:
            lock.release()
        self._locks.clear()

    @classmethod
    def create(
        cls,
        results_dir: str | os.PathLike[str],
        name: str,
        config: Mapping[str, Any] | None = None,
        resume_from: str | os.PathLike[str] | None = None,
        may_differ: Iterable[str] = (),
    ) -> RunRecorder:
        """A recorder in a new directory ``results_dir/name[-N]``.

        Parameters
        ----------
        results_dir, name : str
            Where the run directory goes.
        config : mapping, optional
            The run configuration.
        resume_from : path, optional
            Go on from the last complete round of this run directory (or from one round's
            checkpoint file, see :func:`~fedfiot_flwr.server.checkpoint.load_resume_point`). The
            new directory records it (``"resumed_from"``); of the earlier one the recorder only holds
            the lock (``run.lock``) until :meth:`finish`, and writes nothing else.
        may_differ : iterable of str
            Dotted keys of ``config`` a resumed run may change (``"app.results-dir"``); every
            other setting must equal the checkpoint's (the total ``num_rounds`` may grow).

        Raises
        ------
        CheckpointError
            When ``resume_from`` holds no checkpoint this package can resume from (naming the file
            and what is wrong); the new directory's ``results.json`` is marked failed with it.
        RunDirectoryHeld
            When a live run holds ``resume_from``'s run directory (it names that run's process),
            recorded the same way.
        """
        recorder = cls(unique_run_dir(results_dir, name), config)
        recorder._hold(recorder.run_dir, "writes")
        if resume_from is None:
            return recorder
        recorder._may_differ = (*RESUMABLE_CHANGES, *may_differ)
        recorder.data["resumed_from"] = {"path": str(Path(resume_from).expanduser().resolve())}
        purpose = f"resumes into {recorder.run_dir} from"
        try:
            if (source := run_dir_of(resume_from)).is_dir():
                recorder._hold(source, purpose)  # before reading it: a live run may be writing it
            recorder.resume = load_resume_point(resume_from)
            recorder._hold(recorder.resume.run_dir, purpose)
        except (CheckpointError, RunDirectoryHeld) as exc:
            recorder.finish(error=f"cannot resume: {exc}")
            raise
        recorder.data["resumed_from"].update({"run_dir": str(recorder.resume.run_dir), "round": recorder.resume.round,
                                              "checkpoint": str(recorder.resume.state_path)})
        recorder.write()
        return recorder

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
        """Mark the run finished (or failed, with ``error``), write the file, release the locks."""
        self.data["final"].update(jsonable(dict(final or {})))
        self.data["status"] = "failed" if error else "finished"
        self.data["error"] = error
        self.write()
        self.release()

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

    def _go_on(self, strategy: MergeStrategy, initial_arrays: ArrayRecord, num_rounds: int) -> ArrayRecord:
        """Check the resume point against this run, restore the strategy, carry the earlier rounds over;
        return the global model to start from.

        Raises
        ------
        CheckpointError
            Another model or configuration, or no round left to run (the file is named).
        """
        point = self.resume
        assert point is not None
        point.check_fits(self.data["config"], arrays_to_numpy(initial_arrays), ignore=self._may_differ)
        if num_rounds <= point.round:
            raise CheckpointError(f"{point.state_path}: round {point.round} is already complete and the run has "
                                  f"num_rounds = {num_rounds}; nothing left to run (raise the number of rounds to "
                                  "go on training)")
        try:
            strategy.restore(point.state["strategy"], point.round)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"{point.state_path}: unusable strategy state ({type(exc).__name__}: {exc})") from exc
        self.data["rounds"] = [dict(rec, carried_over=True) for rec in point.state["rounds"]]
        if "initial_test" in point.state:
            self.data["initial_test"] = point.state["initial_test"]
        self.write()
        return numpy_to_arrays(point.model, list(initial_arrays.keys()))

    def _checkpoint(self, strategy: MergeStrategy, server_round: int, arrays: ArrayRecord,
                    res: MetricRecord | None) -> None:
        """Write round ``server_round``'s model and resume state (its record already holds the round's results)."""
        carried = strategy.carried_state()
        if res is not None:  # Flower adds this round's evaluation to its history after evaluate_fn returns
            carried["history"]["evaluate_metrics_serverapp"][str(server_round)] = dict(res)
        state = {"config": self.data["config"], "rounds": self.data["rounds"],
                 "initial_test": self.data.get("initial_test"), "strategy": jsonable(carried)}
        write_round_checkpoint(self.run_dir / "checkpoints", server_round, arrays_to_numpy(arrays), state)

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
        global model of every round and the final one are saved under ``run_dir/checkpoints``, each
        round's with the state a resumed run needs (``round-NNN.state.json``).

        A recorder created with ``resume_from`` first checks the checkpoint against this run's
        model (``initial_arrays``: names, dtypes, shapes) and configuration, restores the strategy
        (:meth:`~fedfiot_flwr.MergeStrategy.restore`), carries the earlier rounds' records over
        (marked ``"carried_over"``), and starts at the next round from the checkpoint's model; a
        checkpoint that does not fit raises :class:`~fedfiot_flwr.server.checkpoint.CheckpointError`
        before any client is asked to train. A run directory that another live run holds raises
        :class:`~fedfiot_flwr.server.run_lock.RunDirectoryHeld` before that too. A failing run is
        recorded as failed with the error, then the error is raised. A round during which the process
        was asked to stop (:mod:`fedfiot_flwr.server.stop_request`) may have lost replies to the
        shutdown: it is neither tested nor checkpointed (a round that lost replies first waits up to
        :data:`~fedfiot_flwr.server.stop_request.STOP_NOTICE_S` seconds for such a request) (its merge report stays in the results), and
        the run ends with :class:`~fedfiot_flwr.server.stop_request.RunStopped`.
        """
        watch_stop_signals()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._hold(self.run_dir, "writes")  # a recorder built on a directory directly: not another live run's
        self.data["config"].update(jsonable({"num_rounds": num_rounds, "strategy": type(strategy).__name__,
                                             "aggregator": strategy.aggregator.config()}))
        self.write()
        if self.resume is not None:
            try:
                initial_arrays = self._go_on(strategy, initial_arrays, num_rounds)
            except CheckpointError as exc:
                self.finish(error=f"cannot resume: {exc}")
                raise

        def recorded_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            # A round during a stop may have lost replies to the shutdown: it is not a complete round.
            if server_round > 0 and _stopped_during(strategy, server_round):
                raise RunStopped(f"the run was asked to stop (a signal) during round {server_round}: round "
                                 f"{server_round} is neither tested nor checkpointed; the last complete round is "
                                 f"{server_round - 1}")
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
                values["checkpoint"] = str(self.run_dir / "checkpoints" / f"round-{server_round:03d}.pt")
            # results.json first: once a round's state file (the mark of a complete round) exists, the
            # results file already holds the round too.
            self.update_round(server_round, values)
            if checkpoints:
                self._checkpoint(strategy, server_round, arrays, res)
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
        if self.resume is not None:
            final["resumed_after_round"] = self.resume.round
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
