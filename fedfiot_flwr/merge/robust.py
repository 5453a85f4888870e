"""Robust Fisher weighting: one client cannot take over the merge by inflating its Fisher.

The merge weights every coordinate of every client by its (tempered, damped) diagonal Fisher,
so a client that multiplies its Fisher by ``1e3`` owns almost every coordinate. The reply bounds
(:mod:`fedfiot_flwr.reply_limits`) reject absurd magnitudes, but a large factor inside the bounds
remains. :func:`cap_fishers` bounds each client's Fisher *relative to the other clients*, per
tensor, before tempering, by one of two rules.

``rule="outliers"`` (the default preset's) touches only the clients far from the others. With
medians taken over the *other* clients (leave-one-out, so that a two-client round still has a
reference), client ``k``'s tensor is

- *inflated* when its mean or its largest entry exceeds ``c`` times the others' median:

      mean F_k > c * median_{j != k}(mean F_j)  or  max F_k > c * median_{j != k}(max F_j);

  it keeps its own shape at the others' median magnitude,
  ``F_k <- min(median_{j != k}(mean F_j) / mean F_k, median_{j != k}(max F_j) / max F_k) * F_k``;
- *flat* when it is ``c`` times flatter than the others (``max F / mean F``, its peak, below
  ``1 / c`` times their median peak): it has no ranking of its own coordinates to keep, so it
  takes the values of the median client, ``median_{j not outlier}(sort(F_j))``, in the order of
  its own entries, equal entries ordered by the others' median at the same coordinate (a flat
  tensor thus weighs like the median client at every coordinate).

Every other client is left exactly as uploaded.

``rule="median"`` scales every client above ``c`` times the clients' median down to it:

    s_k = min(1, c * median_j(mean F_j) / mean F_k, c * median_j(max F_j) / max F_k),
    F_k <- s_k F_k.

With ``c = 1`` every honest client above the median is scaled too, and a flat Fisher brought to the
median mean outweighs the peaky honest Fishers on most coordinates.

A server that caps accepts any finite Fisher, up to float32's maximum (the reply bounds do not
exclude it, :func:`fedfiot_flwr.reply_limits.fisher_bound_for`), so the statistics are computed in
float64, and every tensor whose largest entry is still above
:data:`~fedfiot_flwr.reply_limits.MAX_FISHER_MAGNITUDE` after the rule is scaled down to it (which
only happens when half the clients or more send such a Fisher, or when the median is 0). The
capped Fishers are thus within the bound a server without the cap enforces, and nothing
downstream (tempering, size scaling, float32 cost matrices, the torch backend) sees a larger value.

What it does not defend against: a coalition holding half of the clients (it moves the median);
with ``rule="outliers"``, a client that inflates its Fisher by less than ``c`` (it is not an
outlier); inflation of single coordinates that keeps the tensor's mean and largest entry within
bounds; and weight poisoning (a client sending harmful *weights* with an honest-looking Fisher),
which is a separate threat addressed by Byzantine-robust aggregation (e.g. Flower's ``FedMedian``,
``FedTrimmedAvg``, ``Krum``, ``Bulyan``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from fedfiot_flwr.options import DEFAULT_LAM, DEFAULT_RHO, FISHER_CAP_RULES
from fedfiot_flwr.options import ModelView as Model

from ..reply_limits import MAX_FISHER_MAGNITUDE

__all__ = [
    "DEFAULT_FISHER_CAP",
    "DEFAULT_FISHER_CAP_RULE",
    "cap_factors",
    "cap_fishers",
    "FisherOutlier",
    "cap_fishers_explained",
    "cap_fishers_reporting",
    "describe_outliers",
    "fisher_outliers",
    "weight_shares",
]

DEFAULT_FISHER_CAP: float = 4.0
"""``c`` of the default preset: a client's tensor is an outlier when its mean or largest entry is
more than ``c`` times the other clients' median, or its peak ``c`` times flatter (``rule="outliers"``).
Measured in ``research/results/fisher_inflation_outliers*.md`` and ``fisher_cap_honest_fashion_*.md``:
a 1e3, 1e6 or float32-maximum inflation of one client costs at most 1.6 points (digits and
Fashion-MNIST); on four honest Fashion-MNIST cells the merge is within 2.4 points of no cap, 1.3 above
it on the mean, where the median rule at ``c = 1`` cost up to 12.9 points; an attacker under the
threshold costs up to 6.2 points (16 would leave every measured honest client alone, but lets it
cost 10)."""

DEFAULT_FISHER_CAP_RULE: str = "outliers"
"""The default preset's cap rule (:data:`fedfiot_flwr.options.FISHER_CAP_RULES`)."""

