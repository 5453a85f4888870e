"""The Gram curvature of the merge engine: RegMean's input second moment in place of the diagonal Fisher.

With ``MergeOptions(curvature="gram")`` the engine minimises

``J(W, pi) = sum_k sum_l tr((W_l - P_kl w_kl P_k,l-1^T) A_kl (W_l - P_kl w_kl P_k,l-1^T)^T)``

over the layers ``l`` with an uploaded input Gram (Linear layers, and convolutions through their
unfolded patches ``C_in k_h k_w``; a bias is the constant input, last), where ``w_kl = [W b]`` is
client k's layer with its weight flattened to ``(d_out, C_in k_h k_w)`` and

``A_kl = c_k (alpha G_kl + (1 - alpha) diag(G_kl) + ridge * mean(diag G_kl) I)``,

``c_k`` the client's share of the examples (``fisher_scaling="size"``) or 1 (``"none"``). Both steps
of the alternation minimise J's terms of one permutation group exactly:

* the alignment's cost of global unit ``i`` and client unit ``j`` is
  ``sum_{l in group} (W_l,i - w_kl,j) A_kl (W_l,i - w_kl,j)^T``, the squared difference of the two
  units' pre-activations on client k's own inputs, built from GEMMs;
* the aggregation is RegMean's closed form ``W_l S_l = R_l``, ``S_l = sum_k A_kl``,
  ``R_l = sum_k P_k w_kl A_kl``, of all solutions the one closest to the size-weighted average.

:class:`GramLayers` is one group's side of the engine's alternation (the same protocol as the
diagonal Fisher's :class:`~fedfiot_flwr.merge.costs.ClientLayers`: ``costs``, ``moments``, ``solve``,
``objective``); :func:`merge_with_grams` is the full-model merge after the alignments. Tensors no Gram
covers (buffers, BatchNorm parameters, layers without a Gram) move with their permutation and are
size-weighted averages, outside J; a group that no Gram layer's rows cover keeps every unit in place.
The reference form of the same algorithm is :func:`fedfiot_flwr.algorithm.fedfiot_gram_merge`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedfiot_flwr.options import ModelView as Model
from fedfiot_flwr.psd import InputGram, layer_matrix

from .dtypes import cast_average
from .kfac import range_basis, row_terms, row_weights, unit_weighted_solution
from .spec import AxisPerm, PermutationSpec, expand_block_permutation, permute_tensor
from .validate import check_models, check_num_examples

__all__ = ["GramLayers", "PreparedGrams", "cap_grams", "unit_view", "closed_form", "psd_pinv", "input_order", "merge_with_grams", "prepare_grams",
           "regmean_solution", "scale_off_diagonal", "scaled_gram"]

def scale_off_diagonal(gram: np.ndarray, alpha: float) -> np.ndarray:
    """``alpha * G + (1 - alpha) * diag(G)``: off-diagonal entries times ``alpha``.

    >>> scale_off_diagonal(np.array([[2., 1.], [1., 4.]]), 0.5).tolist()
    [[2.0, 0.5], [0.5, 4.0]]
    """
    g = np.asarray(gram, dtype=np.float64)
    out = alpha * g
    out[np.diag_indices_from(out)] = np.diag(g)
    return out


def scaled_gram(gram: np.ndarray, alpha: float, ridge: float) -> np.ndarray:
    """RegMean's off-diagonal scaling plus ``ridge * mean(diag G) I``, symmetrised (before the client's share).

    >>> scaled_gram(np.array([[2., 1.], [1., 4.]]), 1.0, 0.5).tolist()
    [[3.5, 1.0], [1.0, 5.5]]
    """
    out = scale_off_diagonal(gram, alpha)
    out[np.diag_indices_from(out)] += ridge * float(np.mean(np.diag(out)))
    return (out + out.T) / 2.0


def psd_pinv(s: np.ndarray, rcond: float = 1e-10) -> np.ndarray:
    """The pseudo-inverse of the symmetrised ``s``: eigenvalues at most ``rcond`` times the largest in magnitude
    are dropped (for a symmetric matrix, its singular values are its eigenvalues' magnitudes).

    >>> psd_pinv(np.diag([4.0, 1e-12]), rcond=1e-10).tolist()
    [[0.25, 0.0], [0.0, 0.0]]
    """
    values, vectors = np.linalg.eigh((s + s.T) / 2.0)
    top = float(np.max(np.abs(values))) if values.size else 0.0
    keep = np.abs(values) > rcond * top
    scaled = vectors[:, keep] / values[keep]
    return scaled @ vectors[:, keep].T


def closed_form(w_avg: np.ndarray, r: np.ndarray, s: np.ndarray, rcond: float = 1e-10,
                pinv: np.ndarray | None = None) -> np.ndarray:
    """The ``W`` with ``W S = R`` closest to ``w_avg``: ``w_avg + (R - w_avg S) S^+``.

    ``S^+`` is :func:`psd_pinv` of ``S`` (pass it as ``pinv`` when ``S`` serves several solves).

    >>> closed_form(np.zeros((1, 2)), np.array([[2., 0.]]), np.diag([2., 0.])).tolist()
    [[1.0, 0.0]]
    """
    if pinv is None:
        pinv = psd_pinv(s, rcond)
    return w_avg + (r - w_avg @ ((s + s.T) / 2.0)) @ pinv


def regmean_solution(mats: Sequence[np.ndarray], curvatures: Sequence[np.ndarray], shares: Sequence[float],
                     rcond: float = 1e-10, pinv: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """:func:`closed_form` for ``S = sum_k A_k``, ``R = sum_k M_k A_k``, ``w_avg = sum_k shares_k M_k``
    (``pinv``: where ``S^+`` comes from, :func:`psd_pinv` by default)."""
    s = sum(curvatures[1:], curvatures[0])
    r = sum((m @ a for m, a in zip(mats[1:], curvatures[1:])), mats[0] @ curvatures[0])
    w_avg = sum(c * m for c, m in zip(shares, mats))
    return closed_form(w_avg, r, s, rcond, None if pinv is None else pinv(s))


def input_order(entry: AxisPerm | None, done: Mapping[str, np.ndarray], shape: Sequence[int],
                bias: bool) -> np.ndarray:
    """The order of a layer's flattened inputs (bias input last) after the solved permutations.

    A weight of shape ``(d_out, n_in, *kernel)`` has ``n_in * prod(kernel)`` inputs in ``F.unfold``'s
    order (input channel major); ``entry`` is the permutation of its axis 1.

    >>> input_order(AxisPerm("P"), {"P": np.array([1, 0])}, (3, 2, 1, 2), bias=True).tolist()
    [2, 3, 0, 1, 4]
    """
    n_in, taps = int(shape[1]), int(np.prod(shape[2:], dtype=np.int64))
    channels = np.arange(n_in)
    if entry is not None and entry.perm in done:
        channels = expand_block_permutation(done[entry.perm], entry.block)
    index = (channels[:, None] * taps + np.arange(taps)).reshape(-1)
    return np.concatenate([index, [n_in * taps]]) if bias else index


def _label(client_ids: Sequence[str], k: int, layer: str) -> str:
    return f"client {client_ids[k]!r}, Gram of {layer!r}"


def check_grams(models: Sequence[Mapping[str, np.ndarray]], grams: Sequence[Mapping[str, InputGram]],
                client_ids: Sequence[str], checked: bool = False) -> dict[str, InputGram]:
    """Every client's Grams: the same layers as client 0's, each fitting its weight and bias and
    (unless ``checked``) finite, symmetric, with a non-negative diagonal. Returns client 0's layers."""
    if len(grams) != len(models):
        raise ValueError(f"got {len(models)} models but {len(grams)} Gram sets")
    if not grams[0]:
        raise ValueError(f"client {client_ids[0]!r}: no Gram layer")
    layers = dict(grams[0])
    for k, gk in enumerate(grams):
        if set(gk) != set(layers):
            raise ValueError(f"client {client_ids[k]!r}: Gram layers {sorted(gk)} differ from client "
                             f"{client_ids[0]!r}'s {sorted(layers)}")
        for name, g in gk.items():
            where = _label(client_ids, k, name)
            if (g.weight, g.bias) != (layers[name].weight, layers[name].bias):
                raise ValueError(f"{where}: covers {(g.weight, g.bias)}, client {client_ids[0]!r}'s covers "
                                 f"{(layers[name].weight, layers[name].bias)}")
            w = np.asarray(models[k].get(g.weight, np.empty(0)))
            if w.ndim not in (2, 4) or (g.bias is not None and np.shape(models[k].get(g.bias)) != w.shape[:1]):
                raise ValueError(f"{where}: needs a Linear or Conv2d weight {g.weight!r} (and its bias), got weight "
                                 f"shape {w.shape}")
            d = int(np.prod(w.shape[1:])) + (g.bias is not None)
            gram = np.asarray(g.gram)
            if gram.shape != (d, d):
                raise ValueError(f"{where}: shape {gram.shape} differs from ({d}, {d})")
            if g.output is not None:
                _check_output(np.asarray(g.output), w.shape[0], f"client {client_ids[k]!r}, output factor of {name!r}",
                              checked)
            if checked:
                continue
            if not np.issubdtype(gram.dtype, np.number) or not np.all(np.isfinite(gram)):
                raise ValueError(f"{where}: contains NaN or inf")
            if not np.allclose(gram, gram.T, rtol=1e-6, atol=0.0) or np.any(np.diag(gram) < 0):
                raise ValueError(f"{where}: not symmetric positive semi-definite")
    return layers


def _check_output(output: np.ndarray, d_out: int, where: str, checked: bool) -> None:
    """A layer's output factor: one finite, non-negative entry per output unit."""
    if output.shape != (d_out,):
        raise ValueError(f"{where}: shape {output.shape} differs from ({d_out},)")
    if checked:
        return
    if not np.issubdtype(output.dtype, np.number) or not np.all(np.isfinite(output)):
        raise ValueError(f"{where}: contains NaN or inf")
    if np.any(output < 0):
        raise ValueError(f"{where}: has negative entries (a second moment is >= 0)")


@dataclass
class PreparedGrams:
    """Validated uploads for the Gram curvature (see :func:`prepare_grams`).

    Attributes
    ----------
    models : list of dict[str, np.ndarray]
        As uploaded.
    grams : list of dict[str, np.ndarray]
        Per client, module name -> float64 mean input Gram.
    layers : dict[str, InputGram]
        Client 0's Gram layers (the tensors each covers).
    shapes, dtypes : dict
        Tensor shapes and the model's dtypes (the merged model keeps them).
    client_ids : list[str]
        Names used in error messages.
    num_examples : list[int]
        Client sizes (the curvature's shares and the averages).
    outputs : list of dict[str, np.ndarray]
        Per client, module name -> the layer's output factor, where uploaded (K-FAC's curvature needs every one).
    identity_merges, aligned_merges : dict
        Full merges computed so far, by curvature knobs (and alignment).
    """

    #: Bytes of pseudo-inverses :meth:`pinv` keeps (the least recently used go first).
    PINV_CACHE_BYTES = 256 * 2**20

    models: list[Model]
    grams: list[dict[str, np.ndarray]]
    layers: dict[str, InputGram]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]
    client_ids: list[str]
    num_examples: list[int]
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)
    identity_merges: dict = field(default_factory=dict, repr=False)
    aligned_merges: dict = field(default_factory=dict, repr=False)
    _curvatures: dict = field(default_factory=dict, repr=False)
    _pinvs: OrderedDict = field(default_factory=OrderedDict, repr=False)

    def __len__(self) -> int:
        return len(self.models)

    @property
    def shares(self) -> np.ndarray:
        """Each client's share of the examples."""
        n = np.asarray(self.num_examples, dtype=np.float64)
        return n / n.sum()

    def curvatures(self, alpha: float, ridge: float, scaling: str) -> list[dict[str, np.ndarray]]:
        """Per client, module name -> ``A_k`` (cached per knobs)."""
        key = (float(alpha), float(ridge), scaling)
        if key not in self._curvatures:
            factors = self.shares if scaling == "size" else np.ones(len(self))
            self._curvatures = {key: [{l: c * scaled_gram(g, alpha, ridge) for l, g in gk.items()}
                                      for gk, c in zip(self.grams, factors)]}
        return self._curvatures[key]

    def unit_weights(self, damping: float) -> list[dict[str, np.ndarray]]:
        """Per client, module name -> K-FAC's unit weights (:func:`~fedfiot_flwr.merge.kfac.row_weights`)."""
        outputs = self.outputs or [{} for _ in range(len(self))]
        missing = [f"client {self.client_ids[k]!r}: {sorted(set(self.layers) - set(ok))}"
                   for k, ok in enumerate(outputs) if set(ok) != set(self.layers)]
        if missing:
            raise ValueError("the K-FAC curvature needs every Gram layer's output factor; missing for "
                             + "; ".join(missing))
        return [{l: row_weights(g, damping) for l, g in ok.items()} for ok in self.outputs]

    def pinv(self, s: np.ndarray, rcond: float) -> np.ndarray:
        """:func:`psd_pinv` of ``s``, computed once per distinct ``s``: a layer's summed Gram recurs in every
        alternation pass whose input permutation did not change, and again in the final merges."""
        return self._memo("pinv", s, rcond, psd_pinv)

    def basis(self, s: np.ndarray, rcond: float) -> np.ndarray:
        """:func:`~fedfiot_flwr.merge.kfac.range_basis` of ``s``, once per distinct ``s`` (as :meth:`pinv`)."""
        return self._memo("basis", s, rcond, range_basis)

    def _memo(self, what: str, s: np.ndarray, rcond: float, compute: Callable[[np.ndarray, float], np.ndarray]) -> np.ndarray:
        key = (what, float(rcond), s.shape, hashlib.blake2b(np.ascontiguousarray(s).data, digest_size=16).digest())
        found = self._pinvs.get(key)
        if found is None:
            found = compute(s, rcond)
            self._pinvs[key] = found
            while sum(v.nbytes for v in self._pinvs.values()) > self.PINV_CACHE_BYTES and len(self._pinvs) > 1:
                self._pinvs.popitem(last=False)
        else:
            self._pinvs.move_to_end(key)
        return found


