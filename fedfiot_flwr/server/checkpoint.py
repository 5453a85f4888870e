"""Round checkpoints a run can resume from: the global model plus what the run carries between rounds.

A round's checkpoint is two files in the run's ``checkpoints/`` directory:

- ``round-NNN.pt``: the global model after round ``NNN``, a plain torch ``state_dict`` file
  (``model.load_state_dict(torch.load(path))``);
- ``round-NNN.state.json``: the resume state, written after the model file (both atomically, so
  a run killed at any moment leaves no half-written file): the format name and version, the round,
  the SHA-256, names, dtypes and shapes of the model file, the run's configuration, and what the
  strategy and the results file carry from round to round.

A round whose state file exists is complete. :func:`load_resume_point` finds the last one and
checks it (the state file is whole and of a format version this package reads, the model file is
the one the state names, byte for byte); :meth:`ResumePoint.check_fits` checks that it was written
by the same model and configuration. Every failure is a :class:`CheckpointError` naming the file
and what is wrong: a bad checkpoint never turns into a silent fresh start.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "CheckpointError", "ResumePoint", "load_resume_point", "save_checkpoint",
           "write_round_checkpoint"]

FORMAT_NAME = "fedfiot-flwr round checkpoint"
FORMAT_VERSION = 1
"""Version of the resume state this package writes and the newest it reads."""

FILE_MODE = 0o644
_STATE = re.compile(r"round-(\d+)\.state\.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and what is wrong."""


def _atomic_target(target: Path) -> tuple[int, str]:
    target.parent.mkdir(parents=True, exist_ok=True)
    return tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")


def save_checkpoint(model: Mapping[str, np.ndarray], path: str | os.PathLike[str]) -> Path:
    """Save a numpy state dict as a torch ``state_dict`` file (``model.load_state_dict(torch.load(path))``).

    Written to a temporary file first and renamed, so ``path`` is never half written; mode 0644.
    """
    import torch  # only needed when checkpointing

    target = Path(path)
    fd, tmp = _atomic_target(target)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save({k: torch.from_numpy(np.array(v, copy=True)) for k, v in model.items()}, fh)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _write_json(data: Mapping[str, Any], target: Path) -> None:
    fd, tmp = _atomic_target(target)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, allow_nan=False)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _tensors(model: Mapping[str, np.ndarray]) -> dict[str, list[Any]]:
    """``name -> [dtype, shape]`` of a state dict, in its order."""
    return {k: [str(np.asarray(v).dtype), list(np.shape(v))] for k, v in model.items()}


def write_round_checkpoint(
    directory: str | os.PathLike[str], server_round: int, model: Mapping[str, np.ndarray], state: Mapping[str, Any],
) -> tuple[Path, Path]:
    """Write round ``server_round``'s model file, then its state file; return both paths.

    Parameters
    ----------
    directory : path
        The run's ``checkpoints/`` directory.
    server_round : int
        The round just completed.
    model : mapping of str to np.ndarray
        The global model after the round.
    state : mapping
        JSON-ready: the run's ``config``, its ``rounds`` records, ``initial_test`` and the
        strategy's carried ``strategy`` state (:meth:`fedfiot_flwr.MergeStrategy.carried_state`).
    """
    root = Path(directory)
    model_path = save_checkpoint(model, root / f"round-{server_round:03d}.pt")
    state_path = root / f"round-{server_round:03d}.state.json"
    _write_json({"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "round": int(server_round),
                 "model_file": model_path.name, "model_sha256": _sha256(model_path), "model_tensors": _tensors(model),
                 **state}, state_path)
    return model_path, state_path


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b": leaf}``."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


@dataclass(frozen=True)
class ResumePoint:
    """The last complete round of a run, checked, ready to go on from.

    Attributes
    ----------
    run_dir : Path
        The run directory it belongs to (a resumed run only holds its lock, ``run.lock``, meanwhile).
    state_path, model_path : Path
        The round's state and model files.
    round : int
        The last complete round.
    model : dict[str, np.ndarray]
        The global model after that round, in the state dict's order.
    state : dict
        The rest of the state file (``config``, ``rounds``, ``initial_test``, ``strategy``).
    """

    run_dir: Path
    state_path: Path
    model_path: Path
    round: int
    model: dict[str, np.ndarray]
    state: dict[str, Any]

    def check_fits(self, config: Mapping[str, Any], model: Mapping[str, np.ndarray], ignore: Iterable[str] = ()) -> None:
        """Refuse a checkpoint written by another model or another configuration.

        Parameters
        ----------
        config : mapping
            The new run's configuration, shaped like the one the checkpoint recorded.
        model : mapping of str to np.ndarray
            The new run's initial model (names, dtypes and shapes are compared).
        ignore : iterable of str
            Dotted keys of ``config`` that may differ (``"app.results-dir"``, ``"num_rounds"``).

        Raises
        ------
        CheckpointError
            Naming the state file and every tensor or setting that differs.
        """
        saved, now = _tensors(self.model), _tensors(model)
        if saved != now:
            diffs = [f"{k}: {saved.get(k, 'missing')} in the checkpoint, {now.get(k, 'missing')} now"
                     for k in dict.fromkeys([*saved, *now]) if saved.get(k) != now.get(k)]
            raise CheckpointError(f"{self.state_path}: written for another model ({len(diffs)} tensors differ: "
                                  f"{'; '.join(diffs[:5])}{'; ...' if len(diffs) > 5 else ''})")
        skip = set(ignore)
        old, new = _flat(self.state.get("config", {})), _flat(json.loads(json.dumps(dict(config))))
        diffs = [f"{k}={old.get(k, '<unset>')!r} in the checkpoint, {new.get(k, '<unset>')!r} now"
                 for k in sorted(set(old) | set(new)) if k not in skip and old.get(k) != new.get(k)]
        if diffs:
            raise CheckpointError(f"{self.state_path}: written with another configuration ({'; '.join(diffs)}); "
                                  "resume with the run's own settings")


