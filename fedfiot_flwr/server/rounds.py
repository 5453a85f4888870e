"""One merge round, the same for the Message-API strategy and its legacy twin.

:class:`RoundMerger` takes a round's replies (already attributed to their nodes), decodes and
validates each one once, excludes the broken ones with the reason, calls the aggregator, and keeps
the round's server-side report (:attr:`RoundMerger.reports`, JSON-ready, lists as lists).
"""

from __future__ import annotations

import time
from logging import INFO, WARNING
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import RecordDict
from flwr.supercore import log

from fedfiot_flwr.refine.base import PostMergeStage, StageResult
from fedfiot_flwr.reply_limits import MAX_FISHER_MAGNITUDE
from fedfiot_flwr.server.aggregators import Aggregator, FedAvgAggregator, describe_fedfiot_choice
from fedfiot_flwr.server.outcome import RoundContext, RoundOutcome
from fedfiot_flwr.server.uploads import CollectedUploads, collect_uploads, require_enough, weighted_mean_metrics
from fedfiot_flwr.options import Model

__all__ = ["RoundMerger", "jsonable"]

ValidateFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, float] | None]


def jsonable(value: Any) -> Any:
    """Numpy scalars/arrays to Python values, non-finite floats to None, tuples to lists."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if np.isfinite(value) else None
    return value


def _rejected(uploads: CollectedUploads) -> list[dict[str, str]]:
    """The excluded replies as the report lists them."""
    return [{"client": r.client, "reason": r.reason} for r in uploads.rejections]


class RoundMerger:
    """Decode, validate, exclude, aggregate and report one round.

    Parameters
    ----------
    aggregator : Aggregator
        The merge method.
    buffers : sequence of str
        State-dict entries without a Fisher.
    validate_fn : callable, optional
        ``model dict -> metrics`` on the server's validation data.
    min_valid_replies : int
        The round fails with a clear error below this many valid replies.
    fedavg_baseline : bool
        Also compute FedAvg of the same uploads (reported next to the method's model). With a
        ``post_merge`` stage, FedAvg goes through the same stage, so that the comparison is
        between models that had the same server data used the same way.
    post_merge : PostMergeStage, optional
        Applied to the aggregated model before it is validated and returned (the server
        refinement, :class:`fedfiot_flwr.refine.RefinementStage`, or BatchNorm recalibration as a
        :class:`fedfiot_flwr.refine.ModelMapStage`).
    """

    def __init__(
        self,
        aggregator: Aggregator,
        *,
        buffers: Sequence[str] = (),
        validate_fn: ValidateFn | None = None,
        min_valid_replies: int = 1,
        fedavg_baseline: bool = True,
        post_merge: PostMergeStage | None = None,
    ) -> None:
        if min_valid_replies < 1:
            raise ValueError(f"min_valid_replies must be >= 1, got {min_valid_replies}")
        self.aggregator = aggregator
        self.buffers = tuple(buffers)
        self.validate_fn = validate_fn
        self.min_valid_replies = int(min_valid_replies)
        self.fedavg_baseline = bool(fedavg_baseline)
        self.post_merge = post_merge
        self.reports: list[dict[str, Any]] = []
        self.last: RoundOutcome | None = None
        self._handed_over = False

    def _validate(self, model: Model) -> dict[str, float] | None:
        if self.validate_fn is None:
            return None
        res = self.validate_fn(model)
        if res is None:
            return None
        return {k: float(v) for k, v in res.items() if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}

    def run_round(
        self,
        server_round: int,
        replies: Iterable[tuple[str, RecordDict]],
        errors: Iterable[tuple[str, str]],
        broadcast: Model | None,
    ) -> RoundOutcome:
        """Decode, validate, exclude, aggregate and report one round's replies.

        Parameters
        ----------
        server_round : int
            Current round (1-based).
        replies : iterable of (node id, RecordDict)
            Replies in arrival order, each attributed to the node it answers for.
        errors : iterable of (node id, reason)
            Replies that carry an error instead of content.
        broadcast : dict, optional
            The model sent this round (its names and shapes are what every reply must match).

        Returns
        -------
        RoundOutcome
            The aggregator's outcome, completed with the returned model (post-merge stage
            included, in the broadcast model's order), its validation, the uploads and the report.

        Raises
        ------
        RuntimeError
            When fewer than ``min_valid_replies`` replies are valid; lists every excluded client.
        """
        aggregator = self.round_aggregator(server_round)
        uploads = self._collect(server_round, replies, errors, broadcast, aggregator)
        t0 = time.perf_counter()
        outcome = aggregator.aggregate(uploads, RoundContext(server_round, broadcast, self.buffers, self.validate_fn))
        order = list(broadcast) if broadcast is not None else list(uploads.weights[0])
        stage = self._finish(outcome, uploads, order)
        seconds = time.perf_counter() - t0
        outcome.uploads = uploads
        outcome.report = self._report(server_round, outcome, stage, seconds)
        self.reports.append(outcome.report)
        self.last = outcome
        self._log(server_round, outcome, outcome.validation, stage, seconds, uploads)
        return outcome

    def round_aggregator(self, server_round: int) -> Aggregator:
        """The aggregator of round ``server_round``: an aggregator that no longer wants the Fisher
        (``wants_fisher``, FedFiOT after its ``fisher_rounds``) hands over to FedAvg under its own label."""
        wants_fisher = getattr(self.aggregator, "wants_fisher", None)
        if wants_fisher is None or wants_fisher(server_round):
            self._handed_over = False
            return self.aggregator
        aggregator = FedAvgAggregator(self.aggregator.label)
        if not self._handed_over:  # said on the first round of each hand-over
            self._handed_over = True
            log(INFO, "%s round %s: from this round on, the clients' weights are averaged by size (FedAvg) and the "
                "clients skip the curvature pass (%s)", self.aggregator.label, server_round,
                getattr(self.aggregator, "handover_reason", "fisher_rounds"))
        return aggregator

    def _collect(self, server_round: int, replies: Iterable[tuple[str, RecordDict]],
                 errors: Iterable[tuple[str, str]], broadcast: Model | None, aggregator: Aggregator) -> CollectedUploads:
        """Decode and validate every reply once; log and record the excluded ones; require enough valid ones."""
        label = aggregator.label
        shapes = None if broadcast is None else {k: tuple(v.shape) for k, v in broadcast.items()}
        # An aggregator that caps the Fishers accepts any finite one (``fisher_bound`` None); the
        # others keep the absolute bound.
        fisher_bound = getattr(aggregator, "fisher_bound", MAX_FISHER_MAGNITUDE)
        uploads = collect_uploads(replies, shapes, self.buffers, errors, kind=aggregator.reply_kind,
                                  fisher_kind=aggregator.fisher_kind, fisher_bound=fisher_bound)
        log(INFO, "%s round %s: %d valid replies, %d excluded (%.2f MB received)", label, server_round,
                    len(uploads), len(uploads.rejections), uploads.bytes_received / 2**20)
        for rej in uploads.rejections:
            log(WARNING, "%s round %s: excluded client %s: %s", label, server_round, rej.client,
                rej.reason.removeprefix(f"client {rej.client}: "))  # the client is named once
        try:
            require_enough(uploads, self.min_valid_replies, server_round, label)
        except RuntimeError:
            self.reports.append(jsonable({"round": server_round, "rejected": _rejected(uploads), "failed": True}))
            raise
        return uploads

    def _finish(self, outcome: RoundOutcome, uploads: CollectedUploads, order: Sequence[str]) -> StageResult | None:
        """The returned model: the aggregated one in ``order``, through the post-merge stage, validated;
        FedAvg of the same uploads and every alternative on the same terms."""
        model = {k: np.asarray(outcome.model[k]) for k in order}
        validation = outcome.validation
        if self.fedavg_baseline and "fedavg" not in outcome.alternatives:
            outcome.alternatives["fedavg"] = uploads.fedavg()
        stage: StageResult | None = None
        if self.post_merge is not None:
            stage = self._post_merge(model, uploads, outcome.permutations)
            outcome.alternatives["unrefined"], model = model, {k: np.asarray(stage.model[k]) for k in order}
            if validation is not None:
                outcome.alternative_validation["unrefined"] = dict(validation)
            validation = None  # the model changed: validate what is returned
            if "fedavg" in outcome.alternatives:
                fedavg = {k: np.asarray(outcome.alternatives["fedavg"][k]) for k in order}
                same = all(np.array_equal(fedavg[k], outcome.alternatives["unrefined"][k]) for k in order)
                outcome.alternatives["fedavg"] = model if same else self._post_merge(fedavg, uploads, None).model
                outcome.alternative_validation.pop("fedavg", None)
        if validation is None:
            validation = self._validate(model)
        for name, alt in outcome.alternatives.items():
            outcome.alternatives[name] = {k: np.asarray(alt[k]) for k in order}
            if name not in outcome.alternative_validation and self.validate_fn is not None:
                outcome.alternative_validation[name] = self._validate(outcome.alternatives[name]) or {}
        outcome.model, outcome.validation = model, validation
        return stage

    def _report(self, server_round: int, outcome: RoundOutcome, stage: StageResult | None,
                seconds: float) -> dict[str, Any]:
        """The round's JSON-ready report (lists as lists, non-finite floats as None)."""
        uploads = outcome.uploads
        assert uploads is not None
        server_metrics: dict[str, Any] = {
            "num-valid": len(uploads),
            "num-rejected": len(uploads.rejections),
            "bytes-received": int(uploads.bytes_received),
            "aggregate-seconds": float(seconds),
            **outcome.metrics,
            **(stage.metrics if stage is not None else {}),
        }
        named = (("val", outcome.validation), *((f"{n}-val", v) for n, v in outcome.alternative_validation.items()))
        for prefix, val in named:
            for key, value in (val or {}).items():
                server_metrics[f"{prefix}-{key}"] = float(value)
        return jsonable({
            "round": server_round,
            "strategy": self.aggregator.label,
            "clients": list(uploads.client_ids),
            "num_examples": list(uploads.num_examples),
            "rejected": _rejected(uploads),
            "bytes_received": uploads.bytes_received,
            "bytes_per_client": dict(uploads.bytes_per_client),
            "chosen": outcome.chosen,
            "validation": outcome.validation,
            "alternative_validation": outcome.alternative_validation,
            "client_train_metrics": weighted_mean_metrics(uploads.metrics, uploads.num_examples),
            "server_metrics": server_metrics,
            "seconds": seconds,
            **outcome.record,
            **({"post_merge": {"stage": self.post_merge.label, "returned": stage.returned, **stage.record}}  # type: ignore[union-attr]
               if stage is not None else {}),
        })

    def _post_merge(self, model: Model, uploads: CollectedUploads,
                    permutations: Mapping[str, Sequence[np.ndarray]] | None) -> StageResult:
        assert self.post_merge is not None
        return self.post_merge(model, uploads.weights, permutations, uploads.num_examples, uploads.client_ids,
                               fishers=uploads.fishers)

    def _log(self, server_round: int, outcome: RoundOutcome, validation: Mapping[str, float] | None,
             stage: StageResult | None, seconds: float, uploads: CollectedUploads) -> None:
        """One readable line: what the round returned, the score that chose it, FedAvg on the same terms,
        and the excluded clients."""
        label = self.aggregator.label
        if outcome.chosen.get("variant") in ("aligned", "identity", "fedavg"):
            what = describe_fedfiot_choice(outcome.chosen, outcome.metrics)
        elif outcome.chosen == {"method": "fedavg"}:
            what = "the size-weighted average of the weights (FedAvg)"
        else:
            what = f"chose {outcome.chosen}"
        if stage is not None:
            what += f"; returned {stage.returned}"
        val = ""
        if validation and "accuracy" in validation:
            val = f"; accuracy {validation['accuracy']:.4f} on the server examples that chose it (optimistic)"
            fedavg = outcome.alternative_validation.get("fedavg")
            if fedavg and "accuracy" in fedavg:
                terms = " given the same post-merge stage" if stage is not None else ""
                val += f"; FedAvg of the same uploads{terms}: {fedavg['accuracy']:.4f} on the same examples"
        excluded = "".join(f"; excluded client {r.client}" for r in uploads.rejections)
        log(INFO, "%s round %s (server, %.1fs, %d clients): %s%s%s", label, server_round, seconds, len(uploads), what,
            val, excluded)
