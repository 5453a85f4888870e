"""What FedFiOT does on the server, in one frozen object: :class:`FedFiOTConfig`.

Two named configurations:

- :meth:`FedFiOTConfig.paper`: the paper's algorithm. Fisher tempered with ``rho`` and damped with
  ``lam``; the aligned merge is replaced by the identity merge only when alignment raises the
  merge objective (a tie keeps it); with validation data, ``(rho, lam, reference)`` are chosen on it over the
  paper's grid.
- :meth:`FedFiOTConfig.default`: this project's default. With validation data it also keeps
  whichever of the aligned merge, the identity merge and FedAvg of the same uploads validates
  best, and tries the Fisher scaled by client size in the grid; FedFiOT's own merge is always
  reported next to a FedAvg win, and no client's Fisher may exceed ``DEFAULT_FISHER_CAP`` times the
  clients' median (robust weighting). Without validation data its merge rule is the paper's, and the
  clients' evaluation step chooses each round between the merge and FedAvg of the same uploads
  (``round_choice="clients"``); once FedAvg has won ``handover_after`` rounds in a row, the next rounds
  average the weights by client size and the clients skip the curvature pass, until a probe round
  (after ``reprobe_after`` rounds, then twice as long each time FedAvg wins it) asks for it again.
  With no evaluation step to choose (``fraction_evaluate=0``), or with validation data, that hand-over comes after
  ``DEFAULT_FISHER_ROUNDS`` rounds instead (``fisher_rounds``).

Neither configuration trains on server data: fitting the model on the server's labelled examples
is a separate post-merge stage the strategy runs only when asked (``refine=RefineOptions()``,
:mod:`fedfiot_flwr.refine`), the same for every aggregator. With it on, FedAvg is not a merge
candidate (:meth:`FedFiOTConfig.for_server`): the refinement's candidates are the safety net.

Without a ``validate_fn`` every configuration merges once per round with its own ``(rho, lam,
reference, fisher_scaling)`` and the paper's identity rule (:meth:`FedFiOTConfig.without_validation`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from fedfiot_flwr.merge import FISHER_SCALINGS, MergeOptions, MergeSpeed
from fedfiot_flwr.merge.robust import DEFAULT_FISHER_CAP, DEFAULT_FISHER_CAP_RULE
from fedfiot_flwr.merge.validate import check_options
from fedfiot_flwr.options import (
    DEFAULT_FISHER_ROUNDS,
    DEFAULT_GRAM_ALPHA,
    DEFAULT_GRAM_RIDGE,
    DEFAULT_GRAM_GROWTH,
    DEFAULT_GRAM_CAP,
    DEFAULT_HANDOVER_AFTER,
    DEFAULT_KFAC_DAMPING,
    DEFAULT_LAM,
    DEFAULT_MAX_ITERS,
    DEFAULT_REPROBE_AFTER,
    DEFAULT_RHO,
    FISHER_CAP_RULES,
    GRAM_CURVATURES,
    REFERENCES,
    ROUND_CHOICES,
    SELECTIONS,
)
from fedfiot_flwr.server.selection import Candidate, SweepGrid

__all__ = ["FedFiOTConfig", "SELECTIONS"]



def _check_count(name: str, value: Any, none_means: str | None = None) -> None:
    """Refuse ``value`` unless it is an integer >= 1 (or ``None`` when ``none_means`` says what ``None`` does)."""
    if value is None and none_means is not None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "an integer >= 1" + ("" if none_means is None else f", {none_means}")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class FedFiOTConfig:
    """FedFiOT's server-side options.

    Attributes
    ----------
    name : str
        ``"paper"``, ``"default"`` or ``"custom"``; logged and recorded.
    rho, lam : float
        Fisher tempering exponent in (0, 1] and damping (> 0): ``F**rho + lam``.
    reference : str or int
        Initial global model of the alignment: ``"largest"`` (client with most examples),
        ``"broadcast"`` (this round's global model) or a client index in reply order.
    fisher_scaling : {"none", "size", "normalized", "normalized-size"}
        Per-client Fisher scaling (``"none"``: the paper).
    max_iters : int
        Inner iterations per layer.
    matching : {"fisher", "euclidean", "none"}
        Alignment cost (``"none"``: no alignment).
    aggregation : {"fisher", "uniform", "size"}
        How aligned neurons are combined.
    selection : {"objective", "validation", "none"}
        How the aligned and the identity merge are chosen between (see :data:`SELECTIONS`).
    sweep : SweepGrid or None
        Candidates tried on validation data (ignored without a ``validate_fn``).
    fedavg_candidate : bool
        Let FedAvg of the same uploads compete on validation data.
    selection_metric : str
        Validation metric to select on (maximised unless its name contains ``"loss"``).
    fisher_cap : float or None
        Robust weighting: the factor ``c >= 1`` of :func:`fedfiot_flwr.merge.robust.cap_fishers`;
        ``None`` or 0: the Fishers as uploaded.
    fisher_cap_rule : {"outliers", "median"}
        ``"outliers"``: a client whose tensor's mean or largest entry is more than ``c`` times the
        other clients' median keeps its shape at their median magnitude, and one ``c`` times
        flatter than theirs takes the median client's values in its own order; the others are
        untouched. ``"median"``: every client above ``c`` times the clients' median is scaled down
        to it (see :data:`fedfiot_flwr.options.FISHER_CAP_RULES`).
    certify : bool
        Try each client's previous assignment first and keep it when a dual certificate proves
        it optimal (:mod:`fedfiot_flwr.merge.certify`): the same permutations and the same model
        as solving every assignment, for less time.
    cost_dtype : {"float64", "float32"}
        Precision of the alignment's cost matrices (float32: faster, may break near-ties
        differently; the paper's configuration keeps float64).
    lap_solver : {"scipy", "lapjv", "lapjv-avx", "auto"}
        Assignment solver (``"lapjv"``: the optional ``lap`` package; ``"lapjv-avx"``: the
        optional ``lapjv`` package, GIL-free and about 10x scipy's speed on float32 costs;
        ``"auto"``: the fastest installed for layers of 512 neurons or more).
    backend : {"numpy", "torch"}
        Where the merge's cost GEMMs and gathers run; ``"torch"``: on CUDA when available (the
        assignment stays on the CPU; equal to numpy to float rounding).
    broadcast_in_round_one : bool
        Offer ``reference="broadcast"`` in round 1 too. Round 1's broadcast model is the
        initialisation, which the paper does not match against (round 1 aligns to the largest
        client); when every client started from it (a shared initialisation) it is a reference
        all of them trained away from.
    lap_threads : int or None
        Threads that solve one alignment step's client assignments concurrently; ``None``
        (automatic): one per core, up to the number of clients, for layers of at least 256
        neurons with scipy's solver. Only the time changes: the merge is bit-identical.
    warm_start : bool
        Start each swept candidate's alignment from its nearest already-merged neighbour's (same
        reference and scaling, one grid step away; :mod:`fedfiot_flwr.server.warm_starts`).
        Faster, but not the paper's cold start: it can change the choice, so it is opt-in.
    fisher_rounds : int or None
        When the clients do not choose (``round_choice="none"``, no evaluation step, or validation
        data on the server): merge with the clients' curvature in rounds 1 to ``fisher_rounds``
        only; afterwards the round is the size-weighted average of the weights (FedAvg of the same
        uploads) and the train config tells the clients to skip the curvature pass
        (:func:`fedfiot_flwr.options.uses_fisher`). ``None``: every round (the paper).
    round_choice : {"clients", "none"}
        Without validation data on the server, who chooses between each round's merge and FedAvg
        of the same uploads (:data:`fedfiot_flwr.options.ROUND_CHOICES`). ``"clients"``: every node
        sampled for the round's evaluation step gets both models, as two evaluate messages its
        ordinary evaluate handler answers, and the merge goes on only when its example-weighted
        accuracy (or, without one, loss) over the nodes that scored both is better
        (:func:`~fedfiot_flwr.options.merge_kept_by_clients`); the chosen model is the round's
        global model (what ``evaluate_fn`` scores, what the next round starts from). Active only
        when the strategy has an evaluation step (``fraction_evaluate > 0``) and no validation
        data; then ``fisher_rounds`` does not apply. ``"none"``: the merge goes on.
    handover_after : int
        With the clients' choice: after FedAvg has won this many rounds in a row, the next
        rounds are FedAvg of the uploads and the clients skip the curvature pass.
    reprobe_after : int or None
        With the clients' choice: a hand-over lasts this many rounds, then one round asks the
        clients for their curvature again and they choose again; each probe FedAvg wins doubles
        the next hand-over, a probe the merge wins ends them
        (:func:`~fedfiot_flwr.options.handover_window`). ``None`` or 0: the first hand-over is for good.
    race : bool
        When the validation function offers ``validate_bounded`` (the one of
        :func:`fedfiot_flwr.validation.make_validate_fn` does), stop scoring a candidate as soon
        as it provably cannot beat the best fully scored one. Exact: the same choice and metrics.
    curvature : {"diagonal", "gram", "kfac"}
        The layer curvature both steps weigh with (:data:`fedfiot_flwr.options.CURVATURES`):
        the clients' diagonal Fisher (the paper), their layers' input Grams
        (:mod:`fedfiot_flwr.merge.gram`), or the Grams with each unit weighted by its output factor
        (K-FAC with a diagonal output factor, :mod:`fedfiot_flwr.merge.kfac`). With ``"gram"`` or
        ``"kfac"`` the train config asks the clients for that reply
        (:data:`~fedfiot_flwr.options.CURVATURE_CONFIG_KEY`), ``rho``, ``lam`` and
        ``fisher_scaling`` are not used, and the sweep tries ``sweep.gram_alphas``,
        ``sweep.gram_ridges`` and the references.
    gram_alpha : float
        The Gram's off-diagonal scaling in [0, 1] without validation data (RegMean's alpha).
    gram_ridge : float
        Relative ridge added to every Gram's diagonal (times its mean diagonal entry) without
        validation data. Without one, the merge can inflate the weights until the clients cannot
        train from it the next round (``docs/configuration.md``).
    gram_growth : float or None
        With ``"gram"`` or ``"kfac"``: a merge (aligned or identity) with a tensor whose Frobenius
        norm exceeds this factor times the largest client's norm of that tensor is not kept (the
        trial records the tensor); when no merge of the round meets the bound, the round is FedAvg
        of the uploads, which always does (:data:`~fedfiot_flwr.options.DEFAULT_GRAM_GROWTH`).
        ``None`` or 0: no bound.
    gram_cap : float or None
        Robust weighting of the Gram curvature: a client's Gram of a layer whose mean diagonal
        entry is more than this factor times the other clients' median is scaled down to it
        (:func:`~fedfiot_flwr.merge.gram.cap_grams`); ``None`` or 0: the Grams as uploaded.
    kfac_damping : float
        ``"kfac"`` only: ``delta > 0`` of a unit's weight ``(g / mean(g) + delta) / (1 + delta)``
        (:func:`~fedfiot_flwr.merge.kfac.row_weights`).
    """

    name: str = "custom"
    rho: float = DEFAULT_RHO
    lam: float = DEFAULT_LAM
    reference: str | int = "largest"
    fisher_scaling: str = "none"
    max_iters: int = DEFAULT_MAX_ITERS
    matching: str = "fisher"
    aggregation: str = "fisher"
    selection: str = "objective"
    sweep: SweepGrid | None = None
    fedavg_candidate: bool = False
    selection_metric: str = "accuracy"
    fisher_cap: float | None = None
    fisher_cap_rule: str = DEFAULT_FISHER_CAP_RULE
    certify: bool = False
    cost_dtype: str = "float64"
    lap_solver: str = "scipy"
    broadcast_in_round_one: bool = False
    lap_threads: int | None = None
    backend: str = "numpy"
    warm_start: bool = False
    race: bool = True
    fisher_rounds: int | None = None
    round_choice: str = "none"
    handover_after: int = DEFAULT_HANDOVER_AFTER
    reprobe_after: int | None = DEFAULT_REPROBE_AFTER
    curvature: str = "diagonal"
    gram_alpha: float = DEFAULT_GRAM_ALPHA
    gram_ridge: float = DEFAULT_GRAM_RIDGE
    gram_growth: float | None = DEFAULT_GRAM_GROWTH
    gram_cap: float | None = DEFAULT_GRAM_CAP
    kfac_damping: float = DEFAULT_KFAC_DAMPING

    def __post_init__(self) -> None:
        check_options(self.lam, self.rho, self.max_iters, self.matching, self.aggregation, "objective")
        self.speed  # validates the speed options
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        if not (isinstance(self.reference, int) or self.reference in REFERENCES):
            raise ValueError(f"reference must be a client index or one of {REFERENCES}, got {self.reference!r}")
        if self.fisher_scaling not in FISHER_SCALINGS:
            raise ValueError(f"fisher_scaling must be one of {FISHER_SCALINGS}, got {self.fisher_scaling!r}")
        if self.fisher_cap == 0:  # 0 turns the cap off, as None does
            object.__setattr__(self, "fisher_cap", None)
        if self.fisher_cap is not None and not self.fisher_cap >= 1:
            raise ValueError(f"fisher_cap must be >= 1, or 0 / None for no cap, got {self.fisher_cap!r}")
        if self.gram_growth == 0:
            object.__setattr__(self, "gram_growth", None)
        if self.gram_growth is not None and not 1 <= self.gram_growth < float("inf"):
            raise ValueError(f"gram_growth must be a finite number >= 1, or 0 / None for no bound, got {self.gram_growth!r}")
        if self.gram_cap == 0:
            object.__setattr__(self, "gram_cap", None)
        if self.gram_cap is not None and not self.gram_cap >= 1:
            raise ValueError(f"gram_cap must be >= 1, or 0 / None for no cap, got {self.gram_cap!r}")
        if self.fisher_cap_rule not in FISHER_CAP_RULES:
            raise ValueError(f"fisher_cap_rule must be one of {FISHER_CAP_RULES}, got {self.fisher_cap_rule!r}")
        _check_count("fisher_rounds", self.fisher_rounds, "or None for every round")
        if self.round_choice not in ROUND_CHOICES:
            raise ValueError(f"round_choice must be one of {ROUND_CHOICES}, got {self.round_choice!r}")
        _check_count("handover_after", self.handover_after)
        if self.reprobe_after == 0 and not isinstance(self.reprobe_after, bool):  # 0: for good, as None
            object.__setattr__(self, "reprobe_after", None)
        _check_count("reprobe_after", self.reprobe_after, "or 0 / None for a hand-over for good")
        MergeOptions(curvature=self.curvature, gram_alpha=self.gram_alpha, gram_ridge=self.gram_ridge,
                     kfac_damping=self.kfac_damping, matching=self.matching, aggregation=self.aggregation)  # validates the curvature's options
        for name in ("warm_start", "race"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def candidate(self) -> Candidate:
        """This configuration's own ``(rho, lam, reference, fisher_scaling)``: the merge without a sweep."""
        gram = self.curvature in GRAM_CURVATURES
        return Candidate(float(self.rho), float(self.lam), self.reference, self.fisher_scaling,
                         float(self.gram_alpha) if gram else None, float(self.gram_ridge) if gram else None)

    @property
    def speed(self) -> MergeSpeed:
        """The merge engine's execution options of this configuration (validated on access)."""
        return MergeSpeed(cost_dtype=self.cost_dtype, lap_solver=self.lap_solver, lap_threads=self.lap_threads,
                          certify=self.certify, backend=self.backend)

    @classmethod
    def paper(cls, **changes: Any) -> FedFiOTConfig:
        """The paper's algorithm (identity rule on the objective; the paper's grid on validation data)."""
        return replace(cls(name="paper", selection="objective", sweep=SweepGrid()), **changes)

    @classmethod
    def default(cls, **changes: Any) -> FedFiOTConfig:
        """This project's default: validation chooses among aligned, identity and FedAvg of the same uploads."""
        base = cls(name="default", selection="validation", sweep=SweepGrid(fisher_scalings=("none", "size")),
                   fedavg_candidate=True, fisher_cap=DEFAULT_FISHER_CAP, certify=True,
                   fisher_rounds=DEFAULT_FISHER_ROUNDS, round_choice="clients")
        return replace(base, **changes)

    @classmethod
    def named(cls, name: str, **changes: Any) -> FedFiOTConfig:
        """``"paper"`` or ``"default"`` by name."""
        if name not in ("paper", "default"):
            raise ValueError(f"unknown FedFiOT configuration {name!r}; choose 'paper' or 'default'")
        return cls.paper(**changes) if name == "paper" else cls.default(**changes)

    def without_validation(self) -> FedFiOTConfig:
        """What runs when the server has no validation data: one merge per round, the paper's identity rule."""
        selection = "objective" if self.selection == "validation" else self.selection
        return replace(self, selection=selection, sweep=None, fedavg_candidate=False)

    def for_server(self, has_validation: bool, refining: bool = False, clients_evaluate: bool = True) -> FedFiOTConfig:
        """The configuration that runs given what the server holds and whether the clients evaluate.

        Without validation data: :meth:`without_validation`. With a refinement stage after the
        merge, FedAvg of the same uploads is not a merge candidate (the refinement's candidates,
        the merge and every client, are the safety net). The clients' choice runs only without
        validation data and with an evaluation step (``clients_evaluate``); then its hand-over
        replaces ``fisher_rounds`` (``None`` in the result), otherwise ``round_choice`` is ``"none"``.
        """
        if self.round_choice == "clients" and not has_validation and clients_evaluate:
            return replace(self.without_validation(), fisher_rounds=None)
        cfg = replace(self, round_choice="none")
        if not has_validation:
            return cfg.without_validation()
        return replace(cfg, fedavg_candidate=False) if refining else cfg

    def describe(self, has_validation: bool) -> str:
        """What the merge does each round, in plain words (for the strategy's start-up line)."""
        cfg = self.for_server(has_validation)
        rule = {"objective": "the paper's rule (keep the aligned merge unless alignment raises the merge "
                             "objective)",
                "validation": ("the aligned, the identity or FedAvg's merge" if cfg.fedavg_candidate
                               else "the aligned or the identity merge") + ", whichever validates best",
                "none": "always the aligned merge"}[cfg.selection]
        then = ("" if cfg.fisher_rounds is None else
                f"; from round {cfg.fisher_rounds + 1} on, the size-weighted average (FedAvg) without the clients' Fisher pass")
        if cfg.round_choice == "clients":
            then = ("; each round the clients' evaluation chooses between it and FedAvg of the same uploads, and after "
                    f"FedAvg wins {cfg.handover_after} rounds in a row " + (
                        "the later rounds are FedAvg without the clients' curvature pass" if cfg.reprobe_after is None
                        else f"the next {cfg.reprobe_after} rounds are FedAvg without the clients' curvature pass, then "
                             "a probe round asks for it again (each probe FedAvg wins doubles the wait)"))
        gram = cfg.curvature in GRAM_CURVATURES
        grams = ("the clients' input Grams" if cfg.curvature == "gram" else
                 f"the clients' input Grams and output factors (K-FAC, damping {cfg.kfac_damping:g})")
        if cfg.sweep is None or not has_validation:
            knobs = (f"{grams} (alpha={cfg.gram_alpha:g}, ridge={cfg.gram_ridge:g}), reference={cfg.reference}" if gram else
                     f"rho={cfg.rho:g}, lam={cfg.lam:g}, reference={cfg.reference}")
            return f"FedFiOT merge ({self.name}) with {knobs} and {rule}{then}"
        g = cfg.sweep
        if gram:
            size = len(g.references) * len(g.gram_alphas) * len(g.gram_ridges)
            return (f"FedFiOT merge ({self.name}) with {grams}: up to {size} knob settings "
                    f"(alpha, ridge, reference) and {rule}{then}")
        size = len(g.rhos) * len(g.lams) * len(g.references) * len(g.fisher_scalings)
        first = len(g.candidates(None, 1, cfg.broadcast_in_round_one))
        round_one = f" ({first} in round 1, without the broadcast reference)" if first != size else ""
        return (f"FedFiOT merge ({self.name}): up to {size} knob settings{round_one} (rho, lam, reference, Fisher "
                f"scaling) and {rule}{then}")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready view."""
        out = asdict(self)
        out["sweep"] = None if self.sweep is None else {k: list(v) for k, v in asdict(self.sweep).items()}
        return out
