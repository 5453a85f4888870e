"""FedFisher (diagonal, K-FAC) and RegMean as Message-API Flower strategies.

Both are drop-in replacements for Flower's ``FedAvg`` with FedFiOT's interface (same sampling,
same ``start(grid=..., initial_arrays=..., num_rounds=..., evaluate_fn=...)``, same
``validate_fn``, results file and checkpoints):

- :class:`FedFisherStrategy` (``variant="kfac"`` or ``"diag"``) minimises the Fisher-weighted
  objective from the size-weighted average and keeps the best checkpoint on validation
  (:func:`~fedfiot_flwr.baselines.fedfisher.fedfisher_kfac`, ``fedfisher_diag``);
- :class:`RegMeanStrategy` solves RegMean for every off-diagonal scaling ``alpha`` and keeps
  the best on validation (:func:`~fedfiot_flwr.baselines.regmean.regmean_select`).

The bookkeeping every one-shot baseline shares (splitting error replies off, excluding
broken uploads with the reason, the minimum number of valid replies, the JSON results file,
checkpoints, the test evaluation of the merge and of FedAvg on the same uploads) lives in
:class:`OneShotBaselineStrategy`; a subclass only says how to collect its uploads and how to
merge them.

The client half of each strategy is :func:`pack_upload`, kept next to the strategies so that
a strategy and the upload it expects cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result
from flwr.supercore import log

from fedfiot_flwr.baselines.averaging import size_weighted_average
from fedfiot_flwr.baselines.fedfisher import OPTIMIZERS, _check_optim, fedfisher_diag, fedfisher_kfac
from fedfiot_flwr.baselines.regmean import REGMEAN_ALPHAS, regmean_select
from fedfiot_flwr.baselines.wire import (
    FACTOR_PREFIX,
    fedavg_payload_bytes,
    unpack_curvature_reply,
)
from fedfiot_flwr.curvature import InputGram, KFACFactors
from fedfiot_flwr.results import ResultsFile, run_recorded, save_checkpoint
from fedfiot_flwr.strategy import arrays_to_numpy, numpy_to_arrays
from fedfiot_flwr.strategy_utils import (
    CollectedUploads,
    Rejection,
    aggregate_client_metrics,
    DUPLICATE_REASON,
    NodeWaiter,
    collect_uploads,
    instruction_destinations,
    record_bytes,
    require_enough,
    split_replies,
)
from fedfiot_flwr.reply_limits import MAX_CURVATURE_MAGNITUDE, check_magnitude

if TYPE_CHECKING:
    import torch

__all__ = [
    "FISHER_KINDS",
    "FEDFISHER_VARIANTS",
    "UPLOAD_KINDS",
    "BaselineOutcome",
    "CollectedCurvature",
    "FedFisherStrategy",
    "OneShotBaselineStrategy",
    "RegMeanStrategy",
    "collect_curvature_uploads",
    "pack_upload",
    "split_replies",
]

Model = dict[str, np.ndarray]
Score = Callable[[Model], float]

FEDFISHER_VARIANTS = ("kfac", "diag")
FISHER_KINDS = ("true", "empirical")
UPLOAD_KINDS = ("fedfiot", "fedfisher-diag", "fedfisher-kfac", "regmean")
"""What :func:`pack_upload` can send: one per value of the app's ``strategy`` key."""


# ------------------------------------------------------------------------------ client side