_MEDIAN_CHUNK_BYTES = 64 * 2**20
"""Memory for the stacked sorted Fishers when the median client's distribution is built."""


def _check_factor(factor: float, limit: float | None) -> None:
    if not (np.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"the Fisher cap factor must be a finite number >= 1, got {factor!r}")
    if limit is not None and not (np.isfinite(limit) and limit > 0):
        raise ValueError(f"the Fisher cap limit must be a positive finite number or None, got {limit!r}")


def _summaries(fishers: Sequence[Model], name: str) -> tuple[np.ndarray, np.ndarray]:
    """Every client's mean and largest entry of tensor ``name``, in float64."""
    means = np.array([float(np.mean(f[name], dtype=np.float64)) if np.size(f[name]) else 0.0 for f in fishers])
    maxes = np.array([float(np.max(f[name])) if np.size(f[name]) else 0.0 for f in fishers])
    return means, maxes


_Summaries = dict[str, tuple[np.ndarray, np.ndarray]]
"""Per tensor name, every client's mean and largest entry (:func:`_summaries`)."""


class FisherOutlier(NamedTuple):
    """Why one client's tensor is an outlier: ``kind`` ``"inflated"`` (its mean or largest entry
    is ``ratio`` times the other clients' median), ``"flat"`` (its largest entry over its mean is
    ``ratio`` times smaller than theirs) or, under ``rule="median"``, ``"scaled"`` (scaled down
    ``ratio`` times)."""

    kind: str
    ratio: float


def _outlier_kinds(fishers: Sequence[Model], factor: float) -> tuple[list[dict[str, FisherOutlier]], _Summaries]:
    """Per client, its outlier tensors and why, and the per-tensor summaries they were judged on."""
    kinds: list[dict[str, FisherOutlier]] = [{} for _ in fishers]
    stats: _Summaries = {name: _summaries(fishers, name) for name in (fishers[0] if fishers else ())}
    if len(fishers) < 2:
        return kinds, stats
    for name, (means, maxes) in stats.items():
        peaks = np.divide(maxes, means, out=np.zeros_like(maxes), where=means > 0)
        for k in range(len(fishers)):
            ref_mean, ref_max, ref_peak = (float(np.median(np.delete(x, k))) for x in (means, maxes, peaks))
            if means[k] > 0 and ref_peak > 0 and peaks[k] * factor < ref_peak:
                kinds[k][name] = FisherOutlier("flat", float(ref_peak / peaks[k]))
            elif (ref_mean > 0 and means[k] > factor * ref_mean) or (ref_max > 0 and maxes[k] > factor * ref_max):
                ratio = max(means[k] / ref_mean if ref_mean > 0 else 0.0, maxes[k] / ref_max if ref_max > 0 else 0.0)
                kinds[k][name] = FisherOutlier("inflated", float(ratio))
    return kinds, stats


def fisher_outliers(fishers: Sequence[Model], factor: float) -> list[set[str]]:
    """The tensors of each client that ``rule="outliers"`` treats as outliers.

    Client ``k``'s tensor is an outlier when its mean or its largest entry exceeds ``factor``
    times the median of the other clients' (a median of 0 is no reference), or when it is
    ``factor`` times flatter than theirs (its largest entry over its mean, against their median).

    Parameters
    ----------
    fishers : sequence of mapping of str to np.ndarray
        Raw (untempered) finite non-negative diagonal Fishers, one per client, same keys.
    factor : float
        ``c >= 1``.

    Returns
    -------
    list of set of str
        ``outliers[k]``: the names of client ``k``'s outlier tensors (empty for an honest-looking client).

    Examples
    --------
    >>> honest = [{"w": np.array([1.0, 9.0])}, {"w": np.array([8.0, 2.0])}, {"w": np.array([1.0, 7.0])}]
    >>> fisher_outliers([*honest, {"w": np.array([5e3, 1e3])}], 4.0)  # inflated
    [set(), set(), set(), {'w'}]
    >>> fisher_outliers([*honest, {"w": np.array([4.0, 4.0])}], 1.5)  # flat: no ranking of its own
    [set(), set(), set(), {'w'}]
    """
    _check_factor(factor, None)
    return [set(kinds) for kinds in _outlier_kinds(fishers, factor)[0]]


