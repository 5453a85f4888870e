"""Optional dependencies: imported where they are needed, with one clear error when missing.

The core install (numpy, scipy, torch, flwr) covers the strategies and :func:`fedfiot_flwr.fisher_reply`.
Everything else comes with an extra of ``fedfiot-flwr`` (``pyproject.toml``; see
``docs/install.md``), and every module that needs one imports it through :func:`require`.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["DISTRIBUTION", "require"]

DISTRIBUTION = "fedfiot-flwr"
"""This package's name on pip's command line (the extras hang off it)."""


def require(module: str, distribution: str, extra: str, purpose: str) -> ModuleType:
    """Import an optional dependency, or raise an ImportError naming the extra that installs it.

    Parameters
    ----------
    module : str
        Importable name, e.g. ``"curvlinops"`` or ``"matplotlib.figure"``.
    distribution : str
        The distribution pip installs it from, e.g. ``"curvlinops-for-pytorch"``.
    extra : str
        The extra of ``fedfiot-flwr`` that pulls in ``distribution``, e.g. ``"baselines"``.
    purpose : str
        What needs it, as a noun phrase, e.g. ``"RegMean's client Grams"``.

    Returns
    -------
    ModuleType
        The imported module.

    Raises
    ------
    ImportError
        If ``module`` cannot be imported (missing, or installed but broken). The message names
        ``distribution`` and the ``pip install`` of ``extra``; the original error is chained.

    Examples
    --------
    >>> require("math", "python", "core", "square roots").sqrt(4.0)
    2.0
    >>> require("no_such_module", "no-such-dist", "extra-x", "the example")
    Traceback (most recent call last):
    ...
    ImportError: the optional dependency 'no-such-dist' is needed for the example: pip install 'fedfiot-flwr[extra-x]' (import no_such_module failed: No module named 'no_such_module')
    """
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(
            f"the optional dependency {distribution!r} is needed for {purpose}: "
            f"pip install '{DISTRIBUTION}[{extra}]' (import {module} failed: {err})",
            name=module,
        ) from err
