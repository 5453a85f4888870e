"""Named baselines as configurations of the merge engine.

``"fedavg"`` is the engine without alignment, weighted by client size: the same model as
:func:`fedfiot_flwr.baselines.size_weighted_average` up to float rounding (integer buffers
follow one rule, :func:`fedfiot_flwr.merge.dtypes.cast_average`). The strategies' FedAvg, and
the FedAvg baseline and candidate of FedFiOT's selection, are that function.
"""

from __future__ import annotations

from typing import Any

from .options import MergeOptions

METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {"matching": "none", "aggregation": "size"},
    "fisher-merge": {"matching": "none", "aggregation": "fisher"},
    "otfusion": {"matching": "euclidean", "aggregation": "uniform", "max_iters": 1, "fallback": "none"},
    "wb-fusion": {"matching": "euclidean", "aggregation": "uniform", "fallback": "none"},
    "ablation-b": {"matching": "none", "aggregation": "fisher"},
    "ablation-c": {"matching": "euclidean", "aggregation": "fisher"},
    "ablation-d": {"matching": "fisher", "aggregation": "uniform"},
    "fedfiot": {"matching": "fisher", "aggregation": "fisher"},
}


def method_options(method: str, **overrides: Any) -> MergeOptions:
    """The :class:`~fedfiot_flwr.merge.options.MergeOptions` of a named method (``overrides``:
    other fields, e.g. ``lam``), for :func:`~fedfiot_flwr.merge.merge`.

    >>> opts = method_options("fedavg", lam=1e-3)
    >>> opts.matching, opts.aggregation, opts.lam
    ('none', 'size', 0.001)
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {sorted(METHODS)}")
    return MergeOptions(**{**METHODS[method], **overrides})