def _chunked_median(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The elementwise median of equally long 1-D arrays, in float64, stacked a bounded slice at a time."""
    n = arrays[0].size
    out = np.empty(n, dtype=np.float64)
    step = max(1, _MEDIAN_CHUNK_BYTES // (8 * len(arrays)))
    for lo in range(0, n, step):
        out[lo:lo + step] = np.median(np.stack([a[lo:lo + step].astype(np.float64) for a in arrays]), axis=0)
    return out


def _rank_mapped(f: np.ndarray, values: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """``f`` with its entry of rank ``r`` replaced by ``values[r]``, in ``f``'s float dtype.

    Entries of ``f`` ranked ascending, equal entries by ``tiebreak`` (the other clients' median at
    the same coordinate), so that a flat tensor takes the other clients' ranking.
    """
    arr = np.asarray(f)
    order = np.lexsort((tiebreak, arr.ravel()))
    mapped = np.empty(arr.size, dtype=np.float64)
    mapped[order] = values
    dtype = arr.dtype if np.issubdtype(arr.dtype, np.floating) else np.float64
    return mapped.reshape(arr.shape).astype(dtype)


def _kind(outliers: dict[str, FisherOutlier], name: str) -> str | None:
    """The kind of outlier tensor ``name`` is (None: no outlier)."""
    found = outliers.get(name)
    return None if found is None else found.kind


def _cap_outliers(fishers: Sequence[Model], kinds: list[dict[str, FisherOutlier]], stats: _Summaries,
                  limit: float | None) -> list[dict[str, np.ndarray]]:
    """``rule="outliers"`` given each client's outlier kinds and the summaries they were judged on."""
    out: list[dict[str, np.ndarray]] = [dict(fk) for fk in fishers]
    for name, (means, maxes) in stats.items():
        tops = maxes.copy()  # each client's largest entry once the rule has run
        flat = [k for k in range(len(fishers)) if _kind(kinds[k], name) == "flat"]
        # the reference distribution: the clients that are no outliers, else those that are not flat
        kept = ([j for j in range(len(fishers)) if name not in kinds[j]]
                or [j for j in range(len(fishers)) if _kind(kinds[j], name) != "flat"])
        if flat and kept:  # (every client flat: they are alike, nothing to rank them against)
            kept_arrays = [np.asarray(fishers[j][name]).ravel() for j in kept]
            values = _chunked_median([np.sort(a) for a in kept_arrays])  # the median client's distribution
            tiebreak = _chunked_median(kept_arrays)  # the median client's coordinates
            for k in flat:
                out[k][name] = _rank_mapped(fishers[k][name], values, tiebreak)
                tops[k] = values[-1]
        for k in range(len(fishers)):
            s = 1.0
            if _kind(kinds[k], name) == "inflated":  # its own shape, at the other clients' median magnitude
                ref_mean, ref_max = float(np.median(np.delete(means, k))), float(np.median(np.delete(maxes, k)))
                s = min(ref_mean / means[k] if ref_mean > 0 else 1.0, ref_max / maxes[k] if ref_max > 0 else 1.0)
            if limit is not None and tops[k] * s > limit:
                s = limit / tops[k]
            if s != 1.0:
                out[k][name] = _scaled(out[k][name], s)
    return out


def cap_factors(
    fishers: Sequence[Model], factor: float, limit: float | None = MAX_FISHER_MAGNITUDE
) -> list[dict[str, float]]:
    """The per-client, per-tensor scale :func:`cap_fishers` applies with ``rule="median"`` (1.0: untouched).

    Parameters
    ----------
    fishers : sequence of mapping of str to np.ndarray
        Raw (untempered) finite non-negative diagonal Fishers, one per client, same keys (any
        float dtype; the means are taken in float64, so float32's maximum does not overflow).
    factor : float
        ``c >= 1``: how far above the clients' median a client's Fisher may go.
    limit : float or None
        Largest entry any capped tensor may keep (``None``: no absolute limit).

    Returns
    -------
    list of dict[str, float]
        ``scales[k][name]`` in ``(0, 1]``.

    Raises
    ------
    ValueError
        If ``factor < 1`` or is not finite, or ``limit`` is not a positive finite number.
    """
    _check_factor(factor, limit)
    scales: list[dict[str, float]] = [{} for _ in fishers]
    if not fishers:
        return scales
    for name in fishers[0]:
        means, maxes = _summaries(fishers, name)
        med_mean, med_max = float(np.median(means)), float(np.median(maxes))
        for k in range(len(fishers)):
            s = 1.0
            # A median of 0 gives no reference magnitude (most clients carry no information there).
            if med_mean > 0 and means[k] > factor * med_mean:
                s = min(s, factor * med_mean / means[k])
            if med_max > 0 and maxes[k] > factor * med_max:
                s = min(s, factor * med_max / maxes[k])
            if limit is not None and maxes[k] * s > limit:
                s = min(s, limit / maxes[k])
            scales[k][name] = s
    return scales


def cap_fishers(
    fishers: Sequence[Model],
    factor: float,
    limit: float | None = MAX_FISHER_MAGNITUDE,
    rule: str = DEFAULT_FISHER_CAP_RULE,
) -> list[dict[str, np.ndarray]]:
    """Bound, per tensor, every client's Fisher relative to the other clients' (see the module docstring).

    Parameters
    ----------
    fishers : sequence of mapping of str to np.ndarray
        Raw (untempered) finite non-negative diagonal Fishers, one per client, same keys.
    factor : float
        ``c >= 1``: with ``rule="outliers"``, how far above (or flatter than) the other clients'
        median a tensor may be before it is an outlier; with ``rule="median"``, how far above the
        clients' median any client may stay.
    limit : float or None
        Largest entry any capped tensor may keep: a tensor still above it after the rule is
        scaled down to it (:data:`~fedfiot_flwr.reply_limits.MAX_FISHER_MAGNITUDE` by default;
        ``None``: no absolute limit).
    rule : {"outliers", "median"}
        ``"outliers"``: bring only the inflated or flat tensors to the median client;
        ``"median"``: scale every client above ``factor`` times the median down.

    Returns
    -------
    list of dict[str, np.ndarray]
        The capped Fishers (unchanged tensors are the input arrays themselves; a changed tensor is
        computed in float64 and keeps its float dtype).

    Raises
    ------
    ValueError
        If ``factor < 1`` or is not finite, ``limit`` is not a positive finite number, or ``rule``
        is unknown.

    Examples
    --------
    >>> honest = [{"w": np.array([1.0, 2.0])}, {"w": np.array([2.0, 1.0])}, {"w": np.array([1.5, 1.5])}]
    >>> inflated = [*honest, {"w": np.array([1e3, 2e3])}]
    >>> capped = cap_fishers(inflated, 4.0)  # the outlier rule
    >>> [float(x) for x in capped[3]["w"]], capped[0]["w"] is honest[0]["w"]
    ([1.0, 2.0], True)

    The inflated client keeps its shape at the other clients' median magnitude; the honest
    clients are untouched. The median rule scales it to ``c`` times the clients' median instead:

    >>> [float(x) for x in cap_fishers(inflated, 4.0, rule="median")[3]["w"]]
    [4.0, 8.0]
    """
    return cap_fishers_reporting(fishers, factor, limit, rule)[0]


def cap_fishers_reporting(
    fishers: Sequence[Model],
    factor: float,
    limit: float | None = MAX_FISHER_MAGNITUDE,
    rule: str = DEFAULT_FISHER_CAP_RULE,
) -> tuple[list[dict[str, np.ndarray]], list[set[str]]]:
    """:func:`cap_fishers` and, found on the same pass, each client's changed tensors.

    :func:`cap_fishers_explained` also says why and by how much.

    Returns
    -------
    capped : list of dict[str, np.ndarray]
        As :func:`cap_fishers`.
    outliers : list of set of str
        With ``rule="outliers"``, :func:`fisher_outliers`; with ``rule="median"``, the tensors
        the cap scaled (absolute limit included).

    Examples
    --------
    >>> honest = [{"w": np.array([1.0, 2.0])}, {"w": np.array([2.0, 1.0])}, {"w": np.array([1.5, 1.5])}]
    >>> cap_fishers_reporting([*honest, {"w": np.array([1e3, 2e3])}], 4.0)[1]
    [set(), set(), set(), {'w'}]
    """
    capped, outliers = cap_fishers_explained(fishers, factor, limit, rule)
    return capped, [set(found) for found in outliers]


def cap_fishers_explained(
    fishers: Sequence[Model],
    factor: float,
    limit: float | None = MAX_FISHER_MAGNITUDE,
    rule: str = DEFAULT_FISHER_CAP_RULE,
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, FisherOutlier]]]:
    """:func:`cap_fishers` and, found on the same pass, each client's outlier tensors with why and how far.

    With ``rule="median"`` every scaled tensor is reported as ``"scaled"`` (absolute limit included).

    Examples
    --------
    >>> honest = [{"w": np.array([1.0, 2.0])}, {"w": np.array([2.0, 1.0])}, {"w": np.array([1.5, 1.5])}]
    >>> cap_fishers_explained([*honest, {"w": np.array([1e3, 2e3])}], 4.0)[1][3]
    {'w': FisherOutlier(kind='inflated', ratio=1000.0)}
    """
    if rule not in FISHER_CAP_RULES:
        raise ValueError(f"the Fisher cap rule must be one of {FISHER_CAP_RULES}, got {rule!r}")
    if rule == "outliers":
        _check_factor(factor, limit)
        kinds, stats = _outlier_kinds(fishers, factor)
        return _cap_outliers(fishers, kinds, stats, limit), kinds
    scales = cap_factors(fishers, factor, limit)
    capped = [
        {name: (f if scales[k][name] == 1.0 else _scaled(f, scales[k][name])) for name, f in fk.items()}
        for k, fk in enumerate(fishers)
    ]
    return capped, [{name: FisherOutlier("scaled", 1.0 / sc) for name, sc in client.items() if sc != 1.0}
                    for client in scales]


