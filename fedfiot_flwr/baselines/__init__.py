"""One-shot aggregation baselines of the FedFiOT paper: FedFisher (diagonal, K-FAC) and RegMean.

Server-side merges on NumPy state dicts; they import neither Flower nor client code. The
uploads are packed and read by :mod:`fedfiot_flwr.wire`, computed on the client by
:mod:`fedfiot_flwr.curvature`; the Flower strategies are :class:`fedfiot_flwr.FedFisherStrategy`
and :class:`fedfiot_flwr.RegMeanStrategy`.
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

