"""Paths and command lines as the results files record them: valid on any checkout, not just this machine.

A results page names the command that produced it. Paths inside the repository are written
relative to its root (``benchmarks/results``); paths outside it (a cache or scratch directory)
become placeholders such as ``<cache-dir>`` and ``<out-dir>``, so the recorded command still
reads as one to run: ``--cache-dir <cache-dir>``. Imports nothing beyond the standard library
(the merge benchmarks use it without torch).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository root: recorded paths are relative to it."""

PLACEHOLDERS = {
    "--cache-dir": "<cache-dir>",
    "--out": "<out-dir>",
    "--data-root": "<data-dir>",
    "--app": "<app-dir>",
    "--results-dir": "<results-dir>",
}
"""Placeholder of a path outside the repository, by the option that takes it (others: ``<path>``)."""

CONFIG_PLACEHOLDERS = {"cache_dir": "<cache-dir>", "out": "<out-dir>", "data_root": "<data-dir>", "app": "<app-dir>",
                       "results_dir": "<results-dir>"}
"""The same, by the ``argparse`` destination a results file's ``config`` records."""


def is_placeholder(text: str) -> bool:
    """Whether ``text`` is a placeholder such as ``<cache-dir>``."""
    return text.startswith("<") and text.endswith(">")


def portable_path(path: str | os.PathLike[str], placeholder: str = "<path>") -> str:
    """``path`` relative to the repository root when it lies inside it, else ``placeholder``.

    Relative paths are kept as given (they are read from the directory the command ran in,
    normally the repository root).
    """
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    try:
        rel = Path(text).resolve().relative_to(REPO_ROOT)
    except ValueError:
        return placeholder
    return rel.as_posix() or "."


def portable_args(args: Iterable[str]) -> list[str]:
    """Command-line arguments with every absolute path made portable (see :func:`portable_path`).

    The placeholder of a path outside the repository is chosen by the option before it
    (``--cache-dir PATH``) or around it (``--cache-dir=PATH``), see :data:`PLACEHOLDERS`.
    """
    out: list[str] = []
    previous = ""
    for arg in args:
        if arg.startswith("--") and "=" in arg:
            flag, value = arg.split("=", 1)
            if os.path.isabs(value):
                arg = f"{flag}={portable_path(value, PLACEHOLDERS.get(flag, '<path>'))}"
        elif os.path.isabs(arg):
            arg = portable_path(arg, PLACEHOLDERS.get(previous, "<path>"))
        out.append(arg)
        previous = arg if arg.startswith("--") else ""
    return out


def _quote(arg: str) -> str:
    flag, eq, value = arg.partition("=")
    if is_placeholder(arg) or (eq and flag.startswith("--") and is_placeholder(value) and shlex.quote(flag) == flag):
        return arg
    return shlex.quote(arg)


def command_line(argv: Sequence[str] | None = None, script: str | os.PathLike[str] | None = None,
                 interpreter: str = ".venv/bin/python") -> str:
    """The command that is running, as one shell line run from the repository root.

    ``argv`` (without the script) defaults to ``sys.argv[1:]`` and ``script`` to ``sys.argv[0]``;
    absolute paths are made portable (see :func:`portable_args`).
    """
    if argv is None:
        argv = sys.argv[1:]
    script = portable_path(os.path.abspath(script if script is not None else sys.argv[0]), "<script>")
    words = [interpreter, script, *portable_args(argv)] if interpreter else [script, *portable_args(argv)]
    return " ".join(_quote(w) for w in words)


def portable_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """An ``argparse`` namespace's ``vars`` for a results file: paths as strings, made portable."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, os.PathLike) or (key in CONFIG_PLACEHOLDERS and isinstance(value, str) and value):
            value = portable_path(value, CONFIG_PLACEHOLDERS.get(key, "<path>"))
        out[key] = value
    return out


__all__ = ["CONFIG_PLACEHOLDERS", "PLACEHOLDERS", "REPO_ROOT", "command_line", "is_placeholder", "portable_args",
           "portable_config", "portable_path"]
