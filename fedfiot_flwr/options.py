"""Every mode name and default of the package, in one torch-free place.

The merge engine, the strategies, the app's run config and the client import their choices from
here, so a name is spelled once and a default is set once.

>>> SELECTIONS
('objective', 'validation', 'none')
>>> DEFAULT_GRID_RHOS
(0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
>>> alignment_kept(2.0, 2.0), alignment_kept(2.5, 2.0)
(True, False)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

__all__ = [
    "AGGREGATIONS",
    "BACKENDS",
    "CANDIDATE_CONFIG_KEY",
    "CLIENT_FISHER_KINDS",
    "COST_DTYPES",
    "CURVATURES",
    "DEFAULT_KFAC_DAMPING",
    "GRAM_CURVATURES",
    "CURVATURE_CONFIG_KEY",
    "GRAM_SCALINGS",
    "DEFAULT_FISHER_ROUNDS",
    "DEFAULT_HANDOVER_AFTER",
    "DEFAULT_REPROBE_AFTER",
    "DEFAULT_LAM",
    "DEFAULT_MAX_ITERS",
    "DEFAULT_RHO",
    "DEFAULT_GRAM_ALPHA",
    "DEFAULT_GRAM_CAP",
    "DEFAULT_GRID_GRAM_ALPHAS",
    "DEFAULT_GRID_GRAM_RIDGES",
    "DEFAULT_GRAM_RIDGE",
    "DEFAULT_GRAM_GROWTH",
    "DEFAULT_GRID_LAMS",
    "DEFAULT_GRID_REFERENCES",
    "DEFAULT_GRID_RHOS",
    "FEDFISHER_VARIANTS",
    "FISHER_CAP_RULES",
    "FISHER_CONFIG_KEY",
    "FISHER_SCALINGS",
    "INITS",
    "LAP_SOLVERS",
    "MATCHINGS",
    "MERGE_FALLBACKS",
    "Model",
    "ModelView",
    "PRESETS",
    "REFERENCES",
    "ROUND_CHOICES",
    "SELECTIONS",
    "SERVER_FISHER_KINDS",
    "STRATEGIES",
    "alignment_kept",
    "client_score_key",
    "handover_window",
    "merge_kept_by_clients",
    "uses_fisher",
]

Model = dict[str, np.ndarray]
"""A model as the server sees it: ``state_dict`` names to arrays."""
ModelView = Mapping[str, np.ndarray]
"""A model a function only reads (any mapping of ``state_dict`` names to arrays)."""

# --- the merge -------------------------------------------------------------------------------
CURVATURES = ("diagonal", "gram", "kfac")
"""The layer curvature both steps of the merge weigh with: the uploaded diagonal Fisher (the paper),
RegMean's input Gram of each Linear and Conv2d layer (``A_k ⊗ I``), or K-FAC with a diagonal output factor
(``A_k ⊗ diag(h_k)``, ``h_k`` the units' output-gradient second moments, normalised and damped)."""
GRAM_CURVATURES = ("gram", "kfac")
"""The curvatures built on the clients' input Grams (the Gram reply; ``"kfac"`` adds each layer's output factor)."""
DEFAULT_KFAC_DAMPING = 1.0
"""K-FAC's output-factor damping ``delta > 0``: a unit's weight is ``(g / mean(g) + delta) / (1 + delta)``, between
the output factor's own (``delta -> 0``) and the Gram curvature's equal weights (``delta -> inf``)."""
GRAM_SCALINGS = ("size", "none")
"""How a client's Gram is weighted: times its share of the examples (RegMean's), or as uploaded."""
MATCHINGS = ("fisher", "euclidean", "none")
"""Alignment cost: Fisher-weighted (the paper), plain Euclidean, or no alignment."""
AGGREGATIONS = ("fisher", "uniform", "size")
"""How aligned neurons are combined: Fisher-weighted (the paper), equal weights, client sizes."""
FISHER_SCALINGS = ("none", "size", "normalized", "normalized-size")
"""Per-client Fisher scaling before the merge (``"none"``: the paper)."""
FISHER_CAP_RULES = ("outliers", "median")
"""Robust Fisher cap: bring only the clients far above (or far flatter than) the others to the median client,
or scale every client above the clients' median down to it."""
MERGE_FALLBACKS = ("objective", "none")
"""The engine's identity rule: the paper's (keep alignment unless it raises the objective, :func:`alignment_kept`) or none."""
SELECTIONS = ("objective", "validation", "none")
"""The strategy's choice between the aligned and the identity merge: the paper's rule, validation data, or always aligned."""
REFERENCES = ("largest", "broadcast")
"""The alignment's starting global model: the largest client or this round's broadcast model (or a client index)."""
BACKENDS = ("numpy", "torch")
COST_DTYPES = ("float64", "float32")
LAP_SOLVERS = ("scipy", "lapjv", "lapjv-avx", "auto")
"""Exact assignment solvers: scipy, the ``lap`` package's LAPJV, the ``lapjv`` package's AVX LAPJV, or the fastest installed."""

# --- the merge's knobs ------------------------------------------------------------------------
DEFAULT_RHO = 0.5
"""Fisher tempering exponent in (0, 1]: the merge weights ``F**rho + lam``."""
DEFAULT_LAM = 1e-4
"""Fisher damping (> 0)."""
DEFAULT_MAX_ITERS = 8
"""Inner alignment-aggregation iterations per layer (the paper's S)."""


def alignment_kept(aligned_objective: float, identity_objective: float) -> bool:
    """The paper's identity rule (Algorithm 1, line 34): keep the aligned merge unless its objective is higher.

    The alignment is kept when it does not increase the merge objective, so an exact tie keeps it;
    only a strictly higher objective falls back to the identity merge.
    """
    return not aligned_objective > identity_objective


# --- many rounds ----------------------------------------------------------------------------
DEFAULT_FISHER_ROUNDS = 3
"""Rounds in which the default merges with the Fisher (then the size-weighted average, as FedAvg)."""
FISHER_CONFIG_KEY = "fedfiot-fisher"
"""Train-config entry telling a client whether this round's server uses its Fisher (``False``: skip the pass)."""
ROUND_CHOICES = ("clients", "none")
"""Who chooses between a round's merge and FedAvg of the same uploads without server data: the clients'
evaluation step (each sampled node scores both; the better accuracy, or loss, goes on), or nobody (the merge goes on)."""
DEFAULT_HANDOVER_AFTER = 2
"""With the clients' choice: after FedAvg of the same uploads wins this many rounds in a row, the next rounds
are FedAvg and the clients skip the curvature pass."""
DEFAULT_REPROBE_AFTER = 2
"""With the clients' choice: FedAvg rounds after a hand-over before one round asks for the curvature again
(:func:`handover_window`); ``None``: the hand-over is for good."""
CANDIDATE_CONFIG_KEY = "fedfiot-candidate"
"""Evaluate-config entry, ``"fedavg"``, of the second evaluate message the clients' choice sends a node (the one
with FedAvg of the same uploads), for a client that wants to know; an ordinary evaluate handler ignores it."""
CURVATURE_CONFIG_KEY = "fedfiot-curvature"
"""Train-config entry naming the curvature the server merges with (one of :data:`CURVATURES`; absent: the
diagonal Fisher). ``"gram"``: the client sends its layers' input Grams in place of the Fisher; ``"kfac"``: the
input Grams and each layer's diagonal output factor."""


def uses_fisher(server_round: int, fisher_rounds: int | None) -> bool:
    """Whether round ``server_round`` (1-based) merges with the clients' Fisher.

    ``fisher_rounds=None`` uses it in every round (the paper); ``n`` uses it in rounds 1 to ``n``
    and averages the weights by client size afterwards, when the clients start every round from
    one broadcast model, the alignment has nothing left to move, and the Fisher weighting
    compounds the confident clients' logit growth round after round.

    >>> [uses_fisher(r, 2) for r in (1, 2, 3)], uses_fisher(50, None)
    ([True, True, False], True)
    """
    return fisher_rounds is None or server_round <= fisher_rounds


def client_score_key(names: Iterable[str]) -> tuple[str, bool] | None:
    """The clients' evaluation metric the clients' choice compares, and whether higher is better.

    An accuracy (the first name, in sorted order, ending in ``accuracy`` or ``acc``: ``eval-accuracy``,
    ``eval_acc``) when the clients report one, else a loss (ending in ``loss``); ``None`` when neither.
    Accuracy first: on label-skewed clients the first round's curvature-weighted merge can have the
    lower loss and the lower accuracy (benchmarks/results/many_rounds_choice_fashion_dir.md).

    >>> client_score_key(["eval-accuracy", "eval-loss"]), client_score_key(["eval_loss"]), client_score_key(["n"])
    (('eval-accuracy', True), ('eval_loss', False), None)
    """
    names = sorted(names)
    for ends, higher in ((("accuracy", "acc"), True), (("loss",), False)):
        key = next((n for n in names if n.lower().endswith(ends)), None)
        if key is not None:
            return key, higher
    return None


def handover_window(server_round: int, handovers: int, reprobe_after: int | None) -> tuple[int, int | None]:
    """The rounds a hand-over decided in ``server_round`` makes FedAvg: ``(first, resume)``, ``resume`` the round
    that asks the clients for their curvature again (``None``: never).

    The ``handovers``-th hand-over in a row (1 for the first, one more for each probe round FedAvg wins
    again) lasts ``reprobe_after * 2 ** (handovers - 1)`` rounds, so a merge that keeps losing costs
    ever fewer curvature rounds, and one that starts to win gets them back.

    >>> handover_window(2, 1, 2), handover_window(5, 2, 2), handover_window(5, 1, None)
    ((3, 5), (6, 10), (6, None))
    """
    first = int(server_round) + 1
    if reprobe_after is None:
        return first, None
    return first, first + int(reprobe_after) * 2 ** (int(handovers) - 1)


def merge_kept_by_clients(merge_score: float, fedavg_score: float, higher_is_better: bool) -> bool:
    """The clients' choice: the merge goes on only when its score on their evaluation is strictly better than
    FedAvg's of the same uploads; a tie goes on with FedAvg, a non-finite score loses to a finite one.

    >>> merge_kept_by_clients(0.8, 0.7, True), merge_kept_by_clients(0.6, 0.6, False)
    (True, False)
    >>> merge_kept_by_clients(float("nan"), 1.0, False), merge_kept_by_clients(2.0, float("inf"), False)
    (False, True)
    """
    if not np.isfinite(fedavg_score):
        return bool(np.isfinite(merge_score))
    if not np.isfinite(merge_score):
        return False
    return bool(merge_score > fedavg_score if higher_is_better else merge_score < fedavg_score)


# --- the paper's selection grid ----------------------------------------------------------------
DEFAULT_GRID_RHOS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
DEFAULT_GRID_LAMS = (1e-3, 1e-4, 1e-5)
DEFAULT_GRID_REFERENCES = ("largest", "broadcast")
DEFAULT_GRID_GRAM_ALPHAS = (0.1, 0.5, 0.9, 1.0)
"""The Gram curvature's off-diagonal scalings tried on validation data (RegMean's 0.1 and 0.9, and 0.5, 1)."""
DEFAULT_GRID_GRAM_RIDGES = (0.01, 0.1)
"""The Gram curvature's relative ridges tried on validation data. No ridge is not among them: validation one
round ahead cannot see that an unridged merge's inflated weights stop the clients from training the next round
(research/results/gram_weight_norms.md)."""
DEFAULT_GRAM_RIDGE = 0.01
"""The Gram curvature's relative ridge without validation data (times each Gram's mean diagonal entry)."""
DEFAULT_GRAM_GROWTH = 1.5
"""The Gram curvatures' growth bound: a merge with a tensor whose norm exceeds this factor times the largest
client's norm of that tensor is not kept. FedAvg of the uploads always meets it (a weighted mean of the clients'
tensors is no longer than the longest), so it is the fallback when no merge does. The Gram closed form is not a
weighted mean and can extrapolate; the clients could not train from the merges it excluded on Fashion-MNIST
(research/results/gram_growth.md, gram_weight_norms.md). A bound, not a tuned knob: on that cell 1.5 and 2 keep the same merge."""
DEFAULT_GRAM_CAP = 100.0
"""Robust weighting of the Gram curvature: a client's Gram of a layer more than this many times the other clients'
median (mean diagonal entry) is brought down to it. Looser than the Fisher's cap: the Grams of honest clients' hidden
layers differ with their weights' scale, which the merge should weigh; an inflated Gram is orders of magnitude off."""
DEFAULT_GRAM_ALPHA = 0.9
"""The Gram curvature's off-diagonal scaling without validation data (the value validation chose most often
on digits' MLP, 100 local epochs, 3 seeds, both initialisations: research/results/gram_alignment.md)."""

# --- curvature ------------------------------------------------------------------------------
CLIENT_FISHER_KINDS = ("empirical", "true", "sampled")
"""What a client can compute: the empirical Fisher (the paper, eq. 106), the true Fisher, or one sampled label per example."""
SERVER_FISHER_KINDS = ("true", "empirical")
"""What FedFisher's K-FAC aggregator accepts a reply to declare."""
FEDFISHER_VARIANTS = ("kfac", "diag")

# --- the app ---------------------------------------------------------------------------------
INITS = ("shared", "independent")
"""One broadcast initialisation (the paper's Table 1) or one per client (Table 5)."""
STRATEGIES = ("fedfiot", "fedfisher-kfac", "fedfisher-diag", "regmean")
"""Values of the app's ``strategy`` key."""
PRESETS = ("default", "paper")
"""Values of the app's ``preset`` key: :meth:`fedfiot_flwr.FedFiOTConfig.default` or ``.paper``."""
