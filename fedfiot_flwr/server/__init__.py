"""Server side of FedFiOT: one Flower strategy shell and the aggregators that plug into it.

Data flows one way: reply -> :mod:`fedfiot_flwr.wire` (decode and validate once) ->
:mod:`~fedfiot_flwr.server.shell` (the Flower strategy) -> :mod:`~fedfiot_flwr.server.aggregators`
(FedFiOT, FedFisher, RegMean, FedAvg) -> the merge engine (:mod:`fedfiot_flwr.merge`).
Nothing here imports client code.
"""

from fedfiot_flwr.server.aggregators import (
    Aggregator,
    FedAvgAggregator,
    FedFiOTAggregator,
    FedFisherAggregator,
    RegMeanAggregator,
)
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.legacy import FedFiOTLegacy
from fedfiot_flwr.server.outcome import RoundContext, RoundOutcome
from fedfiot_flwr.server.recorder import RunRecorder
from fedfiot_flwr.server.selection import Candidate, SweepGrid, sweep_candidates
from fedfiot_flwr.server.shell import MergeStrategy, RunResult
from fedfiot_flwr.server.strategies import FedFiOT, FedFisherStrategy, RegMeanStrategy
from fedfiot_flwr.server.uploads import CollectedUploads, Rejection, collect_uploads

__all__ = [
    "Aggregator",
    "Candidate",
    "CollectedUploads",
    "FedAvgAggregator",
    "FedFiOT",
    "FedFiOTAggregator",
    "FedFiOTConfig",
    "FedFiOTLegacy",
    "FedFisherAggregator",
    "FedFisherStrategy",
    "MergeStrategy",
    "RegMeanAggregator",
    "RegMeanStrategy",
    "Rejection",
    "RoundContext",
    "RoundOutcome",
    "RunRecorder",
    "RunResult",
    "SweepGrid",
    "collect_uploads",
    "sweep_candidates",
]
