"""FedFiOT as a Flower strategy of the Message API (``flwr.serverapp.strategy``).

:class:`FedFiOT` is a drop-in replacement for Flower's ``FedAvg``: same sampling, same
``start(grid=..., initial_arrays=..., num_rounds=..., evaluate_fn=...)``. Only the aggregation
differs: each reply carries 16-bit quantized weights and a diagonal Fisher (see
:func:`fedfiot_flwr.client.pack_reply`); the strategy unpacks and validates every reply,
excludes broken ones, and merges the rest with :func:`fedfiot_flwr.merge.merge`, optionally
selecting ``(rho, lam, reference)`` on a server-side validation set.

The bookkeeping shared with the legacy twin (:mod:`fedfiot_flwr.legacy`) lives in
:class:`FedFiOTCore`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from .merge import PermutationSpec
from .merge.validate import check_options
from .results import ResultsFile, round_record, run_recorded, save_checkpoint
from .selection import FALLBACKS, PRESETS, Candidate, MergeOutcome, SweepGrid, merge_round
from .strategy_utils import (
    CollectedUploads,
    NodeWaiter,
    aggregate_client_metrics,
    collect_uploads,
    instruction_destinations,
    require_enough,
    resolve_spec,
    split_replies,
)

if TYPE_CHECKING:
    import torch

Model = dict[str, np.ndarray]


def arrays_to_numpy(arrays: ArrayRecord) -> Model:
    """Convert an ArrayRecord into an ordered ``{name: np.ndarray}`` dict."""
    return {k: np.asarray(v.numpy()) for k, v in arrays.items()}


def numpy_to_arrays(model: Mapping[str, np.ndarray], order: Sequence[str] | None = None) -> ArrayRecord:
    """Convert a numpy dict into an ArrayRecord, keys in ``order`` (default: the dict's order)."""
    keys = list(order) if order is not None else list(model)
    # np.array(copy, order="C"), not np.ascontiguousarray: the latter turns 0-d buffers
    # (BatchNorm's num_batches_tracked) into shape (1,), which the next round then rejects.
    return ArrayRecord({k: Array.from_numpy_ndarray(np.array(model[k], order="C")) for k in keys})


class FedFiOTCore:
    """Configuration, merge and bookkeeping shared by :class:`FedFiOT` and its legacy twin.

    Parameters
    ----------
    spec : PermutationSpec, optional
        Which axes of which tensors move together. Derived from ``model`` when omitted.
    model : torch.nn.Module, optional
        The model architecture; gives the spec (``spec_from_module``) and the buffer names.
    lam, rho, max_iters, reference, matching, aggregation
        The merge's options (see :func:`fedfiot_flwr.merge.merge`); ``reference`` is
        ``"largest"``, ``"broadcast"`` or a client index in reply order.
    fisher_scaling : str
        Per-client Fisher scaling of the merge engine (``"none"``, the paper's, or ``"size"``,
        ``"normalized"``, ``"normalized-size"``).
    fallback : {"objective", "validation", "none"}
        How to choose between the aligned and the identity merge (see
        :func:`fedfiot_flwr.selection.merge_round`).
    buffers : sequence of str, optional
        State-dict entries without a Fisher (read from ``model`` when given).
    validate_fn : callable, optional
        ``model dict -> metrics`` on the server's validation set (framework-neutral form; the
        strategies wrap their Flower-style validation functions into it).
    sweep : SweepGrid or bool, optional
        Candidate grid for server-side selection (``True``: the paper's grid). Used only with a
        validation function.
    selection_metric : str
        Validation metric to select on (maximised unless its name contains ``"loss"``).
    min_valid_replies : int
        The round fails with a clear error when fewer valid replies remain.
    results_path : str or Path, optional
        JSON results file, rewritten after every round.
    checkpoint_dir : str or Path, optional
        Where ``round-NNN.pt`` (after each round) and ``final.pt`` (at the end) are written.
    baseline : bool
        Also compute FedAvg of the same uploads (recorded next to FedFiOT's numbers).
    """

    def _init_core(
        self,
        *,
        spec: PermutationSpec | None,
        model: torch.nn.Module | None,
        lam: float,
        rho: float,
        max_iters: int,
        reference: str | int,
        matching: str,
        aggregation: str,
        fisher_scaling: str,
        fallback: str | None,
        buffers: Sequence[str] | None,
        sweep: SweepGrid | bool | None,
        selection_metric: str,
        min_valid_replies: int,
        results_path: str | Path | None,
        checkpoint_dir: str | Path | None,
        baseline: bool,
        preset: str | None = None,
        fedavg_candidate: bool | None = None,
        fisher_cap: float | None = None,
    ) -> None:
        check_options(lam, rho, max_iters, matching, aggregation, "objective")
        if preset is not None:
            if preset not in PRESETS:
                raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
            chosen = PRESETS[preset]
            fallback = chosen["fallback"] if fallback is None else fallback
            fisher_cap = chosen["fisher_cap"] if fisher_cap is None else fisher_cap
            fedavg_candidate = chosen["fedavg_candidate"] if fedavg_candidate is None else fedavg_candidate
            if sweep is True:  # an explicit SweepGrid is the user's own and stays as given
                sweep = SweepGrid(fisher_scalings=chosen["fisher_scalings"])
        fallback = "objective" if fallback is None else fallback
        self.preset = preset
        self.fedavg_candidate = bool(fedavg_candidate)
        self.fisher_cap = None if fisher_cap is None or fisher_cap == 0 else float(fisher_cap)
        if self.fisher_cap is not None and not (np.isfinite(self.fisher_cap) and self.fisher_cap >= 1):
            raise ValueError(f"fisher_cap must be 0 (off) or a finite number >= 1, got {fisher_cap!r}")
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {fallback!r}")
        self.spec, model_buffers = resolve_spec(spec, model)
        if self.spec is None:
            raise ValueError("FedFiOT needs a permutation spec: pass spec=PermutationSpec(...) or model=<torch module>")
        self.buffers: tuple[str, ...] = tuple(buffers) if buffers is not None else model_buffers
        self.default_candidate = Candidate(float(rho), float(lam), reference, fisher_scaling)
        self.max_iters = int(max_iters)
        self.matching = matching
        self.aggregation = aggregation
        self.fallback = fallback
        self.sweep: SweepGrid | None = SweepGrid() if sweep is True else (sweep or None)
        self.selection_metric = selection_metric
        if min_valid_replies < 1:
            raise ValueError(f"min_valid_replies must be >= 1, got {min_valid_replies}")
        self.min_valid_replies = int(min_valid_replies)
        self.results_path = Path(results_path) if results_path is not None else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.baseline = baseline
        self.results = ResultsFile(self.results_path, self.core_config())
        self.last_outcome: MergeOutcome | None = None
        self.last_uploads: CollectedUploads | None = None
        self._broadcast: Model | None = None
        self.bn_recalibration: Callable[[Model], Model] | None = None
        self._core_validate: Callable[[int, Model], Mapping[str, float] | None] | None = None

    def core_config(self) -> dict[str, Any]:
        """The strategy's merge configuration as a JSON-ready dict."""
        return {
            "strategy": type(self).__name__,
            "lam": self.default_candidate.lam,
            "rho": self.default_candidate.rho,
            "reference": self.default_candidate.reference,
            "fisher_scaling": self.default_candidate.fisher_scaling,
            "max_iters": self.max_iters,
            "matching": self.matching,
            "aggregation": self.aggregation,
            "fallback": self.fallback,
            "buffers": list(self.buffers),
            "sweep": None if self.sweep is None else {
                "rhos": list(self.sweep.rhos), "lams": list(self.sweep.lams),
                "references": list(self.sweep.references), "fisher_scalings": list(self.sweep.fisher_scalings),
            },
            "selection_metric": self.selection_metric,
            "min_valid_replies": self.min_valid_replies,
            "preset": self.preset,
            "fedavg_candidate": self.fedavg_candidate,
            "fisher_cap": self.fisher_cap,
        }

    def merge_replies(
        self,
        server_round: int,
        replies: Iterable[tuple[str, RecordDict]],
        errors: Iterable[tuple[str, str]] = (),
    ) -> tuple[Model, dict[str, Any]]:
        """Unpack, validate and merge one round's replies.

        Parameters
        ----------
        server_round : int
            Current round (1-based).
        replies : iterable of (client id, RecordDict)
            Reply contents with their sender.
        errors : iterable of (client id, reason)
            Replies that failed in transport.

        Returns
        -------
        tuple
            ``(global model dict, flat metrics)``; the metrics hold numbers and lists of numbers.

        Raises
        ------
        RuntimeError
            When fewer than ``min_valid_replies`` replies pass validation.
        """
        broadcast = self._broadcast
        shapes = None if broadcast is None else {k: tuple(v.shape) for k, v in broadcast.items()}
        uploads = collect_uploads(replies, shapes, self.buffers, errors)
        log(
            INFO,
            "FedFiOT round %s: %d valid replies, %d excluded (%.2f MB received)",
            server_round, len(uploads), len(uploads.rejections), uploads.bytes_received / 2**20,
        )
        for rej in uploads.rejections:
            log(WARNING, "FedFiOT round %s: excluded client %s: %s", server_round, rej.client, rej.reason)
        try:
            require_enough(uploads, self.min_valid_replies, server_round)
        except RuntimeError as exc:
            self.results.update_round(server_round, {"rejected": [vars(r) for r in uploads.rejections]})
            self.results.finish(error=str(exc))
            raise
        validate = None
        if self._core_validate is not None:
            core_validate = self._core_validate
            validate = lambda m: core_validate(server_round, m)  # noqa: E731
        outcome = merge_round(
            uploads,
            self.spec,  # type: ignore[arg-type]
            self.default_candidate,
            max_iters=self.max_iters,
            matching=self.matching,
            aggregation=self.aggregation,
            fallback=self.fallback,
            buffers=self.buffers,
            broadcast=broadcast,
            server_round=server_round,
            sweep=self.sweep,
            validate=validate,
            metric=self.selection_metric,
            baseline=self.baseline,
            fedavg_candidate=self.fedavg_candidate,
            fisher_cap=self.fisher_cap,
        )
        order = list(broadcast) if broadcast is not None else list(uploads.weights[0])
        model = {k: outcome.model[k] for k in order}
        if self.bn_recalibration is not None:
            model = self.bn_recalibration(model)
        self.last_outcome, self.last_uploads = outcome, uploads
        record = round_record(server_round, uploads, outcome, self.matching)
        if self.checkpoint_dir is not None:
            record["checkpoint"] = str(save_checkpoint(model, self.checkpoint_dir / f"round-{server_round:03d}.pt"))
        self.results.update_round(server_round, record)
        metrics = self._flat_metrics(uploads, outcome, record)
        log(
            INFO,
            "FedFiOT round %s: %s, %s merge (J aligned %.4g vs identity %.4g), %.0f%% neurons permuted, "
            "%d trial(s) in %.2fs%s",
            server_round, outcome.candidate.label(), outcome.variant, outcome.result.aligned_objective,
            outcome.result.identity_objective, 100 * float(np.mean(outcome.result.fraction_permuted or [0.0])),
            len(outcome.trials), outcome.seconds,
            "" if outcome.validation is None else
            f"; validation {self.selection_metric} {outcome.validation.get(self.selection_metric, float('nan')):.4f}"
            + ("" if not outcome.baseline_validation else
               f" (FedAvg {outcome.baseline_validation.get(self.selection_metric, float('nan')):.4f})"),
        )
        return model, metrics

    def _flat_metrics(self, uploads: CollectedUploads, outcome: MergeOutcome, record: Mapping[str, Any]) -> dict[str, Any]:
        """Numbers (and lists of numbers) for Flower's MetricRecord / legacy metrics dict."""
        res = outcome.result
        cand = outcome.candidate
        iters = [int(r.iterations) for r in res.reports.values()]
        metrics: dict[str, Any] = aggregate_client_metrics(uploads.metrics, uploads.num_examples)
        metrics.update(
            {
                "num-valid": len(uploads),
                "num-rejected": len(uploads.rejections),
                "bytes-received": int(uploads.bytes_received),
                "objective-aligned": float(res.aligned_objective),
                "objective-identity": float(res.identity_objective),
                "fallback-taken": int(bool(record["fallback_taken"])),
                "fedavg-won": int(outcome.variant == "fedavg"),
                "inner-iterations-max": max(iters) if iters else 0,
                "fraction-permuted-mean": float(np.mean(res.fraction_permuted)) if res.fraction_permuted else 0.0,
                "rho": float(cand.rho),
                "lam": float(cand.lam),
                "reference-broadcast": int(cand.reference == "broadcast"),
                "fisher-scaling-size": int(cand.fisher_scaling == "size"),
                "merge-seconds": float(res.seconds),
                "selection-seconds": float(outcome.seconds),
                "num-trials": len(outcome.trials),
            }
        )
        if iters:
            metrics["inner-iterations"] = iters
        if res.fraction_permuted:
            metrics["fraction-permuted"] = [float(x) for x in res.fraction_permuted]
        for prefix, val in (("val", outcome.validation), ("fedavg-val", outcome.baseline_validation)):
            for key, value in (val or {}).items():
                if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
                    metrics[f"{prefix}-{key}"] = float(value)
        return metrics


class FedFiOT(FedAvg, FedFiOTCore):
    """FedFiOT: Fisher-weighted optimal-transport merging, as a Message-API Flower strategy.

    Use it like Flower's ``FedAvg``::

        strategy = FedFiOT(model=Net(), fraction_train=1.0, validate_fn=validate)
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()),
                                num_rounds=1, evaluate_fn=test)

    Clients must reply with :func:`fedfiot_flwr.client.train_and_pack` /
    :func:`fedfiot_flwr.client.pack_reply` (weights and Fisher, 16-bit quantized).

    Parameters
    ----------
    spec : PermutationSpec, optional
        Permutation spec; derived from ``model`` when omitted.
    model : torch.nn.Module, optional
        The architecture (spec and buffer names are read from it).
    lam : float (default: 1e-4)
        Fisher damping.
    rho : float (default: 0.5)
        Fisher tempering exponent.
    max_iters : int (default: 8)
        Inner iterations per layer.
    reference : "largest" | "broadcast" | int (default: "largest")
        Initial global layer of the alternating minimisation.
    matching : "fisher" | "euclidean" | "none" (default: "fisher")
    aggregation : "fisher" | "uniform" | "size" (default: "fisher")
    fisher_scaling : "none" | "size" | "normalized" | "normalized-size" (default: "none")
        Per-client Fisher scaling (see :func:`fedfiot_flwr.merge.merge`).
    fallback : "objective" | "validation" | "none" (default: from ``preset``)
        The paper's identity fallback, a validation-based one, or none.
    preset : "default" | "paper" | None (default: "default")
        ``"paper"``: the paper's behaviour (objective-based fallback, unscaled Fisher).
        ``"default"``: choose on validation among the aligned merge, the identity merge and
        FedAvg of the same uploads, and let the sweep also try the size-scaled Fisher (see
        README, "FedFiOT against FedAvg"). Explicit ``fallback`` / ``fedavg_candidate`` win.
        ``None``: only the explicit options (fallback defaults to the paper's rule).
    fedavg_candidate : bool, optional (default: from ``preset``)
        Let FedAvg of the same uploads compete on validation; when it wins it is returned and
        reported as such (``fedavg_won``), with FedFiOT's own merge reported next to it.
    fisher_cap : float, optional (default: from ``preset``: 1 for "default", none for "paper")
        Robust weighting: no client's Fisher may exceed this factor times the clients' median
        (:func:`fedfiot_flwr.merge.robust.cap_fishers`); ``0`` turns it off.
    validate_fn : callable, optional
        ``(server_round, ArrayRecord) -> MetricRecord | None`` on the server's *validation* set,
        same signature as ``evaluate_fn``. Enables server-side selection over ``sweep``.
    sweep : SweepGrid | bool | None (default: None)
        The selection grid (``True``: the paper's grid). Ignored without ``validate_fn``.
    selection_metric : str (default: "accuracy")
        Key of ``validate_fn``'s MetricRecord to select on.
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes
        Node sampling, as in ``FedAvg``. ``fraction_evaluate`` defaults to 0 (FedFiOT evaluates
        on the server).
    min_valid_replies : int, optional
        Minimum valid replies to merge (default: ``min_train_nodes``).
    node_wait_s : float, optional
        Before each round, wait at most this long for ``min_available_nodes`` nodes, then go on
        with the connected ones (at least ``min_valid_replies``); nodes lost since an earlier
        round are recorded as ``unavailable_nodes``. ``None``: Flower's unbounded wait.
    results_path : str or Path, optional
        JSON results file (per-round metrics; status "finished"/"failed" at the end).
    checkpoint_dir : str or Path, optional
        Directory for ``round-NNN.pt`` and ``final.pt`` (torch ``state_dict`` files).
    baseline : bool (default: True)
        Also merge the same uploads with FedAvg and report its validation/test numbers.
    run_info : mapping, optional
        Extra entries for the results file's ``"config"`` (e.g. the app's run config).
    weighted_by_key, arrayrecord_key, configrecord_key, evaluate_metrics_aggr_fn
        As in ``FedAvg``.
    bn_recalibration : callable, optional
        ``model dict -> model dict`` applied to every round's merged model before it is
        evaluated, checkpointed and broadcast, e.g.
        :func:`fedfiot_flwr.batchnorm.batchnorm_recalibration` (BatchNorm running statistics
        recomputed on server data). Without it, BN statistics are the merge's size-weighted
        averages of the clients' (permuted) statistics.
    """

    # pylint: disable=too-many-arguments,too-many-locals
    def __init__(
        self,
        spec: PermutationSpec | None = None,
        model: torch.nn.Module | None = None,
        *,
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
        validate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        sweep: SweepGrid | bool | None = None,
        selection_metric: str = "accuracy",
        fraction_train: float = 1.0,
        fraction_evaluate: float = 0.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        min_valid_replies: int | None = None,
        node_wait_s: float | None = None,
        results_path: str | Path | None = None,
        checkpoint_dir: str | Path | None = None,
        baseline: bool = True,
        run_info: Mapping[str, Any] | None = None,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
        bn_recalibration: Callable[[Model], Model] | None = None,
    ) -> None:
        FedAvg.__init__(
            self,
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            min_train_nodes=min_train_nodes,
            min_evaluate_nodes=min_evaluate_nodes,
            min_available_nodes=min_available_nodes,
            weighted_by_key=weighted_by_key,
            arrayrecord_key=arrayrecord_key,
            configrecord_key=configrecord_key,
            evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn,
        )
        self._init_core(
            spec=spec, model=model, lam=lam, rho=rho, max_iters=max_iters, reference=reference,
            matching=matching, aggregation=aggregation, fisher_scaling=fisher_scaling, fallback=fallback,
            preset=preset, fedavg_candidate=fedavg_candidate, fisher_cap=fisher_cap,
            buffers=buffers, sweep=sweep, selection_metric=selection_metric,
            min_valid_replies=min_valid_replies if min_valid_replies is not None else max(1, min_train_nodes),
            results_path=results_path, checkpoint_dir=checkpoint_dir, baseline=baseline,
        )
        self.validate_fn = validate_fn
        self.bn_recalibration = bn_recalibration
        self.run_info = dict(run_info or {})
        self._instructions: list[Message] = []
        self._node_waiter = NodeWaiter(node_wait_s)
        if self.sweep is not None and validate_fn is None:
            log(WARNING, "FedFiOT: sweep given without validate_fn; the grid is ignored (nothing to select on)")
        if validate_fn is not None:
            self._core_validate = self._validate_numpy

    def _validate_numpy(self, server_round: int, model: Model) -> dict[str, float] | None:
        assert self.validate_fn is not None
        order = list(self._broadcast) if self._broadcast is not None else None
        res = self.validate_fn(server_round, numpy_to_arrays(model, order))
        return None if res is None else {k: v for k, v in res.items() if not isinstance(v, list)}

    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "\t├──> FedFiOT merge: %s", self.core_config())
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the broadcast model (layout check, ``reference="broadcast"``), then sample as FedAvg.

        The instructions are remembered too: a reply is attributed to the node its instruction went to.
        With ``node_wait_s``, the wait for missing nodes is bounded (see :class:`NodeWaiter`).
        """
        self._broadcast = arrays_to_numpy(arrays)
        self._instructions, lost = self._node_waiter.configure(
            self, grid, self.min_valid_replies, server_round,
            lambda: super(FedFiOT, self).configure_train(server_round, arrays, config, grid),
        )
        if lost:
            log(WARNING, "FedFiOT round %s: nodes %s are no longer connected", server_round, lost)
            self.results.update_round(server_round, {"unavailable_nodes": lost})
        return self._instructions

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unpack and validate the replies, exclude broken ones, and merge the rest with FedFiOT.

        Raises
        ------
        RuntimeError
            When fewer than ``min_valid_replies`` valid replies remain.
        """
        good, errors = split_replies(replies, instruction_destinations(self._instructions))
        model, metrics = self.merge_replies(server_round, good, errors)
        order = list(self._broadcast) if self._broadcast is not None else None
        return numpy_to_arrays(model, order), MetricRecord(metrics)

    # pylint: disable=too-many-arguments,too-many-positional-arguments
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run ``num_rounds`` rounds, as ``FedAvg.start``, and record everything in the results file.

        Besides Flower's behaviour, ``evaluate_fn`` (the test evaluation) is also applied to the
        FedAvg merge of the same uploads, the results file is finalised (status "finished", or
        "failed" with the error), and ``final.pt`` is written to ``checkpoint_dir``.
        """
        self.results = ResultsFile(self.results_path, {**self.core_config(), "num_rounds": num_rounds, **self.run_info})
        wrapped = None if evaluate_fn is None else self._wrap_evaluate(evaluate_fn)
        return run_recorded(
            super().start, self.results, self.checkpoint_dir,
            ("test", "fedavg_test", "own_test", "validation", "fedavg_validation", "chosen", "fedavg_won"),
            num_rounds, grid=grid, initial_arrays=initial_arrays, timeout=timeout,
            train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=wrapped,
        )

    def _wrap_evaluate(
        self, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None]
    ) -> Callable[[int, ArrayRecord], MetricRecord | None]:
        def wrapped(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            res = evaluate_fn(server_round, arrays)
            test = None if res is None else {k: v for k, v in res.items() if not isinstance(v, list)}
            if server_round == 0:
                self.results.data["initial_test"] = test
                self.results.write()
                return res
            values: dict[str, Any] = {"test": test}
            outcome = self.last_outcome
            if outcome is not None and outcome.baseline_model is not None:
                base = evaluate_fn(server_round, numpy_to_arrays(outcome.baseline_model, list(arrays.keys())))
                values["fedavg_test"] = None if base is None else {
                    k: v for k, v in base.items() if not isinstance(v, list)
                }
                log(INFO, "FedFiOT round %s: test %s | FedAvg on the same uploads: %s",
                    server_round, values["test"], values["fedavg_test"])
            if outcome is not None and outcome.variant == "fedavg" and outcome.own_model is not None:
                own = evaluate_fn(server_round, numpy_to_arrays(outcome.own_model, list(arrays.keys())))
                values["own_test"] = None if own is None else {k: v for k, v in own.items() if not isinstance(v, list)}
                log(INFO, "FedFiOT round %s: FedAvg won on validation; FedFiOT's own merge (%s) tests at %s",
                    server_round, outcome.own_variant, values["own_test"])
            self.results.update_round(server_round, values)
            return res

        return wrapped
