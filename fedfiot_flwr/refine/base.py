"""Post-merge stages: what the server may do to any aggregator's model before it is returned.

A :class:`PostMergeStage` gets the aggregated model, the clients' uploaded models, the
aggregator's alignment of them (``None`` when it did not align) and the client sizes, and
returns a :class:`StageResult`. The strategy shell runs the same stage after every aggregator
(FedAvg, RegMean, FedFisher, FedFiOT), and after FedAvg of the same uploads when it reports
that comparison, so that every model it compares had the same server data used the same way.

Two stages ship: the server refinement (:class:`fedfiot_flwr.refine.RefinementStage`, asked for
with ``refine=RefineOptions()``) and :class:`ModelMapStage`, a plain ``model -> model`` function
such as BatchNorm recalibration.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fedfiot_flwr.options import Model

__all__ = ["ModelMapStage", "PostMergeStage", "StageResult"]

Permutations = Mapping[str, Sequence[np.ndarray]]


@dataclass
class StageResult:
    """What a post-merge stage returns.

    Attributes
    ----------
    model : dict[str, np.ndarray]
        The model the round returns.
    returned : str
        What that model is, in plain words (e.g. "the aggregated model fine-tuned for 20 epochs
        on 250 server examples").
    metrics : dict
        Numbers for the round's server metrics (a MetricRecord's values).
    record : dict
        JSON-ready details for the round's report.
    seconds : float
        Wall time of the stage.
    """

    model: Model
    returned: str
    metrics: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class PostMergeStage(Protocol):
    """A step after aggregation that every aggregator's model goes through."""

    label: str

    def describe(self) -> str:
        """What the stage does, in plain words (the strategy's start-up line)."""
        ...

    def __call__(
        self,
        model: Model,
        clients: Sequence[Model],
        permutations: Permutations | None,
        num_examples: Sequence[int],
        client_ids: Sequence[str],
        *,
        fishers: Sequence[Model] = (),
    ) -> StageResult:
        """Turn the aggregated ``model`` into the round's model (``fishers``: the clients' uploaded
        diagonal Fishers in the same order, empty when the uploads carry none)."""
        ...


class ModelMapStage:
    """A ``model dict -> model dict`` function as a post-merge stage (e.g. BatchNorm recalibration).

    Parameters
    ----------
    fn : callable
        Applied to the aggregated model; the clients are not used.
    label : str
        Name in logs and reports.
    """

    def __init__(self, fn: Callable[[Model], Mapping[str, np.ndarray]], label: str = "model map") -> None:
        if not callable(fn):
            raise TypeError(f"a post-merge function must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.label = label

    def describe(self) -> str:
        """The function's name."""
        return f"{self.label} ({getattr(self.fn, '__name__', type(self.fn).__name__)})"

    def __call__(
        self,
        model: Model,
        clients: Sequence[Model],
        permutations: Permutations | None,
        num_examples: Sequence[int],
        client_ids: Sequence[str],
        *,
        fishers: Sequence[Model] = (),
    ) -> StageResult:
        """``fn(model)``."""
        t0 = time.perf_counter()
        out = {k: np.asarray(v) for k, v in self.fn(model).items()}
        return StageResult(out, f"the aggregated model after {self.label}", seconds=time.perf_counter() - t0)
