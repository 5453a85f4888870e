"""Robust Fisher weighting: one client cannot take over the merge by inflating its Fisher.

The merge weights every coordinate of every client by its (tempered, damped) diagonal Fisher,
so a client that multiplies its Fisher by ``1e3`` owns almost every coordinate. The reply bounds
(:mod:`fedfiot_flwr.reply_limits`) reject absurd magnitudes, but a large factor inside the bounds
remains. :func:`cap_fishers` bounds each client's Fisher *relative to the other clients*, per
tensor, before tempering:

    s_k = min(1, c * median_j(mean F_j) / mean F_k, c * median_j(max F_j) / max F_k),
    F_k <- s_k F_k,

so no client's tensor has a mean or a largest entry above ``c`` times the clients' median. A
client whose Fisher is within ``c`` times the median is left untouched; an inflated client keeps
its own shape but the magnitude of a client ``c`` times the median. With the default ``c = 1``
every client above the median is brought down to it.

A server that caps accepts any finite Fisher, up to float32's maximum (the reply bounds do not
exclude it, :func:`fedfiot_flwr.reply_limits.fisher_bound_for`), so the cap is computed in float64
and also scales every tensor whose largest entry is still above
:data:`~fedfiot_flwr.reply_limits.MAX_FISHER_MAGNITUDE` down to it (which only happens when half
the clients or more send such a Fisher, or when the median is 0). The capped Fishers are thus
within the bound a server without the cap enforces, and nothing downstream (tempering, size
scaling, float32 cost matrices, the torch backend) sees a larger value.

What it does not defend against: a coalition holding half of the clients (it moves the median);
two-client rounds (the median of two is their mean); inflation of single coordinates below
``c`` times the median maximum; and weight poisoning (a client sending harmful *weights* with an
honest-looking Fisher), which is a separate threat addressed by Byzantine-robust aggregation
(e.g. Flower's ``FedMedian``, ``FedTrimmedAvg``, ``Krum``, ``Bulyan``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedfiot_flwr.options import ModelView as Model

from ..reply_limits import MAX_FISHER_MAGNITUDE

__all__ = ["DEFAULT_FISHER_CAP", "cap_fishers", "cap_factors", "weight_shares"]

DEFAULT_FISHER_CAP: float = 1.0
"""``c`` of the default preset: no client's Fisher may exceed the clients' median (per tensor, in
mean and in largest entry). Measured in ``benchmarks/results/fisher_inflation*.md``: under two
points lost to a 1e3, 1e6 or float32-maximum inflation of any one client on digits and
Fashion-MNIST, where ``c = 2`` lost 8 points on Fashion-MNIST (1e3)."""



def cap_factors(
    fishers: Sequence[Model], factor: float, limit: float | None = MAX_FISHER_MAGNITUDE
) -> list[dict[str, float]]:
    """The per-client, per-tensor scale :func:`cap_fishers` applies (1.0: untouched).

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
    if not (np.isfinite(factor) and factor >= 1.0):
        raise ValueError(f"the Fisher cap factor must be a finite number >= 1, got {factor!r}")
    if limit is not None and not (np.isfinite(limit) and limit > 0):
        raise ValueError(f"the Fisher cap limit must be a positive finite number or None, got {limit!r}")
    scales: list[dict[str, float]] = [{} for _ in fishers]
    if not fishers:
        return scales
    for name in fishers[0]:
        means = np.array([float(np.mean(f[name], dtype=np.float64)) if np.size(f[name]) else 0.0 for f in fishers])
        maxes = np.array([float(np.max(f[name])) if np.size(f[name]) else 0.0 for f in fishers])
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
    fishers: Sequence[Model], factor: float, limit: float | None = MAX_FISHER_MAGNITUDE
) -> list[dict[str, np.ndarray]]:
    """Scale down, per tensor, every client whose Fisher exceeds ``factor`` times the clients' median.

    Parameters
    ----------
    fishers : sequence of mapping of str to np.ndarray
        Raw (untempered) finite non-negative diagonal Fishers, one per client, same keys.
    factor : float
        ``c >= 1`` (see the module docstring).
    limit : float or None
        Largest entry any capped tensor may keep: a tensor still above it after the relative
        cap is scaled down to it (:data:`~fedfiot_flwr.reply_limits.MAX_FISHER_MAGNITUDE` by
        default; ``None``: no absolute limit).

    Returns
    -------
    list of dict[str, np.ndarray]
        The capped Fishers (unchanged tensors are the input arrays themselves; a scaled tensor is
        multiplied in float64 and keeps its dtype).

    Examples
    --------
    >>> honest = [{"w": np.array([1.0, 2.0])}, {"w": np.array([2.0, 1.0])}, {"w": np.array([1.5, 1.5])}]
    >>> inflated = [*honest, {"w": np.array([1e3, 2e3])}]
    >>> [float(x) for x in cap_fishers(inflated, 4.0)[3]["w"]]
    [4.0, 8.0]
    """
    scales = cap_factors(fishers, factor, limit)
    return [
        {name: (f if scales[k][name] == 1.0 else _scaled(f, scales[k][name])) for name, f in fk.items()}
        for k, fk in enumerate(fishers)
    ]


def _scaled(f: np.ndarray, scale: float) -> np.ndarray:
    """``scale * f`` computed in float64 (a float32 scale of 1e-40 would be denormal), in ``f``'s float dtype."""
    arr = np.asarray(f)
    out = arr.astype(np.float64) * scale
    return out.astype(arr.dtype) if np.issubdtype(arr.dtype, np.floating) else out


def weight_shares(fishers: Sequence[Model], rho: float = 0.5, lam: float = 1e-4) -> np.ndarray:
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
