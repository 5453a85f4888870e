"""The FedFiOT merge: layer-wise alternating Fisher-weighted alignment and aggregation.

See ``SPEC.md`` for the objective. Decisions where the paper leaves room (documented in README):

* the Fisher is tempered, then damped: ``f = F**rho + lam``;
* iteration 1 always aggregates; from iteration 2 on a permutation's loop stops when no
  client's alignment changed; the reference client is re-aligned like every other client;
* the identity fallback follows the paper's Algorithm 1 (line 34): the aligned merge is
  replaced by the identity merge only when its full-model objective is strictly higher;
* tensors without a Fisher (``buffers``, e.g. BatchNorm running statistics) move with their
  channel's permutation, take no part in costs or objectives and are averaged weighted by
  ``num_examples`` (uniformly when sizes are unknown).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .costs import aggregate, assign, euclidean_cost_matrices, fisher_cost_matrices
from .spec import PermutationSpec, permute_tensor
from .validate import check_models, check_num_examples, check_options, check_reference_model

FISHER_SCALINGS = ("none", "size", "normalized", "normalized-size")

Model = Mapping[str, np.ndarray]


@dataclass
class PermutationReport:
    """What happened while aligning one permutation (one hidden layer).

    Attributes
    ----------
    size : int
        Number of neurons.
    iterations : int
        Inner iterations run (alignment steps, the last one possibly confirming convergence).
    initial_objective : float
        Layer objective at the reference with identity alignments, ``J(w[0], I)``.
    alignment_objectives : list[float]
        ``J(w[s-1], pi[s])`` after each alignment step.
    objectives : list[float]
        ``J(w[s], pi[s])`` after each iteration's aggregation.
    fraction_permuted : list[float]
        Per client, the fraction of neurons not mapped to their own index.
    """

    size: int
    iterations: int
    initial_objective: float
    alignment_objectives: list[float] = field(default_factory=list)
    objectives: list[float] = field(default_factory=list)
    fraction_permuted: list[float] = field(default_factory=list)


@dataclass
class MergeResult:
    """Outcome of :func:`merge`.

    Attributes
    ----------
    model : dict[str, np.ndarray]
        The merged model (the aligned merge, or the identity merge when the fallback was taken).
    objective : float
        Full-model objective J of ``model`` with the alignments used.
    identity_objective : float
        J of the identity-aligned merge (``argmin_W J(W, I)`` for Fisher aggregation).
    aligned : bool
        Whether the aligned merge was kept (False when the fallback was taken or matching="none").
    permutations : dict[str, list[np.ndarray]]
        Alignments found, per permutation and client: global neuron ``i`` <- client neuron ``p[i]``.
    reports : dict[str, PermutationReport]
        Per-permutation iterations, objectives and fractions permuted.
    aligned_model, identity_model : dict[str, np.ndarray]
        Both candidate merges.
    aligned_objective : float
        J of the aligned merge.
    fraction_permuted : list[float]
        Per client, the fraction of all hidden neurons that alignment moved.
    reference : int or None
        Index of the reference client (None for a given reference model).
    seconds : float
        Wall time of the merge.
    """

    model: dict[str, np.ndarray]
    objective: float
    identity_objective: float
    aligned: bool
    permutations: dict[str, list[np.ndarray]]
    reports: dict[str, PermutationReport]
    aligned_model: dict[str, np.ndarray]
    identity_model: dict[str, np.ndarray]
    aligned_objective: float
    fraction_permuted: list[float]
    reference: int | None
    seconds: float


def damp_fisher(fisher: np.ndarray, lam: float, rho: float) -> np.ndarray:
    """Server-side preprocessing of a raw Fisher: temper, then damp (``F**rho + lam``).

    >>> damp_fisher(np.array([0., 4.]), lam=1.0, rho=0.5).tolist()
    [1.0, 3.0]
    """
    return np.power(np.asarray(fisher, dtype=np.float64), rho) + lam


def scale_fishers(
    fishers: Sequence[Model], scaling: str, num_examples: Sequence[float] | None
) -> list[dict[str, np.ndarray]]:
    """Rescale each client's raw Fisher before tempering and damping.

    Parameters
    ----------
    fishers : sequence of dict[str, np.ndarray]
        Raw per-client Fisher (the mean over the client's examples, eq. 106).
    scaling : {"none", "size", "normalized", "normalized-size"}
        ``"none"``: as uploaded (the paper). ``"size"``: times ``n_k / n`` (the Fisher of the
        client's summed log-likelihood, as FedFisher's code does). ``"normalized"``: divided by the
        client's mean Fisher entry, so that magnitudes are comparable across clients.
        ``"normalized-size"``: normalized, then times ``K * n_k / n`` (mean client weight 1).
    num_examples : sequence of float, optional
        Client sizes; required by the size-based scalings.

    Examples
    --------
    >>> out = scale_fishers([{"w": np.array([1., 3.])}, {"w": np.array([4., 4.])}], "normalized", None)
    >>> [o["w"].tolist() for o in out]
    [[0.5, 1.5], [1.0, 1.0]]
    >>> scale_fishers([{"w": np.array([2.])}, {"w": np.array([2.])}], "size", [1, 3])[1]["w"].tolist()
    [1.5]
    """
    if scaling not in FISHER_SCALINGS:
        raise ValueError(f"fisher_scaling must be one of {FISHER_SCALINGS}, got {scaling!r}")
    if scaling == "none":
        return [{n: np.asarray(f, dtype=np.float64) for n, f in fk.items()} for fk in fishers]
    if "size" in scaling and num_examples is None:
        raise ValueError(f"fisher_scaling={scaling!r} needs num_examples")
    factors = np.ones(len(fishers))
    if "size" in scaling:
        n = np.asarray(num_examples, dtype=np.float64)
        factors = n / n.sum() * (len(fishers) if scaling == "normalized-size" else 1.0)
    out = []
    for k, fk in enumerate(fishers):
        factor = factors[k]
        if scaling.startswith("normalized"):
            total = sum(float(np.sum(f)) for f in fk.values())
            count = sum(int(np.size(f)) for f in fk.values())
            mean = total / count if count else 0.0
            factor = factor / mean if mean > 0 else factor
        out.append({n: np.asarray(f, dtype=np.float64) * factor for n, f in fk.items()})
    return out


def resolve_reference(reference: object, num_examples: Sequence[int] | None, n_clients: int) -> int | None:
    """Index of the reference client, or None when ``reference`` is a model dict."""
    if isinstance(reference, Mapping):
        return None
    if reference == "largest":
        if num_examples is None:
            raise ValueError("reference='largest' needs num_examples")
        return int(np.argmax(num_examples))
    if isinstance(reference, (int, np.integer)) and not isinstance(reference, bool):
        if not 0 <= reference < n_clients:
            raise ValueError(f"reference client index {reference} is out of range for {n_clients} clients")
        return int(reference)
    raise ValueError(f"reference must be a client index, 'largest' or a model dict, got {reference!r}")


def _layer_matrix(tensors: Sequence[np.ndarray], m: int) -> np.ndarray:
    return np.concatenate([t.reshape(m, -1) for t in tensors], axis=1)


def _scalar_average(aggregation: str, layers: Sequence[np.ndarray], sizes: Sequence[float] | None) -> np.ndarray:
    """Uniform or size-weighted average (the rules without a Fisher)."""
    return aggregate(layers, None, sizes if aggregation == "size" else None)


def _align_permutation(
    perm: str,
    spec: PermutationSpec,
    size: int,
    models: Sequence[Model],
    fishers: Sequence[Model],
    perms: Sequence[dict[str, np.ndarray]],
    ref_layer: np.ndarray,
    *,
    matching: str,
    aggregation: str,
    sizes: Sequence[float] | None,
    max_iters: int,
) -> tuple[list[np.ndarray], PermutationReport]:
    """Alternating minimisation for one permutation; returns per-client alignments and a report."""
    names = [n for n in spec.neuron_tensors(perm) if n in fishers[0]]
    layers = [_layer_matrix([permute_tensor(mk[n], spec.axes[n], pk, (0,)) for n in names], size)
              for mk, pk in zip(models, perms)]
    damped = [_layer_matrix([permute_tensor(fk[n], spec.axes[n], pk, (0,)) for n in names], size)
              for fk, pk in zip(fishers, perms)]
    identity = np.arange(size)
    rows = np.arange(size)
    w = ref_layer
    report = PermutationReport(size, 0, float("nan"))
    current = [identity] * len(models)
    for s in range(1, max_iters + 1):
        report.iterations = s
        if matching == "fisher":
            new, chosen, diagonal = [], 0.0, 0.0
            for cost in fisher_cost_matrices(w, layers, damped):
                new.append(assign(cost))
                # J(w, pi) is the sum of the chosen Fisher costs: no second pass over the weights.
                chosen += float(cost[rows, new[-1]].sum())
                diagonal += float(np.trace(cost))
            if s == 1:  # J(w[0], I): the identity alignments' costs
                report.initial_objective = diagonal
        else:
            if s == 1:
                report.initial_objective = _objective_from_moments(w, *_moments(layers, damped))
            new = [assign(cost) for cost in euclidean_cost_matrices(w, layers)]
        unchanged = s > 1 and all(np.array_equal(a, b) for a, b in zip(new, current))
        if matching != "fisher" and unchanged:
            chosen = report.objectives[-1]
        if unchanged:
            report.alignment_objectives.append(chosen)
            report.objectives.append(chosen)
            break
        current = new
        aligned_layers = [x[p] for x, p in zip(layers, new)]
        aligned_fishers = [f[p] for f, p in zip(damped, new)]
        num, den, const = _moments(aligned_layers, aligned_fishers)
        if matching != "fisher":
            report.alignment_objectives.append(_objective_from_moments(w, num, den, const))
        else:
            report.alignment_objectives.append(chosen)
        w = num / den if aggregation == "fisher" else _scalar_average(aggregation, aligned_layers, sizes)
        report.objectives.append(_objective_from_moments(w, num, den, const))
    report.fraction_permuted = [float(np.mean(p != identity)) for p in current]
    return current, report


def _moments(xs: Sequence[np.ndarray], fs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, float]:
    """``sum_k f_k x_k``, ``sum_k f_k`` and the alignment-invariant constant ``sum_k sum f_k x_k**2``."""
    num = np.zeros_like(xs[0])
    den = np.zeros_like(xs[0])
    const = 0.0
    for x, f in zip(xs, fs):
        fx = f * x
        num += fx
        den += f
        const += float(np.vdot(fx, x))
    return num, den, const


def _objective_from_moments(value: np.ndarray, num: np.ndarray, den: np.ndarray, const: float) -> float:
    """``sum_k sum f_k (value - x_k)**2`` expanded: one pass instead of K."""
    return max(0.0, const + float(np.vdot(den * value - 2.0 * num, value)))


def _merge_all(
    models: Sequence[Model],
    fishers: Sequence[Model],
    spec: PermutationSpec,
    perms: Sequence[Mapping[str, np.ndarray]],
    aggregation: str,
    sizes: Sequence[float] | None,
    dtypes: Mapping[str, np.dtype],
) -> tuple[dict[str, np.ndarray], float]:
    """Aggregate every tensor of the permuted clients; return the model and its full objective J."""
    merged: dict[str, np.ndarray] = {}
    objective = 0.0
    for name in models[0]:
        axes = spec.axes.get(name, (None,) * np.ndim(models[0][name]))
        xs = [permute_tensor(mk[name], axes, pk) for mk, pk in zip(models, perms)]
        if name in fishers[0]:
            fs = [permute_tensor(fk[name], axes, pk) for fk, pk in zip(fishers, perms)]
            num, den, const = _moments(xs, fs)
            value = num / den if aggregation == "fisher" else _scalar_average(aggregation, xs, sizes)
            objective += _objective_from_moments(value, num, den, const)
        else:
            value = _scalar_average("size", xs, sizes)  # buffers: by size (uniform when unknown)
        if np.issubdtype(dtypes[name], np.integer):
            value = np.rint(value)
        merged[name] = value.astype(dtypes[name] if np.issubdtype(dtypes[name], np.number) else np.float64)
    return merged, objective


def merge(
    models: Sequence[Model],
    fishers: Sequence[Model],
    spec: PermutationSpec,
    lam: float = 1e-4,
    rho: float = 0.5,
    max_iters: int = 8,
    reference: int | str | Model = "largest",
    num_examples: Sequence[int] | None = None,
    matching: str = "fisher",
    aggregation: str = "fisher",
    buffers: Collection[str] = (),
    fallback: str = "objective",
    client_ids: Sequence[str] | None = None,
    fisher_scaling: str = "none",
) -> MergeResult:
    """Merge client models with FedFiOT's alternating Fisher-weighted alignment and aggregation.

    Parameters
    ----------
    models : sequence of dict[str, np.ndarray]
        Client models (same keys and shapes).
    fishers : sequence of dict[str, np.ndarray]
        Raw (undamped, untempered) diagonal Fisher per client, same keys and shapes as the
        models except the tensors named in ``buffers``.
    spec : PermutationSpec
        Which axes of which tensors each hidden-unit permutation moves.
    lam : float
        Damping ``lambda > 0`` added after tempering.
    rho : float
        Tempering exponent in ``(0, 1]``: the merge uses ``F**rho + lam``.
    max_iters : int
        Inner iterations ``S`` per permutation (early stop when alignments repeat).
    reference : int, "largest" or dict
        Initial global layer ``w[0]``: a client index, the client with most examples, or a model
        (e.g. the broadcast model).
    num_examples : sequence of int, optional
        Client sizes; needed for ``reference="largest"`` and ``aggregation="size"``.
    matching : {"fisher", "euclidean", "none"}
        Alignment cost: Fisher-weighted, unit-weighted, or no alignment (identity).
    aggregation : {"fisher", "uniform", "size"}
        Fisher-weighted, uniform, or ``num_examples``-weighted averaging.
    buffers : collection of str
        Tensors without a Fisher (BatchNorm running statistics); see the module docstring.
    fallback : {"objective", "none"}
        ``"objective"``: the paper's rule (keep the aligned merge unless its full-model objective
        is strictly above the identity merge's); ``"none"``: always keep the aligned merge.
    client_ids : sequence of str, optional
        Names used in error messages (default: the client indices).
    fisher_scaling : {"none", "size", "normalized", "normalized-size"}
        Per-client rescaling of the raw Fisher before tempering (see :func:`scale_fishers`);
        ``"none"`` is the paper's eq. 106.

    Returns
    -------
    MergeResult

    Raises
    ------
    ValueError
        On mismatched keys or shapes, NaN/inf weights, negative or non-finite Fisher, bad options,
        or a spec naming a tensor the models lack; the message names the client and tensor.

    Examples
    --------
    The worked example of the paper's Appendix G:

    >>> spec = PermutationSpec({"w": ("P0", None)})
    >>> res = merge([{"w": np.array([[0.], [4.], [8.]])}, {"w": np.array([[10.], [2.], [6.]])}],
    ...             [{"w": np.array([[2.], [0.], [2.]])}, {"w": np.array([[0.], [0.], [2.]])}],
    ...             spec, lam=1.0, rho=1.0, reference=0)
    >>> res.model["w"].ravel().tolist(), res.objective, res.permutations["P0"][1].tolist()
    ([0.5, 5.5, 8.5], 9.0, [1, 2, 0])
    """
    start = time.perf_counter()
    check_options(lam, rho, max_iters, matching, aggregation, fallback)
    ids = [str(i) for i in range(len(models))] if client_ids is None else [str(c) for c in client_ids]
    shapes = check_models(models, fishers, buffers, ids)
    check_num_examples(num_examples, len(models), ids)
    if aggregation == "size" and num_examples is None:
        raise ValueError("aggregation='size' needs num_examples")
    sizes_per_perm = spec.sizes(shapes)
    ref_index = resolve_reference(reference, num_examples, len(models))
    if ref_index is None:
        check_reference_model(reference, shapes)  # type: ignore[arg-type]

    dtypes = {n: np.asarray(x).dtype for n, x in models[0].items()}
    xs = [{n: np.asarray(x, dtype=np.float64) for n, x in m.items()} for m in models]
    fs = [{n: damp_fisher(f, lam, rho) for n, f in fk.items()}
          for fk in scale_fishers(fishers, fisher_scaling, num_examples)]
    sizes = None if num_examples is None else [float(n) for n in num_examples]
    perms: list[dict[str, np.ndarray]] = [{} for _ in models]
    reports: dict[str, PermutationReport] = {}
    for perm in spec.perm_names:
        if matching == "none":  # no alignment: identity everywhere, nothing to iterate
            reports[perm] = PermutationReport(sizes_per_perm[perm], 0, float("nan"),
                                              fraction_permuted=[0.0] * len(models))
            continue
        names = [n for n in spec.neuron_tensors(perm) if n in fs[0]]
        m = sizes_per_perm[perm]
        if ref_index is None:
            ref_layer = _layer_matrix([np.asarray(reference[n], dtype=np.float64) for n in names], m)  # type: ignore[index]
        else:
            ref_layer = _layer_matrix(
                [permute_tensor(xs[ref_index][n], spec.axes[n], perms[ref_index], (0,)) for n in names], m
            )
        found, reports[perm] = _align_permutation(
            perm, spec, m, xs, fs, perms, ref_layer,
            matching=matching, aggregation=aggregation, sizes=sizes, max_iters=max_iters,
        )
        for pk, p in zip(perms, found):
            pk[perm] = p
    if matching == "none":
        perms = [{p: np.arange(sizes_per_perm[p]) for p in spec.perm_names} for _ in models]

    identity_perms: list[dict[str, np.ndarray]] = [{} for _ in models]
    identity_model, identity_objective = _merge_all(xs, fs, spec, identity_perms, aggregation, sizes, dtypes)
    if matching == "none":
        aligned_model, aligned_objective = identity_model, identity_objective
        aligned = False
    else:
        aligned_model, aligned_objective = _merge_all(xs, fs, spec, perms, aggregation, sizes, dtypes)
        aligned = fallback == "none" or not aligned_objective > identity_objective
    total = sum(sizes_per_perm[p] for p in spec.perm_names)
    moved = [sum(int(np.sum(pk[p] != np.arange(len(pk[p])))) for p in spec.perm_names) for pk in perms]
    return MergeResult(
        model=aligned_model if aligned else identity_model,
        objective=aligned_objective if aligned else identity_objective,
        identity_objective=identity_objective,
        aligned=aligned,
        permutations={p: [pk[p] for pk in perms] for p in spec.perm_names},
        reports=reports,
        aligned_model=aligned_model,
        identity_model=identity_model,
        aligned_objective=aligned_objective,
        fraction_permuted=[mv / total if total else 0.0 for mv in moved],
        reference=ref_index,
        seconds=time.perf_counter() - start,
    )
