"""FedFiOT for Flower: Fisher-weighted optimal-transport model merging.

``from fedfiot_flwr import FedFiOT`` (Message API, ``flwr.serverapp.strategy``) or
``from fedfiot_flwr import FedFiOTLegacy`` (``flwr.server.strategy``). Both are imported lazily so
that ``import fedfiot_flwr.merge`` stays free of Flower and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["FedFiOT", "FedFiOTLegacy", "SweepGrid", "__version__"]

if TYPE_CHECKING:
    from .legacy import FedFiOTLegacy
    from .selection import SweepGrid
    from .strategy import FedFiOT

_LAZY = {"FedFiOT": ".strategy", "FedFiOTLegacy": ".legacy", "SweepGrid": ".selection"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
