"""One rule for a package's names that load on first use (so importing it stays light)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``table[name]`` (relative to ``package``) on first use.

    Parameters
    ----------
    package : str
        The package's ``__name__``.
    table : mapping
        Public name -> submodule, relative (``"stage"`` or ``".server"``).

    Examples
    --------
    >>> getattr_ = lazy_getattr("fedfiot_flwr.refine", {"split_folds": "stage"})
    >>> getattr_("split_folds").__name__
    'split_folds'
    """

    def __getattr__(name: str) -> Any:
        if name in table:
            module = table[name]
            target = f"{package}{module}" if module.startswith(".") else f"{package}.{module}"
            return getattr(importlib.import_module(target), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