def prepare_grams(models: Sequence[Model], grams: Sequence[Mapping[str, InputGram]], *,
                  num_examples: Sequence[int] | None, client_ids: Sequence[str] | None = None,
                  checked: bool = False) -> PreparedGrams:
    """Validate the uploads of a Gram-curvature merge once (errors name the client and tensor).

    Examples
    --------
    >>> prep = prepare_grams([{"l.weight": np.ones((1, 2))}], [{"l": InputGram("l.weight", None, np.eye(2))}],
    ...                      num_examples=[3])
    >>> list(prep.layers), prep.shapes
    (['l'], {'l.weight': (1, 2)})
    """
    ids = [str(i) for i in range(len(models))] if client_ids is None else [str(c) for c in client_ids]
    if num_examples is None:
        raise ValueError("the Gram curvature needs num_examples (the clients' shares weigh their Grams)")
    shapes = check_models(models, [{} for _ in models], set(models[0]) if models else (), ids, checked=checked)
    check_num_examples(num_examples, len(models), ids, checked=checked)
    layers = check_grams(models, grams, ids, checked)
    return PreparedGrams(
        models=[{n: np.asarray(x) for n, x in m.items()} for m in models],
        grams=[{l: np.asarray(g.gram, dtype=np.float64) for l, g in gk.items()} for gk in grams],
        layers=layers, shapes=shapes, dtypes={n: np.asarray(x).dtype for n, x in models[0].items()},
        client_ids=ids, num_examples=list(num_examples),
        outputs=[{l: np.asarray(g.output, dtype=np.float64) for l, g in gk.items() if g.output is not None}
                 for gk in grams],
    )