def describe_outliers(client_ids: Sequence[str], outliers: Sequence[dict[str, FisherOutlier]], factor: float) -> str | None:
    """The one warning line of a round where ``rule="outliers"`` changed some client's Fisher (None: none).

    It names each client, its tensors and how far they are off, says what the rule did, and that
    it is a robustness rule rather than a finding against the client.

    Examples
    --------
    >>> print(describe_outliers(["a", "b", "c"], [{}, {}, {"w": FisherOutlier("inflated", 1e3)}], 4.0))
    FedFiOT robust Fisher cap (fisher_cap=4): client c's Fisher is more than 4 times above the other clients' \
median in w (1e+03 times), so it keeps its own shape at their median magnitude. This is a robustness rule, \
not an accusation: a client whose data differ from the others' can trip it too (fisher_cap=None turns it off).
    """
    parts = []
    for k, (cid, found) in enumerate(zip(client_ids, outliers)):
        others = ("the other clients' median" if len(client_ids) > 2
                  else f"client {client_ids[1 - k]}'s" if len(client_ids) == 2 else "the others'")
        for kind, verb, does in (("inflated", "above", "so it keeps its own shape at their median magnitude"),
                                 ("flat", "flatter than", "so it takes the median client's values in its own order")):
            names = sorted(n for n, o in found.items() if o.kind == kind)
            if names:
                where = ", ".join(f"{n} ({found[n].ratio:.3g} times)" for n in names)
                if len(client_ids) == 2:
                    does = does.replace("their median magnitude", f"client {client_ids[1 - k]}'s magnitude").replace(
                        "the median client's values", f"client {client_ids[1 - k]}'s values")
                parts.append(f"client {cid}'s Fisher is more than {factor:g} times {verb} {others} in {where}, {does}")
    if not parts:
        return None
    pair = " (with two clients, each is compared with the other alone)" if len(client_ids) == 2 else ""
    return (f"FedFiOT robust Fisher cap (fisher_cap={factor:g}){pair}: " + "; ".join(parts)
            + ". This is a robustness rule, not an accusation: a client whose data differ from the others' can trip "
              "it too (fisher_cap=None turns it off).")


