"""What goes into one round's aggregation besides the uploads, and the one type that comes out.

:class:`RoundContext` is what an aggregator may use besides the uploads (round number, broadcast
model, buffers, validation scorer). :class:`RoundOutcome` is the round's result at every step of
the server path: an aggregator returns it, FedFiOT's candidate sweep fills its FedFiOT-specific
fields, and :class:`~fedfiot_flwr.server.rounds.RoundMerger` completes it with the returned model,
the decoded uploads and the round's report. Framework-neutral: no Flower or torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fedfiot_flwr.options import Model

if TYPE_CHECKING:  # kept out of the import graph: this module stays Flower- and engine-free
    from fedfiot_flwr.merge import MergeResult
    from fedfiot_flwr.server.selection import Candidate
    from fedfiot_flwr.server.uploads import CollectedUploads

__all__ = ["RoundContext", "RoundOutcome", "ValidateFn"]

ValidateFn = Callable[[Model], Mapping[str, float] | None]
"""``model dict -> metrics`` on the server's validation data."""


@dataclass(frozen=True)
class RoundContext:
    """What an aggregator may use besides the uploads.

    Attributes
    ----------
    server_round : int
        Current round (1-based).
    broadcast : dict or None
        The global model sent this round.
    buffers : tuple of str
        State-dict entries without a Fisher.
    validate : callable or None
        ``model dict -> metrics`` on the server's validation data.
    """

    server_round: int
    broadcast: Model | None = None
    buffers: tuple[str, ...] = ()
    validate: ValidateFn | None = None


@dataclass
class RoundOutcome:
    """One round's result: what an aggregator returns and what the strategy keeps of the round.

    Attributes
    ----------
    model : dict[str, np.ndarray]
        The new global model (after :class:`~fedfiot_flwr.server.rounds.RoundMerger`: the model
        the round returns, post-merge stage included, in the broadcast model's order).
    chosen : dict
        The knobs selection settled on (JSON-ready).
    metrics : dict
        Server-side diagnostics: numbers and lists of numbers (a MetricRecord's values).
    record : dict
        Further JSON-ready details for the results file.
    validation : dict[str, float] or None
        Validation metrics of ``model`` where computed.
    alternatives : dict[str, dict[str, np.ndarray]]
        Other models worth evaluating next to ``model`` (``"fedavg"``: FedAvg of the same uploads;
        ``"fedfiot-own"``: FedFiOT's own merge when FedAvg won the validation choice;
        ``"unrefined"``: the aggregated model before a post-merge stage).
    alternative_validation : dict[str, dict[str, float]]
        Validation metrics of the alternatives, where computed.
    seconds : float
        Wall time of the aggregation including selection.
    permutations : dict or None
        How the aggregator aligned each client to ``model``'s neuron order (``perm -> one array
        per client``, in upload order); ``None`` when the clients were merged as they are.
    candidate : Candidate or None
        FedFiOT only: the chosen ``(rho, lam, reference, fisher_scaling)``.
    variant : str or None
        FedFiOT only: ``"aligned"``, ``"identity"`` or ``"fedavg"`` (FedAvg of the same uploads
        validated best).
    engine_result : MergeResult or None
        FedFiOT only: the merge engine's result for the chosen candidate (objectives,
        permutations, per-layer reports).
    trials : list[dict]
        FedFiOT only: one entry per (candidate, variant) tried.
    uploads : CollectedUploads or None
        The round's decoded uploads (set by the round merger).
    report : dict
        The round's JSON-ready report (set by the round merger).
    """

    model: Model
    chosen: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, float] | None = None
    alternatives: dict[str, Model] = field(default_factory=dict)
    alternative_validation: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0
    permutations: dict[str, list[np.ndarray]] | None = None
    candidate: Candidate | None = None
    variant: str | None = None
    engine_result: MergeResult | None = None
    trials: list[dict[str, Any]] = field(default_factory=list)
    uploads: CollectedUploads | None = None
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def baseline_model(self) -> Model | None:
        """FedAvg of the same uploads, where computed."""
        return self.alternatives.get("fedavg")

    @property
    def baseline_validation(self) -> dict[str, float] | None:
        """Validation metrics of :attr:`baseline_model`, where computed."""
        return self.alternative_validation.get("fedavg")

    @property
    def own_model(self) -> Model:
        """FedFiOT's own merge: ``model`` unless FedAvg of the same uploads won."""
        return self.alternatives.get("fedfiot-own", self.model)

    @property
    def own_variant(self) -> str | None:
        """``"aligned"`` or ``"identity"``: which merge :attr:`own_model` is."""
        return self.record.get("own_variant", self.variant)

    @property
    def own_validation(self) -> dict[str, float] | None:
        """Validation metrics of :attr:`own_model`."""
        return self.alternative_validation.get("fedfiot-own", self.validation)
