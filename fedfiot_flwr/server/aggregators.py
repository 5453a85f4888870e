"""Framework-neutral aggregators: what each method does with one round's decoded uploads.

An :class:`Aggregator` names the reply it needs (``reply_kind``, see
:func:`fedfiot_flwr.wire.decode_reply`) and turns :class:`~fedfiot_flwr.server.uploads.CollectedUploads`
into a :class:`~fedfiot_flwr.server.outcome.RoundOutcome`. The Flower strategies (:mod:`fedfiot_flwr.server.shell`,
:mod:`fedfiot_flwr.server.legacy`) do the sampling, decoding and bookkeeping around it; the merge
maths lives below (:mod:`fedfiot_flwr.merge`, :mod:`fedfiot_flwr.baselines`).

- :class:`FedFiOTAggregator`: Fisher-weighted alignment and merging, with the selection of
  :class:`~fedfiot_flwr.server.config.FedFiOTConfig`;
- :class:`FedFisherAggregator`: FedFisher with K-FAC or diagonal Fishers;
- :class:`RegMeanAggregator`: RegMean over a list of off-diagonal scalings;
- :class:`FedAvgAggregator`: FedAvg of the same uploads (the reference every method is compared to).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from logging import INFO
from typing import Any, Protocol

import numpy as np
from flwr.supercore import log

from fedfiot_flwr.choose import higher_is_better
from fedfiot_flwr.merge import PermutationSpec
from fedfiot_flwr.reply_limits import fisher_bound_for
from fedfiot_flwr.server.closeness import broadcast_cosines, describe_closeness
from fedfiot_flwr.server.config import FedFiOTConfig
from fedfiot_flwr.server.outcome import RoundContext, RoundOutcome, ValidateFn
from fedfiot_flwr.server.selection import sweep_candidates
from fedfiot_flwr.server.uploads import CollectedUploads
from fedfiot_flwr.baselines.fedfisher_options import FedFisherOptions
from fedfiot_flwr.options import CURVATURE_CONFIG_KEY, FISHER_CONFIG_KEY, GRAM_CURVATURES, Model, uses_fisher

__all__ = [
    "Aggregator",
    "FedAvgAggregator",
    "FedFiOTAggregator",
    "FedFisherAggregator",
    "RegMeanAggregator",
    "RoundContext",
    "RoundOutcome",
]


class Aggregator(Protocol):
    """A server-side merge method the strategy shell can run."""

    label: str
    reply_kind: str
    fisher_kind: str | None

    def config(self) -> dict[str, Any]:
        """JSON-ready configuration (logged and recorded)."""
        ...

    def describe(self, has_validation: bool) -> str:
        """What the aggregator does each round, in plain words, with or without validation data."""
        ...

    def aggregate(self, uploads: CollectedUploads, context: RoundContext) -> RoundOutcome:
        """Merge the round's valid uploads (at least one).

        ``uploads`` is what :func:`~fedfiot_flwr.server.uploads.collect_uploads` returns: every
        upload was validated when it was decoded, so an aggregator does not validate it again.
        """
        ...


def _scalars(metrics: Mapping[str, Any] | None) -> dict[str, float] | None:
    if metrics is None:
        return None
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)}


def _score_fn(validate: ValidateFn | None, metric: str) -> Callable[[Model], float] | None:
    """``model -> score`` (higher is better) from a ``validate`` function, or None."""
    if validate is None:
        return None
    sign = 1.0 if higher_is_better(metric) else -1.0

    def score(model: Model) -> float:
        res = _scalars(validate(model))
        return float("nan") if not res or metric not in res else sign * res[metric]

    return score


# ------------------------------------------------------------------------------------ FedFiOT


class FedFiOTAggregator:
    """FedFiOT: layer-wise Fisher-weighted alignment and merging (:func:`fedfiot_flwr.merge.merge`).

    Parameters
    ----------
    spec : PermutationSpec
        Which axes of which tensors move together.
    config : FedFiOTConfig
        Merge options and selection (already resolved for the presence of validation data).
    """

    label = "FedFiOT"
    fisher_kind: str | None = None

    def __init__(self, spec: PermutationSpec, config: FedFiOTConfig) -> None:
        if not isinstance(spec, PermutationSpec):
            raise TypeError(f"FedFiOT needs a PermutationSpec, got {type(spec).__name__}")
        if not isinstance(config, FedFiOTConfig):
            raise TypeError(f"config must be a FedFiOTConfig (e.g. FedFiOTConfig.default(rho=0.3)), "
                            f"got {type(config).__name__}")
        self.spec = spec
        self.settings = config
        self.reply_kind = {"gram": "gram", "kfac": "gram-output"}.get(config.curvature, "fisher")
        self._told_close = False
        self.handover: tuple[int, int | None, str] | None = None
        """The clients' choice's latest hand-over: its first FedAvg round, the round that asks for the
        curvature again (``None``: none) and why (``None``: no hand-over yet)."""

    def config(self) -> dict[str, Any]:
        """The FedFiOT configuration."""
        return self.settings.as_dict()

    def describe(self, has_validation: bool) -> str:
        """The merge rule in words (:meth:`FedFiOTConfig.describe`)."""
        return self.settings.describe(has_validation)

    @property
    def fisher_bound(self) -> float | None:
        """Largest Fisher entry a reply may carry (``None``: any finite one, which the robust cap neutralises)."""
        return fisher_bound_for(self.settings.fisher_cap)

    @property
    def clients_choose(self) -> bool:
        """Whether the clients' evaluation chooses between each round's merge and FedAvg (``round_choice``)."""
        return self.settings.round_choice == "clients"

    def hand_over(self, from_round: int, resume_round: int | None = None, reason: str = "the clients' choice") -> None:
        """Make the rounds from ``from_round`` up to ``resume_round`` (excluded; ``None``: every later one)
        FedAvg without the clients' curvature, for ``reason`` (the clients' choice)."""
        self.handover = (int(from_round), None if resume_round is None else int(resume_round), reason)

    @property
    def handover_reason(self) -> str:
        """Why the rounds after the hand-over are FedAvg, in words."""
        return "fisher_rounds" if self.handover is None else self.handover[2]

    def wants_fisher(self, server_round: int) -> bool:
        """Whether round ``server_round`` merges with the clients' curvature (``fisher_rounds``, or outside
        the clients' choice's hand-over)."""
        if self.handover is not None:
            first, resume, _ = self.handover
            if first <= server_round and (resume is None or server_round < resume):
                return False
        return uses_fisher(server_round, self.settings.fisher_rounds)

    def train_config(self, server_round: int) -> dict[str, Any]:
        """What the round's train config tells the clients: whether to send a curvature, and which."""
        return {FISHER_CONFIG_KEY: bool(self.wants_fisher(server_round)), CURVATURE_CONFIG_KEY: self.settings.curvature}

    def aggregate(self, uploads: CollectedUploads, context: RoundContext) -> RoundOutcome:
        """The candidate sweep with this configuration (:func:`~fedfiot_flwr.server.selection.sweep_candidates`):
        the round's merge, selected on validation data when the configuration asks for it."""
        outcome = sweep_candidates(uploads, self.spec, self.settings, context)
        outcome.metrics["fisher-used"] = 1
        if context.broadcast is not None:
            layers = [n for n in self.spec.names if n in context.broadcast and np.ndim(context.broadcast[n]) >= 2]
            cosines = broadcast_cosines(uploads.weights, context.broadcast, layers)
            outcome.metrics["client-broadcast-cosine"] = list(cosines.values())
            outcome.record["client_broadcast_cosine"] = cosines
            sentence = describe_closeness(cosines)
            if sentence is not None and not self._told_close:
                self._told_close = True  # said once per run: it holds for every later round alike
                log(INFO, "%s round %s: %s", self.label, context.server_round, sentence)
        return outcome


