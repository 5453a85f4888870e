"""RegMean (Jin, Ren, Preotiuc-Pietro, Cheng, ICLR 2023) server merge.

For every Linear layer with uploaded Grams, RegMean picks the weights that best reproduce
all clients' layer outputs on their own inputs,

    W* = argmin_W sum_k ||X_k W^T - X_k W_k^T||^2,   i.e.   W* S = R,
    S = sum_k G'_k,   R = sum_k W_k G'_k,   G'_k = alpha G_k + (1 - alpha) diag(G_k),

where ``G_k = n_k E_k[x x^T]`` (``gram_scaling="size"``: ``X_k^T X_k``, so ``alpha = 1``
is the least-squares fit on the union of the clients' inputs) or ``E_k[x x^T]``
(``"none"``) and ``alpha`` scales the off-diagonal entries (paper: ``alpha`` in
``{0.1, 0.9}``, chosen on the validation set by :func:`regmean_select`).

Bias: when a layer has one, the client Grams are augmented with an input of ones (see
:func:`fedfiot_flwr.curvature.input_grams`), so ``[W b]`` is solved jointly (the bias is
the intercept of the least-squares fit) and ``alpha`` scales the bias row/column like any
other off-diagonal entry.

Null space: ``S`` can be singular (inputs that are zero on every client, low-rank
compressed Grams with ``alpha = 1``). Of all solutions of ``W S = R`` the merge returns the
one closest (Frobenius) to the size-weighted average ``W_avg``:
``W* = W_avg + (R - W_avg S) S^+``, with ``S^+`` the pseudo-inverse (singular values below
``rcond`` times the largest are dropped). When ``S`` is invertible this is the unique
solution. Every other tensor (convolutions, buffers, Linear layers without Grams) is the
size-weighted average. The merge is the engine's (:func:`fedfiot_flwr.merge.merge` with the Gram
curvature, :mod:`fedfiot_flwr.merge.gram`, and no alignment).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedfiot_flwr.baselines.averaging import (
    check_clients,
    check_curvature_replies,
    check_square,
)
from fedfiot_flwr.choose import BestSoFar
from fedfiot_flwr.merge.engine import merge
from fedfiot_flwr.merge.gram import prepare_grams, regmean_solution, scale_off_diagonal
from fedfiot_flwr.merge.options import MergeOptions
from fedfiot_flwr.merge.spec import PermutationSpec
from fedfiot_flwr.psd import InputGram
from fedfiot_flwr.options import Model

__all__ = ["REGMEAN_ALPHAS", "RegMeanResult", "regmean_merge", "regmean_select", "regmean_solution",
           "scale_off_diagonal"]

REGMEAN_ALPHAS: tuple[float, ...] = (0.1, 0.9)
"""The paper's off-diagonal scalings, selected on validation data."""



@dataclass
class RegMeanResult:
    """Outcome of :func:`regmean_select`.

    Attributes
    ----------
    model : dict[str, np.ndarray]
        The merge with the best validation score.
    alpha : float
        Its off-diagonal scaling.
    scores : dict[float, float]
        Validation score of every ``alpha`` tried.
    merged_layers : list[str]
        Module names merged in closed form (the rest are size-weighted averages).
    seconds : float
        Wall-clock time of all merges.
    """

    model: Model
    alpha: float
    scores: dict[float, float] = field(default_factory=dict)
    merged_layers: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _check_grams(
    ids: Sequence[str],
    models: Sequence[Mapping[str, np.ndarray]],
    grams: Sequence[Mapping[str, InputGram]],
    checked: bool = False,
) -> list[str]:
    """The merged layers; with ``checked`` (decoded uploads) only counts and names are checked."""
    return check_curvature_replies(ids, models, grams, "regmean", None if checked else _check_gram_layer)


def _check_gram_layer(where: str, g: InputGram, model: Mapping[str, np.ndarray]) -> None:
    """One layer's Gram fits its 2-D Linear weight (``d_in (+1 with a bias)``) and is finite."""
    w = np.asarray(model[g.weight])
    if w.ndim != 2:
        raise ValueError(f"{where}: RegMean needs a 2-D Linear weight, got shape {w.shape}")
    check_square(f"{where}: Gram", g.gram, w.shape[1] + (g.bias is not None))


