"""The public strategies: thin configurations of :class:`~fedfiot_flwr.server.shell.MergeStrategy`.

- :class:`FedFiOT`: a drop-in replacement for Flower's ``FedAvg`` (same options, same defaults,
  same ``start``) that merges with FedFiOT;
- :class:`FedFisherStrategy` and :class:`RegMeanStrategy`: the paper's one-shot baselines.
"""

from __future__ import annotations

from collections.abc import Sequence
from logging import INFO
from typing import TYPE_CHECKING, Any

from flwr.supercore import log

from fedfiot_flwr.merge import PermutationSpec, spec_from_module
from fedfiot_flwr.server.aggregators import FedFiOTAggregator, FedFisherAggregator, RegMeanAggregator
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.shell import MergeStrategy, ValidateFn

if TYPE_CHECKING:
    import torch

__all__ = ["FedFiOT", "FedFisherStrategy", "RegMeanStrategy", "resolve_config"]


def resolve_config(config: FedFiOTConfig, has_validation: bool, label: str = "FedFiOT") -> FedFiOTConfig:
    """The configuration that will run; says once (at construction) what changes without validation data."""
    if has_validation:
        return config
    notice = config.describe_without_validation()
    if notice:
        log(INFO, "%s", notice)
    return config.without_validation()


class FedFiOT(MergeStrategy):
    """FedFiOT as a Flower strategy (Message API): ``FedAvg`` with a Fisher-weighted alignment merge.

    Swap ``FedAvg(...)`` for ``FedFiOT(model=Net(), ...)``; every ``FedAvg`` option keeps its name
    and default. Clients reply with :func:`fedfiot_flwr.client.fisher_reply`.

    Parameters
    ----------
    spec : PermutationSpec, optional
        Which axes of which tensors move together; derived from ``model`` when omitted.
    model : torch.nn.Module, optional
        The architecture (gives the spec and the buffer names).
    config : FedFiOTConfig, optional
        Merge options and selection; default :meth:`FedFiOTConfig.default`. Without
        ``validate_fn`` it runs as :meth:`FedFiOTConfig.without_validation` (said once at start).
    validate_fn : callable, optional
        ``model dict -> metrics`` on held-out server data (:func:`fedfiot_flwr.validation.make_validate_fn`).
    buffers : sequence of str, optional
        State-dict entries without a Fisher (default: ``model``'s non-parameters).
    min_valid_replies : int, optional
        Fewer valid replies fail the round with a clear error (default: ``min_train_nodes``).
    fedavg_baseline : bool
        Also compute FedAvg of the same uploads each round (reported next to FedFiOT's model).
    **fedavg_options
        Flower ``FedAvg``'s options, with its defaults (``fraction_train=1.0``,
        ``fraction_evaluate=1.0``, ``min_train_nodes=2``, ..., ``train_metrics_aggr_fn``,
        ``evaluate_metrics_aggr_fn``).
    """

    def __init__(
        self,
        spec: PermutationSpec | None = None,
        model: torch.nn.Module | None = None,
        *,
        config: FedFiOTConfig | None = None,
        validate_fn: ValidateFn | None = None,
        buffers: Sequence[str] | None = None,
        min_valid_replies: int | None = None,
        fedavg_baseline: bool = True,
        **fedavg_options: Any,
    ) -> None:
        if spec is None and model is not None:
            spec = spec_from_module(model)
        if spec is None:
            raise ValueError("FedFiOT needs a permutation spec: pass model=<torch module> or spec=PermutationSpec(...)")
        self.requested_config = config if config is not None else FedFiOTConfig.default()
        self.fedfiot_config = resolve_config(self.requested_config, validate_fn is not None)
        self.spec = spec
        super().__init__(
            FedFiOTAggregator(spec, self.fedfiot_config),
            model=model, buffers=buffers, validate_fn=validate_fn, min_valid_replies=min_valid_replies,
            fedavg_baseline=fedavg_baseline, **fedavg_options,
        )

    def __repr__(self) -> str:
        return f"FedFiOT(config={self.fedfiot_config!r})"


class FedFisherStrategy(MergeStrategy):
    """FedFisher (K-FAC or diagonal) as a Flower strategy; clients reply with
    :func:`fedfiot_flwr.client.curvature_reply` (``"fedfisher-kfac"`` / ``"fedfisher-diag"``).

    Parameters
    ----------
    variant : {"kfac", "diag"}
        Kronecker-factored or diagonal Fishers.
    steps, lr, eval_every, optimizer, fisher_scaling, damping, fisher_kind, selection_metric, device
        See :class:`~fedfiot_flwr.server.aggregators.FedFisherAggregator`.
    **options
        :class:`~fedfiot_flwr.server.shell.MergeStrategy`'s options (``model``, ``validate_fn``,
        ``min_valid_replies``, FedAvg's options).
    """

    def __init__(
        self,
        variant: str = "kfac",
        *,
        steps: int = 2000,
        lr: float = 0.01,
        eval_every: int = 100,
        optimizer: str = "fedfisher",
        fisher_scaling: str = "size",
        damping: float = 0.0,
        fisher_kind: str | None = None,
        selection_metric: str = "accuracy",
        device: Any = None,
        **options: Any,
    ) -> None:
        aggregator = FedFisherAggregator(
            variant, steps=steps, lr=lr, eval_every=eval_every, optimizer=optimizer, fisher_scaling=fisher_scaling,
            damping=damping, fisher_kind=fisher_kind, selection_metric=selection_metric, device=device,
        )
        super().__init__(aggregator, **options)


class RegMeanStrategy(MergeStrategy):
    """RegMean as a Flower strategy; clients reply with :func:`fedfiot_flwr.client.curvature_reply` (``"regmean"``).

    Parameters
    ----------
    alphas : sequence of float, optional
        Off-diagonal scalings to try (default: the paper's 0.1 and 0.9).
    gram_scaling, rcond, selection_metric
        See :class:`~fedfiot_flwr.server.aggregators.RegMeanAggregator`.
    **options
        :class:`~fedfiot_flwr.server.shell.MergeStrategy`'s options.
    """

    def __init__(
        self,
        alphas: Sequence[float] | None = None,
        *,
        gram_scaling: str = "size",
        rcond: float = 1e-10,
        selection_metric: str = "accuracy",
        **options: Any,
    ) -> None:
        super().__init__(RegMeanAggregator(alphas, gram_scaling=gram_scaling, rcond=rcond,
                                           selection_metric=selection_metric), **options)
