"""The public strategies: thin configurations of :class:`~fedfiot_flwr.server.shell.MergeStrategy`.

- :class:`FedFiOT`: a drop-in replacement for Flower's ``FedAvg`` (same options, same defaults,
  same ``start``) that merges with FedFiOT;
- :class:`FedFisherStrategy` and :class:`RegMeanStrategy`: the paper's one-shot baselines.
"""

from __future__ import annotations

import copy
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
    from torch.utils.data import Dataset

__all__ = ["FedFiOT", "FedFisherStrategy", "RegMeanStrategy", "fedfiot_aggregator", "resolve_config"]


def resolve_config(config: FedFiOTConfig, has_validation: bool, label: str = "FedFiOT",
                   has_server_data: bool = False) -> FedFiOTConfig:
    """The configuration that will run; says once (at construction) what changes without validation
    data, or without the labelled server data the refinement needs."""
    if has_validation:
        if config.refine is not None and not has_server_data:
            log(INFO, "%s config %r with a validate_fn but no server_data: no server refinement (pass "
                "server_data=<labelled Dataset> instead of validate_fn to refine every merge)", label, config.name)
        return config.with_server_data(has_server_data)
    notice = config.describe_without_validation()
    if notice:
        log(INFO, "%s", notice)
    return config.without_validation()


def fedfiot_aggregator(
    spec: PermutationSpec | None,
    model: torch.nn.Module | None,
    config: FedFiOTConfig | None,
    validate_fn: ValidateFn | None,
    server_data: Dataset[Any] | None,
    label: str = "FedFiOT",
) -> tuple[PermutationSpec, FedFiOTConfig, FedFiOTAggregator, ValidateFn | None]:
    """The spec, resolved configuration, aggregator and selection ``validate_fn`` of a FedFiOT strategy.

    With ``server_data`` and a refining configuration, the data is split into a fitting and a
    selection fold (:class:`~fedfiot_flwr.server.refinement.ServerRefinement`) and ``validate_fn``
    sees the selection fold only; without refinement ``validate_fn`` scores all of it.

    Raises
    ------
    ValueError
        Without a spec or model, with both ``validate_fn`` and ``server_data``, or with
        ``server_data`` but no ``model``.
    """
    if spec is None and model is not None:
        spec = spec_from_module(model)
    if spec is None:
        raise ValueError(f"{label} needs a permutation spec: pass model=<torch module> or spec=PermutationSpec(...)")
    requested = config if config is not None else FedFiOTConfig.default()
    if server_data is not None:
        if validate_fn is not None:
            raise ValueError(f"{label}: pass either validate_fn or server_data, not both (with server_data the "
                             "strategy builds its own validate_fn on the selection fold)")
        if model is None:
            raise ValueError(f"{label}: server_data needs model=<torch module> (the architecture to run it through)")
    resolved = resolve_config(requested, validate_fn is not None or server_data is not None, label,
                              server_data is not None)
    refiner = None
    if server_data is not None:
        from torch.utils.data import DataLoader

        from fedfiot_flwr.server.refinement import ServerRefinement
        from fedfiot_flwr.validation import make_validate_fn

        if resolved.refine is not None:
            refiner = ServerRefinement(model, server_data, resolved.refine, spec=spec)  # type: ignore[arg-type]
            validate_fn = refiner.validate_fn
        else:
            validate_fn = make_validate_fn(copy.deepcopy(model), DataLoader(server_data, batch_size=500))  # type: ignore[arg-type]
    return spec, resolved, FedFiOTAggregator(spec, resolved, refiner), validate_fn


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
    server_data : torch Dataset, optional
        Labelled ``(input, label)`` examples the server holds (instead of ``validate_fn``). With the
        default configuration they are split into a fitting and a selection fold: the merge is
        chosen on the selection fold, then refined on the fitting fold
        (:class:`~fedfiot_flwr.server.refinement.ServerRefinement`). Needs ``model``.
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
        server_data: Dataset[Any] | None = None,
        buffers: Sequence[str] | None = None,
        min_valid_replies: int | None = None,
        fedavg_baseline: bool = True,
        **fedavg_options: Any,
    ) -> None:
        self.requested_config = config if config is not None else FedFiOTConfig.default()
        spec, self.fedfiot_config, aggregator, validate_fn = fedfiot_aggregator(
            spec, model, self.requested_config, validate_fn, server_data)
        self.spec = spec
        super().__init__(
            aggregator,
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
