"""FedFiOT for Flower: Fisher-weighted optimal-transport model merging.

Server: ``from fedfiot_flwr import FedFiOT`` (Message API, a drop-in for Flower's ``FedAvg``) or
``FedFiOTLegacy`` (``flwr.server.strategy``). Client: ``from fedfiot_flwr import fisher_reply``
after your own training loop. Names are imported lazily so that ``import fedfiot_flwr.merge``
stays free of Flower and torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedfiot_flwr.lazy import lazy_getattr

__version__ = "0.1.0"

__all__ = [
    "FedFiOT",
    "FedFiOTConfig",
    "FedFiOTLegacy",
    "FedFisherStrategy",
    "RefineOptions",
    "RegMeanStrategy",
    "SweepGrid",
    "__version__",
    "fisher_reply",
    "make_validate_fn",
]

if TYPE_CHECKING:
    from .client import fisher_reply
    from .refine import RefineOptions
    from .server import FedFiOT, FedFiOTConfig, FedFiOTLegacy, FedFisherStrategy, RegMeanStrategy, SweepGrid
    from .validation import make_validate_fn

_LAZY = {
    "FedFiOT": ".server",
    "FedFiOTConfig": ".server",
    "FedFiOTLegacy": ".server",
    "FedFisherStrategy": ".server",
    "RegMeanStrategy": ".server",
    "SweepGrid": ".server",
    "RefineOptions": ".refine",
    "fisher_reply": ".client",
    "make_validate_fn": ".validation",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
