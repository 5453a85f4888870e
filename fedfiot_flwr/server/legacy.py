"""FedFiOT for projects on Flower's legacy strategy API (``flwr.server.strategy``).

:class:`FedFiOTLegacy` is a ``flwr.server.strategy.FedAvg`` whose ``aggregate_fit`` runs the same
:class:`~fedfiot_flwr.server.rounds.RoundMerger` and FedFiOT aggregator as the Message-API
:class:`fedfiot_flwr.FedFiOT`. A ``NumPyClient`` returns the reply RecordDict inside its
``FitRes`` as one ``uint8`` array::

    content = fisher_reply(model, trainloader, metrics)
    return reply_to_ndarrays(content), num_examples, metrics

(:func:`fedfiot_flwr.server.legacy_envelope.reply_to_ndarrays`). The client's metrics travel
inside the reply; without a ``fit_metrics_aggregation_fn`` the strategy returns their
example-weighted mean (names unchanged). Global parameters travel as usual: a list of arrays
in ``model.state_dict()`` order.
"""

from __future__ import annotations

from collections.abc import Sequence
from logging import DEBUG, INFO
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import RecordDict
from flwr.common import FitIns, FitRes, NDArrays, Parameters, Scalar, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg
from flwr.supercore import log

from fedfiot_flwr.merge import PermutationSpec
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.legacy_envelope import fitres_to_reply, ndarrays_to_reply, reply_to_ndarrays
from fedfiot_flwr.server.rounds import RoundMerger
from fedfiot_flwr.server.server_data import plan_server_data
from fedfiot_flwr.server.shell import StrategyOptions, buffers_of, check_sampling, metric_record
from fedfiot_flwr.server.strategies import fedfiot_aggregator, refuse_config_fields
from fedfiot_flwr.server.uploads import FirstReplies

if TYPE_CHECKING:
    import torch

__all__ = ["FedFiOTLegacy", "fitres_to_reply", "ndarrays_to_reply", "reply_to_ndarrays"]


