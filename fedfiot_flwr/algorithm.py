"""FedFiOT's server-side merge as the paper writes it (Algorithm 1): a readable NumPy reference.

:func:`fedfiot_merge` runs the paper's configuration only (Fisher matching, Fisher aggregation,
scipy's exact assignment, float64). The fast engine :func:`fedfiot_flwr.merge.merge` returns
bit-identical models and permutations (``tests/test_algorithm_reference.py``). Comments marked
"engine:" name a choice the paper leaves open, made here as the engine makes it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from numbers import Real
from typing import NamedTuple

import numpy as np
from scipy.optimize import linear_sum_assignment

from fedfiot_flwr.options import DEFAULT_LAM, DEFAULT_MAX_ITERS, DEFAULT_RHO, alignment_kept
from fedfiot_flwr.options import ModelView as Model

from .merge.spec import PermutationSpec



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
