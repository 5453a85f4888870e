"""One-off measurements that answered a question about FedFiOT once; not part of the package.

Each script imports :mod:`fedfiot_flwr` and :mod:`benchmarks.harness` and writes its pages to
``research/results/``; ``research/README.md`` indexes the questions and their answers. Nothing in
``fedfiot_flwr/``, ``benchmarks/`` or the apps imports this folder, and the wheel does not ship it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where the research scripts write their pages by default."""


def writing_here(
    extra_args: Callable[[argparse.ArgumentParser], None] | None = None,
) -> Callable[[argparse.ArgumentParser], None]:
    """``extra_args`` for :func:`benchmarks.harness.run_cell_analysis` that also sends ``--out`` to :data:`RESULTS_DIR`."""

    def add(parser: argparse.ArgumentParser) -> None:
        parser.set_defaults(out=RESULTS_DIR)
        if extra_args is not None:
            extra_args(parser)

    return add
