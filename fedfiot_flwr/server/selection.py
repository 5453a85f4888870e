"""One round of server-side merging, with the paper's validation-based selection.

Given the valid uploads of a round, :func:`merge_round` merges them once (no validation
function) or once per candidate of a :class:`SweepGrid` of ``(rho, lam, reference, Fisher
scaling)`` and keeps the candidate with the best validation score. Tempering, damping and the
reference are server-side choices, so the sweep costs no communication: every candidate merges
the same uploads. Framework-neutral: no Flower import.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fedfiot_flwr.baselines.averaging import size_weighted_average
from fedfiot_flwr.choose import BestSoFar, beats, higher_is_better
from fedfiot_flwr.merge import FISHER_SCALINGS, MergeResult, MergeSpeed, PermutationSpec, merge, prepare_clients
from fedfiot_flwr.merge.robust import DEFAULT_FISHER_CAP_RULE, cap_fishers_explained, describe_outliers
from fedfiot_flwr.server.warm_starts import WarmStarts
from fedfiot_flwr.options import (
    DEFAULT_GRID_LAMS,
    DEFAULT_GRID_REFERENCES,
    DEFAULT_GRID_RHOS,
    DEFAULT_MAX_ITERS,
    REFERENCES,
    SELECTIONS,
    alignment_kept,
)
from fedfiot_flwr.options import Model

if TYPE_CHECKING:  # the uploads container; kept out of the import graph so this stays Flower-free
    from fedfiot_flwr.server.uploads import CollectedUploads

logger = logging.getLogger("fedfiot_flwr")


ValidateFn = Callable[[Model], Mapping[str, float] | None]


@dataclass(frozen=True)
class Candidate:
    """One server-side merge configuration.

    Attributes
    ----------
    rho : float
        Fisher tempering exponent in (0, 1].
    lam : float
        Damping added after tempering (> 0).
    reference : str or int
        ``"largest"`` (the client with most examples), ``"broadcast"`` (the model the server sent
        this round) or a client index in reply order.
    fisher_scaling : str
        Per-client Fisher scaling of the merge engine (:data:`fedfiot_flwr.merge.FISHER_SCALINGS`):
        ``"none"`` (the paper's per-example mean Fisher), ``"size"`` (times ``n_k / n``,
        FedFisher's scaling), ``"normalized"``, ``"normalized-size"``.
    """

    rho: float
    lam: float
    reference: str | int = "largest"
    fisher_scaling: str = "none"

    def __post_init__(self) -> None:
        if not (isinstance(self.reference, int) or self.reference in REFERENCES):
            raise ValueError(f"reference must be a client index or one of {REFERENCES}, got {self.reference!r}")
        if self.fisher_scaling not in FISHER_SCALINGS:
            raise ValueError(f"fisher_scaling must be one of {FISHER_SCALINGS}, got {self.fisher_scaling!r}")
        if not (0 < self.rho <= 1):
            raise ValueError(f"rho must lie in (0, 1], got {self.rho!r}")
        if not self.lam > 0:
            raise ValueError(f"lam must be > 0, got {self.lam!r}")

    def label(self) -> str:
        """Short human-readable name, e.g. ``rho=0.5,lam=1e-04,ref=largest,scale=none``."""
        return f"rho={self.rho:g},lam={self.lam:.0e},ref={self.reference},scale={self.fisher_scaling}"


@dataclass(frozen=True)
class SweepGrid:
    """The grid of candidates the server tries each round (the paper's Appendix C.2 grid).

    Attributes
    ----------
    rhos, lams : tuple of float
        Tempering exponents and dampings.
    references : tuple of str
        ``"largest"`` and/or ``"broadcast"``; ``"broadcast"`` is skipped in round 1, where the
        broadcast model is the random initialisation and encodes nothing to match against
        (unless the caller says every client started from it: ``broadcast_in_round_one``).
    fisher_scalings : tuple of str
        Any of :data:`fedfiot_flwr.merge.FISHER_SCALINGS`.
    """

    rhos: tuple[float, ...] = DEFAULT_GRID_RHOS
    lams: tuple[float, ...] = DEFAULT_GRID_LAMS
    references: tuple[str, ...] = DEFAULT_GRID_REFERENCES
    fisher_scalings: tuple[str, ...] = ("none",)

    def candidates(self, default: Candidate | None = None, server_round: int = 1,
                   broadcast_in_round_one: bool = False) -> list[Candidate]:
        """All candidates of the grid for ``server_round``, ``default`` first (it wins ties).

        Parameters
        ----------
        default : Candidate, optional
            The strategy's own configuration; tried first so that ties keep it.
        server_round : int
            Current round (1-based); round 1 drops ``reference="broadcast"``.
        broadcast_in_round_one : bool
            Keep ``reference="broadcast"`` in round 1 too (every client started from the
            broadcast initialisation).

        Returns
        -------
        list[Candidate]
            Distinct candidates in a fixed order.
        """
        out: list[Candidate] = []
        no_broadcast = server_round <= 1 and not broadcast_in_round_one
        refs = [r for r in self.references if not (r == "broadcast" and no_broadcast)]
        if default is not None and not (default.reference == "broadcast" and no_broadcast):
            out.append(default)
        for ref in refs:
            for scaling in self.fisher_scalings:
                for rho in self.rhos:
                    for lam in self.lams:
                        c = Candidate(float(rho), float(lam), ref, scaling)
                        if c not in out:
                            out.append(c)
        if not out:
            raise ValueError(f"the sweep grid has no candidate for round {server_round} (references={self.references})")
        return out


@dataclass
class MergeOutcome:
    """What :func:`merge_round` chose, and everything it tried.

    Attributes
    ----------
    model : dict[str, np.ndarray]
        The new global model.
    candidate : Candidate
        The chosen configuration.
    variant : str
        ``"aligned"`` or ``"identity"``: which of the candidate's two merges was kept, or
        ``"fedavg"`` when FedAvg of the same uploads was a candidate and scored best.
    result : MergeResult
        The chosen candidate's merge (objectives, permutations, reports).
    validation : dict[str, float] or None
        Validation metrics of ``model`` (None without a validation function).
    trials : list[dict]
        One entry per (candidate, variant) tried: configuration, objectives, validation metrics.
    baseline_model : dict[str, np.ndarray] or None
        FedAvg of the same uploads (:func:`fedfiot_flwr.baselines.size_weighted_average`).
    baseline_validation : dict[str, float] or None
        Validation metrics of the FedAvg baseline.
    seconds : float
        Wall time of the whole selection (all merges and validations).
    own_model, own_variant, own_validation
        FedFiOT's own best merge, its variant and validation metrics: the same as ``model``,
        ``variant`` and ``validation`` unless FedAvg won (then reported next to it, so that a
        fallback is never mistaken for a win).
    """

    model: Model
    candidate: Candidate
    variant: str
    result: MergeResult
    validation: dict[str, float] | None
    trials: list[dict[str, Any]] = field(default_factory=list)
    baseline_model: Model | None = None
    baseline_validation: dict[str, float] | None = None
    seconds: float = 0.0
    own_model: Model | None = None
    own_variant: str | None = None
    own_validation: dict[str, float] | None = None


def _score(metrics: Mapping[str, float] | None, metric: str) -> float:
    if metrics is None or metric not in metrics:
        return math.nan
    return float(metrics[metric])


def model_digest(model: Mapping[str, np.ndarray]) -> str:
    """Hash of a model's tensor names, dtypes, shapes and bytes (equal models, equal digests).

    >>> model_digest({"w": np.zeros(2)}) == model_digest({"w": np.zeros(2)})
    True
    >>> model_digest({"w": np.zeros(2)}) == model_digest({"w": np.ones(2)})
    False
    """
    h = hashlib.blake2b(digest_size=20)
    for name in sorted(model):
        x = np.ascontiguousarray(model[name])
        h.update(f"{name}|{x.dtype.str}|{x.shape}|".encode())
        h.update(x.view(np.uint8).reshape(-1) if x.size else b"")
    return h.hexdigest()


class _CachedValidation:
    """Validates each distinct model once (models are told apart by :func:`model_digest`).

    With ``race`` and a ``validate`` that offers ``validate_bounded`` (:func:`fedfiot_flwr.validation.make_validate_fn`
    does), :meth:`bounded` lets it stop once a model provably cannot beat the best score so far.
    A model cut that way stays cut: the best score only gets harder to beat.
    """

    def __init__(self, validate: ValidateFn, race: bool = True) -> None:
        self.validate = validate
        self.race: Callable[..., Mapping[str, float] | None] | None = (
            getattr(validate, "validate_bounded", None) if race else None)
        self.cache: dict[str, dict[str, float]] = {}
        self.cut: set[str] = set()
        self.calls = 0

    def __call__(self, model: Model) -> dict[str, float]:
        key = model_digest(model)
        if key not in self.cache:
            self.calls += 1
            self.cache[key] = dict(self.validate(model) or {})
        return dict(self.cache[key])

    def bounded(self, model: Model, metric: str, threshold: float, maximize: bool) -> dict[str, float] | None:
        """The model's metrics, or ``None`` when it was cut: it cannot beat ``threshold`` (ties lose)."""
        if self.race is None or math.isnan(threshold):
            return self(model)
        key = model_digest(model)
        if key in self.cut:
            return None
        if key not in self.cache:
            self.calls += 1
            out = self.race(model, metric, threshold, maximize)
            if out is None:
                self.cut.add(key)
                return None
            self.cache[key] = dict(out)
        return dict(self.cache[key])


def _capped(uploads: CollectedUploads, factor: float, rule: str) -> list[dict[str, np.ndarray]]:
    """The uploads' Fishers after the robust cap; with the outlier rule every outlier client is logged."""
    capped, outliers = cap_fishers_explained(uploads.fishers, factor, rule=rule)
    message = describe_outliers(uploads.client_ids, outliers, factor) if rule == "outliers" else None
    if message:
        logger.warning("%s", message)
    return capped


def _warn_zero_fishers(uploads: CollectedUploads, server_round: int) -> None:
    """Say which clients sent a Fisher that is zero everywhere (it carries no information on its weights)."""
    for client, fisher in zip(uploads.client_ids, uploads.fishers):
        if fisher and not any(np.any(f) for f in fisher.values()):
            logger.warning("FedFiOT round %s: client %s's Fisher is zero everywhere, so its weights enter the merge "
                           "with the damping lam alone (as little as a client can weigh); check how it computes its "
                           "Fisher", server_round, client)


def merge_round(
    uploads: CollectedUploads,
    spec: PermutationSpec,
    default: Candidate,
    *,
    max_iters: int = DEFAULT_MAX_ITERS,
    matching: str = "fisher",
    aggregation: str = "fisher",
    fallback: str = "objective",
    buffers: Sequence[str] = (),
    broadcast: Model | None = None,
    server_round: int = 1,
    sweep: SweepGrid | None = None,
    validate: ValidateFn | None = None,
    metric: str = "accuracy",
    baseline: bool = True,
    fedavg_candidate: bool = False,
    fisher_cap: float | None = None,
    fisher_cap_rule: str = DEFAULT_FISHER_CAP_RULE,
    speed: MergeSpeed | None = None,
    warm_start: bool = False,
    broadcast_in_round_one: bool = False,
    race: bool = True,
) -> MergeOutcome:
    """Merge one round's valid uploads, selecting on validation data when possible.

    Parameters
    ----------
    uploads : CollectedUploads
        Valid, dequantized uploads (at least one), as :func:`fedfiot_flwr.server.uploads.collect_uploads`
        returns them: their shapes and values were validated when they were decoded and are not
        checked again.
    spec : PermutationSpec
        Permutation spec of the model.
    default : Candidate
        The configuration used without a sweep (and tried first with one).
    max_iters, matching, aggregation, buffers
        Passed to :func:`fedfiot_flwr.merge.merge`.
    fallback : {"objective", "validation", "none"}
        ``"objective"``: the paper's rule (identity merge when alignment raises the
        objective; a tie keeps the aligned merge). ``"validation"``: keep whichever of the aligned and identity merges scores
        better on validation (needs ``validate``; otherwise the paper's rule). ``"none"``: always
        the aligned merge.
    broadcast : dict, optional
        The model broadcast this round (needed for ``reference="broadcast"``).
    server_round : int
        Current round (1-based).
    sweep : SweepGrid, optional
        Candidate grid; used only together with ``validate``.
    validate : callable, optional
        ``model dict -> metrics`` on the server's validation set.
    metric : str
        Validation metric to select on; maximised unless its name contains ``"loss"``. The best
        candidate follows :mod:`fedfiot_flwr.choose` (NaN never wins; ties keep the earlier
        candidate: ``default`` before the grid, the aligned merge before the identity merge,
        FedFiOT's own merge before FedAvg).
    baseline : bool
        Also compute (and validate) FedAvg of the same uploads.
    fedavg_candidate : bool
        Let FedAvg of the same uploads compete on validation (implies ``baseline``; needs
        ``validate``). When it wins, ``variant`` is ``"fedavg"`` and FedFiOT's own best merge is
        kept in ``own_model`` / ``own_variant`` / ``own_validation``.
    fisher_cap : float, optional
        Robust weighting: cap every client's Fisher at this factor times the clients' median
        (:func:`fedfiot_flwr.merge.robust.cap_fishers`) before the merge tempers it; any finite
        Fisher may then be uploaded (the reply bounds do not apply, see
        :func:`fedfiot_flwr.reply_limits.fisher_bound_for`). ``None``: the Fishers as uploaded (the
        paper), which the reply bounds keep within ``MAX_FISHER_MAGNITUDE``.
    fisher_cap_rule : {"outliers", "median"}
        Which clients the cap changes (:func:`fedfiot_flwr.merge.robust.cap_fishers`); an outlier
        is logged with its client and tensors.
    speed : MergeSpeed, optional
        How each merge is computed (:class:`fedfiot_flwr.merge.MergeSpeed`; its defaults when
        omitted): float32 costs, solver, threads, certified assignments, torch backend.
    warm_start : bool
        Start each candidate's alignment from its nearest already-merged neighbour's (same
        reference and scaling, one grid step away; :mod:`fedfiot_flwr.server.warm_starts`).
        Faster (usually one inner iteration per layer instead of two), but not the paper's
        cold start: opt-in.
    broadcast_in_round_one : bool
        Offer ``reference="broadcast"`` in round 1 too, where the broadcast model is the
        initialisation: meaningful when every client started from it (a shared initialisation).
        Off: round 1 aligns to the largest client, as the paper does.
    race : bool
        When ``validate`` offers ``validate_bounded(model, metric, threshold, maximize)`` (the
        ``validate_fn`` of :func:`fedfiot_flwr.validation.make_validate_fn` does), stop scoring a
        candidate as soon as it provably cannot beat the best fully scored one. Exact: the choice
        and the chosen model's metrics are those of a full scoring. A cut trial is recorded with
        ``"validation": None`` and ``"validation_cut": True``. FedAvg of the same uploads is always
        scored in full. Plain callables are scored in full.

    Every candidate merges the same uploads, so the sweep shares its work: the uploads are
    prepared once, each ``(fisher_scaling, rho)`` is tempered once, each identity merge is
    computed once for all references, and each distinct model is validated once.

    Returns
    -------
    MergeOutcome
    """
    if len(uploads) == 0:
        raise ValueError("merge_round needs at least one valid upload")
    if fallback not in SELECTIONS:
        raise ValueError(f"fallback must be one of {SELECTIONS}, got {fallback!r}")
    if fallback == "validation" and validate is None:
        logger.warning("FedFiOT: fallback='validation' without a validation function; using the paper's rule")
        fallback = "objective"
    start = time.perf_counter()
    candidates = (sweep.candidates(default, server_round, broadcast_in_round_one)
                  if sweep is not None and validate is not None else [default])
    no_broadcast = server_round <= 1 and not broadcast_in_round_one
    if default.reference == "broadcast" and no_broadcast and candidates == [default]:
        logger.info("FedFiOT: reference='broadcast' in round 1 is the random init; using 'largest'")
        candidates = [Candidate(default.rho, default.lam, "largest", default.fisher_scaling)]

    _warn_zero_fishers(uploads, server_round)
    fishers = uploads.fishers if fisher_cap is None else _capped(uploads, fisher_cap, fisher_cap_rule)
    clients = prepare_clients(uploads.weights, fishers, buffers=buffers, num_examples=uploads.num_examples,
                              client_ids=uploads.client_ids, checked=True)
    starts = WarmStarts() if warm_start and matching != "none" else None
    validated = _CachedValidation(validate, race) if validate is not None else None
    maximize = higher_is_better(metric)
    best: BestSoFar[tuple[Candidate, str, MergeResult, Model, dict[str, float] | None]] = BestSoFar(maximize=maximize)
    trials: list[dict[str, Any]] = []
    both = fallback == "validation" and matching != "none"
    if len(candidates) > 1:
        logger.info("FedFiOT round %s: trying %d knob settings on the validation data%s", server_round, len(candidates),
                    ", each as the aligned and the identity merge" if both else "")
    for cand in candidates:
        reference: str | int | Model = cand.reference
        if cand.reference == "broadcast":
            if broadcast is None:
                raise ValueError("reference='broadcast' needs the broadcast model")
            reference = broadcast
        res = merge(
            clients,
            None,
            spec,
            lam=cand.lam,
            rho=cand.rho,
            max_iters=max_iters,
            reference=reference,
            matching=matching,
            aggregation=aggregation,
            fallback="none" if fallback == "validation" else fallback,
            fisher_scaling=cand.fisher_scaling,
            initial_perms=None if starts is None else starts.nearest(cand.reference, cand.fisher_scaling,
                                                                     cand.rho, cand.lam),
            speed=speed,
        )
        if starts is not None:
            starts.add(cand.reference, cand.fisher_scaling, cand.rho, cand.lam, res.permutations)
        variants: list[tuple[str, Model]] = [("aligned" if res.aligned else "identity", res.model)]
        if fallback == "validation" and res.aligned and matching != "none":
            variants.append(("identity", res.identity_model))
        for variant, model in variants:
            val = (validated.bounded(model, metric, best.score if best.count else math.nan, maximize)
                   if validated is not None else None)
            score = _score(val, metric)
            trials.append(
                {
                    **asdict(cand),
                    "variant": variant,
                    "objective": float(res.aligned_objective if variant == "aligned" else res.identity_objective),
                    "identity_objective": float(res.identity_objective),
                    "paper_rule_aligned": alignment_kept(res.aligned_objective, res.identity_objective),
                    "merge_seconds": float(res.seconds),
                    "validation": val,
                    **({"validation_cut": True} if validated is not None and val is None else {}),
                }
            )
            best.offer(score, (cand, variant, res, model, val))
    cand, variant, res, model, val = best.item

    own = (model, variant, val)
    merges_validated = validated.calls if validated is not None else 0
    baseline_model = baseline_val = None
    if baseline or (fedavg_candidate and validate is not None):
        baseline_model = size_weighted_average(uploads.weights, uploads.num_examples)
        baseline_val = validated(baseline_model) if validated is not None else None
    if len(trials) > 1:
        logger.info("FedFiOT round %s: selected %s (%s) out of %d knob settings (%d merges, %d distinct models "
                    "validated, %d of them cut once they could not be chosen)", server_round, cand.label(), variant,
                    len(candidates), len(trials), merges_validated, len(validated.cut) if validated is not None else 0)
    if fedavg_candidate and validate is not None and beats(_score(baseline_val, metric), best.score, maximize=maximize):
        logger.info("FedFiOT round %s: FedAvg of the same uploads scored best on validation and is returned; "
                    "FedFiOT's own merge (%s) is reported next to it", server_round, variant)
        model, variant, val = baseline_model, "fedavg", baseline_val
    return MergeOutcome(
        model=model, candidate=cand, variant=variant, result=res, validation=val, trials=trials,
        baseline_model=baseline_model, baseline_validation=baseline_val, seconds=time.perf_counter() - start,
        own_model=own[0], own_variant=own[1], own_validation=own[2],
    )