def _state_files(directory: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in directory.glob("round-*.state.json") if (m := _STATE.fullmatch(p.name)))


def complete_rounds(run_dir: str | os.PathLike[str]) -> list[int]:
    """The rounds of ``run_dir`` that left a resume state (``checkpoints/round-NNN.state.json``), in order;
    the files are not read (:func:`load_resume_point` checks them)."""
    return [r for r, _ in _state_files(Path(run_dir) / "checkpoints")]


def _locate(source: Path) -> tuple[Path, Path]:
    """``(run directory, state file)`` of ``source``: a run directory (its last complete round), its
    ``checkpoints/`` directory, or one round's ``round-NNN.state.json`` or ``round-NNN.pt``."""
    if source.is_file():
        state = source.with_name(source.name.removesuffix(".pt") + ".state.json") if source.suffix == ".pt" else source
        if not _STATE.fullmatch(state.name):
            raise CheckpointError(f"{source}: not a round checkpoint (round-NNN.pt or round-NNN.state.json)")
        if not state.is_file():
            raise CheckpointError(f"{state}: missing; {source.name} has no resume state (the round did not "
                                  "complete, or the run was written before resume support)")
        return run_dir_of(state), state
    if not source.is_dir():
        raise CheckpointError(f"{source}: no such run directory")
    checkpoints = source if source.name == "checkpoints" else source / "checkpoints"
    found = _state_files(checkpoints) if checkpoints.is_dir() else []
    if not found:
        models = sorted(checkpoints.glob("round-*.pt")) if checkpoints.is_dir() else []
        why = (f"has model checkpoints ({', '.join(p.name for p in models[:3])}) but no round-NNN.state.json "
               "(written before resume support, or not one complete round)" if models else "has no round checkpoint")
        raise CheckpointError(f"{checkpoints}: {why}; nothing to resume from")
    return run_dir_of(checkpoints), found[-1][1]


def run_dir_of(source: str | os.PathLike[str]) -> Path:
    """The run directory a resume source names, without reading it (see :func:`load_resume_point`).

    >>> run_dir_of("/runs/a/checkpoints/round-002.pt").as_posix(), run_dir_of("/runs/a/checkpoints").as_posix()
    ('/runs/a', '/runs/a')
    """
    path = Path(source).expanduser().resolve()
    if path.suffix in (".pt", ".json"):  # one round's files, in <run dir>/checkpoints/
        return path.parent.parent
    return path.parent if path.name == "checkpoints" else path


def _read_state(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable resume state, truncated or corrupted ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise CheckpointError(f"{path}: not a {FORMAT_NAME} (format {data.get('format') if isinstance(data, dict) else None!r})")
    version = data.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{path}: format_version {version!r} is not a version number (corrupted)")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: format version {version} is newer than this fedfiot-flwr reads (up to "
                              f"{FORMAT_VERSION}); resume it with the version that wrote it, or a newer one")
    missing = [k for k in ("round", "model_file", "model_sha256", "model_tensors", "config", "rounds", "strategy")
               if k not in data]
    if missing:
        raise CheckpointError(f"{path}: incomplete resume state, missing {missing} (corrupted)")
    return data


def _read_model(path: Path, data: Mapping[str, Any], state_path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (named by {state_path.name})")
    if _sha256(path) != data["model_sha256"]:
        raise CheckpointError(f"{path}: its SHA-256 differs from the one {state_path.name} recorded "
                              f"({path.stat().st_size} bytes): truncated, corrupted or replaced")
    import torch  # only needed when resuming

    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True)
        model = {str(k): v.numpy() for k, v in tensors.items()}
    except Exception as exc:  # torch raises many kinds for a bad file
        raise CheckpointError(f"{path}: not a readable torch state_dict ({type(exc).__name__}: {exc})") from exc
    if _tensors(model) != data["model_tensors"]:
        raise CheckpointError(f"{path}: its tensors differ from the names, dtypes and shapes {state_path.name} recorded")
    return model


def load_resume_point(source: str | os.PathLike[str]) -> ResumePoint:
    """The last complete round of the run at ``source``, checked file by file.

    Parameters
    ----------
    source : path
        A run directory (its last complete round), its ``checkpoints/`` directory, or one round's
        ``round-NNN.state.json`` / ``round-NNN.pt`` (that round).

    Raises
    ------
    CheckpointError
        Naming the file: no complete round, a state file that is not whole JSON of this format,
        a format version newer than :data:`FORMAT_VERSION`, a model file missing, truncated,
        corrupted or not the one the state recorded.
    """
    run_dir, state_path = _locate(Path(source).expanduser().resolve())
    data = _read_state(state_path)
    model = _read_model(state_path.parent / str(data["model_file"]), data, state_path)
    rest = {k: v for k, v in data.items() if k not in ("format", "format_version", "round", "model_file",
                                                        "model_sha256", "model_tensors")}
    return ResumePoint(run_dir, state_path, state_path.parent / str(data["model_file"]), int(data["round"]), model,
                       rest)