def regmean_merge(
    models: Sequence[Mapping[str, np.ndarray]],
    grams: Sequence[Mapping[str, InputGram]],
    num_examples: Sequence[int],
    *,
    alpha: float = 0.9,
    gram_scaling: str = "size",
    rcond: float = 1e-10,
    client_ids: Sequence[str] | None = None,
    checked: bool = False,
) -> Model:
    """RegMean with one off-diagonal scaling ``alpha``.

    The input checks guard direct callers; uploads that came over the wire were validated when
    they were decoded (every Gram fits its Linear layer and is finite), and the server passes
    ``checked=True``.

    Parameters
    ----------
    models : sequence of mapping of str to np.ndarray
        Client state dicts (dequantized uploads).
    grams : sequence of mapping of str to InputGram
        Per client, ``{module name: InputGram}`` (mean Grams; same layers for every client),
        as returned by :func:`fedfiot_flwr.curvature.input_grams` (or dequantized).
    num_examples : sequence of int
        Local data-set sizes.
    alpha : float
        Off-diagonal scaling in ``[0, 1]`` (1: the exact least-squares merge).
    gram_scaling : str
        ``"size"`` (Grams times ``n_k``: ``X_k^T X_k``) or ``"none"``.
    rcond : float
        Relative cut-off of the pseudo-inverse of ``S``.
    client_ids : sequence of str, optional
        Names for error messages.
    checked : bool
        The uploads come from :func:`fedfiot_flwr.server.uploads.collect_uploads`: only counts
        and tensor names are checked, not sizes, shapes or values again.

    Returns
    -------
    dict[str, np.ndarray]
        The merged state dict (the first model's key order and dtypes).

    Raises
    ------
    ValueError
        On inconsistent models, Gram sets or shapes, non-finite Grams or ``alpha`` outside
        ``[0, 1]``; the message names the client and layer.
    """
    ids = check_clients(models, num_examples, client_ids, checked=checked)
    if not (0.0 <= alpha <= 1.0):
        raise ValueError(f"regmean: alpha must lie in [0, 1], got {alpha!r}")
    _check_grams(ids, models, grams, checked)
    prepared = prepare_grams(models, grams, num_examples=num_examples, client_ids=ids, checked=True)
    options = MergeOptions(curvature="gram", matching="none", gram_alpha=float(alpha), gram_scaling=gram_scaling,
                           gram_rcond=float(rcond))
    return merge(prepared, None, PermutationSpec({}), options).model


def regmean_select(
    models: Sequence[Mapping[str, np.ndarray]],
    grams: Sequence[Mapping[str, InputGram]],
    num_examples: Sequence[int],
    evaluate: Callable[[Model], float] | None,
    *,
    alphas: Sequence[float] = REGMEAN_ALPHAS,
    gram_scaling: str = "size",
    rcond: float = 1e-10,
    client_ids: Sequence[str] | None = None,
    checked: bool = False,
) -> RegMeanResult:
    """RegMean for every ``alpha`` in ``alphas``; keep the best on validation.

    Parameters
    ----------
    models, grams, num_examples, gram_scaling, rcond, client_ids, checked
        As in :func:`regmean_merge`.
    evaluate : callable or None
        ``model -> score`` on the validation set (higher is better). ``None`` returns the
        merge with the last ``alpha``.
    alphas : sequence of float
        Candidates (paper: 0.1 and 0.9), chosen under :mod:`fedfiot_flwr.choose` (a NaN score
        never wins; ties go to the earlier one).

    Returns
    -------
    RegMeanResult
    """
    if len(alphas) == 0:
        raise ValueError("regmean_select: no alpha to try")
    t0 = time.perf_counter()
    best: BestSoFar[tuple[float, Model]] = BestSoFar()
    last: tuple[float, Model] | None = None
    scores: dict[float, float] = {}
    for alpha in alphas:
        model = regmean_merge(models, grams, num_examples, alpha=float(alpha), gram_scaling=gram_scaling,
                              rcond=rcond, client_ids=client_ids, checked=checked)
        score = float("nan") if evaluate is None else float(evaluate(model))
        scores[float(alpha)] = score
        best.offer(score, (float(alpha), model))
        last = (float(alpha), model)
    assert last is not None
    chosen_alpha, chosen = best.item if evaluate is not None else last
    return RegMeanResult(chosen, chosen_alpha, scores, list(grams[0]), time.perf_counter() - t0)