def describe_fedfiot_choice(chosen: Mapping[str, Any], metrics: Mapping[str, Any]) -> str:
    """One log line about what the merge kept, e.g. ``kept the aligned merge (alignment moved 12% of neurons)``."""
    moved = 100 * float(np.mean(metrics.get("alignment-moved-fraction") or [0.0]))
    share = "less than 1%" if 0 < moved < 0.5 else f"{moved:.0f}%"
    variant = chosen.get("variant")
    if variant == "aligned":
        if moved == 0:
            return "kept the aligned merge (the alignment found nothing to move: every neuron stays in place)"
        return f"kept the aligned merge (alignment moved {share} of neurons)"
    if variant == "identity":
        if moved == 0:
            return "kept the identity merge (the alignment found nothing to move)"
        return f"kept the identity merge, no alignment (the discarded alignment would have moved {share} of neurons)"
    if metrics.get("merges-grown", 0) == metrics.get("num-trials", -1):
        return ("kept FedAvg of the same uploads (every merge grew a tensor beyond the growth bound, "
                "FedFiOTConfig.gram_growth)")
    return "kept FedAvg of the same uploads (it validated best; FedFiOT's own merge is reported next to it)"


# ----------------------------------------------------------------------------------- FedAvg


class FedAvgAggregator:
    """FedAvg (example-weighted mean of the weights) of the same uploads any strategy receives.

    Parameters
    ----------
    label : str
        The name in logs and reports (FedFiOT's, when it averages after its Fisher rounds).
    """

    reply_kind = "weights"
    fisher_kind: str | None = None

    def __init__(self, label: str = "FedAvg") -> None:
        self.label = label

    def config(self) -> dict[str, Any]:
        """No options."""
        return {"method": "fedavg"}

    def describe(self, has_validation: bool) -> str:
        """FedAvg has no knobs to choose."""
        return "FedAvg (example-weighted mean of the weights)"

    def aggregate(self, uploads: CollectedUploads, context: RoundContext) -> RoundOutcome:
        """``sum_k n_k W_k / sum_k n_k`` (:meth:`CollectedUploads.fedavg`); it is also the round's FedAvg alternative."""
        model = uploads.fedavg()
        return RoundOutcome(model, {"method": "fedavg"}, {"fisher-used": 0}, alternatives={"fedavg": model})