def pack_upload(
    strategy: str,
    model: torch.nn.Module,
    loader: Iterable[Any],
    *,
    num_examples: int | None = None,
    metrics: Mapping[str, float] | None = None,
    fisher_kind: str | None = None,
    rank: int | str | None = "fedavg",
    device: torch.device | str | None = None,
) -> RecordDict:
    """The reply a client of ``strategy`` sends for its trained ``model``.

    Parameters
    ----------
    strategy : str
        ``"fedfiot"`` or ``"fedfisher-diag"`` (16-bit weights and diagonal Fisher,
        :func:`fedfiot_flwr.client.pack_reply`), ``"fedfisher-kfac"`` (16-bit weights and
        8-bit low-rank K-FAC factors, :func:`~fedfiot_flwr.baselines.wire.pack_kfac_reply`) or
        ``"regmean"`` (16-bit weights and 8-bit low-rank input Grams,
        :func:`~fedfiot_flwr.baselines.wire.pack_gram_reply`).
    model : torch.nn.Module
        The locally trained model.
    loader : Iterable
        The client's examples once, without augmentation (curvature pass).
    num_examples : int, optional
        Local data-set size; defaults to ``len(loader.dataset)``.
    metrics : mapping of str to float, optional
        Training metrics to send along.
    fisher_kind : str, optional
        ``"true"`` or ``"empirical"``; default ``"empirical"`` for FedFiOT (eq. 106) and
        ``"true"`` for FedFisher (its code). Ignored by RegMean.
    rank : int, None or "fedavg"
        Shared rank cap of the curvature factors (``"fedavg"``: stay within FedAvg's upload).
    device : torch.device or str, optional
        Where the curvature is computed (default: CUDA when available).

    Returns
    -------
    RecordDict

    Raises
    ------
    ValueError
        For an unknown ``strategy`` or ``fisher_kind``.
    """
    import torch

    from fedfiot_flwr.baselines.wire import pack_gram_reply, pack_kfac_reply
    from fedfiot_flwr.client import pack_reply
    from fedfiot_flwr.curvature import input_grams, kfac_factors
    from fedfiot_flwr.fisher import diagonal_fisher

    if strategy not in UPLOAD_KINDS:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {UPLOAD_KINDS}")
    kind = fisher_kind or ("empirical" if strategy == "fedfiot" else "true")
    if kind not in FISHER_KINDS:
        raise ValueError(f"unknown Fisher kind {fisher_kind!r}; choose one of {FISHER_KINDS}")
    dev = device if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if num_examples is None:
        dataset = getattr(loader, "dataset", None)
        if dataset is None:
            raise ValueError("pack_upload: pass num_examples for a loader without a dataset")
        num_examples = len(dataset)
    n = int(num_examples)
    state = model.state_dict()
    if strategy in ("fedfiot", "fedfisher-diag"):
        fisher = diagonal_fisher(model, loader, kind, device=dev, progress=False)
        return pack_reply(state, fisher, n, metrics)
    if strategy == "fedfisher-kfac":
        factors = kfac_factors(model, loader, kind, device=dev)
        return pack_kfac_reply(state, factors, n, fisher_kind=kind, rank=rank, metrics=metrics)
    return pack_gram_reply(state, input_grams(model, loader, device=dev), n, rank=rank, metrics=metrics)


# ---------------------------------------------------------------------- collecting uploads


@dataclass
class CollectedCurvature(CollectedUploads):
    """Valid K-FAC or RegMean uploads of one round (``fishers`` stays empty).

    Attributes
    ----------
    factors : list of dict[str, KFACFactors]
        Per valid upload, the dequantized K-FAC factors (K-FAC replies).
    grams : list of dict[str, InputGram]
        Per valid upload, the dequantized input Grams (RegMean replies).
    fisher_kinds : list of str or None
        The Fisher kind each valid upload declares (``None`` for RegMean).
    ranks : list of int or None
        The rank cap each valid upload used (``None``: full rank).
    curvature_bytes_per_client : dict[str, int]
        Bytes of the curvature factors in each reply (part of ``bytes_per_client``).
    """

    factors: list[dict[str, KFACFactors]] = field(default_factory=list)
    grams: list[dict[str, InputGram]] = field(default_factory=list)
    fisher_kinds: list[str | None] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    curvature_bytes_per_client: dict[str, int] = field(default_factory=dict)


def _layer_signature(layers: Mapping[str, KFACFactors | InputGram]) -> list[tuple[str, str, str | None]]:
    return [(name, f.weight, f.bias) for name, f in layers.items()]