def cap_grams(grams: Sequence[Mapping[str, InputGram]],
              factor: float) -> tuple[list[dict[str, InputGram]], list[tuple[int, str, float]]]:
    """Robust weighting: a client whose Gram of a layer has a mean diagonal entry more than ``factor`` times
    the other clients' median is scaled down to that median; the others are untouched.

    Returns the Grams and, per capped Gram, ``(client index, layer, how many times the median it was)``.

    >>> g = [{"l": InputGram("l.weight", None, np.eye(2) * s)} for s in (1.0, 2.0, 1e6)]
    >>> out, capped = cap_grams(g, 10.0)
    >>> float(out[2]["l"].gram[0, 0]), capped
    (1.5, [(2, 'l', 666666.6666666666)])
    """
    out = [dict(gk) for gk in grams]
    capped: list[tuple[int, str, float]] = []
    if len(grams) < 2:
        return out, capped
    for layer in grams[0]:
        sizes = np.array([float(np.mean(np.diag(np.asarray(gk[layer].gram)))) for gk in grams])
        for k, size in enumerate(sizes):
            others = float(np.median(np.delete(sizes, k)))
            if others > 0 and size > factor * others:
                g = grams[k][layer]
                out[k][layer] = InputGram(g.weight, g.bias, np.asarray(g.gram, dtype=np.float64) * (others / size),
                                          g.output)
                capped.append((k, layer, size / others))
    return out, capped


