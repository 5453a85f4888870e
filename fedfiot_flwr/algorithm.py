"""FedFiOT's server-side merge as the paper writes it (Algorithm 1): a readable NumPy reference.

:func:`fedfiot_merge` runs the paper's configuration only (Fisher matching, Fisher aggregation,
scipy's exact assignment, float64). The fast engine :func:`fedfiot_flwr.merge.merge` returns
bit-identical models and permutations (``tests/test_algorithm_reference.py``). Comments marked
"engine:" name a choice the paper leaves open, made here as the engine makes it.

:func:`fedfiot_gram_merge` is the same alternation with a layer curvature in place of the diagonal
Fisher: RegMean's input Gram (:class:`GramCurvature`), for Linear and Conv2d layers, or K-FAC with a
diagonal output factor (the Gram with each unit weighted, ``output_damping``); both of its steps minimise
one objective, and without alignment the Gram form is RegMean.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from numbers import Real
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from scipy.optimize import linear_sum_assignment

from fedfiot_flwr.options import DEFAULT_LAM, DEFAULT_MAX_ITERS, DEFAULT_RHO, alignment_kept
from fedfiot_flwr.options import ModelView as Model

from .baselines.regmean import regmean_solution, scale_off_diagonal
from .merge.gram import closed_form
from .merge.kfac import range_basis, row_weights
from .merge.spec import AxisPerm, PermutationSpec
from .psd import InputGram, layer_matrix



class FedFiOTResult(NamedTuple):
    """The merged model; per group and client the alignment ``p`` (global neuron ``i`` <- client
    neuron ``p[i]``), also when the identity rule dropped it; whether the aligned merge was kept."""

    model: dict[str, np.ndarray]
    permutations: dict[str, list[np.ndarray]]
    aligned: bool


def fedfiot_merge(
    weights: Sequence[Model],
    fishers: Sequence[Model],
    spec: PermutationSpec,
    *,
    rho: float = DEFAULT_RHO,
    lam: float = DEFAULT_LAM,
    max_iters: int = DEFAULT_MAX_ITERS,
    reference: int | str | Model = "largest",
    num_examples: Sequence[float] | None = None,
    buffers: Collection[str] = (),
) -> FedFiOTResult:
    r"""Merge K client models by alternating Fisher-weighted alignment and aggregation.

    With damped Fishers :math:`f_k = F_k^\rho + \lambda`, the permutation groups (hidden layers)
    of ``spec`` are solved in turn. A group's neurons are the rows of ``(m, d)`` matrices
    :math:`w_k, f_k`: every tensor it moves on axis 0, flattened, with the incoming axes reordered
    by the groups solved before. From :math:`w^{[0]}` = the reference's layer, for s = 1..S:

    .. math::
        C_k[i, j] = \sum_c f_k[j, c]\,(w[i, c] - w_k[j, c])^2, \qquad
        \pi_k = \mathrm{argmin}_{\pi} \sum_i C_k[i, \pi(i)] \ \text{(Hungarian)},

        w[i, c] = \frac{\sum_k f_k[\pi_k(i), c]\; w_k[\pi_k(i), c]}{\sum_k f_k[\pi_k(i), c]},

    stopping once no :math:`\pi_k` changes (s > 1). Every tensor (the output layer with identity
    alignment) is then aggregated by the same rule, and the merge is kept unless its objective
    :math:`J = \sum_k \sum f_k\,(W - \pi_k(W_k))^2` is strictly above the identity merge's.

    Parameters
    ----------
    weights, fishers : sequence of dict[str, np.ndarray]
        Per client, the model and its raw diagonal Fisher (no entry for the ``buffers``).
    spec : PermutationSpec
        Which axes of which tensors each permutation group moves.
    rho, lam : float
        Tempering exponent in (0, 1] and damping > 0.
    max_iters : int
        Inner iterations S per group.
    reference : int, "largest" or dict
        A client index, the client with most examples, or a model (the broadcast model).
    num_examples : sequence of float, optional
        Client sizes (for ``"largest"`` and the buffers).
    buffers : collection of str
        Tensors without a Fisher (BatchNorm statistics): permuted with their channel, averaged
        weighted by ``num_examples`` (uniformly without), outside the costs and J.

    Returns
    -------
    FedFiOTResult

    Examples
    --------
    The paper's worked example (Appendix G): client 2's neurons are the cycle (2, 3, 1).

    >>> spec = PermutationSpec({"w": ("P0", None)})
    >>> out = fedfiot_merge([{"w": np.array([[0.], [4.], [8.]])}, {"w": np.array([[10.], [2.], [6.]])}],
    ...                     [{"w": np.array([[2.], [0.], [2.]])}, {"w": np.array([[0.], [0.], [2.]])}],
    ...                     spec, rho=1.0, lam=1.0, reference=0)
    >>> out.model["w"].ravel().tolist(), out.permutations["P0"][1].tolist(), out.aligned
    ([0.5, 5.5, 8.5], [1, 2, 0], True)
    """
    sizes = _check(weights, fishers, spec, rho, lam, max_iters, num_examples, buffers)
    ref = _reference_client(reference, num_examples, weights)
    x = [{n: np.asarray(t, dtype=np.float64) for n, t in wk.items()} for wk in weights]
    # Line 8 tempers; lines 19 and 25 add the damping lambda. engine: temper first, then damp.
    f = [{n: np.power(np.asarray(t, dtype=np.float64), rho) + lam for n, t in fk.items()} for fk in fishers]
    perms: list[dict[str, np.ndarray]] = [{} for _ in weights]  # pi_k of the groups solved so far
    for group in spec.perm_names:  # engine: groups in order of first appearance in the spec
        names = [n for n in spec.neuron_tensors(group) if n in f[0]]  # engine: in spec order, no buffers
        m = sizes[group]

        def layer(t: Model, done: Mapping[str, np.ndarray]) -> np.ndarray:  # lines 10-13
            # engine: only axes of groups already solved move (a residual group's neurons can
            # have incoming axes of a later group: those stay in the client's order).
            return np.concatenate([_permute(np.asarray(t[n], np.float64), spec.axes[n], done, rows=False)
                                   .reshape(m, -1) for n in names], axis=1)

        w_k = [layer(xk, pk) for xk, pk in zip(x, perms)]
        f_k = [layer(fk, pk) for fk, pk in zip(f, perms)]
        # Line 14. engine: a reference client's layer has its own earlier alignments applied (and it
        # is re-aligned like every client); a reference model is already in the global order.
        w = w_k[ref] if ref is not None else layer(reference, {})  # type: ignore[arg-type]
        pi = [np.arange(m)] * len(weights)
        for s in range(1, max_iters + 1):
            # Lines 16-20. engine: ties go to scipy's choice (rows == arange(m) for a square cost).
            new = [linear_sum_assignment(c)[1] for c in _fisher_costs(w, w_k, f_k)]
            if s > 1 and all(np.array_equal(a, b) for a, b in zip(new, pi)):
                break  # line 30
            pi = new  # lines 23-27: aggregate the aligned clients
            w = _total([(fk * wk)[p] for fk, wk, p in zip(f_k, w_k, pi)]) / _total([fk[p] for fk, p in zip(f_k, pi)])
        for pk, p in zip(perms, pi):  # lines 32-33
            pk[group] = p
    # Line 34: keep the alignment only if it does not increase the merge objective.
    aligned_model, J_aligned = _aggregate(x, f, spec, perms, num_examples, weights[0])
    identity_model, J_identity = _aggregate(x, f, spec, [{} for _ in weights], num_examples, weights[0])
    aligned = alignment_kept(J_aligned, J_identity)
    permutations = {g: [pk[g] for pk in perms] for g in spec.perm_names}
    return FedFiOTResult(aligned_model if aligned else identity_model, permutations, aligned)


def _permute(t: np.ndarray, axes: Sequence, perms: Mapping[str, np.ndarray], rows: bool = True) -> np.ndarray:
    """``t`` with every axis of a group in ``perms`` reordered (``rows=False``: not axis 0); an
    axis entry of block b moves blocks of b elements (a conv channel's columns after a flatten)."""
    for axis, entry in enumerate(axes):
        if entry is not None and entry.perm in perms and (rows or axis > 0):
            index = perms[entry.perm][:, None] * entry.block + np.arange(entry.block)
            t = np.take(t, index.reshape(-1), axis=axis)
    return t


def _fisher_costs(w: np.ndarray, w_k: Sequence[np.ndarray], f_k: Sequence[np.ndarray]) -> list[np.ndarray]:
    r"""All :math:`C_k = [w^2, -2w]\,[f_k, f_k w_k]^T + \sum_c f_k w_k^2` by matrix products
    (never an m*m*d array). engine: GEMM rounding depends on the product's width, so the right
    factors are stacked into one product per group of clients, grouped as the engine does."""
    m, d = w.shape
    left = np.concatenate([w * w, -2.0 * w], axis=1)
    rights = [np.concatenate([f, f * x], axis=1) for x, f in zip(w_k, f_k)]
    consts = [np.einsum("jc,jc,jc->j", f, x, x) for x, f in zip(w_k, f_k)]
    group = 1 if 16 * len(w_k) * m * d > 2**31 else max(1, 2**26 // (8 * m * m))
    costs = []
    for first in range(0, len(rights), group):
        product = left @ np.concatenate(rights[first:first + group], axis=0).T
        costs += [product[:, i * m:(i + 1) * m] + c[None, :] for i, c in enumerate(consts[first:first + group])]
    return costs


def _total(terms: Sequence[np.ndarray]) -> np.ndarray:
    """``terms[0] + terms[1] + ...``, in client order as the engine adds them."""
    return sum(terms[1:], terms[0])


def _aggregate(x: Sequence[Model], f: Sequence[Model], spec: PermutationSpec, perms: Sequence[Mapping],
               num_examples: Sequence[float] | None, dtypes: Model) -> tuple[dict[str, np.ndarray], float]:
    """Every tensor of the permuted clients, Fisher-averaged (buffers: by size), and J."""
    share = np.ones(len(x)) if num_examples is None else np.asarray(num_examples, dtype=np.float64)
    share = share / share.sum()
    model, J = {}, 0.0
    for name in x[0]:
        xs = [_permute(xk[name], spec.axes.get(name, ()), pk) for xk, pk in zip(x, perms)]
        if name in f[0]:
            fs = [_permute(fk[name], spec.axes.get(name, ()), pk) for fk, pk in zip(f, perms)]
            num, den = _total([fk * xk for fk, xk in zip(fs, xs)]), _total(fs)
            value, const = num / den, 0.0
            for fk, xk in zip(fs, xs):
                const += float(np.vdot(fk * xk, xk))
            # engine: J expanded as sum f x^2 + <den v - 2 num, v> per tensor, clipped at 0
            J += max(0.0, const + float(np.vdot(den * value - 2.0 * num, value)))
        else:  # engine: buffers weighted by num_examples (uniformly without), integers rounded
            value = _total([c * xk for c, xk in zip(share, xs)])
        dtype = np.asarray(dtypes[name]).dtype
        model[name] = (np.rint(value) if np.issubdtype(dtype, np.integer) else value).astype(dtype)
    return model, J


def _reference_client(reference: object, num_examples: Sequence[float] | None, weights: Sequence[Model]) -> int | None:
    """Index of the reference client (engine: ``"largest"`` = first argmax), None for a model."""
    if isinstance(reference, Mapping):
        for n, t in weights[0].items():
            if n not in reference or np.shape(reference[n]) != np.shape(t) or not np.all(np.isfinite(reference[n])):
                raise ValueError(f"reference model: tensor {n!r} is missing, has the wrong shape or is not finite")
        return None
    if reference == "largest":
        if num_examples is None:
            raise ValueError("reference='largest' needs num_examples")
        return int(np.argmax(num_examples))
    if isinstance(reference, (int, np.integer)) and not isinstance(reference, bool) and 0 <= reference < len(weights):
        return int(reference)
    raise ValueError(f"reference must be a client index in [0, {len(weights)}), 'largest' or a model, "
                     f"got {reference!r}")


def _check(weights: Sequence[Model], fishers: Sequence[Model], spec: PermutationSpec, rho: float, lam: float,
           max_iters: int, num_examples: Sequence[float] | None, buffers: Collection[str]) -> dict[str, int]:
    """Validate the inputs (errors name the client and tensor); return each group's size."""
    if not (isinstance(rho, Real) and 0 < rho <= 1 and isinstance(lam, Real) and 0 < lam < np.inf):
        raise ValueError(f"need 0 < rho <= 1 and a finite lam > 0, got rho={rho!r}, lam={lam!r}")
    if isinstance(max_iters, bool) or not isinstance(max_iters, (int, np.integer)) or max_iters < 1:
        raise ValueError(f"max_iters must be an integer >= 1, got {max_iters!r}")
    if not weights or len(fishers) != len(weights):
        raise ValueError(f"need one Fisher per client model (and a client), got {len(weights)} and {len(fishers)}")
    if num_examples is not None and not (len(num_examples) == len(weights)
                                         and all(isinstance(n, Real) and 0 < n < np.inf for n in num_examples)):
        raise ValueError(f"num_examples must give one positive size per client, got {num_examples!r}")
    shapes = {n: np.shape(t) for n, t in weights[0].items()}
    for k, (wk, fk) in enumerate(zip(weights, fishers)):
        if set(wk) != set(shapes) or set(fk) != set(shapes) - set(buffers):
            raise ValueError(f"client {k}: model keys must equal client 0's, Fisher keys the model's minus buffers")
        for what, n, t in [("weights", n, t) for n, t in wk.items()] + [("Fisher", n, t) for n, t in fk.items()]:
            t = np.asarray(t)
            if t.shape != shapes[n] or not np.issubdtype(t.dtype, np.number) or not np.all(np.isfinite(t)):
                raise ValueError(f"client {k}, {what} of {n!r}: need finite numbers of shape {shapes[n]}, "
                                 f"got {t.shape}")
            if what == "Fisher" and np.any(t < 0):
                raise ValueError(f"client {k}, Fisher of {n!r}: negative entries")
    return spec.sizes(shapes)


# --- the Gram curvature ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GramCurvature:
    r"""RegMean's layer curvature for :func:`fedfiot_gram_merge`.

    Client k's curvature of a Linear layer is :math:`A_k = s_k\,(\alpha G_k + (1-\alpha)\,\mathrm{diag}\,G_k
    + r\,\bar g_k I)`, with :math:`G_k = E_k[x x^T]` the uploaded input Gram (augmented with a constant
    input for a bias), :math:`s_k` the client's share of the examples, :math:`\bar g_k` the mean of
    :math:`\mathrm{diag}\,G_k`.

    Attributes
    ----------
    alpha : float
        Off-diagonal scaling in [0, 1] (1: the least-squares fit on the union of the clients' inputs).
    ridge : float
        Relative ridge r >= 0 (0: RegMean's pseudo-inverse handles a singular sum).
    output_damping : float or None
        ``None``: the Gram curvature :math:`A_k \otimes I`. A number :math:`\delta > 0`: K-FAC with a diagonal
        output factor, :math:`A_k \otimes \mathrm{diag}(h_k)`, :math:`h_k = (g_k / \bar g_k + \delta) / (1 + \delta)`
        from each layer's uploaded output factor :math:`g_k` (``InputGram.output``).
    """

    alpha: float = 1.0
    ridge: float = 0.0
    output_damping: float | None = None

    def __post_init__(self) -> None:
        if self.output_damping is not None and not (isinstance(self.output_damping, Real)
                                                    and 0.0 < self.output_damping < np.inf):
            raise ValueError(f"GramCurvature: output_damping must be None or finite and > 0, got {self.output_damping!r}")
        if not (isinstance(self.alpha, Real) and 0.0 <= self.alpha <= 1.0):
            raise ValueError(f"GramCurvature: alpha must lie in [0, 1], got {self.alpha!r}")
        if not (isinstance(self.ridge, Real) and 0.0 <= self.ridge < np.inf):
            raise ValueError(f"GramCurvature: ridge must be finite and >= 0, got {self.ridge!r}")


class GramMergeResult(NamedTuple):
    """:class:`FedFiOTResult`'s fields; the objective J of the aligned and of the identity merge; per
    group, the group's objective after every step of its alternation (starting point included); and
    J's term of every Gram layer, aligned and identity."""

    model: dict[str, np.ndarray]
    permutations: dict[str, list[np.ndarray]]
    aligned: bool
    objectives: tuple[float, float]
    steps: dict[str, list[float]]
    layer_objectives: tuple[dict[str, float], dict[str, float]]


def fedfiot_gram_merge(
    weights: Sequence[Model],
    grams: Sequence[Mapping[str, InputGram]],
    num_examples: Sequence[float],
    spec: PermutationSpec,
    *,
    curvature: GramCurvature = GramCurvature(),
    max_iters: int = DEFAULT_MAX_ITERS,
    reference: int | str | Model = "largest",
) -> GramMergeResult:
    r"""Merge K client models by alternating Gram-weighted alignment and aggregation.

    The same alternation as :func:`fedfiot_merge`, on the objective

    .. math::
        J(W, \pi) = \sum_k \sum_l \mathrm{tr}\big((W_l - P_{kl} w_{kl} P_{k,l-1}^T)\, A_{kl}\,
        (W_l - P_{kl} w_{kl} P_{k,l-1}^T)^T\big),

    :math:`w_{kl} = [W\ b]` of client k's Linear or Conv2d layer l (a convolution's weight flattened to
    ``(d_out, C_in k_h k_w)``, its Gram over the unfolded patches) and :math:`A_{kl}` its curvature
    (:class:`GramCurvature`) with rows and columns in the order of the group solved before. For a
    group, from the reference's layers, each step assigns (Hungarian) on

    .. math::
        C_k[i, j] = \sum_{l \in \text{group}} (W_{l,i} - w_{kl,j})\, A_{kl}\, (W_{l,i} - w_{kl,j})^T,

    the squared difference of the two units' pre-activations on client k's own inputs, then
    aggregates in closed form, :math:`W_l = (\sum_k P_k w_{kl} A_{kl})(\sum_k A_{kl})^{-1}`
    (RegMean's: the solution closest to the size-weighted average when the sum is singular).
    Both steps minimise the group's terms of J exactly, so they never raise it (``steps``).
    Tensors without a Gram (buffers, BatchNorm parameters, layers without a Gram) are
    size-weighted averages after their permutation, outside J; a group that no Gram layer's rows
    cover keeps every unit in place.
    The identity rule compares the same J.

    Parameters
    ----------
    weights : sequence of dict[str, np.ndarray]
        Per client, the model.
    grams : sequence of mapping of str to InputGram
        Per client, ``{module: InputGram}`` of the same Linear and Conv2d layers
        (:func:`fedfiot_flwr.curvature.input_grams`).
    num_examples : sequence of float
        Client sizes (the curvature's shares, ``"largest"``, the averages).
    spec : PermutationSpec
        Which axes of which tensors each permutation group moves.
    curvature : GramCurvature
        Off-diagonal scaling and ridge.
    max_iters : int
        Inner iterations per group.
    reference : int, "largest" or dict
        A client index, the client with most examples, or a model in the global order.

    Returns
    -------
    GramMergeResult

    Examples
    --------
    Two one-layer clients whose hidden units are swapped merge into either of them:

    >>> spec = PermutationSpec({"a.weight": ("P", None), "b.weight": (None, "P")})
    >>> w1 = {"a.weight": np.array([[1., 0.], [0., 2.]]), "b.weight": np.array([[1., 3.]])}
    >>> w2 = {"a.weight": w1["a.weight"][::-1], "b.weight": w1["b.weight"][:, ::-1]}
    >>> g = {"a": InputGram("a.weight", None, np.eye(2)), "b": InputGram("b.weight", None, np.eye(2))}
    >>> g2 = {"a": g["a"], "b": InputGram("b.weight", None, np.eye(2))}
    >>> out = fedfiot_gram_merge([w1, w2], [g, g2], [1, 1], spec, reference=0)
    >>> out.model["a.weight"].tolist(), out.permutations["P"][1].tolist(), out.objectives[0]
    ([[1.0, 0.0], [0.0, 2.0]], [1, 0], 0.0)
    """
    layers = _check_grams(weights, grams, num_examples, spec, max_iters)
    ref = _reference_client(reference, num_examples, weights)
    share = np.asarray(num_examples, dtype=np.float64) / float(np.sum(num_examples))
    x = [{n: np.asarray(t, dtype=np.float64) for n, t in wk.items()} for wk in weights]
    a = [{l: s * _scaled_gram(gk[l].gram, curvature) for l in layers} for gk, s in zip(grams, share)]
    h = None if curvature.output_damping is None else [
        {l: row_weights(_output(gk[l], k, l), curvature.output_damping) for l in layers} for k, gk in enumerate(grams)]
    perms: list[dict[str, np.ndarray]] = [{} for _ in weights]
    steps: dict[str, list[float]] = {}
    for group in spec.perm_names:
        members = [l for l, g in layers.items() if spec.axes.get(g.weight, (None,))[0] is not None
                   and spec.axes[g.weight][0].perm == group]
        if not members:  # no Gram layer's units: nothing to align them on
            for pk in perms:
                pk[group] = np.arange(spec.sizes({n: np.shape(t) for n, t in weights[0].items()})[group])
            continue
        views = [[(*_gram_view(xk, layers[l], ak[l], spec, pk), None if h is None else h[k][l]) for l in members]
                 for k, (xk, ak, pk) in enumerate(zip(x, a, perms))]
        if ref is not None:
            w = [m for m, _, _ in views[ref]]
        else:
            w = [layer_matrix(np.asarray(reference[layers[l].weight], np.float64).reshape(  # type: ignore[index]
                              np.shape(reference[layers[l].weight])[0], -1),  # type: ignore[index]
                              None if layers[l].bias is None else np.asarray(reference[layers[l].bias], np.float64))
                 for l in members]
        pi = [np.arange(w[0].shape[0])] * len(weights)
        steps[group] = [_group_objective(w, views, pi)]
        for s in range(1, max_iters + 1):
            costs = [sum(_gram_cost(wl, m, am, hm) for wl, (m, am, hm) in zip(w, vk)) for vk in views]
            new = [linear_sum_assignment(c)[1] for c in costs]
            if s > 1 and all(np.array_equal(p, q) for p, q in zip(new, pi)):
                break
            pi = new
            steps[group].append(float(sum(c[np.arange(len(p)), p].sum() for c, p in zip(costs, pi))))
            w = [_layer_solution([vk[i][0][p] for vk, p in zip(views, pi)], [vk[i][1] for vk in views],
                                 None if h is None else [vk[i][2][p] for vk, p in zip(views, pi)], share)
                 for i in range(len(members))]
            steps[group].append(_group_objective(w, views, pi))
        for pk, p in zip(perms, pi):
            pk[group] = p
    aligned_model, j_aligned = _gram_aggregate(x, (a, h), layers, spec, perms, share, weights[0])
    identity_model, j_identity = _gram_aggregate(x, (a, h), layers, spec, [{} for _ in weights], share, weights[0])
    objectives = (sum(j_aligned.values()), sum(j_identity.values()))
    aligned = alignment_kept(*objectives)
    permutations = {g: [pk[g] for pk in perms] for g in spec.perm_names}
    return GramMergeResult(aligned_model if aligned else identity_model, permutations, aligned, objectives, steps,
                           (j_aligned, j_identity))


def _scaled_gram(gram: np.ndarray, curvature: GramCurvature) -> np.ndarray:
    """RegMean's off-diagonal scaling plus ``ridge * mean(diag G) I`` (before the client's share)."""
    out = scale_off_diagonal(gram, curvature.alpha)
    out[np.diag_indices_from(out)] += curvature.ridge * float(np.mean(np.diag(out)))
    return (out + out.T) / 2.0


def _input_index(entry: AxisPerm | None, done: Mapping[str, np.ndarray], shape: Sequence[int], bias: bool) -> np.ndarray:
    """The order of a layer's inputs (and its bias input, last) after the solved groups: a weight
    ``(d_out, n_in, *kernel)`` has ``n_in * prod(kernel)`` inputs, input channel major (``F.unfold``'s order)."""
    taps = int(np.prod(shape[2:], dtype=np.int64))
    channels = np.arange(shape[1])
    if entry is not None and entry.perm in done:
        channels = (done[entry.perm][:, None] * entry.block + np.arange(entry.block)).reshape(-1)
    index = (channels[:, None] * taps + np.arange(taps)).reshape(-1)
    return np.concatenate([index, [shape[1] * taps]]) if bias else index


def _gram_view(xk: Model, g: InputGram, ak: np.ndarray, spec: PermutationSpec,
               done: Mapping[str, np.ndarray], rows: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Client k's ``[W b]`` and curvature of layer ``g`` with the solved groups applied (rows too with ``rows``)."""
    weight = _permute(xk[g.weight], spec.axes[g.weight], done, rows=rows)
    bias = None if g.bias is None else _permute(xk[g.bias], spec.axes.get(g.bias, ()), done, rows=rows)
    index = _input_index(spec.axes[g.weight][1], done, weight.shape, g.bias is not None)
    return layer_matrix(weight.reshape(weight.shape[0], -1), bias), ak[np.ix_(index, index)]


def _output(g: InputGram, k: int, layer: str) -> np.ndarray:
    if g.output is None:
        raise ValueError(f"client {k}, Gram of {layer!r}: the K-FAC curvature needs its output factor")
    return np.asarray(g.output, dtype=np.float64)


def _gram_cost(w: np.ndarray, m: np.ndarray, a: np.ndarray, h: np.ndarray | None = None) -> np.ndarray:
    """``C[i, j] = h_j (w_i - m_j) A (w_i - m_j)^T`` by matrix products (``h``: 1 without unit weights)."""
    wa, ma = w @ a, m @ a
    cost = np.einsum("ic,ic->i", wa, w)[:, None] - 2.0 * wa @ m.T + np.einsum("jc,jc->j", ma, m)[None, :]
    return cost if h is None else cost * h[None, :]


def _layer_objective(w: np.ndarray, m: np.ndarray, a: np.ndarray, h: np.ndarray | None = None) -> float:
    d = w - m
    rows = np.sum((d @ a) * d, axis=1)
    return float(np.sum(rows) if h is None else np.dot(h, rows))


def _layer_solution(mats: Sequence[np.ndarray], grams: Sequence[np.ndarray], units: Sequence[np.ndarray] | None,
                    share: np.ndarray) -> np.ndarray:
    """RegMean's closed form; with unit weights, one per row: the ``W_i`` with ``W_i S_i = R_i`` nearest the
    size-weighted average, ``S_i = sum_k h_ki A_k``, ``R_i = sum_k h_ki w_ki A_k``. Every ``h > 0``, so each
    ``S_i`` has the range of ``S = sum_k A_k``: its pseudo-inverse is taken on the range RegMean keeps of ``S``,
    ``U (U^T S_i U)^{-1} U^T``, so that a row and its layer drop the same directions."""
    if units is None:
        return regmean_solution(mats, grams, share)
    w_avg = _total([c * m for c, m in zip(share, mats)])
    u = range_basis(_total(list(grams)))
    rows = []
    for i in range(w_avg.shape[0]):
        s_i = _total([h[i] * am for h, am in zip(units, grams)])
        r_i = _total([h[i] * (m[i] @ am) for h, m, am in zip(units, mats, grams)])
        pinv = u @ np.linalg.inv(u.T @ s_i @ u) @ u.T
        rows.append(closed_form(w_avg[i:i + 1], r_i[None, :], s_i, pinv=pinv)[0])
    return np.stack(rows)


def _group_objective(w: Sequence[np.ndarray], views: Sequence[Sequence[tuple[np.ndarray, np.ndarray, np.ndarray | None]]],
                     pi: Sequence[np.ndarray]) -> float:
    """The group's terms of J: every member layer, every client with its assignment."""
    return sum(_layer_objective(wl, m[p], am, None if hm is None else hm[p])
               for vk, p in zip(views, pi) for wl, (m, am, hm) in zip(w, vk))


def _gram_aggregate(x: Sequence[Model], curvature: tuple, layers: Mapping[str, InputGram],
                    spec: PermutationSpec, perms: Sequence[Mapping], share: np.ndarray,
                    dtypes: Model) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Every Gram layer in closed form, every other tensor size-weighted, after ``perms``; and J's layer terms.

    ``curvature``: per client the layers' ``A_k``, and per client their unit weights (or ``None``)."""
    a, h = curvature
    model, J = {}, {}
    for name in x[0]:
        xs = [_permute(xk[name], spec.axes.get(name, ()), pk) for xk, pk in zip(x, perms)]
        model[name] = _total([c * xk for c, xk in zip(share, xs)])
    for l, g in layers.items():
        views = [_gram_view(xk, g, ak[l], spec, pk, rows=True) for xk, ak, pk in zip(x, a, perms)]
        units = None if h is None else [_permute(hk[l], spec.axes[g.weight][:1], pk) for hk, pk in zip(h, perms)]
        w = _layer_solution([m for m, _ in views], [am for _, am in views], units, share)
        J[l] = sum(_layer_objective(w, m, am, None if units is None else units[k]) for k, (m, am) in enumerate(views))
        n_in = int(np.prod(np.shape(x[0][g.weight])[1:]))
        model[g.weight] = w[:, :n_in].reshape(np.shape(x[0][g.weight]))
        if g.bias is not None:
            model[g.bias] = w[:, n_in]
    for name, value in model.items():
        dtype = np.asarray(dtypes[name]).dtype
        model[name] = (np.rint(value) if np.issubdtype(dtype, np.integer) else value).astype(dtype)
    return model, J


def _check_grams(weights: Sequence[Model], grams: Sequence[Mapping[str, InputGram]], num_examples: Sequence[float],
                 spec: PermutationSpec, max_iters: int) -> dict[str, InputGram]:
    """Validate the inputs (errors name the client and layer); return client 0's layers by module name."""
    _check(weights, [{} for _ in weights], spec, 1.0, 1.0, max_iters, num_examples, buffers=set(weights[0]) if weights else ())
    if num_examples is None or len(grams) != len(weights):
        raise ValueError(f"need one Gram set and one size per client, got {len(grams)} Gram sets for {len(weights)} clients")
    layers = dict(grams[0])
    for k, gk in enumerate(grams):
        if set(gk) != set(layers):
            raise ValueError(f"client {k}: Gram layers {sorted(gk)} differ from client 0's {sorted(layers)}")
        for l, g in gk.items():
            w = np.asarray(weights[k].get(g.weight, np.empty(0)))
            d = (int(np.prod(w.shape[1:])) if w.ndim in (2, 4) else -1) + (g.bias is not None)
            gram = np.asarray(g.gram)
            if (g.weight, g.bias) != (layers[l].weight, layers[l].bias) or w.ndim not in (2, 4) or gram.shape != (d, d):
                raise ValueError(f"client {k}, Gram of {l!r}: needs a Linear or Conv2d weight {g.weight!r} and a "
                                 f"({d}, {d}) Gram, got weight shape {w.shape} and Gram shape {gram.shape}")
            if not np.all(np.isfinite(gram)) or not np.allclose(gram, gram.T, rtol=1e-6, atol=0.0):
                raise ValueError(f"client {k}, Gram of {l!r}: not finite or not symmetric")
    return layers