def collect_curvature_uploads(
    replies: Iterable[tuple[str, RecordDict]],
    expected_shapes: Mapping[str, tuple[int, ...]] | None,
    method: str,
    errors: Iterable[tuple[str, str]] = (),
    fisher_kind: str | None = None,
) -> CollectedCurvature:
    """Unpack, dequantize and validate K-FAC or RegMean replies; exclude the broken ones.

    Parameters
    ----------
    replies : iterable of (client id, RecordDict)
        Reply contents with their sender.
    expected_shapes : mapping of str to tuple of int, optional
        The broadcast model's state-dict shapes (``None``: the first valid upload's).
    method : {"kfac", "gram"}
        The upload every reply must carry.
    errors : iterable of (client id, reason)
        Replies that failed in transport (recorded as rejections).
    fisher_kind : str, optional
        When given, K-FAC uploads computed with another Fisher kind are excluded.

    Returns
    -------
    CollectedCurvature
        Valid uploads in reply order (all with the first valid upload's layers) and the
        rejections with the reason (naming the client and the tensor or factor).
    """
    out = CollectedCurvature()
    out.rejections.extend(Rejection(str(c), str(r)) for c, r in errors)
    reference: list[tuple[str, str, str | None]] | None = None
    shapes = None if expected_shapes is None else dict(expected_shapes)
    seen: set[str] = set()
    for client, content in replies:
        client = str(client)
        record_bytes(out, client, content)
        if client in seen:
            out.rejections.append(Rejection(client, DUPLICATE_REASON))
            continue
        seen.add(client)
        try:
            up = unpack_curvature_reply(content, shapes, client)
            if up.method != method:
                raise ValueError(f"client {client}: sent a {up.method!r} upload, this strategy needs {method!r}")
            if fisher_kind is not None and method == "kfac" and up.fisher_kind != fisher_kind:
                raise ValueError(f"client {client}: K-FAC factors of the {up.fisher_kind!r} Fisher, "
                                 f"this strategy expects {fisher_kind!r}")
            for name, w in up.weights.items():
                if np.issubdtype(w.dtype, np.floating) and not np.all(np.isfinite(w)):
                    raise ValueError(f"client {client}: tensor {name!r} has NaN or infinite values")
            layers: Mapping[str, KFACFactors | InputGram] = up.factors if method == "kfac" else up.grams
            for name, f in layers.items():
                mats = (("A", f.A), ("G", f.G)) if isinstance(f, KFACFactors) else (("gram", f.gram),)
                for what, mat in mats:
                    if not np.all(np.isfinite(mat)):
                        raise ValueError(f"client {client}: factor {FACTOR_PREFIX}{name}/{what} has NaN or infinite values")
                    if mat.size:
                        check_magnitude(float(np.max(np.abs(mat))), MAX_CURVATURE_MAGNITUDE,
                                        f"client {client}: factor {FACTOR_PREFIX}{name}/{what}")
            signature = _layer_signature(layers)
            if reference is not None and signature != reference:
                raise ValueError(f"client {client}: curvature layers {[s[0] for s in signature]} differ from the "
                                 f"other clients' {[s[0] for s in reference]}")
        except Exception as exc:  # noqa: BLE001 - an untrusted reply excludes itself, never the round
            out.rejections.append(Rejection(client, str(exc) or type(exc).__name__))
            continue
        if shapes is None:
            shapes = {k: tuple(np.shape(v)) for k, v in up.weights.items()}
        reference = signature
        arrays = content.array_records.values()
        out.curvature_bytes_per_client[client] = int(sum(
            len(a.data) for rec in arrays for k, a in rec.items() if k.startswith(FACTOR_PREFIX)))
        out.client_ids.append(client)
        out.weights.append(dict(up.weights))
        out.num_examples.append(int(up.num_examples))
        out.metrics.append(dict(up.metrics))
        out.factors.append(dict(up.factors))
        out.grams.append(dict(up.grams))
        out.fisher_kinds.append(up.fisher_kind)
        out.ranks.append(up.rank)
    return out


# ------------------------------------------------------------------------- shared strategy


