"""The FedFiOT merge: layer-wise alternating Fisher-weighted alignment and aggregation.

The objective is the paper's (see README). Decisions where the paper leaves room (documented in README):

* the Fisher is tempered, then damped: ``f = F**rho + lam``;
* iteration 1 always aggregates; from iteration 2 on a permutation's loop stops when no
  client's alignment changed; the reference client is re-aligned like every other client;
* the identity fallback follows the paper's Algorithm 1 (line 34): the aligned merge is
  replaced by the identity merge only when its full-model objective is strictly higher;
* tensors without a Fisher (the ``buffers`` given to :func:`~fedfiot_flwr.merge.prepare_clients`,
  e.g. BatchNorm running statistics) move with their channel's permutation, take no part in
  costs or objectives and are averaged weighted by ``num_examples`` (uniformly when sizes are
  unknown); integer ones are rounded to the nearest integer
  (:func:`~fedfiot_flwr.merge.dtypes.cast_average`, FedAvg's rule too).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedfiot_flwr.options import GRAM_CURVATURES, alignment_kept
from fedfiot_flwr.options import ModelView as Model

from .backend import get_backend
from .certify import assign_with_hint
from .costs import ClientLayers, objective_from_moments
from .gram import GramLayers, PreparedGrams, group_members, layer_view, merge_with_grams, prepare_grams
from .kfac import KFACLayers
from fedfiot_flwr.psd import layer_matrix
from .dtypes import cast_average
from .lap import assign
from .parallel import lap_workers, solve_in_order
from .prepared import FISHER_SCALINGS, PreparedClients, as_prepared, fisher_scale_factors, scaled_fisher
from .reuse import AlignmentMemo, AlignmentTail, permutations_digest
from .spec import PermutationSpec, permute_tensor
from .speed import MergeSpeed
from .options import MergeOptions
from .validate import check_reference_model



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
    factors = fisher_scale_factors(fishers, scaling, num_examples)
    return [{n: scaled_fisher(f, factor) for n, f in fk.items()} for fk, factor in zip(fishers, factors)]


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


def _as_float64(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _layer_loader(
    models: Sequence[Model],
    fishers: Sequence[Model],
    perms: Sequence[Mapping[str, np.ndarray]],
    spec: PermutationSpec,
    names: Sequence[str],
    m: int,
) -> Any:
    """``k -> (w_k, f_k)``: one permutation's ``(m, d)`` client layer and damped Fisher, with
    the incoming axes already aligned by the permutations decided before."""

    def load(k: int) -> tuple[np.ndarray, np.ndarray]:
        layer = _layer_matrix([_as_float64(permute_tensor(models[k][n], spec.axes[n], perms[k], (0,))) for n in names], m)
        fisher = _layer_matrix([permute_tensor(fishers[k][n], spec.axes[n], perms[k], (0,)) for n in names], m)
        return layer, fisher

    return load


def _stack_bytes(m: int, d: int, n_clients: int, matching: str, aggregation: str, cost_dtype: str) -> int:
    """Bytes that :class:`ClientLayers` keeps when it stacks every client."""
    per_client = 2 * m * d * 8 + (m * d * 8 if matching == "euclidean" or aggregation != "fisher" else 0)
    if cost_dtype == "float32":
        per_client += 2 * m * d * 4
    return n_clients * per_client


def _align_permutation(
    size: int,
    clients: ClientLayers,
    ref_layer: np.ndarray,
    *,
    options: MergeOptions,
    sizes: Sequence[float] | None,
    speed: MergeSpeed,
    ref_client: int | None = None,
    start: Sequence[np.ndarray] | None = None,
    memo: AlignmentMemo | None = None,
    memo_key: tuple | None = None,
) -> tuple[list[np.ndarray], PermutationReport]:
    """Alternating minimisation for one permutation (Algorithm 1's inner loop): for each
    iteration, build every client's cost matrix against ``w``, assign exactly, aggregate
    (``options.matching``, ``options.aggregation``, at most ``options.max_iters`` iterations).

    With ``speed.certify``, each assignment is first tried from a hint (the previous one; the
    identity in iteration 1) and solved only when the hint is not certified optimal
    (:mod:`fedfiot_flwr.merge.certify`); in iteration 1 the reference client ``ref_client``
    keeps the identity without a cost matrix when none of its neurons repeats.
    With ``start`` (per-client permutations) the loop starts from the clients aligned by it (a
    warm start) and stops at once when it is a fixed point. With ``memo`` (and ``memo_key``), a
    cold start whose first assignment another merge reached takes the remaining iterations from
    it (bit-identical). With more than one ``speed.lap_threads`` the clients' independent
    problems are solved in a thread pool and handed back in client order: bit-identical.
    """
    matching, aggregation = options.matching, options.aggregation
    workers = lap_workers(speed.lap_threads, size, clients.n_clients, speed.lap_solver)
    with ThreadPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        identity = np.arange(size)
        w = ref_layer
        report = PermutationReport(size, 0, float("nan"))
        current = [identity] * clients.n_clients
        use_memo = start is None and memo is not None and memo_key is not None
        first_key: tuple | None = None  # the memo's key: memo_key and the first iteration's assignment

        single = speed.cost_dtype == "float32"  # the costs come from float32 GEMMs

        def solve(cost: np.ndarray, hint: np.ndarray) -> np.ndarray:
            if speed.certify:
                return assign_with_hint(cost, hint, speed.lap_solver, single)[0]
            return assign(cost, speed.lap_solver, single)

        def global_layer(perms: list[np.ndarray], num: np.ndarray, den: np.ndarray) -> np.ndarray:
            if aggregation == "fisher":
                return clients.solve(perms, num, den)
            return clients.average(perms, sizes if aggregation == "size" else None)

        if start is not None:
            current = [np.asarray(p, dtype=np.int64) for p in start]
            w = global_layer(current, *clients.moments(current))
        for s in range(1, options.max_iters + 1):
            report.iterations = s
            skip: set[int] = set()
            if (speed.certify and s == 1 and start is None and ref_client is not None and matching == "fisher"
                    and isinstance(clients, ClientLayers) and _distinct_rows(ref_layer)):
                skip = {ref_client}
            if matching == "fisher":
                new, chosen, diagonal = _fisher_step(solve_in_order(clients.costs(w, skip), current, solve,
                                                                    pool, workers), identity)
                if s == 1:  # J(w[0], I): the identity alignments' costs
                    report.initial_objective = diagonal
            else:
                if s == 1:
                    report.initial_objective = clients.objective(w, *clients.moments(current))
                new = [p for _, p in solve_in_order(clients.euclidean_costs(w), current, solve, pool, workers)]
            unchanged = (s > 1 or start is not None) and all(np.array_equal(a, b) for a, b in zip(new, current))
            if matching != "fisher" and unchanged:
                chosen = report.objectives[-1] if report.objectives else clients.objective(
                    w, *clients.moments(current))
            if unchanged:
                report.alignment_objectives.append(chosen)
                report.objectives.append(chosen)
                break
            current = new
            num, den = clients.moments(new)
            if matching != "fisher":
                report.alignment_objectives.append(clients.objective(w, num, den))
            else:
                report.alignment_objectives.append(chosen)
            w = global_layer(new, num, den)
            report.objectives.append(clients.objective(w, num, den))
            if s == 1 and use_memo:
                first_key = (*memo_key, permutations_digest(new))  # type: ignore[misc]
                tail = memo.get(first_key)  # type: ignore[union-attr]
                if tail is not None:
                    current, report.iterations = list(tail.perms), tail.iterations
                    report.alignment_objectives += tail.alignment_objectives
                    report.objectives += tail.objectives
                    break
        if first_key is not None and report.iterations > 1 and first_key not in memo.tails:  # type: ignore[union-attr]
            memo.put(first_key, AlignmentTail(list(current), report.iterations,  # type: ignore[union-attr]
                                              report.alignment_objectives[1:], report.objectives[1:]))
        report.fraction_permuted = [float(np.mean(p != identity)) for p in current]
        return current, report


def _fisher_step(solved: Any, identity: np.ndarray) -> tuple[list[np.ndarray], float, float]:
    """Each client's new assignment with ``J(w, pi)`` (the sum of the chosen Fisher costs: no second
    pass over the weights) and ``J(w, I)`` (the diagonals), from ``(cost, assignment)`` pairs."""
    new, chosen, diagonal = [], 0.0, 0.0
    for cost, p in solved:
        if cost is None:  # the reference against itself: the identity, at zero cost
            new.append(identity)
            continue
        new.append(p)
        chosen += float(cost[identity, p].sum())
        diagonal += float(np.trace(cost))
    return new, chosen, diagonal


def _distinct_rows(layer: np.ndarray) -> bool:
    """Whether no two rows of ``layer`` are equal (equal rows have equal projections: only rows
    whose projections tie are compared).

    >>> _distinct_rows(np.array([[1., 2.], [2., 1.]])), _distinct_rows(np.array([[1., 2.], [1., 2.]]))
    (True, False)
    """
    key = layer @ np.random.default_rng(0).standard_normal(layer.shape[1])
    order = np.argsort(key, kind="stable")
    tie = key[order[1:]] == key[order[:-1]]
    if not tie.any():
        return True
    rows = np.unique(np.concatenate([order[1:][tie], order[:-1][tie]]))
    return len(np.unique(layer[rows], axis=0)) == len(rows)


def _merge_all(
    models: Sequence[Model],
    fishers: Sequence[Model],
    spec: PermutationSpec,
    perms: Sequence[Mapping[str, np.ndarray]],
    aggregation: str,
    sizes: Sequence[float] | None,
    dtypes: Mapping[str, np.dtype],
) -> tuple[dict[str, np.ndarray], float]:
    """Aggregate every tensor of the permuted clients; return the model and its full objective J.

    Clients are streamed one tensor at a time: the same sums as :func:`_moments` and
    :func:`~fedfiot_flwr.merge.costs.aggregate`, without holding K copies.
    """
    merged: dict[str, np.ndarray] = {}
    objective = 0.0
    scalar = np.ones(len(models)) if sizes is None else np.asarray(sizes, dtype=np.float64)
    scalar = scalar / scalar.sum()
    uniform = np.full(len(models), 1.0 / len(models))
    for name in models[0]:
        axes = spec.axes.get(name, (None,) * np.ndim(models[0][name]))
        has_fisher = name in fishers[0]
        weights = uniform if has_fisher and aggregation == "uniform" else scalar
        num = den = average = None
        const = 0.0
        for k, (mk, pk) in enumerate(zip(models, perms)):
            x = np.asarray(permute_tensor(mk[name], axes, pk), dtype=np.float64)
            if has_fisher:
                f = permute_tensor(fishers[k][name], axes, pk)
                fx = f * x
                const += float(np.vdot(fx, x))
                # asarray: 0-d tensors give numpy scalars, which cannot be accumulated in place.
                num = np.asarray(fx) if num is None else np.add(num, fx, out=num)
                den = np.asarray(f) if den is None else np.add(den, f, out=den)  # f is fresh (damped on read)
            if not has_fisher or aggregation != "fisher":
                term = weights[k] * x
                average = np.asarray(term) if average is None else np.add(average, term, out=average)
        if has_fisher:
            value = num / den if aggregation == "fisher" else average
            objective += objective_from_moments(value, num, den, const)
        else:
            value = average  # buffers: by size (uniform when unknown)
        merged[name] = cast_average(value, dtypes[name])
    return merged, objective


def merge(
    models: Sequence[Model] | PreparedClients,
    fishers: Sequence[Model] | None,
    spec: PermutationSpec,
    options: MergeOptions | None = None,
    *,
    num_examples: Sequence[int] | None = None,
    speed: MergeSpeed | None = None,
    initial_perms: Mapping[str, Sequence[np.ndarray]] | None = None,
) -> MergeResult:
    """Merge client models with FedFiOT's alternating Fisher-weighted alignment and aggregation.

    Layer by layer from the input side, the clients' neurons are aligned to a global layer and
    aggregated, alternately, to minimise

    ``J(W, pi) = sum_k sum_l sum_(i,j) f_k[l,i,j] * (W_l[i,j] - (P_k,l w_k,l P_k,l-1^T)[i,j])**2``

    with ``f_k = (s_k * F_k)**rho + lam`` (docs/algorithm.md derives each step).

    Parameters
    ----------
    models : sequence of dict[str, np.ndarray], or PreparedClients
        Client models (same keys and shapes), or uploads checked once by
        :func:`~fedfiot_flwr.merge.prepare_clients` (then ``fishers=None``). Buffers (tensors
        without a Fisher, e.g. BatchNorm running statistics; see the module docstring), client
        names and sizes are given to ``prepare_clients``; plain lists have no buffers and their
        clients are named by index in errors. A sweep over candidates should prepare once:
        validation, tempering per ``(fisher_scaling, rho)`` and identity merges are then shared.
    fishers : sequence of dict[str, np.ndarray], or None
        Raw (undamped, untempered) diagonal Fisher per client, same keys and shapes as the
        models; None with PreparedClients. With ``options.curvature="gram"``: per client, the
        input Grams ``{module: InputGram}`` of its Linear and Conv2d layers
        (:func:`fedfiot_flwr.curvature.input_grams`; the objective is then
        :mod:`fedfiot_flwr.merge.gram`'s, ``num_examples`` is required; ``"kfac"`` also needs every
        layer's ``InputGram.output``, :mod:`fedfiot_flwr.merge.kfac`), or None with
        :func:`~fedfiot_flwr.merge.gram.prepare_grams`'s result as ``models``.
    spec : PermutationSpec
        Which axes of which tensors each hidden-unit permutation moves.
    options : MergeOptions, optional
        The algorithm (tempering, damping, iterations, reference, matching, aggregation, identity
        rule, Fisher scaling), as :class:`~fedfiot_flwr.merge.options.MergeOptions` documents and
        validates it; its defaults when omitted.
    num_examples : sequence of int, optional
        Client sizes, for plain lists (PreparedClients carry theirs); needed for
        ``reference="largest"`` and ``aggregation="size"``.
    speed : MergeSpeed, optional
        How the merge is computed (cost precision, solver, threads, certified assignments,
        torch backend, memory budget); :class:`~fedfiot_flwr.merge.speed.MergeSpeed`'s defaults
        when omitted. None of it changes the algorithm.
    initial_perms : dict[str, list[np.ndarray]], optional
        Warm start: per permutation, per client, the alignment to start from (e.g. another
        candidate's :attr:`MergeResult.permutations`). Each permutation's loop then starts from
        the merge of the clients aligned by ``initial_perms`` rather than from the reference, and
        stops after one step when they are already a fixed point. Not the paper's algorithm: it can
        reach a different fixed point than a cold start (see :mod:`fedfiot_flwr.server.warm_starts`).

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
    ...             spec, MergeOptions(lam=1.0, rho=1.0, reference=0))
    >>> res.model["w"].ravel().tolist(), res.objective, res.permutations["P0"][1].tolist()
    ([0.5, 5.5, 8.5], 9.0, [1, 2, 0])
    """
    start = time.perf_counter()
    options = _instance(MergeOptions() if options is None else options, MergeOptions, "options")
    speed = _instance(MergeSpeed() if speed is None else speed, MergeSpeed, "speed")
    clients = _prepared(models, fishers, num_examples, options.curvature)
    if options.aggregation == "size" and clients.num_examples is None:
        raise ValueError("aggregation='size' needs num_examples")
    sizes_per_perm = spec.sizes(clients.shapes)
    ref_index = resolve_reference(options.reference, clients.num_examples, len(clients))
    if ref_index is None:
        check_reference_model(options.reference, clients.shapes)  # type: ignore[arg-type]
    perms, reports = _align_all(clients, spec, sizes_per_perm, ref_index, options, speed, initial_perms)
    identity, aligned, kept = _candidates(clients, spec, perms, options)
    chosen = aligned if kept else identity
    return MergeResult(
        model=chosen[0],
        objective=chosen[1],
        identity_objective=identity[1],
        aligned=kept,
        permutations={p: [pk[p] for pk in perms] for p in spec.perm_names},
        reports=reports,
        aligned_model=aligned[0],
        identity_model=identity[0],
        aligned_objective=aligned[1],
        fraction_permuted=_fractions_permuted(perms, spec, sizes_per_perm),
        reference=ref_index,
        seconds=time.perf_counter() - start,
    )


def _fractions_permuted(
    perms: Sequence[Mapping[str, np.ndarray]], spec: PermutationSpec, sizes_per_perm: Mapping[str, int]
) -> list[float]:
    """Per client, the fraction of all hidden neurons that its alignment moved."""
    total = sum(sizes_per_perm[p] for p in spec.perm_names)
    moved = [sum(int(np.sum(pk[p] != np.arange(len(pk[p])))) for p in spec.perm_names) for pk in perms]
    return [mv / total if total else 0.0 for mv in moved]


def _instance(value: Any, kind: type, name: str) -> Any:
    """``value``, checked to be a ``kind`` (the options objects validate themselves when built)."""
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    return value


def _prepared(
    models: Sequence[Model] | PreparedClients | PreparedGrams,
    fishers: Sequence[Model] | None,
    num_examples: Sequence[int] | None,
    curvature: str = "diagonal",
) -> PreparedClients | PreparedGrams:
    """The uploads as :class:`PreparedClients` (or, for the Gram curvature, :class:`PreparedGrams`):
    already prepared, or checked now for this one merge.

    A one-off merge tempers each tensor when it reads it (no cache: peak memory stays near the
    per-layer stack); a sweep prepares once and caches the tempered Fishers.
    """
    if curvature in GRAM_CURVATURES:
        if isinstance(models, PreparedClients):
            raise ValueError(f"curvature={curvature!r} needs the clients' input Grams (PreparedGrams or a list of "
                             "{module: InputGram} per client), not PreparedClients")
        if isinstance(models, PreparedGrams):
            if fishers is not None:
                raise ValueError("pass fishers=None with PreparedGrams: the Grams are already in it")
            clients: PreparedClients | PreparedGrams = models
        else:
            if fishers is None:
                raise ValueError(f"curvature={curvature!r} needs the clients' input Grams (one {{module: InputGram}} "
                                 "per client)")
            clients = prepare_grams(models, fishers, num_examples=num_examples)  # type: ignore[arg-type]
    elif isinstance(models, PreparedGrams):
        raise ValueError("PreparedGrams holds input Grams: merge it with MergeOptions(curvature='gram' or 'kfac')")
    else:
        clients = as_prepared(models, fishers, num_examples=num_examples, cache_bytes=0)
    if isinstance(models, (PreparedClients, PreparedGrams)) and num_examples is not None and list(num_examples) != clients.num_examples:
        raise ValueError("num_examples differs from the one given to prepare_clients")
    return clients


def _align_all(
    clients: PreparedClients,
    spec: PermutationSpec,
    sizes_per_perm: Mapping[str, int],
    ref_index: int | None,
    options: MergeOptions,
    speed: MergeSpeed,
    initial_perms: Mapping[str, Sequence[np.ndarray]] | None,
) -> tuple[list[dict[str, np.ndarray]], dict[str, PermutationReport]]:
    """Every client's alignment, permutation by permutation in the spec's order (Algorithm 1's
    outer loop), each solved with the incoming axes aligned by the permutations decided before."""
    n_clients = len(clients)
    if options.matching == "none":  # no alignment: identity everywhere, nothing to iterate
        return ([{p: np.arange(sizes_per_perm[p]) for p in spec.perm_names} for _ in range(n_clients)],
                {p: PermutationReport(sizes_per_perm[p], 0, float("nan"), fraction_permuted=[0.0] * n_clients)
                 for p in spec.perm_names})
    sizes = None if clients.num_examples is None else [float(n) for n in clients.num_examples]
    perms: list[dict[str, np.ndarray]] = [{} for _ in range(n_clients)]
    reports: dict[str, PermutationReport] = {}
    for perm in spec.perm_names:
        m = sizes_per_perm[perm]
        if isinstance(clients, PreparedGrams):
            layer, ref_layer = _gram_group(clients, spec, perm, perms, ref_index, options)
            memo, memo_key = None, None
        else:
            layer, ref_layer, memo_key = _diagonal_group(clients, spec, perm, m, perms, ref_index, options, speed)
            memo = clients.alignments
        if layer is None:  # no curvature covers this group's units: they stay in place
            found = [np.arange(m)] * n_clients
            reports[perm] = PermutationReport(m, 0, float("nan"), fraction_permuted=[0.0] * n_clients)
        else:
            found, reports[perm] = _align_permutation(
                m, layer, ref_layer,
                options=options, sizes=sizes, speed=speed,
                ref_client=ref_index, start=None if initial_perms is None else initial_perms.get(perm),
                memo=memo, memo_key=memo_key,
            )
        del layer
        for pk, p in zip(perms, found):
            pk[perm] = p
    return perms, reports


def _diagonal_group(
    clients: PreparedClients,
    spec: PermutationSpec,
    perm: str,
    m: int,
    perms: Sequence[Mapping[str, np.ndarray]],
    ref_index: int | None,
    options: MergeOptions,
    speed: MergeSpeed,
) -> tuple[ClientLayers, np.ndarray, tuple]:
    """One permutation's diagonal-Fisher client layers, the reference layer and the alignment memo's key."""
    xs, fs = clients.models, clients.damped(options.fisher_scaling, options.rho, options.lam)
    names = [n for n in spec.neuron_tensors(perm) if n in fs[0]]
    if ref_index is None:
        ref_layer = _layer_matrix([np.asarray(options.reference[n], dtype=np.float64)  # type: ignore[index]
                                   for n in names], m)
    else:
        ref_layer = _layer_matrix([_as_float64(permute_tensor(xs[ref_index][n], spec.axes[n], perms[ref_index], (0,)))
                                   for n in names], m)
    array_backend = get_backend(speed.backend, speed.device)
    keep_layers = options.matching == "euclidean" or options.aggregation != "fisher"
    layer = ClientLayers(
        _layer_loader(xs, fs, perms, spec, names, m), len(clients), keep_layers=keep_layers,
        stack=_stack_bytes(m, ref_layer.shape[1], len(clients), options.matching, options.aggregation,
                           speed.cost_dtype) <= speed.stack_bytes,
        cost_dtype=speed.cost_dtype, backend=array_backend,
    )
    memo_key = (options.fisher_scaling, float(options.rho), float(options.lam), options.matching,
                options.aggregation, options.max_iters, speed.lap_solver, speed.certify, speed.cost_dtype,
                array_backend.name, str(array_backend.device), layer.stacked, perm, permutations_digest(perms))
    return layer, ref_layer, memo_key


def _gram_group(
    clients: PreparedGrams,
    spec: PermutationSpec,
    perm: str,
    perms: Sequence[Mapping[str, np.ndarray]],
    ref_index: int | None,
    options: MergeOptions,
) -> tuple[GramLayers | KFACLayers | None, list[np.ndarray] | None]:
    """One permutation's Gram (or K-FAC) layers and the reference's member layers (None when no Gram layer's rows move)."""
    members = group_members(clients, spec, perm)
    if not members:
        return None, None
    curvatures = clients.curvatures(options.gram_alpha, options.gram_ridge, options.gram_scaling)
    views = [[layer_view(clients, k, l, curvatures[k][l], spec, pk, rows=False) for l in members]
             for k, pk in enumerate(perms)]
    if ref_index is not None:
        ref_layer = [m for m, _ in views[ref_index]]
    else:
        ref_layer = []
        for l in members:
            g = clients.layers[l]
            weight = np.asarray(options.reference[g.weight], dtype=np.float64)  # type: ignore[index]
            bias = None if g.bias is None else np.asarray(options.reference[g.bias], dtype=np.float64)  # type: ignore[index]
            ref_layer.append(layer_matrix(weight.reshape(weight.shape[0], -1), bias))
    if options.curvature == "kfac":
        units = clients.unit_weights(options.kfac_damping)
        return KFACLayers(views, [[units[k][l] for l in members] for k in range(len(clients))], clients.shares,
                          lambda s: clients.basis(s, options.gram_rcond)), ref_layer
    return GramLayers(views, clients.shares, options.gram_rcond, lambda s: clients.pinv(s, options.gram_rcond)), ref_layer


def _candidates(
    clients: PreparedClients,
    spec: PermutationSpec,
    perms: Sequence[Mapping[str, np.ndarray]],
    options: MergeOptions,
) -> tuple[tuple[dict[str, np.ndarray], float], tuple[dict[str, np.ndarray], float], bool]:
    """The identity and aligned merges, each ``(model, J)``, and whether the aligned one is kept
    (the paper's identity rule, or always with ``fallback="none"``; never without matching).

    Each merge is computed once per prepared uploads: the identity merge does not depend on the
    reference, and another candidate of a sweep may have found the same alignment.
    """
    if isinstance(clients, PreparedGrams):
        return _gram_candidates(clients, spec, perms, options)
    identity_key = (options.fisher_scaling, float(options.rho), float(options.lam), options.aggregation)
    fs = clients.damped(options.fisher_scaling, options.rho, options.lam)
    sizes = None if clients.num_examples is None else [float(n) for n in clients.num_examples]
    if identity_key not in clients.identity_merges:
        identity_perms: list[dict[str, np.ndarray]] = [{} for _ in range(len(clients))]
        clients.identity_merges[identity_key] = _merge_all(clients.models, fs, spec, identity_perms,
                                                           options.aggregation, sizes, clients.dtypes)
    identity_model, identity_objective = clients.identity_merges[identity_key]
    identity = (dict(identity_model), identity_objective)
    if options.matching == "none":
        return identity, identity, False
    if all(np.array_equal(pk[p], np.arange(len(pk[p]))) for pk in perms for p in pk):
        # Alignment kept every neuron in place: the aligned merge is the identity merge.
        return identity, (dict(identity[0]), identity_objective), True
    aligned_key = (*identity_key, permutations_digest(perms))
    cached = clients.aligned_merges.get(aligned_key)
    if cached is None:
        cached = _merge_all(clients.models, fs, spec, perms, options.aggregation, sizes, clients.dtypes)
        clients.aligned_merges.put(aligned_key, cached)
    kept = options.fallback == "none" or alignment_kept(cached[1], identity_objective)
    return identity, (dict(cached[0]), cached[1]), kept


def _gram_candidates(
    clients: PreparedGrams,
    spec: PermutationSpec,
    perms: Sequence[Mapping[str, np.ndarray]],
    options: MergeOptions,
) -> tuple[tuple[dict[str, np.ndarray], float], tuple[dict[str, np.ndarray], float], bool]:
    """:func:`_candidates` for the Gram curvature: both merges in closed form, compared on the same J."""
    knobs = (float(options.gram_alpha), float(options.gram_ridge), options.gram_scaling)
    curvatures = clients.curvatures(*knobs)
    kfac = options.curvature == "kfac"
    units = clients.unit_weights(options.kfac_damping) if kfac else None
    key = (*knobs, float(options.gram_rcond), float(options.kfac_damping) if kfac else None)
    if key not in clients.identity_merges:
        clients.identity_merges[key] = merge_with_grams(clients, spec, [{} for _ in range(len(clients))],
                                                        curvatures, options.gram_rcond, units)[:2]
    identity_model, identity_objective = clients.identity_merges[key]
    identity = (dict(identity_model), identity_objective)
    if options.matching == "none":
        return identity, identity, False
    if all(np.array_equal(pk[p], np.arange(len(pk[p]))) for pk in perms for p in pk):
        return identity, (dict(identity_model), identity_objective), True
    aligned_key = (*key, permutations_digest(perms))
    if aligned_key not in clients.aligned_merges:
        clients.aligned_merges = {aligned_key: merge_with_grams(clients, spec, perms, curvatures, options.gram_rcond,
                                                                units)[:2]}
    model, objective = clients.aligned_merges[aligned_key]
    kept = options.fallback == "none" or alignment_kept(objective, identity_objective)
    return identity, (dict(model), objective), kept