def group_members(prepared: PreparedGrams, spec: PermutationSpec, group: str) -> list[str]:
    """The Gram layers whose rows (axis 0) the permutation ``group`` moves."""
    out = []
    for name, g in prepared.layers.items():
        entry = spec.axes.get(g.weight, (None,))[0]
        if entry is not None and entry.perm == group:
            out.append(name)
    return out


def layer_view(prepared: PreparedGrams, k: int, layer: str, curvature: np.ndarray, spec: PermutationSpec,
               done: Mapping[str, np.ndarray], rows: bool) -> tuple[np.ndarray, np.ndarray]:
    """Client k's ``[W b]`` (float64, weight flattened) and ``A_k`` of ``layer``, with the permutations in
    ``done`` applied to the inputs (and, with ``rows``, to the rows)."""
    g, model = prepared.layers[layer], prepared.models[k]
    axes = spec.axes.get(g.weight, (None,) * model[g.weight].ndim)
    keep = () if rows else (0,)
    weight = np.asarray(permute_tensor(model[g.weight], axes, done, keep), dtype=np.float64)
    bias = None
    if g.bias is not None:
        bias = np.asarray(permute_tensor(model[g.bias], spec.axes.get(g.bias, (None,)), done, keep), dtype=np.float64)
    order = input_order(axes[1] if len(axes) > 1 else None, done, weight.shape, g.bias is not None)
    return layer_matrix(weight.reshape(weight.shape[0], -1), bias), curvature[np.ix_(order, order)]


