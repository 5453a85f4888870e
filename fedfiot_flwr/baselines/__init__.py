"""One-shot aggregation baselines of the FedFiOT paper: FedFisher (diagonal, K-FAC) and RegMean.

Server-side merges on NumPy state dicts; they import neither Flower nor client code, and the
package loads torch (FedFisher's optimiser) only when a FedFisher name is first used. The
uploads are packed and read by :mod:`fedfiot_flwr.wire`, computed on the client by
:mod:`fedfiot_flwr.curvature`; the Flower strategies are :class:`fedfiot_flwr.FedFisherStrategy`
and :class:`fedfiot_flwr.RegMeanStrategy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedfiot_flwr.lazy import lazy_getattr
from fedfiot_flwr.baselines.averaging import check_clients, client_weights, size_weighted_average
from fedfiot_flwr.baselines.fedfisher_options import FedFisherOptions

if TYPE_CHECKING:
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
    "FedFisherOptions",
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


_LAZY = {
    "FedFisherResult": "fedfisher",
    "fedfisher_diag": "fedfisher",
    "fedfisher_kfac": "fedfisher",
    "kfac_quadratic": "fedfisher",
    "REGMEAN_ALPHAS": "regmean",
    "RegMeanResult": "regmean",
    "regmean_merge": "regmean",
    "regmean_select": "regmean",
    "scale_off_diagonal": "regmean",
}


__getattr__ = lazy_getattr(__name__, _LAZY)
