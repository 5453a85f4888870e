"""Per-round metrics of a FedFiOT run: the JSON results file and the model checkpoints."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .selection import MergeOutcome
from .strategy_utils import CollectedUploads


def _jsonable(value: Any) -> Any:
    """Convert numpy scalars/arrays and non-finite floats into JSON-safe values."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else None
    return value


def round_record(server_round: int, uploads: CollectedUploads, outcome: MergeOutcome, matching: str) -> dict[str, Any]:
    """Everything worth keeping about one merge round, as a JSON-ready dict.

    Parameters
    ----------
    server_round : int
        Round number (1-based).
    uploads : CollectedUploads
        The round's valid uploads and rejections.
    outcome : MergeOutcome
        What :func:`fedfiot_flwr.selection.merge_round` returned.
    matching : str
        The merge's matching mode (the fallback only exists when matching is not "none").

    Returns
    -------
    dict
        Keys: ``round``, ``clients``, ``num_examples``, ``rejected``, ``bytes_received``,
        ``bytes_per_client``, ``chosen`` (rho, lam, reference, fisher_scaling, variant),
        ``objective_aligned``, ``objective_identity``, ``fallback_taken``, ``inner_iterations``
        (per permutation), ``fraction_permuted`` (per client), ``merge_seconds``,
        ``selection_seconds``, ``num_trials``, ``trials``, ``validation``, ``fedavg_validation``,
        ``fedavg_won`` (FedAvg was a candidate and scored best), ``own_variant`` and
        ``own_validation`` (FedFiOT's own best merge, reported next to a FedAvg win).
    """
    res = outcome.result
    return _jsonable(
        {
            "round": server_round,
            "clients": uploads.client_ids,
            "num_examples": uploads.num_examples,
            "rejected": [{"client": r.client, "reason": r.reason} for r in uploads.rejections],
            "bytes_received": uploads.bytes_received,
            "bytes_per_client": uploads.bytes_per_client,
            "chosen": {
                "rho": outcome.candidate.rho,
                "lam": outcome.candidate.lam,
                "reference": outcome.candidate.reference,
                "fisher_scaling": outcome.candidate.fisher_scaling,
                "variant": outcome.variant,
            },
            "objective_aligned": res.aligned_objective,
            "objective_identity": res.identity_objective,
            "fallback_taken": matching != "none" and outcome.variant in ("identity", "fedavg"),
            "fedavg_won": outcome.variant == "fedavg",
            "own_variant": outcome.own_variant,
            "own_validation": outcome.own_validation,
            "inner_iterations": {p: r.iterations for p, r in res.reports.items()},
            "fraction_permuted": dict(zip(uploads.client_ids, res.fraction_permuted)),
            "merge_seconds": res.seconds,
            "selection_seconds": outcome.seconds,
            "num_trials": len(outcome.trials),
            "trials": outcome.trials,
            "validation": outcome.validation,
            "fedavg_validation": outcome.baseline_validation,
            "client_metrics": uploads.metrics,
        }
    )


class ResultsFile:
    """A JSON results file rewritten atomically after every change.

    Layout: ``{"status": "running" | "finished" | "failed", "error": str | None,
    "config": {...}, "rounds": [round records], "final": {...}, "started": t, "updated": t}``.

    Parameters
    ----------
    path : str or Path, optional
        Where to write; ``None`` keeps everything in memory only.
    config : mapping, optional
        The run configuration, stored under ``"config"``.
    """

    def __init__(self, path: str | os.PathLike[str] | None, config: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.data: dict[str, Any] = {
            "status": "running",
            "error": None,
            "config": _jsonable(dict(config or {})),
            "rounds": [],
            "final": {},
            "started": time.time(),
            "updated": time.time(),
        }

    def round(self, server_round: int) -> dict[str, Any]:
        """The record of ``server_round``, created empty if missing."""
        for rec in self.data["rounds"]:
            if rec.get("round") == server_round:
                return rec
        rec = {"round": server_round}
        self.data["rounds"].append(rec)
        return rec

    def update_round(self, server_round: int, values: Mapping[str, Any]) -> None:
        """Merge ``values`` into the record of ``server_round`` and write the file."""
        self.round(server_round).update(_jsonable(dict(values)))
        self.write()

    def set_config(self, values: Mapping[str, Any]) -> None:
        """Merge ``values`` into the stored configuration and write the file."""
        self.data["config"].update(_jsonable(dict(values)))
        self.write()

    def finish(self, final: Mapping[str, Any] | None = None, error: str | None = None) -> None:
        """Mark the run finished (or failed, with ``error``) and write the file."""
        self.data["final"].update(_jsonable(dict(final or {})))
        self.data["status"] = "failed" if error else "finished"
        self.data["error"] = error
        self.write()

    def write(self) -> None:
        """Write the file atomically (temp file + rename); no-op without a path."""
        self.data["updated"] = time.time()
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(self.data, fh, indent=2, allow_nan=False)
        os.replace(tmp, self.path)


def save_checkpoint(model: Mapping[str, np.ndarray], path: str | os.PathLike[str]) -> Path:
    """Save a numpy state dict as a torch ``state_dict`` file (loadable with ``model.load_state_dict``).

    Parameters
    ----------
    model : mapping of str to np.ndarray
        The global model.
    path : str or Path
        Target file (parents are created).

    Returns
    -------
    Path
        The written path.
    """
    import torch  # lazy: only needed when checkpointing

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    state = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in model.items()}
    torch.save(state, target)
    return target


def run_recorded(
    start: Callable[..., Any],
    results: ResultsFile,
    checkpoint_dir: str | os.PathLike[str] | None,
    final_keys: Iterable[str],
    num_rounds: int,
    **start_kwargs: Any,
) -> Any:
    """Run a strategy's ``start`` and finalise its results file.

    Marks the file "failed" with the error if ``start`` raises; otherwise copies ``final_keys`` of
    the last round into ``final``, writes ``final.pt`` to ``checkpoint_dir`` and marks it "finished".
    Shared by every strategy of this package so that their results files read the same.
    """
    t0 = time.perf_counter()
    try:
        result = start(num_rounds=num_rounds, **start_kwargs)
    except BaseException as exc:
        if results.data["status"] == "running":
            results.finish(error=f"{type(exc).__name__}: {exc}")
        raise
    final: dict[str, Any] = {"rounds": num_rounds, "seconds": time.perf_counter() - t0}
    if results.data["rounds"]:
        last = results.data["rounds"][-1]
        final.update({k: last[k] for k in final_keys if k in last})
    if checkpoint_dir is not None and len(result.arrays) > 0:
        model = {k: np.asarray(v.numpy()) for k, v in result.arrays.items()}
        final["checkpoint"] = str(save_checkpoint(model, Path(checkpoint_dir) / "final.pt"))
    results.finish(final)
    return result
