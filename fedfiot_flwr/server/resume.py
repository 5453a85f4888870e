"""Going on with a run after a round: the history a strategy carries, and Flower's round loop from a later round.

Flower's ``Strategy.start`` always begins at round 1. :func:`continue_rounds` is the same loop
(training, federated evaluation, server-side evaluation, the same hooks and log lines) starting at
a later round, with the :class:`flwr.serverapp.strategy.Result` already holding the earlier rounds'
metrics (:class:`RoundHistory`), so that a resumed run returns what the uninterrupted run would.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import log_strategy_start_info
from flwr.supercore import log

__all__ = ["RoundHistory"]

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]
HISTORY_FIELDS = ("train_metrics_clientapp", "evaluate_metrics_clientapp", "evaluate_metrics_serverapp")


def _records(values: Mapping[Any, Mapping[str, Any]]) -> dict[int, MetricRecord]:
    return {int(r): MetricRecord(dict(m)) for r, m in values.items()}


@dataclass
class RoundHistory:
    """Flower's per-round metrics of a run so far: what its ``Result`` holds, by round.

    Attributes
    ----------
    train_metrics_clientapp, evaluate_metrics_clientapp, evaluate_metrics_serverapp : dict[int, MetricRecord]
        The aggregated client training and evaluation metrics and the server-side evaluation
        (round 0: the initial model), as Flower's ``Result`` names them.
    """

    train_metrics_clientapp: dict[int, MetricRecord] = field(default_factory=dict)
    evaluate_metrics_clientapp: dict[int, MetricRecord] = field(default_factory=dict)
    evaluate_metrics_serverapp: dict[int, MetricRecord] = field(default_factory=dict)

    def as_json(self) -> dict[str, dict[str, dict[str, Any]]]:
        """JSON-ready: ``{field: {"round": {metric: value}}}`` (values keep int / float / list types)."""
        return {name: {str(r): dict(m) for r, m in getattr(self, name).items()} for name in HISTORY_FIELDS}

    @classmethod
    def from_json(cls, data: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> RoundHistory:
        """The inverse of :meth:`as_json`."""
        return cls(**{name: _records(data.get(name, {})) for name in HISTORY_FIELDS})

    def result(self, arrays: ArrayRecord) -> Result:
        """A ``Result`` holding this history and ``arrays`` as the current global model."""
        result = Result()
        result.arrays = arrays
        for name in HISTORY_FIELDS:
            getattr(result, name).update(getattr(self, name))
        return result


def _round(  # noqa: PLR0913 - one round of Flower's loop, its arguments as Flower passes them
    strategy: Strategy, grid: Grid, server_round: int, arrays: ArrayRecord, result: Result, timeout: float,
    configs: tuple[ConfigRecord, ConfigRecord], evaluate_fn: EvaluateFn | None,
) -> ArrayRecord:
    """Round ``server_round`` exactly as Flower's ``Strategy.start`` runs it; returns the new global model."""
    train_replies = grid.send_and_receive(
        messages=strategy.configure_train(server_round, arrays, configs[0], grid), timeout=timeout)
    agg_arrays, agg_train_metrics = strategy.aggregate_train(server_round, train_replies)
    if agg_arrays is not None:
        result.arrays = arrays = agg_arrays
    if agg_train_metrics is not None:
        log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_train_metrics)
        result.train_metrics_clientapp[server_round] = agg_train_metrics
    evaluate_replies = grid.send_and_receive(
        messages=strategy.configure_evaluate(server_round, arrays, configs[1], grid), timeout=timeout)
    agg_evaluate_metrics = strategy.aggregate_evaluate(server_round, evaluate_replies)
    if agg_evaluate_metrics is not None:
        log(INFO, "\t└──> Aggregated MetricRecord: %s", agg_evaluate_metrics)
        result.evaluate_metrics_clientapp[server_round] = agg_evaluate_metrics
    if evaluate_fn:
        log(INFO, "Global evaluation")
        res = evaluate_fn(server_round, arrays)
        log(INFO, "\t└──> MetricRecord: %s", res)
        if res is not None:
            result.evaluate_metrics_serverapp[server_round] = res
    return arrays


def continue_rounds(  # noqa: PLR0913 - Flower's start(...) plus where to begin
    strategy: Strategy,
    history: RoundHistory,
    first_round: int,
    grid: Grid,
    initial_arrays: ArrayRecord,
    num_rounds: int,
    timeout: float = 3600,
    configs: tuple[ConfigRecord | None, ConfigRecord | None] = (None, None),
    evaluate_fn: EvaluateFn | None = None,
) -> Result:
    """Flower's ``Strategy.start`` loop from ``first_round`` to ``num_rounds``, after ``history``.

    ``initial_arrays`` is the global model after round ``first_round - 1``; it is not evaluated
    again (the history holds its evaluation). ``configs`` is ``(train_config, evaluate_config)``.

    Returns
    -------
    Result
        The earlier rounds' metrics from ``history`` and this call's rounds, the final model.
    """
    log(INFO, "Starting %s strategy at round %d (resumed after round %d):", type(strategy).__name__, first_round,
        first_round - 1)
    log_strategy_start_info(num_rounds, initial_arrays, configs[0], configs[1])
    strategy.summary()
    log(INFO, "")
    train_config = ConfigRecord() if configs[0] is None else configs[0]
    evaluate_config = ConfigRecord() if configs[1] is None else configs[1]
    result = history.result(initial_arrays)
    t_start = time.time()
    arrays = initial_arrays
    for server_round in range(first_round, num_rounds + 1):
        log(INFO, "")
        log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
        arrays = _round(strategy, grid, server_round, arrays, result, timeout, (train_config, evaluate_config),
                        evaluate_fn)
    log(INFO, "")
    log(INFO, "Strategy execution finished in %.2fs (rounds %d-%d)", time.time() - t_start, first_round, num_rounds)
    log(INFO, "")
    log(INFO, "Final results:")
    log(INFO, "")
    for line in io.StringIO(str(result)):
        log(INFO, "\t%s", line.strip("\n"))
    log(INFO, "")
    return result