def _scaled(f: np.ndarray, scale: float) -> np.ndarray:
    """``scale * f`` computed in float64 (a float32 scale of 1e-40 would be denormal), in ``f``'s float dtype."""
    arr = np.asarray(f)
    out = arr.astype(np.float64) * scale
    return out.astype(arr.dtype) if np.issubdtype(arr.dtype, np.floating) else out


def weight_shares(fishers: Sequence[Model], rho: float = DEFAULT_RHO, lam: float = DEFAULT_LAM) -> np.ndarray:
    """Each client's mean share of the per-coordinate merge weight ``(F**rho + lam) / sum_j (F_j**rho + lam)``.

    The share a client holds in the Fisher-weighted average of one coordinate (before alignment),
    averaged over every coordinate of every tensor.

    Parameters
    ----------
    fishers : sequence of mapping of str to np.ndarray
        Diagonal Fishers (capped or not), one per client, same keys and shapes.
    rho, lam : float
        Tempering exponent and damping of the merge.

    Returns
    -------
    np.ndarray
        ``(K,)`` shares summing to 1.

    Examples
    --------
    >>> weight_shares([{"w": np.ones(3)}, {"w": np.ones(3)}]).tolist()
    [0.5, 0.5]
    """
    total = np.zeros(len(fishers))
    count = 0
    for name in fishers[0]:
        tempered = np.stack([np.power(np.asarray(f[name], dtype=np.float64), rho) + lam for f in fishers])
        shares = tempered / tempered.sum(axis=0, keepdims=True)
        total += shares.reshape(len(fishers), -1).sum(axis=1)
        count += shares[0].size
    return total / max(count, 1)