def unit_view(prepared: PreparedGrams, layer: str, units: np.ndarray, spec: PermutationSpec,
              done: Mapping[str, np.ndarray]) -> np.ndarray:
    """A layer's unit weights with its rows' permutation in ``done`` applied (as its rows are)."""
    g = prepared.layers[layer]
    entry = spec.axes.get(g.weight, (None,))[0]
    return np.asarray(permute_tensor(units, (entry,), done), dtype=np.float64)


class GramLayers:
    """One permutation group's Gram layers, prepared once per alignment (the engine's curvature protocol).

    Holds per client ``k`` and member layer ``l`` the client layer ``m_kl`` (``(m, d_l)``), ``m_kl A_kl``
    and the row constants ``m_kl A_kl m_kl^T``; per member the sum ``S_l = sum_k A_kl``, which the
    alignment of this group does not change.

    Parameters
    ----------
    views : sequence of sequence of (np.ndarray, np.ndarray)
        Per client, per member layer, ``(m_kl, A_kl)`` with the inputs in the global order.
    shares : np.ndarray
        The clients' shares of the examples (the size-weighted average the closed form stays near).
    rcond : float
        Relative cut-off of the pseudo-inverse of ``S_l``.
    pinv : callable, optional
        Where ``S_l^+`` comes from (:meth:`PreparedGrams.pinv`, which reuses it); :func:`psd_pinv` by default.
    """

    def __init__(self, views: Sequence[Sequence[tuple[np.ndarray, np.ndarray]]], shares: np.ndarray,
                 rcond: float = 1e-10, pinv: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        self.n_clients, self.shares, self.rcond = len(views), shares, rcond
        self.layers = [[m for m, _ in vk] for vk in views]
        self.curvatures = [[a for _, a in vk] for vk in views]
        self.weighted = [[m @ a for m, a in vk] for vk in views]
        self.row_const = [[np.einsum("jc,jc->j", ma, m) for ma, (m, _) in zip(wk, vk)]
                          for wk, vk in zip(self.weighted, views)]
        self.const = float(sum(float(r.sum()) for rk in self.row_const for r in rk))
        members = len(views[0])
        self.den = [sum(self.curvatures[k][i] for k in range(self.n_clients)) for i in range(members)]
        inverse = pinv if pinv is not None else (lambda s: psd_pinv(s, rcond))
        self.pinv = [inverse(s) for s in self.den]  # S_l does not change while this group aligns

    def costs(self, w: Sequence[np.ndarray], skip: Collection[int] = ()) -> Iterator[np.ndarray | None]:
        """Per client, ``C[i, j] = sum_l (w_l,i - m_kl,j) A_kl (w_l,i - m_kl,j)^T`` up to a row constant.

        Row ``i``'s term ``w_l,i A_kl w_l,i^T`` does not change a client's assignment; only its sum over
        the clients, ``w_l,i S_l w_l,i^T``, enters J. Each client's matrix carries an equal share of that
        sum (one ``m d^2`` product per layer instead of one per client), so the chosen entries of all
        clients still add up to J. ``None`` for a client in ``skip``.
        """
        shared = sum(np.einsum("ic,ic->i", wl @ s, wl) for wl, s in zip(w, self.den)) / self.n_clients
        for k in range(self.n_clients):
            if k in skip:
                yield None
                continue
            cost = np.repeat(shared[:, None], w[0].shape[0], axis=1)
            for wl, ma, rc in zip(w, self.weighted[k], self.row_const[k]):
                cost -= 2.0 * (wl @ ma.T)
                cost += rc[None, :]
            yield cost

    def moments(self, perms: Sequence[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per member, ``R_l = sum_k (m_kl A_kl)[p_k]`` and ``S_l``."""
        num = [sum(self.weighted[k][i][p] for k, p in enumerate(perms)) for i in range(len(self.den))]
        return num, self.den

    def solve(self, perms: Sequence[np.ndarray], num: Sequence[np.ndarray], den: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per member, the closed form ``W_l S_l = R_l`` nearest the size-weighted average of the aligned clients."""
        out = []
        for i, (r, s) in enumerate(zip(num, den)):
            w_avg = sum(c * self.layers[k][i][p] for k, (c, p) in enumerate(zip(self.shares, perms)))
            out.append(closed_form(w_avg, r, s, self.rcond, self.pinv[i] if s is self.den[i] else None))
        return out

    def objective(self, w: Sequence[np.ndarray], num: Sequence[np.ndarray], den: Sequence[np.ndarray]) -> float:
        """The group's terms of J at ``w``, expanded: ``const + sum_l tr(w_l S_l w_l^T) - 2 tr(R_l w_l^T)``."""
        return max(0.0, self.const + sum(float(np.vdot(wl @ s - 2.0 * r, wl)) for wl, r, s in zip(w, num, den)))


def merge_with_grams(prepared: PreparedGrams, spec: PermutationSpec, perms: Sequence[Mapping[str, np.ndarray]],
                     curvatures: Sequence[Mapping[str, np.ndarray]], rcond: float = 1e-10,
                     units: Sequence[Mapping[str, np.ndarray]] | None = None,
                     ) -> tuple[dict[str, np.ndarray], float, dict[str, float]]:
    """Every Gram layer in closed form, every other tensor size-weighted, after ``perms``; J and its layer terms.

    With ``units`` (per client, the unit weights of every Gram layer) the curvature is K-FAC's
    (:mod:`fedfiot_flwr.merge.kfac`): one closed form per row."""
    shares = prepared.shares
    merged: dict[str, np.ndarray] = {}
    for name in prepared.models[0]:
        axes = spec.axes.get(name, (None,) * np.ndim(prepared.models[0][name]))
        total = None
        for c, mk, pk in zip(shares, prepared.models, perms):
            term = c * np.asarray(permute_tensor(mk[name], axes, pk), dtype=np.float64)
            total = term if total is None else total + term
        merged[name] = total
    terms: dict[str, float] = {}
    for layer, g in prepared.layers.items():
        views = [layer_view(prepared, k, layer, curvatures[k][layer], spec, pk, rows=True) for k, pk in enumerate(perms)]
        mats, grams = [m for m, _ in views], [a for _, a in views]
        if units is None:
            w = regmean_solution(mats, grams, shares, rcond, lambda s: prepared.pinv(s, rcond))
            terms[layer] = float(sum(np.sum(((w - m) @ a) * (w - m)) for m, a in views))
        else:
            h = [unit_view(prepared, layer, uk[layer], spec, pk) for uk, pk in zip(units, perms)]
            w_avg = sum(c * m for c, m in zip(shares, mats))
            r = sum(hk[:, None] * (m @ a) for hk, m, a in zip(h, mats, grams))
            w = unit_weighted_solution(w_avg, r, grams, np.stack(h), prepared.basis(sum(grams[1:], grams[0]), rcond))
            terms[layer] = row_terms(w, mats, grams, h)
        shape = prepared.shapes[g.weight]
        n_w = int(np.prod(shape[1:]))
        merged[g.weight] = w[:, :n_w].reshape(shape)
        if g.bias is not None:
            merged[g.bias] = w[:, n_w]
    model = {name: cast_average(value, prepared.dtypes[name]) for name, value in merged.items()}
    return model, float(sum(terms.values())), terms
