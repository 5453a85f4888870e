"""One round of server-side merging, with the paper's validation-based selection.

Given the valid uploads of a round, :func:`sweep_candidates` merges them once (no validation
function) or once per candidate of a :class:`SweepGrid` of ``(rho, lam, reference, Fisher
scaling)`` and keeps the candidate with the best validation score. Tempering, damping and the
reference are server-side choices, so the sweep costs no communication: every candidate merges
the same uploads. Framework-neutral: no Flower import.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedfiot_flwr.choose import BestSoFar, beats, higher_is_better
from fedfiot_flwr.merge import (
    FISHER_SCALINGS,
    MergeOptions,
    MergeResult,
    PermutationSpec,
    PreparedClients,
    merge,
    prepare_clients,
)
from fedfiot_flwr.merge.gram import PreparedGrams, cap_grams, prepare_grams
from fedfiot_flwr.merge.robust import cap_fishers_explained, describe_outliers
from fedfiot_flwr.options import (
    GRAM_CURVATURES,
    DEFAULT_GRID_GRAM_ALPHAS,
    DEFAULT_GRID_GRAM_RIDGES,
    DEFAULT_GRID_LAMS,
    DEFAULT_GRID_REFERENCES,
    DEFAULT_GRID_RHOS,
    REFERENCES,
    alignment_kept,
)
from fedfiot_flwr.options import Model
from fedfiot_flwr.server.outcome import RoundContext, RoundOutcome, ValidateFn
from fedfiot_flwr.server.warm_starts import WarmStarts

if TYPE_CHECKING:  # kept out of the import graph: the uploads container (Flower-free) and the config (imports this)
    from fedfiot_flwr.server.config import FedFiOTConfig
    from fedfiot_flwr.server.uploads import CollectedUploads

logger = logging.getLogger("fedfiot_flwr")


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
    gram_alpha : float or None
        The Gram curvature's off-diagonal scaling (``None``: a diagonal-Fisher candidate, which
        ``rho``, ``lam`` and ``fisher_scaling`` describe).
    gram_ridge : float or None
        The Gram curvature's relative ridge (``None``: the configuration's ``gram_ridge``).
    """

    rho: float
    lam: float
    reference: str | int = "largest"
    fisher_scaling: str = "none"
    gram_alpha: float | None = None
    gram_ridge: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.reference, int) or self.reference in REFERENCES):
            raise ValueError(f"reference must be a client index or one of {REFERENCES}, got {self.reference!r}")
        if self.fisher_scaling not in FISHER_SCALINGS:
            raise ValueError(f"fisher_scaling must be one of {FISHER_SCALINGS}, got {self.fisher_scaling!r}")
        if not (0 < self.rho <= 1):
            raise ValueError(f"rho must lie in (0, 1], got {self.rho!r}")
        if not self.lam > 0:
            raise ValueError(f"lam must be > 0, got {self.lam!r}")
        if self.gram_alpha is not None and not 0.0 <= self.gram_alpha <= 1.0:
            raise ValueError(f"gram_alpha must lie in [0, 1], got {self.gram_alpha!r}")
        if self.gram_ridge is not None and not 0.0 <= self.gram_ridge < math.inf:
            raise ValueError(f"gram_ridge must be a finite number >= 0, got {self.gram_ridge!r}")

    def label(self) -> str:
        """Short human-readable name, e.g. ``rho=0.5,lam=1e-04,ref=largest,scale=none`` or
        ``gram-alpha=0.9,ridge=0.01,ref=largest``."""
        if self.gram_alpha is not None:
            ridge = "" if self.gram_ridge is None else f"ridge={self.gram_ridge:g},"
            return f"gram-alpha={self.gram_alpha:g},{ridge}ref={self.reference}"
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
    gram_alphas : tuple of float
        The Gram curvature's off-diagonal scalings (tried instead of ``rhos``, ``lams`` and
        ``fisher_scalings`` when the default candidate is a Gram one).
    gram_ridges : tuple of float
        The Gram curvature's relative ridges, tried with every ``gram_alphas`` value.
    """

    rhos: tuple[float, ...] = DEFAULT_GRID_RHOS
    lams: tuple[float, ...] = DEFAULT_GRID_LAMS
    references: tuple[str, ...] = DEFAULT_GRID_REFERENCES
    fisher_scalings: tuple[str, ...] = ("none",)
    gram_alphas: tuple[float, ...] = DEFAULT_GRID_GRAM_ALPHAS
    gram_ridges: tuple[float, ...] = DEFAULT_GRID_GRAM_RIDGES

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
        if default is not None and default.gram_alpha is not None:
            for ref in refs:
                for ridge in self.gram_ridges:
                    for alpha in self.gram_alphas:
                        c = Candidate(default.rho, default.lam, ref, default.fisher_scaling, float(alpha), float(ridge))
                        if c not in out:
                            out.append(c)
            return out
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


def sweep_candidates(
    uploads: CollectedUploads,
    spec: PermutationSpec,
    config: FedFiOTConfig,
    context: RoundContext,
    *,
    baseline: bool = False,
) -> RoundOutcome:
    """Merge one round's valid uploads once per candidate and keep the one that validates best.

    Without a validation function (``context.validate``) or a sweep grid (``config.sweep``) there
    is one candidate, ``config.candidate``, and the paper's identity rule decides between its
    aligned and identity merges (``config.selection``; see :class:`~fedfiot_flwr.server.config.FedFiOTConfig`
    for every option). Every candidate merges the same uploads, so the sweep shares its work: the
    uploads are prepared once, each ``(fisher_scaling, rho)`` is tempered once, each identity
    merge is computed once for all references, and each distinct model is validated once. The
    best candidate follows :mod:`fedfiot_flwr.choose` (NaN never wins; ties keep the earlier
    candidate: the configuration's own before the grid, the aligned merge before the identity
    merge, FedFiOT's own merge before FedAvg).

    Parameters
    ----------
    uploads : CollectedUploads
        Valid, dequantized uploads (at least one), as :func:`fedfiot_flwr.server.uploads.collect_uploads`
        returns them (validated when decoded; not checked again).
    spec : PermutationSpec
        Permutation spec of the model.
    config : FedFiOTConfig
        The merge, the selection and how they are computed.
    context : RoundContext
        Round number, broadcast model (for ``reference="broadcast"``), buffers, validation function.
    baseline : bool
        Also compute (and validate) FedAvg of the same uploads when ``config`` does not make it a
        candidate (it is in :attr:`RoundOutcome.alternatives` as ``"fedavg"``).

    Returns
    -------
    RoundOutcome
        The chosen model with its candidate, variant, engine result and every trial.
    """
    if len(uploads) == 0:
        raise ValueError("the candidate sweep needs at least one valid upload")
    start = time.perf_counter()
    validate = context.validate
    selection = config.selection
    if selection == "validation" and validate is None:
        logger.warning("FedFiOT: fallback='validation' without a validation function; using the paper's rule")
        selection = "objective"
    candidates = _round_candidates(config, context.server_round, validate is not None)
    clients = _prepared_uploads(uploads, config, context)
    validated = _CachedValidation(validate, config.race) if validate is not None else None
    if len(candidates) > 1:
        both = selection == "validation" and config.matching != "none"
        logger.info("FedFiOT round %s: trying %d knob settings on the validation data%s", context.server_round,
                    len(candidates), ", each as the aligned and the identity merge" if both else "")
    bounds = _growth_bounds(uploads, config)
    best, trials, grown = _try_candidates(clients, spec, _with_selection(config, selection), candidates,
                                          context, validated, bounds)
    if best.count == 0:
        _fedavg_when_every_merge_grew(best, grown, uploads, config, context, validated)
    cand, variant, res, model, val = best.item
    merges_validated = validated.calls if validated is not None else 0
    out = RoundOutcome(model, {}, validation=val, candidate=cand, variant=variant, engine_result=res, trials=trials)
    if baseline or (config.fedavg_candidate and validate is not None):
        out.alternatives["fedavg"] = uploads.fedavg()
        if validated is not None:
            out.alternative_validation["fedavg"] = validated(out.alternatives["fedavg"])
    if len(trials) > 1:
        logger.info("FedFiOT round %s: selected %s (%s) out of %d knob settings (%d merges, %d distinct models "
                    "validated, %d of them cut once they could not be chosen)", context.server_round, cand.label(),
                    variant, len(candidates), len(trials), merges_validated,
                    len(validated.cut) if validated is not None else 0)
    if (config.fedavg_candidate and validate is not None and variant != "fedavg"
            and beats(_score(out.baseline_validation, config.selection_metric), best.score,
                      maximize=higher_is_better(config.selection_metric))):
        logger.info("FedFiOT round %s: FedAvg of the same uploads scored best on validation and is returned; "
                    "FedFiOT's own merge (%s) is reported next to it", context.server_round, variant)
        out.alternatives["fedfiot-own"] = model
        if val is not None:
            out.alternative_validation["fedfiot-own"] = dict(val)
        out.model, out.variant, out.validation = out.alternatives["fedavg"], "fedavg", out.baseline_validation
    _report(out, config, uploads, own_variant=variant, own_validation=val)
    out.seconds = time.perf_counter() - start
    return out


def _prepared_uploads(uploads: CollectedUploads, config: FedFiOTConfig,
                      context: RoundContext) -> PreparedClients | PreparedGrams:
    """The round's uploads prepared once for every candidate, with the robust cap on their curvature."""
    if config.curvature in GRAM_CURVATURES:
        grams = uploads.grams
        if config.gram_cap is not None:
            grams, capped = cap_grams(grams, config.gram_cap)
            for k, layer, factor in capped:
                logger.warning("FedFiOT round %s: client %s's Gram of %s was %.3g times the clients' median; "
                               "brought down to it", context.server_round, uploads.client_ids[k], layer, factor)
        return prepare_grams(uploads.weights, grams, num_examples=uploads.num_examples,
                             client_ids=uploads.client_ids, checked=True)
    _warn_zero_fishers(uploads, context.server_round)
    fishers = uploads.fishers if config.fisher_cap is None else _capped(uploads, config.fisher_cap,
                                                                         config.fisher_cap_rule)
    return prepare_clients(uploads.weights, fishers, buffers=context.buffers, num_examples=uploads.num_examples,
                           client_ids=uploads.client_ids, checked=True)


def _with_selection(config: FedFiOTConfig, selection: str) -> FedFiOTConfig:
    """``config`` with ``selection`` (the identity rule that runs when validation data is missing)."""
    return config if config.selection == selection else dataclasses.replace(config, selection=selection)


def _round_candidates(config: FedFiOTConfig, server_round: int, has_validation: bool) -> list[Candidate]:
    """The candidates of this round: the grid with validation data, else the configuration's own."""
    default = config.candidate
    if config.sweep is not None and has_validation:
        return config.sweep.candidates(default, server_round, config.broadcast_in_round_one)
    if default.reference == "broadcast" and server_round <= 1 and not config.broadcast_in_round_one:
        logger.info("FedFiOT: reference='broadcast' in round 1 is the random init; using 'largest'")
        return [dataclasses.replace(default, reference="largest")]
    return [default]


_Kept = tuple[Candidate, str, MergeResult, Model, "dict[str, float] | None"]
"""A kept merge: its candidate, variant, engine result, model and validation scores."""


def _growth_bounds(uploads: CollectedUploads, config: FedFiOTConfig) -> dict[str, float] | None:
    """Per tensor, ``gram_growth`` times the largest client's Frobenius norm (``None``: no bound).

    A permutation keeps a tensor's norm, so the aligned clients' norms are the uploaded ones.
    """
    if config.curvature not in GRAM_CURVATURES or config.gram_growth is None:
        return None
    return {name: config.gram_growth * norm for name, norm in longest_norms(uploads.weights).items()}


def longest_norms(weights: Sequence[Model]) -> dict[str, float]:
    """Per tensor, the largest Frobenius norm among the clients' ``weights`` (what ``gram_growth`` multiplies)."""
    return {name: max(float(np.linalg.norm(w[name])) for w in weights) for name in weights[0]}


def _grown_tensor(model: Model, bounds: Mapping[str, float] | None) -> str | None:
    """The first tensor of ``model`` longer than its bound, as ``"name (ratio x)"``; ``None`` when none is."""
    if bounds is None:
        return None
    for name, bound in bounds.items():
        norm = float(np.linalg.norm(model[name]))
        if not norm <= bound:  # NaN grows too
            return f"{name} ({norm / bound:.3g}x the bound)" if bound > 0 else f"{name} (norm {norm:.3g}, bound 0)"
    return None


def _gram_ridge(cand: Candidate, config: FedFiOTConfig) -> float:
    """The candidate's Gram ridge, or the configuration's where the candidate names none."""
    return config.gram_ridge if cand.gram_ridge is None else cand.gram_ridge


def _fedavg_when_every_merge_grew(best: BestSoFar[_Kept], grown: tuple[_Kept, str] | None, uploads: CollectedUploads,
                                  config: FedFiOTConfig, context: RoundContext,
                                  validated: _CachedValidation | None) -> None:
    """Offer FedAvg of the uploads (within the growth bound by the triangle inequality) as the round's model."""
    assert grown is not None
    (cand, variant, res, _, _), tensor = grown
    logger.warning("FedFiOT round %s: every merge grew a tensor beyond %g times the largest client's norm (the "
                   "%s merge of %s: %s); the round is FedAvg of the uploads", context.server_round,
                   config.gram_growth, variant, cand.label(), tensor)
    fedavg = uploads.fedavg()
    best.offer(math.nan, (cand, "fedavg", res, fedavg, validated(fedavg) if validated is not None else None))


def _try_candidates(
    clients: PreparedClients | PreparedGrams,
    spec: PermutationSpec,
    config: FedFiOTConfig,
    candidates: Sequence[Candidate],
    context: RoundContext,
    validated: _CachedValidation | None,
    bounds: Mapping[str, float] | None,
) -> tuple[BestSoFar[_Kept], list[dict[str, Any]], tuple[_Kept, str] | None]:
    """Merge every candidate (each as its aligned and identity merge where validation chooses) and score it.

    A merge with a tensor beyond ``bounds`` is recorded but not offered; where the paper's rule kept
    such an aligned merge, its identity merge is tried in its place. The last item is the first grown
    merge with its grown tensor (``None`` when none grew)."""
    metric = config.selection_metric
    maximize = higher_is_better(metric)
    starts = (WarmStarts() if config.warm_start and config.matching != "none" and config.curvature == "diagonal"
              else None)
    best: BestSoFar[_Kept] = BestSoFar(maximize=maximize)
    trials: list[dict[str, Any]] = []
    first_grown: tuple[_Kept, str] | None = None
    for cand in candidates:
        reference: str | int | Model = cand.reference
        if cand.reference == "broadcast":
            if context.broadcast is None:
                raise ValueError("reference='broadcast' needs the broadcast model")
            reference = context.broadcast
        options = MergeOptions(
            lam=cand.lam, rho=cand.rho, max_iters=config.max_iters, reference=reference,
            matching=config.matching, aggregation=config.aggregation,
            fallback="none" if config.selection == "validation" else config.selection,
            fisher_scaling=cand.fisher_scaling, curvature=config.curvature,
            gram_alpha=config.gram_alpha if cand.gram_alpha is None else cand.gram_alpha,
            gram_ridge=_gram_ridge(cand, config), kfac_damping=config.kfac_damping,
        )
        res = merge(
            clients, None, spec, options, speed=config.speed,
            initial_perms=None if starts is None else starts.nearest(cand.reference, cand.fisher_scaling,
                                                                     cand.rho, cand.lam),
        )
        if starts is not None:
            starts.add(cand.reference, cand.fisher_scaling, cand.rho, cand.lam, res.permutations)
        kept_grown = _grown_tensor(res.model, bounds)
        variants: list[tuple[str, Model, str | None]] = [("aligned" if res.aligned else "identity", res.model,
                                                          kept_grown)]
        if res.aligned and config.matching != "none" and (config.selection == "validation" or kept_grown is not None):
            variants.append(("identity", res.identity_model, _grown_tensor(res.identity_model, bounds)))
        for variant, model, grown in variants:
            val = (validated.bounded(model, metric, best.score if best.count else math.nan, maximize)
                   if validated is not None and grown is None else None)
            trials.append({
                **asdict(cand),
                "variant": variant,
                "objective": float(res.aligned_objective if variant == "aligned" else res.identity_objective),
                "identity_objective": float(res.identity_objective),
                "paper_rule_aligned": alignment_kept(res.aligned_objective, res.identity_objective),
                "merge_seconds": float(res.seconds),
                "validation": val,
                **({"validation_cut": True} if validated is not None and val is None and grown is None else {}),
                **({"grown": grown} if grown is not None else {}),
            })
            if grown is None:
                best.offer(_score(val, metric), (cand, variant, res, model, val))
            elif first_grown is None:
                first_grown = ((cand, variant, res, model, val), grown)
    return best, trials, first_grown


def _report(out: RoundOutcome, config: FedFiOTConfig, uploads: CollectedUploads, own_variant: str,
            own_validation: dict[str, float] | None) -> None:
    """Fill the outcome's chosen knobs, metrics, record and permutations from its engine result."""
    res, cand = out.engine_result, out.candidate
    assert res is not None and cand is not None
    moved = [float(x) for x in res.fraction_permuted]
    fedavg_won = out.variant == "fedavg"
    out.metrics = {
        "objective-aligned": float(res.aligned_objective),
        "objective-identity": float(res.identity_objective),
        "kept-aligned": out.variant == "aligned",
        "paper-rule-aligned": alignment_kept(res.aligned_objective, res.identity_objective),
        "alignment-moved-fraction": moved,
        "inner-iterations": [int(r.iterations) for r in res.reports.values()],
        "rho": float(cand.rho),
        "lam": float(cand.lam),
        **({} if cand.gram_alpha is None else {"gram-alpha": float(cand.gram_alpha)}),
        **({} if cand.gram_ridge is None else {"gram-ridge": float(cand.gram_ridge)}),
        "merge-seconds": float(res.seconds),
        "num-trials": len(out.trials),
        **({"merges-grown": sum("grown" in t for t in out.trials)} if config.curvature in GRAM_CURVATURES else {}),
    }
    if config.fedavg_candidate and out.baseline_validation is not None:  # FedAvg competed on validation data
        out.metrics["fedavg-won"] = fedavg_won
    out.record = {
        "objective_aligned": res.aligned_objective,
        "objective_identity": res.identity_objective,
        "kept": out.variant,
        "fedavg_won": fedavg_won,
        "own_variant": own_variant,
        "own_validation": own_validation,
        "inner_iterations": {p: r.iterations for p, r in res.reports.items()},
        "alignment_moved_fraction": dict(zip(uploads.client_ids, moved)),
        "num_trials": len(out.trials),
        "trials": out.trials,
    }
    out.chosen = {"rho": cand.rho, "lam": cand.lam, "reference": cand.reference,
                  "fisher_scaling": cand.fisher_scaling, "variant": out.variant}
    if cand.gram_alpha is not None:
        out.chosen = {"curvature": config.curvature, "gram_alpha": cand.gram_alpha,
                      "gram_ridge": _gram_ridge(cand, config),
                      "reference": cand.reference, "variant": out.variant}
    out.permutations = {p: list(v) for p, v in res.permutations.items()} if out.variant == "aligned" else None
