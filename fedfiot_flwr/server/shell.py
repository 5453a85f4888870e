"""The one Flower strategy shell (Message API) every merge method of this package runs in.

:class:`MergeStrategy` is Flower's ``FedAvg`` with its aggregation replaced: sampling, messages,
``start(...)``, federated evaluation and every ``FedAvg`` option stay Flower's, with Flower's
defaults. In ``aggregate_train`` it attributes each reply to the node it answers for, decodes
and validates it once, excludes broken and duplicated replies (naming client and tensor), calls
its :class:`~fedfiot_flwr.server.aggregators.Aggregator`, and returns the new global model with
the clients' own training metrics (aggregated by Flower's ``train_metrics_aggr_fn``, names
unchanged). The merge's own diagnostics are server metrics: logged once per round and kept in
:attr:`MergeStrategy.server_metrics` and :attr:`MergeStrategy.reports`.
"""

from __future__ import annotations

import logging
import pprint
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from logging import DEBUG, INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from fedfiot_flwr.refine.base import ModelMapStage, PostMergeStage
from fedfiot_flwr.refine.options import RefineOptions
from fedfiot_flwr.server.aggregators import Aggregator
from fedfiot_flwr.server.clients_choice import ChoiceScores, ClientsChoice
from fedfiot_flwr.server.nodes import NodeWaiter
from fedfiot_flwr.server.outcome import RoundOutcome
from fedfiot_flwr.server.resume import RoundHistory, continue_rounds
from fedfiot_flwr.server.rounds import RoundMerger
from fedfiot_flwr.server.server_data import plan_server_data
from fedfiot_flwr.server.uploads import FirstReplies
from fedfiot_flwr.options import Model

if TYPE_CHECKING:
    import torch
    from torch.utils.data import Dataset

__all__ = ["RunResult", "MergeStrategy", "StrategyOptions", "arrays_to_numpy", "buffers_of", "check_sampling", "check_model",
           "metric_record", "numpy_to_arrays"]

ValidateFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, float] | None]


def arrays_to_numpy(arrays: ArrayRecord) -> Model:
    """An ArrayRecord as an ordered ``{name: np.ndarray}`` dict."""
    return {k: np.asarray(v.numpy()) for k, v in arrays.items()}


def numpy_to_arrays(model: Mapping[str, np.ndarray], order: Sequence[str] | None = None) -> ArrayRecord:
    """A numpy dict as an ArrayRecord, keys in ``order`` (default: the dict's order)."""
    keys = list(order) if order is not None else list(model)
    # np.array(copy, order="C"), not np.ascontiguousarray: the latter turns 0-d buffers
    # (BatchNorm's num_batches_tracked) into shape (1,), which the next round then rejects.
    return ArrayRecord({k: Array.from_numpy_ndarray(np.array(model[k], order="C")) for k in keys})


def buffers_of(model: torch.nn.Module | None) -> tuple[str, ...]:
    """State-dict entries of ``model`` that are not parameters (BatchNorm statistics)."""
    if model is None:
        return ()
    params = {n for n, _ in model.named_parameters()}
    return tuple(n for n in model.state_dict() if n not in params)


def show_package_logs() -> None:
    """Send the package's own log lines (the sweep, tracing a model) to Flower's console too.

    The merge engine logs to the ``fedfiot_flwr`` logger, which has no handler of its own; a
    strategy gives it Flower's, so that a user sees them where Flower's lines appear.
    """
    package = logging.getLogger("fedfiot_flwr")
    for handler in logging.getLogger("flwr").handlers:
        if handler not in package.handlers:
            package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(logging.INFO)


def check_model(model: Any, label: str) -> None:
    """``model`` is ``None`` or a torch module with floating-point parameters (checked without importing torch).

    Raises
    ------
    TypeError
        For anything else, or a parameter that is not floating point (it has no Fisher), named.
    """
    if model is None:
        return
    if not (callable(getattr(model, "named_parameters", None)) and callable(getattr(model, "state_dict", None))):
        raise TypeError(f"{label}: model must be a torch.nn.Module instance (e.g. model=Net()), "
                        f"got {type(model).__name__} {model!r:.60}")
    for name, param in model.named_parameters():
        if not param.is_floating_point():
            raise TypeError(f"{label}: parameter {name!r} of the model is {param.dtype}; every parameter must be "
                            "floating point (make integer state a buffer)")


