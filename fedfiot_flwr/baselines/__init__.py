"""One-shot aggregation baselines of the FedFiOT paper: FedFisher (diagonal, K-FAC) and RegMean.

Server-side merges work on NumPy state dicts and import neither Flower nor the client code;
:mod:`fedfiot_flwr.baselines.wire` (which imports Flower) packs and unpacks the client
uploads. The client-side curvature (K-FAC factors, input Grams, their compression) is in
:mod:`fedfiot_flwr.curvature`.
"""

from fedfiot_flwr.baselines.averaging import check_clients, client_weights, size_weighted_average
from fedfiot_flwr.baselines.fedfisher import FedFisherResult, fedfisher_diag, fedfisher_kfac, kfac_quadratic
from fedfiot_flwr.baselines.regmean import (
    REGMEAN_ALPHAS,
    RegMeanResult,
    regmean_merge,
    regmean_select,
    scale_off_diagonal,
)

__all__ = [
    "REGMEAN_ALPHAS",
    "FedFisherResult",
    "RegMeanResult",
    "check_clients",
    "client_weights",
    "fedfisher_diag",
    "fedfisher_kfac",
    "kfac_quadratic",
    "regmean_merge",
    "regmean_select",
    "scale_off_diagonal",
    "size_weighted_average",
]
