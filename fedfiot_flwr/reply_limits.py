"""The bounds every client reply must respect, in one place, and the small checks that apply them.

A reply outside these bounds is excluded from the round with a reason naming the client and
the tensor (see ``docs/robustness.md``). The bounds are absolute: they reject values no honest
client produces and that would break the server's arithmetic. How much one *valid* client may
weigh relative to the others is bounded separately, by the robust weighting of
:mod:`fedfiot_flwr.merge.robust`.

The limits
----------
:data:`MAX_NUM_EXAMPLES`
    ``num-examples`` must be a positive integer ``<= 10**9``. Python/NumPy ints are accepted,
    and so are floats holding an integer value within the bound (``57.0``); booleans, lists,
    NaN, infinities, fractions and anything larger are rejected, so no Python big int ever
    reaches NumPy.
:data:`MAX_WEIGHT_MAGNITUDE`
    Largest ``|entry|`` of a weight or a floating-point buffer, i.e. its quantisation scale:
    ``1e6``. Trained weights and BatchNorm statistics of normalised inputs stay far below it.
:data:`MAX_FISHER_MAGNITUDE`
    Largest diagonal Fisher entry (its quantisation scale): ``1e8``, a mean squared
    per-example gradient of ``1e4`` per coordinate, far beyond a converging client's. It
    applies where the server merges the Fishers as uploaded (the paper configuration). Where
    the server applies the robust Fisher cap, a finite Fisher of any size (up to float32's
    maximum) is accepted: the cap brings it to the clients' median, and never above this bound,
    before the merge reads it (:func:`fisher_bound_for`).
:data:`MAX_CURVATURE_MAGNITUDE`
    Largest ``|entry|`` of a K-FAC factor or RegMean Gram rebuilt from its 8-bit codes: ``1e8``.
:data:`MAX_INTEGER_BUFFER`
    Largest ``|entry|`` of an integer buffer (``num_batches_tracked``): ``2**53``, the largest
    integer a float64 average still represents exactly.

Replies that are not bounded by a number
-----------------------------------------
- One reply per node and round: the first reply of a node is the one that counts; every later
  reply of the same node (a replay or a different content) is excluded as a duplicate.
- Records other than the ones the wire format defines (an unknown ArrayRecord, ConfigRecord or
  MetricRecord) are ignored: never read, so they cannot change the merge.
- Unknown metric keys are kept as reported metrics only (they never enter the merge); a metric
  that is not a finite number (NaN, inf, a list) is dropped from the reported metrics.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

__all__ = [
    "MAX_CURVATURE_MAGNITUDE",
    "MAX_FISHER_MAGNITUDE",
    "MAX_INTEGER_BUFFER",
    "MAX_NUM_EXAMPLES",
    "MAX_WEIGHT_MAGNITUDE",
    "check_magnitude",
    "finite_metric",
    "fisher_bound_for",
    "parse_num_examples",
]

MAX_NUM_EXAMPLES: int = 10**9
"""Largest accepted ``num-examples`` of one client."""

MAX_WEIGHT_MAGNITUDE: float = 1e6
"""Largest accepted ``|entry|`` (quantisation scale) of a weight or a floating-point buffer."""

MAX_FISHER_MAGNITUDE: float = 1e8
"""Largest accepted diagonal Fisher entry (quantisation scale of a Fisher)."""

MAX_CURVATURE_MAGNITUDE: float = 1e8
"""Largest accepted ``|entry|`` of a rebuilt K-FAC factor or RegMean Gram."""

MAX_INTEGER_BUFFER: int = 2**53
"""Largest accepted ``|entry|`` of an integer buffer (``num_batches_tracked``)."""


def parse_num_examples(raw: Any, who: str) -> int:
    """Return ``raw`` as a positive int within :data:`MAX_NUM_EXAMPLES`, or raise.

    Parameters
    ----------
    raw : Any
        The value a reply reported.
    who : str
        Prefix of the error message (e.g. ``"client 3"``).

    Returns
    -------
    int
        The number of examples.

    Raises
    ------
    ValueError
        Unless ``raw`` is an int, or a float with an integer value, in ``[1, MAX_NUM_EXAMPLES]``.

    Examples
    --------
    >>> parse_num_examples(57.0, "client 1")
    57
    >>> parse_num_examples(1e20, "client 1")
    Traceback (most recent call last):
    ...
    ValueError: client 1: num-examples must be a positive integer <= 1000000000, got 1e+20
    """
    value: int | None = None
    if isinstance(raw, Integral) and not isinstance(raw, bool):
        value = int(raw)
    elif isinstance(raw, Real) and not isinstance(raw, bool) and math.isfinite(float(raw)):
        as_float = float(raw)
        if as_float.is_integer() and abs(as_float) <= MAX_NUM_EXAMPLES:
            value = int(as_float)
    if value is None or not 1 <= value <= MAX_NUM_EXAMPLES:
        raise ValueError(f"{who}: num-examples must be a positive integer <= {MAX_NUM_EXAMPLES}, got {raw!r}")
    return value


def fisher_bound_for(fisher_cap: float | None) -> float | None:
    """The largest Fisher entry a reply may carry when the server merges with ``fisher_cap``.

    Parameters
    ----------
    fisher_cap : float or None
        The robust cap factor the server applies (:func:`fedfiot_flwr.merge.robust.cap_fishers`);
        ``None`` or 0: the Fishers are merged as uploaded.

    Returns
    -------
    float or None
        :data:`MAX_FISHER_MAGNITUDE` without a cap; ``None`` (any finite value) with one, since
        the cap scales an inflated Fisher down to the clients' median and never leaves an entry
        above :data:`MAX_FISHER_MAGNITUDE`.

    Examples
    --------
    >>> fisher_bound_for(None) == MAX_FISHER_MAGNITUDE, fisher_bound_for(1.0)
    (True, None)
    """
    return None if fisher_cap else MAX_FISHER_MAGNITUDE


def check_magnitude(largest: float, limit: float | None, what: str) -> None:
    """Raise unless ``largest`` is finite and ``0 <= largest <= limit`` (NaN fails).

    Parameters
    ----------
    largest : float
        A tensor's largest ``|entry|`` (or its quantisation scale).
    limit : float or None
        The bound (one of this module's constants); ``None``: any finite non-negative value.
    what : str
        Names the client and tensor in the error.

    Raises
    ------
    ValueError
        When ``largest`` is NaN, negative, infinite or above ``limit``.
    """
    if not (math.isfinite(largest) and largest >= 0.0):
        raise ValueError(f"{what}: magnitude {largest!r} is not a finite non-negative number")
    if limit is not None and largest > limit:
        raise ValueError(f"{what}: magnitude {largest!r} is outside [0, {limit:g}]")


def finite_metric(value: Any) -> float | None:
    """A reported metric as a float, or ``None`` when it is not a finite number (then it is dropped)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    try:
        out = float(value)
    except OverflowError:
        return None
    return out if math.isfinite(out) else None