def metric_record(values: Mapping[str, Any]) -> MetricRecord:
    """Keep what a MetricRecord can hold: finite numbers and lists of them (booleans as 0/1, integers
    stay integers, so both strategy APIs report the same types)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, bool):
            out[key] = int(value)
        elif isinstance(value, (int, float)) and np.isfinite(value):
            out[key] = value
        elif isinstance(value, list) and value and all(isinstance(v, (int, float)) and np.isfinite(v) for v in value):
            ints = all(isinstance(v, int) for v in value)
            out[key] = [int(v) for v in value] if ints else [float(v) for v in value]
    return MetricRecord(out)


def check_sampling(label: str, **options: Any) -> None:
    """Refuse sampling options Flower would accept and then hang or misbehave on.

    Fractions must lie in [0, 1] and node counts be integers >= 0 (``min_*_nodes``, ``min_fit_clients``...).

    Raises
    ------
    ValueError
        Naming the option and the value.
    """
    for name, value in options.items():
        if name.startswith("fraction"):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= 1.0
            rule = "a number in [0, 1]"
        else:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            rule = "an integer >= 0"
        if not ok:
            raise ValueError(f"{label}: {name} must be {rule}, got {value!r}")


@dataclass
class RunResult(Result):
    """Flower's ``Result`` plus the server-side aggregation metrics of every round.

    Attributes
    ----------
    aggregation_metrics_serverapp : dict[int, MetricRecord]
        Per round, the merge's own numbers (what was kept, the fraction of neurons moved, the
        selection scores, excluded replies): :attr:`MergeStrategy.server_metrics`.
    """

    aggregation_metrics_serverapp: dict[int, MetricRecord] = field(default_factory=dict)

    def aggregation_summary(self) -> str:
        """The section this class adds to Flower's summary."""
        rounds = {r: dict(m) for r, m in self.aggregation_metrics_serverapp.items()}
        return "ServerApp-side Aggregation Metrics:\n" + pprint.pformat(rounds, indent=2, compact=True) + "\n"

    def __repr__(self) -> str:
        """Flower's summary, then the aggregation metrics."""
        return super().__repr__() + "\n" + self.aggregation_summary()


@dataclass(frozen=True)
class StrategyOptions:
    """The options every strategy of this package takes beside Flower's, spelled once.

    The strategies take them as keyword arguments (``FedFiOT(model=Net(), server_data=...)``)
    and pull them apart from ``FedAvg``'s with :meth:`split`; see :class:`MergeStrategy` for
    what each does.
    """

    model: torch.nn.Module | None = None
    buffers: Sequence[str] | None = None
    validate_fn: ValidateFn | None = None
    server_data: Dataset[Any] | None = None
    refine: RefineOptions | None = None
    min_valid_replies: int | None = None
    fedavg_baseline: bool = True
    bn_recalibration: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    node_wait_s: float | None = None

    @classmethod
    def split(cls, options: Mapping[str, Any]) -> tuple[StrategyOptions, dict[str, Any]]:
        """``(this package's options, the rest)`` of keyword arguments; the rest are Flower ``FedAvg``'s."""
        own = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in options.items() if k in own}), {k: v for k, v in options.items() if k not in own}


