"""Layer-wise uniform 16-bit quantizer of FedFiOT uploads (the paper's eq. 107).

Each tensor ``x`` is sent as signed 16-bit codes plus one float32 scale,

    s = ||x||_inf,   c_i = round(l_q * x_i / s),   Q(x)_i = s * c_i / l_q,

with ``l_q = 2**15 - 1`` so that every code lies in ``[-l_q, l_q]`` (the int16 value
``-32768`` is never produced and is rejected on decoding). Rounding to nearest gives the
error bound ``||x - Q(x)||_inf <= ||x||_inf / (2 l_q)``. A zero tensor is sent with scale
0 and all-zero codes; a tensor with a single non-zero value round-trips exactly.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["LEVELS", "quantize", "dequantize", "check_codes"]

LEVELS: int = 2**15 - 1
"""Number of positive quantization levels ``l_q`` (codes lie in ``[-LEVELS, LEVELS]``)."""

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _as_numpy(x: object) -> np.ndarray:
    """Return ``x`` as a NumPy array (detaching and moving torch tensors to the CPU)."""
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        x = x.detach().cpu().numpy()  # type: ignore[attr-defined]
    return np.asarray(x)


def quantize(x: npt.ArrayLike, name: str = "tensor") -> tuple[np.ndarray, np.float32]:
    """Quantize one tensor to int16 codes and a float32 scale (eq. 107).

    Parameters
    ----------
    x : array_like
        Real-valued tensor (NumPy array or torch tensor) of any shape. Must be finite.
    name : str, optional
        Name used in error messages.

    Returns
    -------
    codes : np.ndarray
        ``int16`` array of ``x``'s shape with values in ``[-LEVELS, LEVELS]``.
    scale : np.float32
        ``||x||_inf`` as float32 (rounded up if ``x`` is float64, so that ``|x| <= scale``);
        0 for an all-zero or empty tensor.

    Raises
    ------
    ValueError
        If ``x`` is not real-valued, contains NaN or infinity, or its largest magnitude does
        not fit in float32.
    """
    arr = _as_numpy(x)
    if arr.dtype == np.bool_ or not (
        np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)
    ):
        raise ValueError(f"cannot quantize {name!r}: dtype {arr.dtype} is not real-valued")
    x64 = arr.astype(np.float64, copy=False)
    if not np.all(np.isfinite(x64)):
        raise ValueError(f"cannot quantize {name!r}: it contains NaN or infinite values")
    if x64.size == 0:
        return np.zeros(arr.shape, dtype=np.int16), np.float32(0.0)
    amax = float(np.max(np.abs(x64)))
    if amax == 0.0:
        return np.zeros(arr.shape, dtype=np.int16), np.float32(0.0)
    if amax > _FLOAT32_MAX:
        raise ValueError(f"cannot quantize {name!r}: max |x| = {amax:g} overflows float32")
    scale = np.float32(amax)
    if float(scale) < amax:  # float64 input: round the scale up so that |x| / scale <= 1
        scale = np.nextafter(scale, np.float32(np.inf))
    s = float(scale)
    codes = np.rint(x64 / s * LEVELS)
    np.clip(codes, -LEVELS, LEVELS, out=codes)
    return codes.astype(np.int16), scale


def check_codes(codes: np.ndarray, scale: float, name: str = "tensor", max_scale: float | None = None) -> None:
    """Validate quantized codes and their scale.

    Parameters
    ----------
    codes : np.ndarray
        Integer codes; must be of an integer dtype with values in ``[-LEVELS, LEVELS]``.
    scale : float
        Scale; must be finite and ``>= 0``.
    name : str, optional
        Name used in error messages.
    max_scale : float, optional
        Largest accepted scale (the bounds of :mod:`fedfiot_flwr.reply_limits`); ``None``: any
        finite scale.

    Raises
    ------
    ValueError
        On a non-integer dtype, codes out of range, a negative / non-finite scale, a scale
        above ``max_scale``, or a zero scale with non-zero codes.
    """
    if not np.issubdtype(codes.dtype, np.integer):
        raise ValueError(f"{name!r}: codes have dtype {codes.dtype}, expected int16")
    if codes.size and (int(codes.min()) < -LEVELS or int(codes.max()) > LEVELS):
        raise ValueError(
            f"{name!r}: codes out of range [{-LEVELS}, {LEVELS}] "
            f"(min {int(codes.min())}, max {int(codes.max())})"
        )
    s = float(scale)
    if not np.isfinite(s) or s < 0.0:
        raise ValueError(f"{name!r}: scale {s!r} is not a finite non-negative number")
    if max_scale is not None and s > max_scale:
        raise ValueError(f"{name!r}: scale {s:g} exceeds the bound {max_scale:g}")
    if s == 0.0 and codes.size and np.any(codes != 0):
        raise ValueError(f"{name!r}: scale 0 with non-zero codes")


def dequantize(
    codes: np.ndarray,
    scale: float | np.floating,
    dtype: npt.DTypeLike = np.float64,
    name: str = "tensor",
    max_scale: float | None = None,
) -> np.ndarray:
    """Invert :func:`quantize`: ``Q(x) = scale * codes / LEVELS``.

    Parameters
    ----------
    codes : np.ndarray
        Integer codes in ``[-LEVELS, LEVELS]`` (as returned by :func:`quantize`).
    scale : float
        The float32 scale returned by :func:`quantize`.
    dtype : numpy dtype, optional
        Output dtype. The default float64 keeps the eq. 107 error bound exact
        (float32 output adds up to half a float32 ulp of rounding).
    name : str, optional
        Name used in error messages.
    max_scale : float, optional
        Largest accepted scale (see :func:`check_codes`). Since ``|codes| <= LEVELS``, it bounds
        every ``|entry|`` of the result: no second pass over the output is needed.

    Returns
    -------
    np.ndarray
        The dequantized tensor, of ``codes``' shape.

    Raises
    ------
    ValueError
        On codes out of range, a non-integer dtype, a negative / non-finite scale or one above
        ``max_scale``.
    """
    codes = np.asarray(codes)
    check_codes(codes, float(scale), name, max_scale=max_scale)
    # codes * scale is exact in float64 (16 x 24 significant bits); one rounding for / LEVELS.
    out = codes.astype(np.float64) * float(np.float32(scale)) / LEVELS
    return out.astype(dtype, copy=False)
