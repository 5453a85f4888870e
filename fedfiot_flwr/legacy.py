"""FedFiOT for projects still on Flower's legacy strategy API (``flwr.server.strategy``).

:class:`FedFiOTLegacy` is a ``flwr.server.strategy.FedAvg`` whose ``aggregate_fit`` merges with
FedFiOT; it shares every step (unpacking, validation, exclusion, selection, results, checkpoints)
with the Message-API :class:`fedfiot_flwr.FedFiOT` through :class:`~fedfiot_flwr.strategy.FedFiOTCore`.

Wire format on the legacy path: a ``FitRes`` carries the same RecordDict a Message-API client
sends (:func:`fedfiot_flwr.client.pack_reply`), serialized with Flower's own protobuf serde into
a single ``uint8`` array. A ``NumPyClient`` therefore returns::

    content = train_and_pack(model, loader, epochs)           # or pack_reply(...)
    return reply_to_ndarrays(content), num_examples, {}

and the strategy decodes it with :func:`fitres_to_reply`. Global parameters travel as usual: a
list of arrays in ``model.state_dict()`` order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from logging import INFO
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import RecordDict
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    NDArrays,
    Parameters,
    Scalar,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import FedAvg
from flwr.supercore import log

from .merge import PermutationSpec
from .results import ResultsFile, save_checkpoint
from .selection import SweepGrid
from .strategy import FedFiOTCore
from .strategy_utils import DUPLICATE_REASON

if TYPE_CHECKING:
    import torch

LegacyEvaluateFn = Callable[[int, NDArrays, dict[str, Scalar]], "tuple[float, dict[str, Scalar]] | None"]


def reply_to_ndarrays(content: RecordDict) -> NDArrays:
    """Serialize a FedFiOT reply RecordDict into the one-array payload of a legacy ``FitRes``.

    Parameters
    ----------
    content : RecordDict
        A reply built by :func:`fedfiot_flwr.client.pack_reply`.

    Returns
    -------
    list of np.ndarray
        A single ``uint8`` array holding Flower's protobuf serialization of ``content``.
    """
    blob = recorddict_to_proto(content).SerializeToString()
    return [np.frombuffer(blob, dtype=np.uint8).copy()]


def ndarrays_to_reply(ndarrays: NDArrays, client: str = "?") -> RecordDict:
    """Inverse of :func:`reply_to_ndarrays`.

    Raises
    ------
    ValueError
        If the payload is not exactly one uint8 array holding a serialized RecordDict.
    """
    if len(ndarrays) != 1 or np.asarray(ndarrays[0]).dtype != np.uint8:
        raise ValueError(
            f"client {client!r}: a FedFiOT legacy FitRes must carry exactly one uint8 array "
            f"(reply_to_ndarrays), got {len(ndarrays)} array(s) of dtype "
            f"{sorted({str(np.asarray(a).dtype) for a in ndarrays})}"
        )
    try:
        proto = ProtoRecordDict.FromString(np.asarray(ndarrays[0]).tobytes())
        return recorddict_from_proto(proto)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise ValueError(f"client {client!r}: undecodable FedFiOT legacy payload: {exc}") from exc


def fitres_to_reply(fit_res: FitRes, client: str = "?") -> RecordDict:
    """Decode the RecordDict a FedFiOT legacy client put into its ``FitRes``.

    Raises
    ------
    ValueError
        If the FitRes reports a failure or its parameters are not a FedFiOT payload.
    """
    if fit_res.status.code != Code.OK:
        raise ValueError(f"client {client!r}: FitRes status {fit_res.status.code.name}: {fit_res.status.message}")
    try:
        ndarrays = parameters_to_ndarrays(fit_res.parameters)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"client {client!r}: undecodable FitRes parameters: {exc}") from exc
    return ndarrays_to_reply(ndarrays, client)


def _legacy_metrics(metrics: dict[str, Any]) -> dict[str, Scalar]:
    """Legacy metrics hold scalars only: lists become comma-separated strings."""
    out: dict[str, Scalar] = {}
    for key, value in metrics.items():
        if isinstance(value, list):
            out[key] = ",".join(f"{v:.6g}" if isinstance(v, float) else str(v) for v in value)
        else:
            out[key] = value
    return out


class FedFiOTLegacy(FedAvg, FedFiOTCore):
    """FedFiOT as a ``flwr.server.strategy`` strategy (``aggregate_fit`` over ``FitRes``).

    Parameters
    ----------
    spec, model, lam, rho, max_iters, reference, matching, aggregation, fisher_scaling, fallback,
    preset, fedavg_candidate, fisher_cap, buffers, sweep, selection_metric, min_valid_replies,
    results_path, checkpoint_dir, baseline
        As in :class:`fedfiot_flwr.FedFiOT`.
    names : sequence of str, optional
        State-dict key order of the global parameter list (default: ``model.state_dict()`` order,
        else ``spec.names``).
    validate_fn : callable, optional
        ``(server_round, ndarrays, config) -> (loss, metrics) | None`` on the server's validation
        set (the signature of FedAvg's ``evaluate_fn``); enables selection over ``sweep``.
    num_rounds : int, optional
        When given, the results file is finalised and ``final.pt`` written after that round.
    fraction_fit, fraction_evaluate, min_fit_clients, min_evaluate_clients, min_available_clients,
    evaluate_fn, on_fit_config_fn, on_evaluate_config_fn, initial_parameters,
    evaluate_metrics_aggregation_fn
        As in ``flwr.server.strategy.FedAvg``.
    """

    # pylint: disable=too-many-arguments,too-many-locals
    def __init__(
        self,
        spec: PermutationSpec | None = None,
        model: torch.nn.Module | None = None,
        *,
        names: Sequence[str] | None = None,
        lam: float = 1e-4,
        rho: float = 0.5,
        max_iters: int = 8,
        reference: str | int = "largest",
        matching: str = "fisher",
        aggregation: str = "fisher",
        fisher_scaling: str = "none",
        fallback: str | None = None,
        preset: str | None = "default",
        fedavg_candidate: bool | None = None,
        fisher_cap: float | None = None,
        buffers: Sequence[str] | None = None,
        validate_fn: LegacyEvaluateFn | None = None,
        sweep: SweepGrid | bool | None = None,
        selection_metric: str = "accuracy",
        fraction_fit: float = 1.0,
        fraction_evaluate: float = 0.0,
        min_fit_clients: int = 2,
        min_evaluate_clients: int = 2,
        min_available_clients: int = 2,
        min_valid_replies: int | None = None,
        evaluate_fn: LegacyEvaluateFn | None = None,
        on_fit_config_fn: Callable[[int], dict[str, Scalar]] | None = None,
        on_evaluate_config_fn: Callable[[int], dict[str, Scalar]] | None = None,
        initial_parameters: Parameters | None = None,
        evaluate_metrics_aggregation_fn: Any = None,
        num_rounds: int | None = None,
        results_path: str | Path | None = None,
        checkpoint_dir: str | Path | None = None,
        baseline: bool = True,
    ) -> None:
        FedAvg.__init__(
            self,
            fraction_fit=fraction_fit,
            fraction_evaluate=fraction_evaluate,
            min_fit_clients=min_fit_clients,
            min_evaluate_clients=min_evaluate_clients,
            min_available_clients=min_available_clients,
            evaluate_fn=evaluate_fn,
            on_fit_config_fn=on_fit_config_fn,
            on_evaluate_config_fn=on_evaluate_config_fn,
            accept_failures=True,
            initial_parameters=initial_parameters,
            evaluate_metrics_aggregation_fn=evaluate_metrics_aggregation_fn,
        )
        self._init_core(
            spec=spec, model=model, lam=lam, rho=rho, max_iters=max_iters, reference=reference,
            matching=matching, aggregation=aggregation, fisher_scaling=fisher_scaling, fallback=fallback,
            preset=preset, fedavg_candidate=fedavg_candidate, fisher_cap=fisher_cap,
            buffers=buffers, sweep=sweep, selection_metric=selection_metric,
            min_valid_replies=min_valid_replies if min_valid_replies is not None else max(1, min_fit_clients),
            results_path=results_path, checkpoint_dir=checkpoint_dir, baseline=baseline,
        )
        if names is not None:
            self.names = list(names)
        elif model is not None:
            self.names = list(model.state_dict())
        else:
            self.names = list(self.spec.names)  # type: ignore[union-attr]
        self.num_rounds = num_rounds
        self.validate_fn = validate_fn
        if validate_fn is not None:
            self._core_validate = self._validate_numpy
        self.results = ResultsFile(self.results_path, {**self.core_config(), "num_rounds": num_rounds})

    def __repr__(self) -> str:
        return f"FedFiOTLegacy({self.core_config()})"

    def _to_list(self, model: dict[str, np.ndarray]) -> NDArrays:
        return [np.asarray(model[k]) for k in self.names]

    def _to_dict(self, ndarrays: NDArrays) -> dict[str, np.ndarray]:
        if len(ndarrays) != len(self.names):
            raise ValueError(
                f"the global parameters hold {len(ndarrays)} arrays but the model has {len(self.names)} "
                "state_dict entries (pass names= in state_dict order)"
            )
        return {k: np.asarray(v) for k, v in zip(self.names, ndarrays)}

    def _validate_numpy(self, server_round: int, model: dict[str, np.ndarray]) -> dict[str, float] | None:
        assert self.validate_fn is not None
        res = self.validate_fn(server_round, self._to_list(model), {})
        if res is None:
            return None
        loss, metrics = res
        return {"loss": float(loss), **{k: v for k, v in metrics.items() if isinstance(v, (int, float))}}

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Remember the broadcast model, then sample clients as FedAvg does."""
        self._broadcast = self._to_dict(parameters_to_ndarrays(parameters))
        return super().configure_fit(server_round, parameters, client_manager)

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Decode, validate and merge the FitRes payloads with FedFiOT; exclude the broken ones.

        Raises
        ------
        RuntimeError
            When fewer than ``min_valid_replies`` valid replies remain.
        """
        good: list[tuple[str, RecordDict]] = []
        errors: list[tuple[str, str]] = []
        seen: set[str] = set()  # one reply per client: results first, then failures
        for proxy, fit_res in results:
            cid = str(proxy.cid)
            if cid in seen:
                errors.append((cid, DUPLICATE_REASON))
                continue
            seen.add(cid)
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
            errors.append((cid, f"{DUPLICATE_REASON} ({reason})" if cid in seen else reason))
            seen.add(cid)
        model, metrics = self.merge_replies(server_round, good, errors)
        if self.num_rounds is not None and server_round >= self.num_rounds:
            final: dict[str, Any] = {"rounds": server_round}
            if self.checkpoint_dir is not None:
                final["checkpoint"] = str(save_checkpoint(model, self.checkpoint_dir / "final.pt"))
            self.results.finish(final)
        return ndarrays_to_parameters(self._to_list(model)), _legacy_metrics(metrics)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        """FedAvg's server-side evaluation, also applied to the FedAvg baseline and recorded."""
        res = super().evaluate(server_round, parameters)
        if res is None or server_round == 0:
            return res
        values: dict[str, Any] = {"test": {"loss": res[0], **res[1]}}
        outcome = self.last_outcome
        if outcome is not None and outcome.baseline_model is not None and self.evaluate_fn is not None:
            base = self.evaluate_fn(server_round, self._to_list(outcome.baseline_model), {})
            if base is not None:
                values["fedavg_test"] = {"loss": base[0], **base[1]}
            if outcome.variant == "fedavg" and outcome.own_model is not None:
                own = self.evaluate_fn(server_round, self._to_list(outcome.own_model), {})
                if own is not None:
                    values["own_test"] = {"loss": own[0], **own[1]}
        log(INFO, "FedFiOT round %s: test %s | FedAvg on the same uploads: %s",
            server_round, values["test"], values.get("fedavg_test"))
        self.results.update_round(server_round, values)
        if self.num_rounds is not None and server_round >= self.num_rounds:
            final = dict(self.results.data["final"])
            final.update(values)
            self.results.finish(final)
        return res