@dataclass
class BaselineOutcome:
    """What a baseline's merge returns to the shared bookkeeping.

    Attributes
    ----------
    model : dict[str, np.ndarray]
        The chosen global model.
    chosen : dict
        The knobs selection settled on (JSON-ready), e.g. ``{"alpha": 0.9}``.
    record : dict
        Further JSON-ready entries for the round record (histories, scores).
    metrics : dict[str, float]
        Extra numbers for the round's MetricRecord.
    seconds : float
        Wall time of the merge including selection.
    """

    model: Model
    chosen: dict[str, Any]
    record: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def _scalars(res: Mapping[str, Any] | None) -> dict[str, float] | None:
    if res is None:
        return None
    return {k: float(v) for k, v in res.items()
            if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}


class OneShotBaselineStrategy(FedAvg):
    """Bookkeeping shared by the one-shot baselines; subclasses implement ``collect`` and ``merge_uploads``.

    Parameters
    ----------
    model : torch.nn.Module, optional
        The architecture; gives the buffer names (state-dict entries that are not parameters).
    buffers : sequence of str, optional
        Explicit buffer names (win over ``model``).
    validate_fn : callable, optional
        ``(server_round, ArrayRecord) -> MetricRecord | None`` on the server's validation set
        (as FedFiOT's). Without it no selection happens (the strategies say what they return).
    selection_metric : str
        Key of ``validate_fn``'s metrics to select on (maximised unless it contains ``"loss"``).
    baseline : bool
        Also record FedAvg of the same uploads (validation and test), as FedFiOT does.
    min_valid_replies : int, optional
        Minimum valid replies to merge (default: ``min_train_nodes``).
    node_wait_s, results_path, checkpoint_dir, run_info
        As in :class:`fedfiot_flwr.FedFiOT`.
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes, min_available_nodes,
    weighted_by_key, arrayrecord_key, configrecord_key, evaluate_metrics_aggr_fn
        As in ``FedAvg`` (``fraction_evaluate`` defaults to 0: evaluation is on the server).
    """

    label: ClassVar[str] = "baseline"

    # pylint: disable=too-many-arguments,too-many-locals
    def __init__(
        self,
        *,
        model: torch.nn.Module | None = None,
        buffers: Sequence[str] | None = None,
        validate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
        selection_metric: str = "accuracy",
        baseline: bool = True,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 0.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        min_valid_replies: int | None = None,
        node_wait_s: float | None = None,
        results_path: str | Path | None = None,
        checkpoint_dir: str | Path | None = None,
        run_info: Mapping[str, Any] | None = None,
        weighted_by_key: str = "num-examples",
        arrayrecord_key: str = "arrays",
        configrecord_key: str = "config",
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord] | None = None,
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
        if buffers is None and model is not None:
            params = {n for n, _ in model.named_parameters()}
            buffers = [n for n in model.state_dict() if n not in params]
        self.buffers: tuple[str, ...] = tuple(buffers or ())
        self.validate_fn = validate_fn
        self.selection_metric = selection_metric
        self.baseline = bool(baseline)
        min_valid = min_valid_replies if min_valid_replies is not None else max(1, min_train_nodes)
        if min_valid < 1:
            raise ValueError(f"min_valid_replies must be >= 1, got {min_valid}")
        self.min_valid_replies = int(min_valid)
        self.results_path = Path(results_path) if results_path is not None else None
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.run_info = dict(run_info or {})
        self.results = ResultsFile(self.results_path, self.config())
        self._broadcast: Model | None = None
        self._instructions: list[Message] = []
        self._node_waiter = NodeWaiter(node_wait_s)
        self.last_outcome: BaselineOutcome | None = None
        self.last_uploads: CollectedUploads | None = None
        self._fedavg_model: Model | None = None

    # -- what a subclass provides ------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The strategy's configuration as a JSON-ready dict (stored in the results file)."""
        return {
            "strategy": type(self).__name__,
            "buffers": list(self.buffers),
            "selection_metric": self.selection_metric,
            "min_valid_replies": self.min_valid_replies,
        }

    def collect(
        self,
        replies: Iterable[tuple[str, RecordDict]],
        errors: Iterable[tuple[str, str]] = (),
        expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> CollectedUploads:
        """Unpack and validate one round's replies (default shapes: the broadcast model's)."""
        raise NotImplementedError

    def merge_uploads(self, uploads: CollectedUploads, score: Score | None) -> BaselineOutcome:
        """Merge valid uploads; ``score(model)`` (higher is better) selects the knobs."""
        raise NotImplementedError

    # -- shared bookkeeping ------------------------------------------------------------------

    def _expected_shapes(self) -> dict[str, tuple[int, ...]] | None:
        if self._broadcast is None:
            return None
        return {k: tuple(v.shape) for k, v in self._broadcast.items()}

    def _validate(self, server_round: int, model: Model) -> dict[str, float] | None:
        if self.validate_fn is None:
            return None
        order = list(self._broadcast) if self._broadcast is not None else None
        return _scalars(self.validate_fn(server_round, numpy_to_arrays(model, order)))

    def _score_fn(self, server_round: int) -> Score | None:
        if self.validate_fn is None:
            return None
        sign = -1.0 if "loss" in self.selection_metric else 1.0
        metric = self.selection_metric

        def score(model: Model) -> float:
            res = self._validate(server_round, model)
            return float("nan") if not res or metric not in res else sign * res[metric]

        return score

    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "\t├──> %s: %s", self.label, self.config())
        super().summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Remember the broadcast model (layout check of the replies) and the instructions, then sample as FedAvg."""
        self._broadcast = arrays_to_numpy(arrays)
        self._instructions, lost = self._node_waiter.configure(
            self, grid, self.min_valid_replies, server_round,
            lambda: super(OneShotBaselineStrategy, self).configure_train(server_round, arrays, config, grid),
        )
        if lost:
            log(WARNING, "%s round %s: nodes %s are no longer connected", self.label, server_round, lost)
            self.results.update_round(server_round, {"unavailable_nodes": lost})
        return self._instructions

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unpack and validate the replies, exclude broken ones, merge the rest and record the round.

        Raises
        ------
        RuntimeError
            When fewer than ``min_valid_replies`` valid replies remain.
        """
        good, errors = split_replies(replies, instruction_destinations(self._instructions))
        model, metrics = self.merge_replies(server_round, good, errors)
        order = list(self._broadcast) if self._broadcast is not None else None
        return numpy_to_arrays(model, order), MetricRecord(metrics)

    def merge_replies(
        self,
        server_round: int,
        replies: Iterable[tuple[str, RecordDict]],
        errors: Iterable[tuple[str, str]] = (),
    ) -> tuple[Model, dict[str, Any]]:
        """Collect, check, merge and record one round; returns ``(model, flat metrics)``.

        Raises
        ------
        RuntimeError
            When fewer than ``min_valid_replies`` replies pass validation.
        """
        uploads = self.collect(replies, errors)
        log(INFO, "%s round %s: %d valid replies, %d excluded (%.2f MB received)", self.label, server_round,
            len(uploads), len(uploads.rejections), uploads.bytes_received / 2**20)
        for rej in uploads.rejections:
            log(WARNING, "%s round %s: excluded client %s: %s", self.label, server_round, rej.client, rej.reason)
        rejected = [{"client": r.client, "reason": r.reason} for r in uploads.rejections]
        try:
            require_enough(uploads, self.min_valid_replies, server_round)
        except RuntimeError as exc:
            msg = str(exc).replace("FedFiOT round", f"{self.label} round", 1)
            self.results.update_round(server_round, {"rejected": rejected})
            self.results.finish(error=msg)
            raise RuntimeError(msg) from exc
        outcome = self.merge_uploads(uploads, self._score_fn(server_round))
        order = list(self._broadcast) if self._broadcast is not None else list(uploads.weights[0])
        model = {k: outcome.model[k] for k in order}
        validation = self._validate(server_round, model)
        fedavg = fedavg_val = None
        if self.baseline:
            fedavg = size_weighted_average(uploads.weights, uploads.num_examples)
            fedavg = {k: fedavg[k] for k in order}
            fedavg_val = self._validate(server_round, fedavg)
        self.last_outcome, self.last_uploads, self._fedavg_model = outcome, uploads, fedavg
        record: dict[str, Any] = {
            "round": server_round,
            "strategy": type(self).__name__,
            "clients": list(uploads.client_ids),
            "num_examples": list(uploads.num_examples),
            "rejected": rejected,
            "bytes_received": uploads.bytes_received,
            "bytes_per_client": dict(uploads.bytes_per_client),
            "fedavg_bytes_per_client": fedavg_payload_bytes(uploads.weights[0]),
            "chosen": outcome.chosen,
            "validation": validation,
            "fedavg_validation": fedavg_val,
            "merge_seconds": outcome.seconds,
            "client_metrics": uploads.metrics,
            **outcome.record,
        }
        if self.checkpoint_dir is not None:
            record["checkpoint"] = str(save_checkpoint(model, self.checkpoint_dir / f"round-{server_round:03d}.pt"))
        self.results.update_round(server_round, record)
        metrics: dict[str, Any] = aggregate_client_metrics(uploads.metrics, uploads.num_examples)
        metrics.update({
            "num-valid": len(uploads),
            "num-rejected": len(uploads.rejections),
            "bytes-received": int(uploads.bytes_received),
            "merge-seconds": float(outcome.seconds),
            **outcome.metrics,
        })
        for prefix, val in (("val", validation), ("fedavg-val", fedavg_val)):
            for key, value in (val or {}).items():
                metrics[f"{prefix}-{key}"] = float(value)
        log(INFO, "%s round %s: chose %s in %.2fs%s", self.label, server_round, outcome.chosen, outcome.seconds,
            "" if validation is None else f"; validation {validation} (FedAvg {fedavg_val})")
        return model, metrics

    # pylint: disable=too-many-arguments,too-many-positional-arguments
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 1,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Run ``num_rounds`` rounds as ``FedAvg.start`` and record everything in the results file.

        ``evaluate_fn`` (the test evaluation) is also applied to FedAvg of the same uploads; the
        results file is finalised ("finished", or "failed" with the error) and ``final.pt`` is
        written to ``checkpoint_dir``.
        """
        self.results = ResultsFile(self.results_path, {**self.config(), "num_rounds": num_rounds, **self.run_info})
        wrapped = None if evaluate_fn is None else self._wrap_evaluate(evaluate_fn)
        return run_recorded(
            super().start, self.results, self.checkpoint_dir,
            ("test", "fedavg_test", "validation", "fedavg_validation", "chosen", "fisher_kind", "best_step"),
            num_rounds, grid=grid, initial_arrays=initial_arrays, timeout=timeout,
            train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=wrapped,
        )

    def _wrap_evaluate(
        self, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None]
    ) -> Callable[[int, ArrayRecord], MetricRecord | None]:
        def wrapped(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            res = evaluate_fn(server_round, arrays)
            if server_round == 0:
                self.results.data["initial_test"] = _scalars(res)
                self.results.write()
                return res
            values: dict[str, Any] = {"test": _scalars(res)}
            if self._fedavg_model is not None:
                values["fedavg_test"] = _scalars(evaluate_fn(server_round, numpy_to_arrays(self._fedavg_model)))
                log(INFO, "%s round %s: test %s | FedAvg on the same uploads: %s",
                    self.label, server_round, values["test"], values["fedavg_test"])
            self.results.update_round(server_round, values)
            return res

        return wrapped


# --------------------------------------------------------------------------------- FedFisher


class FedFisherStrategy(OneShotBaselineStrategy):
    """FedFisher (Jhunjhunwala et al., 2024) as a Message-API Flower strategy.

    Use it like FedFiOT / Flower's ``FedAvg``::

        strategy = FedFisherStrategy("kfac", model=Net(), validate_fn=validate)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(Net().state_dict()), num_rounds=1,
                       evaluate_fn=test)

    Clients reply with :func:`pack_upload` (``"fedfisher-kfac"``: 16-bit weights and 8-bit
    low-rank K-FAC factors; ``"fedfisher-diag"``: FedFiOT's 16-bit weights and diagonal
    Fisher). The server starts from the size-weighted average, runs ``steps`` steps on the
    Fisher-weighted objective and keeps the checkpoint (every ``eval_every`` steps, plus step
    0 and the last) with the best validation score; without ``validate_fn`` the last iterate.

    Parameters
    ----------
    variant : {"kfac", "diag"}
        Kronecker-factored or diagonal Fishers.
    steps, lr, eval_every : int, float, int
        Optimisation steps, step size and checkpoint spacing (paper, C.2: 2000, 0.01, 100).
    optimizer : {"fedfisher", "adam"}
        FedFisher's own update rule (default; see :mod:`fedfiot_flwr.baselines.fedfisher`:
        ``torch.optim.Adam`` diverged on K-FAC in a measurement) or the paper's stated Adam.
    fisher_scaling : {"size", "none"}
        Client weights ``c_k = n_k / n`` (FedFisher's code) or ``1 / K``.
    damping : float
        Added to every client's curvature (``damping * ||W - W_k||^2``).
    fisher_kind : {"true", "empirical"}, optional
        The Fisher the clients compute; recorded in the results. With K-FAC, replies declaring
        another kind are excluded (a diagonal reply does not declare its kind: it is recorded
        as configured).
    device : torch.device or str, optional
        Where the optimisation runs (default: CUDA when available).
    **kwargs
        Everything :class:`OneShotBaselineStrategy` takes (``model``, ``validate_fn``,
        ``results_path``, ``checkpoint_dir``, ``min_valid_replies``, FedAvg's sampling, ...).
    """

    label = "FedFisher"

    def __init__(
        self,
        variant: str = "kfac",
        *,
        steps: int = 2000,
        lr: float = 0.01,
        eval_every: int = 100,
        optimizer: str = "fedfisher",
        fisher_scaling: str = "size",
        damping: float = 0.0,
        fisher_kind: str | None = None,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> None:
        if variant not in FEDFISHER_VARIANTS:
            raise ValueError(f"FedFisher variant must be one of {FEDFISHER_VARIANTS}, got {variant!r}")
        if fisher_kind is not None and fisher_kind not in FISHER_KINDS:
            raise ValueError(f"fisher_kind must be one of {FISHER_KINDS} or None, got {fisher_kind!r}")
        if fisher_scaling not in ("size", "none"):
            raise ValueError(f"fisher_scaling must be 'size' or 'none', got {fisher_scaling!r}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        _check_optim(steps, lr, eval_every, damping, optimizer)
        self.variant = variant
        self.steps, self.lr, self.eval_every = int(steps), float(lr), int(eval_every)
        self.optimizer, self.fisher_scaling, self.damping = optimizer, fisher_scaling, float(damping)
        self.fisher_kind = fisher_kind
        self.device = device
        self.label = f"FedFisher ({'K-FAC' if variant == 'kfac' else 'diag'})"
        super().__init__(**kwargs)

    def config(self) -> dict[str, Any]:
        """The configuration, with the FedFisher knobs."""
        return {
            **super().config(),
            "variant": self.variant, "steps": self.steps, "lr": self.lr, "eval_every": self.eval_every,
            "optimizer": self.optimizer, "fisher_scaling": self.fisher_scaling, "damping": self.damping,
            "fisher_kind": self.fisher_kind,
        }

    def collect(
        self,
        replies: Iterable[tuple[str, RecordDict]],
        errors: Iterable[tuple[str, str]] = (),
        expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> CollectedUploads:
        """K-FAC replies (:func:`collect_curvature_uploads`) or diagonal ones (FedFiOT's ``collect_uploads``)."""
        shapes = expected_shapes if expected_shapes is not None else self._expected_shapes()
        if self.variant == "kfac":
            return collect_curvature_uploads(replies, shapes, "kfac", errors, self.fisher_kind)
        return collect_uploads(replies, shapes, self.buffers, errors)

    def merge_uploads(self, uploads: CollectedUploads, score: Score | None) -> BaselineOutcome:
        """FedFisher on the valid uploads; the best checkpoint on ``score`` (the last without one)."""
        common = dict(
            steps=self.steps, lr=self.lr, eval_every=self.eval_every, evaluate=score,
            fisher_scaling=self.fisher_scaling, damping=self.damping, optimizer=self.optimizer,
            device=self.device, client_ids=uploads.client_ids,
        )
        if self.variant == "kfac":
            assert isinstance(uploads, CollectedCurvature)
            res = fedfisher_kfac(uploads.weights, uploads.factors, uploads.num_examples, **common)
            kinds = sorted({str(k) for k in uploads.fisher_kinds})
            kind: str | None = kinds[0] if len(kinds) == 1 else ",".join(kinds)
            extra = {"curvature_bytes_per_client": uploads.curvature_bytes_per_client,
                     "ranks": uploads.ranks}
        else:
            res = fedfisher_diag(uploads.weights, uploads.fishers, uploads.num_examples, **common)
            kind, extra = self.fisher_kind, {}
        chosen = {"variant": self.variant, "best_step": res.best_step, "steps": self.steps, "lr": self.lr,
                  "optimizer": self.optimizer, "fisher_scaling": self.fisher_scaling}
        record = {"fisher_kind": kind, "best_step": res.best_step, "best_score": res.best_score,
                  "history": res.history, **extra}
        metrics = {"best-step": float(res.best_step), "objective": float(res.history[-1]["objective"])}
        return BaselineOutcome(res.model, chosen, record, metrics, res.seconds)


# ----------------------------------------------------------------------------------- RegMean


class RegMeanStrategy(OneShotBaselineStrategy):
    """RegMean (Jin et al., ICLR 2023) as a Message-API Flower strategy.

    Clients reply with :func:`pack_upload` (``"regmean"``: 16-bit weights and each Linear
    layer's 8-bit low-rank input Gram). The server solves RegMean for every ``alpha`` and
    keeps the one with the best validation score (without ``validate_fn``: the last alpha).

    Parameters
    ----------
    alphas : sequence of float
        Off-diagonal scalings to try (paper: 0.1 and 0.9).
    gram_scaling : {"size", "none"}
        Grams times ``n_k`` (``X_k^T X_k``) or as sent (mean).
    rcond : float
        Relative cut-off of the pseudo-inverse.
    **kwargs
        Everything :class:`OneShotBaselineStrategy` takes.
    """

    label = "RegMean"

    def __init__(
        self,
        alphas: Sequence[float] = REGMEAN_ALPHAS,
        *,
        gram_scaling: str = "size",
        rcond: float = 1e-10,
        **kwargs: Any,
    ) -> None:
        self.alphas = tuple(float(a) for a in alphas)
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be a non-empty list of values in [0, 1], got {alphas!r}")
        if gram_scaling not in ("size", "none"):
            raise ValueError(f"gram_scaling must be 'size' or 'none', got {gram_scaling!r}")
        self.gram_scaling, self.rcond = gram_scaling, float(rcond)
        super().__init__(**kwargs)

    def config(self) -> dict[str, Any]:
        """The configuration, with the RegMean knobs."""
        return {**super().config(), "alphas": list(self.alphas), "gram_scaling": self.gram_scaling,
                "rcond": self.rcond}

    def collect(
        self,
        replies: Iterable[tuple[str, RecordDict]],
        errors: Iterable[tuple[str, str]] = (),
        expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> CollectedUploads:
        """RegMean replies (:func:`collect_curvature_uploads` with ``method="gram"``)."""
        shapes = expected_shapes if expected_shapes is not None else self._expected_shapes()
        return collect_curvature_uploads(replies, shapes, "gram", errors)

    def merge_uploads(self, uploads: CollectedUploads, score: Score | None) -> BaselineOutcome:
        """RegMean for every alpha; the best on ``score``."""
        assert isinstance(uploads, CollectedCurvature)
        res = regmean_select(uploads.weights, uploads.grams, uploads.num_examples, score, alphas=self.alphas,
                             gram_scaling=self.gram_scaling, rcond=self.rcond, client_ids=uploads.client_ids)
        record = {"alpha_scores": {f"{a:g}": s for a, s in res.scores.items()}, "merged_layers": res.merged_layers,
                  "curvature_bytes_per_client": uploads.curvature_bytes_per_client, "ranks": uploads.ranks}
        return BaselineOutcome(res.model, {"alpha": res.alpha}, record, {"alpha": res.alpha}, res.seconds)
