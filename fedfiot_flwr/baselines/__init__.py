"""One-shot aggregation baselines of the FedFiOT paper: FedFisher (diagonal, K-FAC) and RegMean.

Server-side merges work on NumPy state dicts and import neither Flower nor the client code;
:mod:`fedfiot_flwr.baselines.wire` (which imports Flower) packs and unpacks the client
uploads. The client-side curvature (K-FAC factors, input Grams, their compression) is in
:mod:`fedfiot_flwr.curvature`. The Flower strategies (:class:`FedFisherStrategy`,
:class:`RegMeanStrategy`, in :mod:`fedfiot_flwr.baselines.strategies`) are imported lazily, so
that importing the merges stays free of Flower.
"""

from typing import TYPE_CHECKING, Any

from fedfiot_flwr.baselines.averaging import check_clients, client_weights, size_weighted_average
from fedfiot_flwr.baselines.fedfisher import FedFisherResult, fedfisher_diag, fedfisher_kfac, kfac_quadratic
from fedfiot_flwr.baselines.regmean import (
    REGMEAN_ALPHAS,
    RegMeanResult,
    regmean_merge,
    regmean_select,
    scale_off_diagonal,
)

if TYPE_CHECKING:
    from fedfiot_flwr.baselines.strategies import FedFisherStrategy, OneShotBaselineStrategy, RegMeanStrategy, pack_upload

_LAZY = {"FedFisherStrategy", "OneShotBaselineStrategy", "RegMeanStrategy", "pack_upload"}

__all__ = [
    "REGMEAN_ALPHAS",
    "FedFisherResult",
    "FedFisherStrategy",
    "OneShotBaselineStrategy",
    "RegMeanStrategy",
    "RegMeanResult",
    "check_clients",
    "client_weights",
    "fedfisher_diag",
    "fedfisher_kfac",
    "kfac_quadratic",
    "pack_upload",
    "regmean_merge",
    "regmean_select",
    "scale_off_diagonal",
    "size_weighted_average",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from fedfiot_flwr.baselines import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