class MergeStrategy(FedAvg):
    """Flower's ``FedAvg`` with a pluggable one-shot-capable aggregator.

    Parameters
    ----------
    aggregator : Aggregator
        The merge method (FedFiOT, FedFisher, RegMean, FedAvg on the same uploads).
    model : torch.nn.Module, optional
        The architecture; gives the buffer names (state-dict entries without a Fisher).
    buffers : sequence of str, optional
        Explicit buffer names (win over ``model``'s).
    validate_fn : callable, optional
        ``model dict -> metrics`` on the server's validation data
        (:func:`fedfiot_flwr.validation.make_validate_fn` builds one).
    server_data : torch Dataset, optional
        Labelled ``(input, label)`` examples the server holds (instead of ``validate_fn``; needs
        ``model``). On their own they only choose the aggregator's knobs; nothing is trained on
        them. Checked with one forward pass when the strategy is built.
    refine : RefineOptions, optional
        Also fit the returned model on the server's examples
        (:class:`fedfiot_flwr.refine.RefinementStage`): they are split into a fitting and a
        selection fold, the selection fold chooses the knobs and the returned model, the
        fitting fold trains the refinement's candidates. The same stage runs after FedAvg of the
        same uploads when ``fedavg_baseline`` is on (twice the server time).
    min_valid_replies : int, optional
        The round fails with a clear error below this many valid replies (default:
        ``min_train_nodes``, at least 1).
    fedavg_baseline : bool
        Also compute FedAvg of the same uploads each round (in :attr:`last_round`).
    bn_recalibration : callable, optional
        ``model dict -> model dict`` applied to every round's merged model before it is
        validated, reported and broadcast (e.g. BatchNorm running statistics recomputed on server
        data). Without it, BN statistics are the merge's size-weighted averages of the clients'.
        Not with ``refine`` (the refinement recalibrates BatchNorm on its fitting fold itself).
    node_wait_s : float, optional
        Before each round, wait at most this long for ``min_available_nodes`` nodes, then go on
        with the connected ones (at least ``min_valid_replies``); nodes lost since an earlier
        round are reported as ``unavailable_nodes``. ``None``: Flower's unbounded wait.
    **fedavg_options
        The options above (the fields of :class:`StrategyOptions`), and everything Flower's
        ``FedAvg`` takes, with ``FedAvg``'s defaults (``fraction_train``,
        ``fraction_evaluate``, ``min_train_nodes``, ``min_evaluate_nodes``,
        ``min_available_nodes``, ``weighted_by_key``, ``arrayrecord_key``, ``configrecord_key``,
        ``train_metrics_aggr_fn``, ``evaluate_metrics_aggr_fn``).
    """

    def __init__(self, aggregator: Aggregator, **fedavg_options: Any) -> None:
        own, fedavg_options = StrategyOptions.split(fedavg_options)
        model, buffers, validate_fn, refine = own.model, own.buffers, own.validate_fn, own.refine
        bn_recalibration, min_valid_replies = own.bn_recalibration, own.min_valid_replies
        FedAvg.__init__(self, **fedavg_options)
        show_package_logs()
        check_sampling(aggregator.label, fraction_train=self.fraction_train, fraction_evaluate=self.fraction_evaluate,
                       min_train_nodes=self.min_train_nodes, min_evaluate_nodes=self.min_evaluate_nodes,
                       min_available_nodes=self.min_available_nodes)
        check_model(model, aggregator.label)
        self.aggregator = aggregator
        plan = plan_server_data(aggregator.label, model, own.server_data, refine, validate_fn, aggregator.describe,
                                getattr(aggregator, "spec", None))
        if plan.stage is not None and bn_recalibration is not None:
            raise ValueError(f"{aggregator.label}: pass refine or bn_recalibration, not both (the refinement "
                             "recalibrates BatchNorm on its fitting fold)")
        stage: PostMergeStage | None = plan.stage
        if bn_recalibration is not None:
            stage = ModelMapStage(bn_recalibration, "BatchNorm recalibration")
        self.validate_fn = plan.validate_fn
        self.post_merge = stage
        min_valid = max(1, self.min_train_nodes) if min_valid_replies is None else min_valid_replies
        self.merger = RoundMerger(
            aggregator,
            buffers=tuple(buffers) if buffers is not None else buffers_of(model),
            validate_fn=plan.validate_fn,
            min_valid_replies=min_valid,
            fedavg_baseline=own.fedavg_baseline,
            post_merge=stage,
        )
        self.plan = f"{aggregator.label}: {plan.describe}"
        """What the strategy will do with what it was given, in words (logged by :meth:`summary`)."""
        self.server_metrics: dict[int, MetricRecord] = {}
        self._broadcast: Model | None = None
        self._sent: list[Message] = []
        self._node_waiter = NodeWaiter(own.node_wait_s)
        self.unavailable_nodes: dict[int, list[int]] = {}  # round -> nodes lost since an earlier round
        self.lost_replies: dict[int, int] = {}
        """Per round, the instructions whose answer was lost: error replies, no reply, nodes gone before it."""
        self.history = RoundHistory()
        """Flower's per-round metrics so far (what ``start``'s ``Result`` holds), kept for a resume."""
        self.resumed_after = 0
        """The round :meth:`restore` went on from (0: ``start`` begins at round 1)."""
        self.choice: ClientsChoice | None = None
        """The clients' choice between each round's merge and FedAvg (an aggregator with ``clients_choose``)."""
        if getattr(aggregator, "clients_choose", False) and self.fraction_evaluate > 0:
            settings = aggregator.settings  # type: ignore[attr-defined]
            self.choice = ClientsChoice(settings.handover_after, settings.reprobe_after, self.arrayrecord_key,
                                        self.configrecord_key, self.weighted_by_key, self.evaluate_metrics_aggr_fn)
        self._returned: ArrayRecord | None = None
        self._fedavg_offered: Model | None = None  # FedAvg of the round's uploads, as the clients' choice sent it
        self._told_no_loss = False

    # -- what the round produced -------------------------------------------------------------

    @property
    def buffers(self) -> tuple[str, ...]:
        """State-dict entries merged without a Fisher."""
        return self.merger.buffers

    @property
    def min_valid_replies(self) -> int:
        """Minimum number of valid replies a round needs."""
        return self.merger.min_valid_replies

    @property
    def reports(self) -> list[dict[str, Any]]:
        """One JSON-ready report per merged (or failed) round."""
        return self.merger.reports

    @property
    def last_round(self) -> RoundOutcome | None:
        """The last merged round: model, decoded uploads, aggregator outcome and report."""
        return self.merger.last

    # -- what a resumed run needs -----------------------------------------------------------

    def carried_state(self) -> dict[str, Any]:
        """Everything the strategy carries from one round to the next, JSON-ready.

        The per-round reports, server-side metrics, lost nodes and Flower's per-round metrics
        (:attr:`history`). With the global model this is what :meth:`restore` needs to go on as if
        the run had never stopped: every round's merge depends only on its own uploads, the
        broadcast model and the strategy's options (the selection, the robust Fisher cap and the
        refinement keep nothing from one round to the next). Not carried: the node bookkeeping of
        the bounded wait (node ids belong to the SuperLink; a node lost before the stop and still
        missing is waited for once more).
        """
        return {
            "reports": [dict(r) for r in self.reports],
            "server_metrics": {str(r): dict(m) for r, m in self.server_metrics.items()},
            "unavailable_nodes": {str(r): list(n) for r, n in self.unavailable_nodes.items()},
            "history": self.history.as_json(),
            **({"clients_choice": self.choice.state()} if self.choice is not None else {}),
        }

    def restore(self, state: Mapping[str, Any], after_round: int) -> None:
        """Take back :meth:`carried_state` of a run stopped after ``after_round``; ``start`` then begins
        at round ``after_round + 1`` with ``initial_arrays`` the global model of that round.

        Raises
        ------
        ValueError
            If ``after_round < 1`` or ``state`` lacks a part (the message names it).
        """
        if after_round < 1:
            raise ValueError(f"{self.aggregator.label}: restore needs a completed round >= 1, got {after_round}")
        missing = [k for k in ("reports", "server_metrics", "unavailable_nodes", "history") if k not in state]
        if missing:
            raise ValueError(f"{self.aggregator.label}: the carried state lacks {missing}")
        self.merger.reports[:] = [dict(r) for r in state["reports"]]
        self.server_metrics = {int(r): MetricRecord(dict(m)) for r, m in state["server_metrics"].items()}
        self.unavailable_nodes = {int(r): [int(n) for n in nodes] for r, nodes in state["unavailable_nodes"].items()}
        self.history = RoundHistory.from_json(state["history"])
        self.resumed_after = int(after_round)
        if self.choice is not None:
            self.choice.restore(state.get("clients_choice", {}))
            if self.choice.window is not None:
                self.aggregator.hand_over(*self.choice.window, self.choice.handover_sentence())  # type: ignore[attr-defined]

    # -- Flower hooks ------------------------------------------------------------------------

    def start(  # noqa: PLR0913 - Flower's signature
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> RunResult:
        """Flower's ``start``; the returned result also holds the server-side aggregation metrics.

        After :meth:`restore` it begins at the round after the restored one (``initial_arrays``:
        that round's global model, not evaluated again) and returns every round's metrics.
        """
        def tracked(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            res = evaluate_fn(server_round, arrays)  # type: ignore[misc]
            if res is not None:
                self.history.evaluate_metrics_serverapp[server_round] = res
            return res

        tracked_fn = tracked if evaluate_fn is not None else None
        if self.resumed_after:
            result = continue_rounds(self, self.history, self.resumed_after + 1, grid, initial_arrays, num_rounds,
                                     timeout, (train_config, evaluate_config), tracked_fn)
        else:
            result = super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                                   tracked_fn)
        out = RunResult(**{f.name: getattr(result, f.name) for f in fields(result)},
                          aggregation_metrics_serverapp=dict(self.server_metrics))
        for line in out.aggregation_summary().splitlines():  # after the summary Flower printed
            log(INFO, "\t%s", line)
        log(INFO, "")
        return out

    def summary(self) -> None:
        """Log what the strategy will do (in words), then FedAvg's summary."""
        log(INFO, "\t├──> %s", self.plan)
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample as FedAvg (with a bounded wait for nodes); remember the broadcast model and the instructions.

        An aggregator with a ``train_config`` (FedFiOT's) adds its entries to the train config:
        whether the round uses the clients' curvature (:data:`~fedfiot_flwr.options.FISHER_CONFIG_KEY`,
        for the clients to skip the pass when it is not used) and which one
        (:data:`~fedfiot_flwr.options.CURVATURE_CONFIG_KEY`).
        """
        self._broadcast = arrays_to_numpy(arrays)
        train_config = getattr(self.aggregator, "train_config", None)
        if train_config is not None:
            config = ConfigRecord({**config, **train_config(server_round)})
        self._sent, lost = self._node_waiter.configure(
            self, grid, self.min_valid_replies, server_round,
            lambda: super(MergeStrategy, self).configure_train(server_round, arrays, config, grid),
        )
        if lost:
            log(WARNING, "%s round %s: nodes %s are no longer connected", self.aggregator.label, server_round, lost)
            self.unavailable_nodes[server_round] = lost
        return self._sent

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample as FedAvg; with ``node_wait_s``, evaluate on the nodes left after a bounded wait.

        With the clients' choice, each sampled node also gets FedAvg of the same uploads in a second
        evaluate message (:class:`~fedfiot_flwr.server.clients_choice.ClientsChoice`).
        """
        if self.fraction_evaluate == 0.0:
            return super().configure_evaluate(server_round, arrays, config, grid)
        messages = self._node_waiter.configure_evaluate(
            self, grid, server_round,
            lambda: super(MergeStrategy, self).configure_evaluate(server_round, arrays, config, grid),
        )
        order = list(arrays.keys())
        self._fedavg_offered = self._fedavg_candidate(server_round, order)
        if self.choice is None or self._fedavg_offered is None:
            return messages
        return self.choice.pair(server_round, messages, numpy_to_arrays(self._fedavg_offered, order))

    def _fedavg_candidate(self, server_round: int, order: Sequence[str]) -> Model | None:
        """FedAvg of this round's uploads when the clients choose and it differs from the returned model."""
        last = self.merger.last
        if self.choice is None or last is None or last.report.get("round") != server_round or last.uploads is None:
            return None
        fedavg = last.alternatives.get("fedavg")
        fedavg = fedavg if fedavg is not None else last.uploads.fedavg()
        if all(np.array_equal(np.asarray(fedavg[k]), np.asarray(last.model[k])) for k in order):
            return None
        return fedavg

    def _node_of(self, reply: Message, sent: Mapping[str, int]) -> str:
        """The node an answer is for: the instruction's destination (error replies may lack a source)."""
        node = sent.get(reply.metadata.reply_to_message_id)
        return str(node if node is not None else reply.metadata.src_node_id)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and validate each reply once, exclude the broken ones, and aggregate the rest.

        Raises
        ------
        RuntimeError
            When fewer than ``min_valid_replies`` valid replies remain (the message lists every
            excluded client with the reason).
        """
        sent = {m.metadata.message_id: m.metadata.dst_node_id for m in self._sent if m.metadata.message_id}
        good, errors, failed, answered = [], [], 0, set()
        first = FirstReplies()  # in arrival order, error replies included
        for msg in replies:
            node = self._node_of(msg, sent)
            answered.add(node)
            duplicate = first.duplicate(node)
            if duplicate is not None:
                errors.append((node, duplicate))
            elif msg.has_error():
                failed += 1
                errors.append((node, f"error reply: {msg.error.reason} (code {msg.error.code})"))
            else:
                good.append((node, msg.content))
        lost = self.unavailable_nodes.get(server_round)
        self.lost_replies[server_round] = failed + len(lost or ()) + len({str(n) for n in sent.values()} - answered)
        try:
            result = self.merger.run_round(server_round, good, errors, self._broadcast)
        finally:
            if lost and self.reports and self.reports[-1].get("round") == server_round:
                self.reports[-1]["unavailable_nodes"] = list(lost)
        self.server_metrics[server_round] = metric_record(result.report["server_metrics"])
        log(DEBUG, "%s round %s server-side metrics: %s", self.aggregator.label, server_round,
            dict(self.server_metrics[server_round]))
        metrics = self._train_metrics(result)
        if metrics is not None:
            self.history.train_metrics_clientapp[server_round] = metrics
        self._returned = numpy_to_arrays(result.model)
        return self._returned, metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """FedAvg's aggregation of the clients' evaluation metrics (kept in :attr:`history`).

        With the clients' choice: the two models' losses decide the round's global model (the
        returned ``ArrayRecord`` of :meth:`aggregate_train` takes FedAvg's arrays when FedAvg won), and
        the metrics are the chosen model's.
        """
        if self.choice is not None and self.choice.pending(server_round):
            merge, fedavg = self.choice.split(replies)
            scores = self.choice.decide(server_round, merge, fedavg)
            replies = merge if scores is None or scores.kept_merge else fedavg
            self._apply_choice(server_round, scores)
        metrics = super().aggregate_evaluate(server_round, replies)
        if metrics is not None:
            self.history.evaluate_metrics_clientapp[server_round] = metrics
        return metrics

    def _apply_choice(self, server_round: int, scores: ChoiceScores | None) -> None:
        """Make the clients' choice the round's global model, record it, log it once, and hand over when due."""
        label, last = self.aggregator.label, self.merger.last
        assert self.choice is not None and last is not None
        if scores is None:
            if not self._told_no_loss:
                self._told_no_loss = True
                log(WARNING, "%s round %s: no node scored both the merge and FedAvg with an accuracy or a loss "
                    "(a metric whose name ends in 'accuracy', 'acc' or 'loss'); the merge goes on", label, server_round)
            return
        if not scores.kept_merge:
            fedavg = self._fedavg_offered
            assert fedavg is not None  # the choice is pending only after configure_evaluate offered it
            last.alternatives = {"fedfiot-own": last.model, **{k: v for k, v in last.alternatives.items()
                                                               if k != "fedavg"}}
            last.model = {k: np.asarray(fedavg[k]) for k in last.model}
            if self._returned is not None:
                for name, array in numpy_to_arrays(last.model, list(self._returned.keys())).items():
                    self._returned[name] = array
        last.report["clients_choice"] = scores.record()
        last.report["server_metrics"].update(scores.metrics())
        self.server_metrics[server_round] = metric_record(last.report["server_metrics"])
        handover = ""
        window = self.choice.hand_over(server_round)
        if window is not None:
            reason = self.choice.handover_sentence()
            self.aggregator.hand_over(*window, reason)  # type: ignore[attr-defined]
            handover = f"; the next rounds are FedAvg ({reason})"
        log(INFO, "%s round %s (clients' evaluation): %s%s", label, server_round, scores.sentence(), handover)

    def _train_metrics(self, result: RoundOutcome) -> MetricRecord | None:
        """The clients' own training metrics, aggregated as FedAvg does (names unchanged)."""
        contents = result.uploads.contents
        if not contents:
            return None
        try:
            return self.train_metrics_aggr_fn(contents, self.weighted_by_key)
        except (KeyError, TypeError, ValueError) as exc:
            log(WARNING, "train_metrics_aggr_fn failed (%s); using the example-weighted mean", exc)
            return metric_record(result.report["client_train_metrics"])  # the same mean, already in the report
