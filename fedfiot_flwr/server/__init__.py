"""Server side of FedFiOT: one Flower strategy shell and the aggregators that plug into it.

Data flows one way: reply -> :mod:`fedfiot_flwr.wire` (decode and validate once) ->
:mod:`~fedfiot_flwr.server.shell` (the Flower strategy) -> :mod:`~fedfiot_flwr.server.aggregators`
(FedFiOT, FedFisher, RegMean, FedAvg) -> the merge engine (:mod:`fedfiot_flwr.merge`).
Nothing here imports client code.
"""

from fedfiot_flwr.server.aggregators import (
    AggregateOutcome,
    Aggregator,
    FedAvgAggregator,
    FedFiOTAggregator,
    FedFisherAggregator,
    RegMeanAggregator,
    RoundContext,
)
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.legacy import FedFiOTLegacy
from fedfiot_flwr.server.recorder import RunRecorder
from fedfiot_flwr.server.selection import Candidate, MergeOutcome, SweepGrid, merge_round
from fedfiot_flwr.server.shell import MergeResult, MergeStrategy
from fedfiot_flwr.server.strategies import FedFiOT, FedFisherStrategy, RegMeanStrategy
from fedfiot_flwr.server.uploads import CollectedUploads, Rejection, collect_uploads

__all__ = [
    "AggregateOutcome",
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
    "MergeOutcome",
    "MergeResult",
    "MergeStrategy",
    "RegMeanAggregator",
    "RegMeanStrategy",
    "Rejection",
    "RoundContext",
    "RunRecorder",
    "SweepGrid",
    "collect_uploads",
    "merge_round",
]