class FedFiOTLegacy(FedAvg):
    """FedFiOT as a ``flwr.server.strategy`` strategy (``aggregate_fit`` over ``FitRes``).

    Parameters
    ----------
    spec, model, config
        As in :class:`fedfiot_flwr.FedFiOT`.
    names : sequence of str, optional
        State-dict key order of the global parameter list (default: ``model.state_dict()``
        order, else ``spec.names``).
    **fedavg_options
        :class:`fedfiot_flwr.FedFiOT`'s other options (``validate_fn``, ``server_data``,
        ``refine``, ``buffers``, ``min_valid_replies``, ``fedavg_baseline``: the fields of
        :class:`~fedfiot_flwr.server.shell.StrategyOptions` but the Message API's
        ``bn_recalibration`` and ``node_wait_s``), and everything
        ``flwr.server.strategy.FedAvg`` takes, with its defaults.
    """

    def __init__(
        self,
        spec: PermutationSpec | None = None,
        model: torch.nn.Module | None = None,
        *,
        config: FedFiOTConfig | None = None,
        names: Sequence[str] | None = None,
        **fedavg_options: Any,
    ) -> None:
        label = "FedFiOTLegacy"
        refuse_config_fields(label, fedavg_options)
        own, fedavg_options = StrategyOptions.split(fedavg_options)
        unsupported = [k for k in ("bn_recalibration", "node_wait_s") if getattr(own, k) is not None]
        if unsupported:
            raise TypeError(f"{label}: {' and '.join(unsupported)} {'are options' if len(unsupported) > 1 else 'is an option'} "
                            "of the Message-API FedFiOT only")
        validate_fn, server_data, refine, buffers = own.validate_fn, own.server_data, own.refine, own.buffers
        FedAvg.__init__(self, **fedavg_options)
        check_sampling(label, fraction_fit=self.fraction_fit, fraction_evaluate=self.fraction_evaluate,
                       min_fit_clients=self.min_fit_clients, min_evaluate_clients=self.min_evaluate_clients,
                       min_available_clients=self.min_available_clients)
        aggregator = fedfiot_aggregator(spec, model, config, validate_fn is not None or server_data is not None,
                                        refine is not None, label=label)
        self.fedfiot_config = aggregator.settings
        self.spec = spec = aggregator.spec
        plan = plan_server_data(label, model, server_data, refine, validate_fn, aggregator.describe, spec)
        self.merger = RoundMerger(
            aggregator,
            buffers=tuple(buffers) if buffers is not None else buffers_of(model),
            validate_fn=plan.validate_fn,
            min_valid_replies=max(1, self.min_fit_clients) if own.min_valid_replies is None else own.min_valid_replies,
            fedavg_baseline=own.fedavg_baseline,
            post_merge=plan.stage,
        )
        self.plan = f"{label}: {plan.describe}"
        log(INFO, "%s", self.plan)
        if names is not None:
            self.names = list(names)
        elif model is not None:
            self.names = list(model.state_dict())
        else:
            self.names = list(spec.names)
        self.server_metrics: dict[int, dict[str, Any]] = {}
        self._broadcast: dict[str, np.ndarray] | None = None

    def __repr__(self) -> str:
        return f"FedFiOTLegacy(config={self.fedfiot_config!r})"

    @property
    def reports(self) -> list[dict[str, Any]]:
        """One JSON-ready report per merged (or failed) round."""
        return self.merger.reports

    def _to_dict(self, ndarrays: NDArrays) -> dict[str, np.ndarray]:
        if len(ndarrays) != len(self.names):
            raise ValueError(
                f"the global parameters hold {len(ndarrays)} arrays but the model has {len(self.names)} "
                "state_dict entries (pass names= in state_dict order)"
            )
        return {k: np.asarray(v) for k, v in zip(self.names, ndarrays)}

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Remember the broadcast model, sample clients as FedAvg does, and tell them whether the round uses their
        curvature and which (:meth:`~fedfiot_flwr.server.aggregators.FedFiOTAggregator.train_config`)."""
        self._broadcast = self._to_dict(parameters_to_ndarrays(parameters))
        instructions = super().configure_fit(server_round, parameters, client_manager)
        extra = self.merger.aggregator.train_config(server_round)
        return [(proxy, FitIns(ins.parameters, {**ins.config, **extra})) for proxy, ins in instructions]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Decode each FitRes payload once, exclude the broken ones, merge the rest with FedFiOT.

        Raises
        ------
        RuntimeError
            When fewer than ``min_valid_replies`` valid replies remain.
        """
        good: list[tuple[str, RecordDict]] = []
        errors: list[tuple[str, str]] = []
        first = FirstReplies()  # results first, then failures
        for proxy, fit_res in results:
            cid = str(proxy.cid)
            duplicate = first.duplicate(cid)
            if duplicate is not None:
                errors.append((cid, duplicate))
                continue
            try:
                good.append((cid, fitres_to_reply(fit_res, cid)))
            except Exception as exc:  # noqa: BLE001 - an untrusted reply excludes itself, never the round
                errors.append((cid, str(exc) or type(exc).__name__))
        for failure in failures:
            if isinstance(failure, BaseException):
                errors.append(("?", f"failure: {type(failure).__name__}: {failure}"))
                continue
            proxy, fit_res = failure
            cid = str(proxy.cid)
            reason = f"failure: {fit_res.status.code.name}: {fit_res.status.message}"
            errors.append((cid, first.duplicate(cid, reason) or reason))
        result = self.merger.run_round(server_round, good, errors, self._broadcast)
        self.server_metrics[server_round] = dict(metric_record(result.report["server_metrics"]))
        log(DEBUG, "FedFiOTLegacy round %s server-side metrics: %s", server_round,
            dict(metric_record(result.report["server_metrics"])))
        ups = result.uploads
        if self.fit_metrics_aggregation_fn is not None:
            metrics = self.fit_metrics_aggregation_fn(list(zip(ups.num_examples, ups.metrics)))
        else:  # the clients' own metrics, example-weighted, as the Message API strategy reports them
            metrics = dict(result.report["client_train_metrics"])
        return ndarrays_to_parameters([result.model[k] for k in self.names]), metrics
