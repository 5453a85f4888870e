"""The public strategies: thin configurations of :class:`~fedfiot_flwr.server.shell.MergeStrategy`.

- :class:`FedFiOT`: a drop-in replacement for Flower's ``FedAvg`` (same options, same defaults,
  same ``start``) that merges with FedFiOT;
- :class:`FedFisherStrategy` and :class:`RegMeanStrategy`: the paper's one-shot baselines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from fedfiot_flwr.merge import PermutationSpec, spec_from_module
from fedfiot_flwr.baselines.fedfisher_options import FedFisherOptions
from fedfiot_flwr.server.aggregators import FedFiOTAggregator, FedFisherAggregator, RegMeanAggregator
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.shell import MergeStrategy, StrategyOptions, check_model, show_package_logs

if TYPE_CHECKING:
    import torch

__all__ = ["FedFiOT", "FedFisherStrategy", "RegMeanStrategy", "fedfiot_aggregator", "refuse_config_fields"]


def refuse_config_fields(label: str, options: Mapping[str, Any]) -> None:
    """Refuse :class:`FedFiOTConfig` fields given to a strategy as keyword arguments, showing the call.

    Raises
    ------
    TypeError
        ``FedFiOT: rho is a FedFiOTConfig field, not a strategy option; pass it as
        FedFiOT(model, config=FedFiOTConfig.default(rho=0.3))``.
    """
    knobs = {f.name for f in fields(FedFiOTConfig)}
    misplaced = {k: v for k, v in options.items() if k in knobs}
    if misplaced:
        what = "is a FedFiOTConfig field" if len(misplaced) == 1 else "are FedFiOTConfig fields"
        call = ", ".join(f"{k}={v!r}" for k, v in misplaced.items())
        raise TypeError(f"{label}: {', '.join(misplaced)} {what}, not a strategy option; pass it as "
                        f"{label}(model, config=FedFiOTConfig.default({call}))")


def fedfiot_aggregator(
    spec: PermutationSpec | None,
    model: torch.nn.Module | None,
    config: FedFiOTConfig | None,
    has_validation: bool,
    refining: bool,
    label: str = "FedFiOT",
    clients_evaluate: bool = False,
) -> FedFiOTAggregator:
    """FedFiOT's aggregator with the configuration that runs given what the server holds.

    Parameters
    ----------
    spec : PermutationSpec, optional
        Derived from ``model`` when omitted.
    model : torch.nn.Module, optional
        The architecture.
    config : FedFiOTConfig, optional
        Default :meth:`FedFiOTConfig.default`; resolved by :meth:`FedFiOTConfig.for_server`.
    has_validation, refining : bool
        Whether the server has examples to choose on, and whether a refinement follows the merge.
    label : str
        The strategy's name in messages.
    clients_evaluate : bool
        Whether the strategy runs the clients' evaluation step, where the clients' choice
        (``round_choice="clients"``) takes place.

    Raises
    ------
    ValueError
        Without a spec or model.
    TypeError
        When ``config`` is not a :class:`FedFiOTConfig` or ``model`` not a torch module.
    """
    show_package_logs()
    check_model(model, label)
    if config is not None and not isinstance(config, FedFiOTConfig):
        raise TypeError(f"{label}: config must be a FedFiOTConfig (e.g. FedFiOTConfig.default(rho=0.3)), "
                        f"got {type(config).__name__}")
    if spec is None and model is not None:
        spec = spec_from_module(model)
    if spec is None:
        raise ValueError(f"{label} needs a permutation spec: pass model=<torch module> or spec=PermutationSpec(...)")
    requested = config if config is not None else FedFiOTConfig.default()
    return FedFiOTAggregator(spec, requested.for_server(has_validation, refining, clients_evaluate))


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
        Merge options and selection; default :meth:`FedFiOTConfig.default`. Without server data
        it runs as :meth:`FedFiOTConfig.without_validation` (the start-up line says so).
    validate_fn : callable, optional
        ``model dict -> metrics`` on held-out server data (:func:`fedfiot_flwr.validation.make_validate_fn`).
    server_data : torch Dataset, optional
        Labelled ``(input, label)`` examples the server holds (instead of ``validate_fn``; needs
        ``model``). They choose the merge's knobs; nothing is trained on them unless ``refine``
        is given.
    refine : RefineOptions, optional
        Also fit the returned model on half of ``server_data``
        (:class:`fedfiot_flwr.refine.RefinementStage`); the other half chooses.
    buffers : sequence of str, optional
        State-dict entries without a Fisher (default: ``model``'s non-parameters).
    min_valid_replies : int, optional
        Fewer valid replies fail the round with a clear error (default: ``min_train_nodes``).
    fedavg_baseline : bool
        Also compute FedAvg of the same uploads each round (reported next to FedFiOT's model).
    **fedavg_options
        The options above from ``validate_fn`` on, :class:`~fedfiot_flwr.server.shell.MergeStrategy`'s
        other options (the fields of :class:`~fedfiot_flwr.server.shell.StrategyOptions`), and
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
        **fedavg_options: Any,
    ) -> None:
        refuse_config_fields("FedFiOT", fedavg_options)
        self.requested_config = config if config is not None else FedFiOTConfig.default()
        own, _ = StrategyOptions.split(fedavg_options)
        aggregator = fedfiot_aggregator(spec, model, config, own.validate_fn is not None or own.server_data is not None,
                                        own.refine is not None,
                                        clients_evaluate=fedavg_options.get("fraction_evaluate", 1.0) != 0)
        self.fedfiot_config = aggregator.settings
        self.spec = aggregator.spec
        super().__init__(aggregator, model=model, **fedavg_options)

    def __repr__(self) -> str:
        return f"FedFiOT(config={self.fedfiot_config!r})"


class FedFisherStrategy(MergeStrategy):
    """FedFisher (K-FAC or diagonal) as a Flower strategy; clients reply with
    :func:`fedfiot_flwr.client.curvature_reply` (``"fedfisher-kfac"`` / ``"fedfisher-diag"``).

    Parameters
    ----------
    variant : {"kfac", "diag"}
        Kronecker-factored or diagonal Fishers.
    **options
        FedFisher's knobs, the fields of :class:`~fedfiot_flwr.baselines.FedFisherOptions`
        (``steps``, ``lr``, ``eval_every``, ``optimizer``, ``fisher_scaling``, ``damping``,
        ``fisher_kind``, ``selection_metric``, ``device``), and
        :class:`~fedfiot_flwr.server.shell.MergeStrategy`'s options (``model``, ``validate_fn`` or
        ``server_data``, ``refine``, ``min_valid_replies``, FedAvg's options).
    """

    def __init__(self, variant: str = "kfac", **options: Any) -> None:
        knobs = {k: options.pop(k) for k in list(options) if k in FedFisherOptions.__dataclass_fields__}
        super().__init__(FedFisherAggregator(variant, **knobs), **options)


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