# -------------------------------------------------------------------------------- FedFisher


class FedFisherAggregator:
    """FedFisher: minimise the Fisher-weighted objective from the size-weighted average.

    Parameters
    ----------
    variant : {"kfac", "diag"}
        Kronecker-factored or diagonal Fishers.
    **knobs
        The other fields of :class:`FedFisherOptions` (``steps``, ``lr``, ``eval_every``,
        ``optimizer``, ``fisher_scaling``, ``damping``, ``fisher_kind``, ``selection_metric``,
        ``device``), readable as attributes of the aggregator.
    """

    def __init__(self, variant: str = "kfac", **knobs: Any) -> None:
        self.options = FedFisherOptions(variant, **knobs)
        self.label = f"FedFisher ({'K-FAC' if variant == 'kfac' else 'diag'})"
        self.reply_kind = "kfac" if variant == "kfac" else "fisher"

    def __getattr__(self, name: str) -> Any:
        """The knobs of :attr:`options` read as the aggregator's own (``aggregator.steps``)."""
        if name != "options" and name in FedFisherOptions.__dataclass_fields__:
            return getattr(self.options, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def config(self) -> dict[str, Any]:
        """The FedFisher options."""
        knobs = {k: v for k, v in asdict(self.options).items() if k != "device"}
        return {"method": "fedfisher", **knobs}

    def describe(self, has_validation: bool) -> str:
        """The optimisation and how its checkpoint is chosen."""
        pick = "the checkpoint that validates best" if has_validation else "the last step"
        return f"{self.label}: {self.steps} optimisation steps from FedAvg, keeping {pick}"

    def aggregate(self, uploads: CollectedUploads, context: RoundContext) -> RoundOutcome:
        """FedFisher on the valid uploads; the best checkpoint on validation (the last without)."""
        from fedfiot_flwr.baselines.fedfisher import fedfisher_diag, fedfisher_kfac

        common: dict[str, Any] = dict(
            evaluate=_score_fn(context.validate, self.selection_metric), client_ids=uploads.client_ids, checked=True,
        )
        extra: dict[str, Any] = {}
        if self.variant == "kfac":
            res = fedfisher_kfac(uploads.weights, uploads.factors, uploads.num_examples, self.options, **common)
            kinds = sorted({str(k) for k in uploads.fisher_kinds})
            kind: str | None = kinds[0] if len(kinds) == 1 else ",".join(kinds)
            extra = {"curvature_bytes_per_client": uploads.curvature_bytes_per_client, "ranks": uploads.ranks}
        else:
            res = fedfisher_diag(uploads.weights, uploads.fishers, uploads.num_examples, self.options, **common)
            kind = self.fisher_kind
        chosen = {"variant": self.variant, "best_step": res.best_step, "steps": self.steps, "lr": self.lr,
                  "optimizer": self.optimizer, "fisher_scaling": self.fisher_scaling}
        record = {"fisher_kind": kind, "best_step": res.best_step, "best_score": res.best_score,
                  "history": res.history, **extra}
        metrics = {"best-step": float(res.best_step), "objective": float(res.history[-1]["objective"])}
        return RoundOutcome(res.model, chosen, metrics, record, seconds=res.seconds)


# ---------------------------------------------------------------------------------- RegMean


class RegMeanAggregator:
    """RegMean: closed-form merge of the Linear layers from the clients' input Grams.

    Parameters
    ----------
    alphas : sequence of float
        Off-diagonal scalings to try; the best on validation is kept (the last without).
    gram_scaling : {"size", "none"}
        Grams times ``n_k`` or as sent.
    rcond : float
        Relative cut-off of the pseudo-inverse.
    selection_metric : str
        Validation metric to choose ``alpha`` on.
    """

    label = "RegMean"
    reply_kind = "gram"
    fisher_kind: str | None = None

    def __init__(
        self,
        alphas: Sequence[float] | None = None,
        *,
        gram_scaling: str = "size",
        rcond: float = 1e-10,
        selection_metric: str = "accuracy",
    ) -> None:
        from fedfiot_flwr.baselines.regmean import REGMEAN_ALPHAS

        self.alphas = tuple(float(a) for a in (REGMEAN_ALPHAS if alphas is None else alphas))
        if not self.alphas or any(not 0.0 <= a <= 1.0 for a in self.alphas):
            raise ValueError(f"alphas must be a non-empty list of values in [0, 1], got {alphas!r}")
        if gram_scaling not in ("size", "none"):
            raise ValueError(f"gram_scaling must be 'size' or 'none', got {gram_scaling!r}")
        self.gram_scaling, self.rcond = gram_scaling, float(rcond)
        self.selection_metric = selection_metric

    def config(self) -> dict[str, Any]:
        """The RegMean options."""
        return {"method": "regmean", "alphas": list(self.alphas), "gram_scaling": self.gram_scaling,
                "rcond": self.rcond, "selection_metric": self.selection_metric}

    def describe(self, has_validation: bool) -> str:
        """The alphas tried and how one is chosen."""
        pick = "the alpha that validates best" if has_validation else f"alpha={self.alphas[-1]:g} (the last)"
        return f"RegMean over alpha in {list(self.alphas)}, keeping {pick}"

    def aggregate(self, uploads: CollectedUploads, context: RoundContext) -> RoundOutcome:
        """RegMean for every alpha; the best on validation."""
        from fedfiot_flwr.baselines.regmean import regmean_select

        res = regmean_select(uploads.weights, uploads.grams, uploads.num_examples,
                             _score_fn(context.validate, self.selection_metric), alphas=self.alphas,
                             gram_scaling=self.gram_scaling, rcond=self.rcond, client_ids=uploads.client_ids,
                             checked=True)
        record = {"alpha_scores": {f"{a:g}": s for a, s in res.scores.items()}, "merged_layers": res.merged_layers,
                  "curvature_bytes_per_client": uploads.curvature_bytes_per_client, "ranks": uploads.ranks}
        return RoundOutcome(res.model, {"alpha": res.alpha}, {"alpha": res.alpha}, record, seconds=res.seconds)
