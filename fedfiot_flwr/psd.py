"""Curvature records and their 8-bit low-rank code (numpy only; shared by the client and the wire).

K-FAC factors (FedFisher) and input Grams (RegMean) are symmetric PSD matrices. An upload
compresses each one ``M`` (``n x n``) as ``M ~= L L^T`` with ``L = V_r diag(sqrt(lambda_r))``
from its top-``r`` eigenpairs, each column of ``L`` stored as signed 8-bit codes
(``[-127, 127]``) plus one float32 scale: ``n r + 4 r`` bytes. The reconstruction
``L_hat L_hat^T`` is PSD by construction. :func:`rank_for_budget` picks the largest rank shared
by all factors that fits a byte budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import scipy.linalg

__all__ = [
    "CODE_LEVELS",
    "CompressedPSD",
    "InputGram",
    "KFACFactors",
    "compress_psd",
    "compressed_nbytes",
    "decompress_psd",
    "layer_matrix",
    "psd_root",
    "rank_for_budget",
]

CODE_LEVELS: int = 127
"""Positive levels of the 8-bit factor codes (codes lie in ``[-127, 127]``)."""


# ------------------------------------------------------------------------------ records


@dataclass(frozen=True)
class KFACFactors:
    """K-FAC factors of one Linear or Conv2d layer.

    Attributes
    ----------
    weight : str
        State-dict key of the layer's weight.
    bias : str or None
        State-dict key of its bias (``None`` without one). When set, ``A`` is augmented:
        its last row/column belongs to the bias (an input of ones).
    A : np.ndarray
        ``(d_in [+1], d_in [+1])`` input factor (float64, symmetric PSD).
    G : np.ndarray
        ``(d_out, d_out)`` output-gradient factor (float64, symmetric PSD).
    A_root, G_root : np.ndarray or None
        Optional low-rank roots, ``(n, r)`` with ``A = A_root A_root^T`` (``G`` likewise):
        a decoded upload carries its factors' dequantized 8-bit codes here
        (:func:`decompress_psd` builds ``A`` from them), so that a server can apply a rank-``r``
        factor to a matrix in ``O(n r)`` per column instead of ``O(n^2)``
        (:func:`fedfiot_flwr.baselines.fedfisher_kfac`). ``None``: only the dense factor is known.
    """

    weight: str
    bias: str | None
    A: np.ndarray
    G: np.ndarray
    A_root: np.ndarray | None = None
    G_root: np.ndarray | None = None


@dataclass(frozen=True)
class InputGram:
    """RegMean's Gram matrix of one Linear layer's inputs.

    Attributes
    ----------
    weight : str
        State-dict key of the layer's weight.
    bias : str or None
        State-dict key of its bias; when set the Gram is augmented with an input of ones
        (last row/column), so RegMean solves for ``[W b]`` jointly.
    gram : np.ndarray
        ``(d_in [+1], d_in [+1])`` mean of ``x x^T`` over the client's inputs (float64).
    output : np.ndarray or None
        ``(d_out,)`` K-FAC's diagonal output factor: per output unit, the mean over the client's examples of
        the squared loss gradient with respect to the unit's pre-activation, summed over a convolution's
        positions (the empirical Fisher of a bias on that unit). ``None``: only the input Gram was sent.
    """

    weight: str
    bias: str | None
    gram: np.ndarray
    output: np.ndarray | None = None


@dataclass(frozen=True)
class CompressedPSD:
    """A symmetric PSD matrix ``M ~= L L^T`` with ``L`` stored as 8-bit codes.

    Attributes
    ----------
    codes : np.ndarray
        ``(n, r)`` int8 codes of ``L``, in ``[-CODE_LEVELS, CODE_LEVELS]``.
    scales : np.ndarray
        ``(r,)`` float32 per-column scales (``max |L[:, j]|``).
    """

    codes: np.ndarray
    scales: np.ndarray

    @property
    def size(self) -> int:
        """``n``: the matrix is ``n x n``."""
        return int(self.codes.shape[0])

    @property
    def rank(self) -> int:
        """``r``: number of kept eigenpairs."""
        return int(self.codes.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of the payload (codes and scales)."""
        return int(self.codes.nbytes + self.scales.nbytes)


# ------------------------------------------------------------------------- compression


def _check_square(m: np.ndarray, name: str) -> np.ndarray:
    arr = np.asarray(m, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] != arr.shape[1]:
        raise ValueError(f"{name!r}: expected a square matrix, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name!r}: the matrix contains NaN or infinite values")
    return arr


def compress_psd(m: np.ndarray, rank: int | None = None, name: str = "factor") -> CompressedPSD:
    """Truncated eigendecomposition + 8-bit codes of a symmetric PSD matrix.

    Parameters
    ----------
    m : np.ndarray
        ``(n, n)`` symmetric PSD matrix (symmetrised; negative eigenvalues from rounding are
        clipped to zero).
    rank : int, optional
        Eigenpairs to keep (``min(rank, n)``); ``None`` keeps all ``n``.
    name : str
        Used in error messages.

    Returns
    -------
    CompressedPSD
        ``n r + 4 r`` bytes; :func:`decompress_psd` rebuilds ``L_hat L_hat^T``.

    Raises
    ------
    ValueError
        On a non-square or non-finite matrix or a negative rank.
    """
    arr = _check_square(m, name)
    n = arr.shape[0]
    if rank is not None and int(rank) < 0:
        raise ValueError(f"{name!r}: rank must be >= 0, got {rank}")
    r = n if rank is None else min(int(rank), n)
    if r == 0 or n == 0:
        return CompressedPSD(np.zeros((n, 0), dtype=np.int8), np.zeros(0, dtype=np.float32))
    sym = (arr + arr.T) / 2.0
    vals, vecs = np.linalg.eigh(sym)  # the full divide-and-conquer solve is faster than a subset's
    vals, vecs = vals[n - r:], vecs[:, n - r:]
    factor = vecs * np.sqrt(np.clip(vals, 0.0, None))  # (n, r), ascending eigenvalues
    factor = factor[:, ::-1]
    scales = np.abs(factor).max(axis=0).astype(np.float32)
    safe = np.where(scales > 0, scales.astype(np.float64), 1.0)
    codes = np.clip(np.rint(factor / safe * CODE_LEVELS), -CODE_LEVELS, CODE_LEVELS).astype(np.int8)
    return CompressedPSD(codes, scales)


def decompress_psd(c: CompressedPSD, name: str = "factor") -> np.ndarray:
    """Rebuild ``L_hat L_hat^T`` (float64) from :func:`compress_psd`'s output.

    Raises
    ------
    ValueError
        On codes that are not int8 in ``[-127, 127]``, or scales of the wrong length,
        negative or non-finite.
    """
    factor = psd_root(c, name)
    return factor @ factor.T


def psd_root(c: CompressedPSD, name: str = "factor") -> np.ndarray:
    """The dequantized ``(n, r)`` root ``L_hat`` of :func:`compress_psd`'s output (float64):
    :func:`decompress_psd` returns ``L_hat L_hat^T``.

    Raises
    ------
    ValueError
        As :func:`decompress_psd`.

    Examples
    --------
    >>> c = compress_psd(np.diag([4.0, 1.0]), rank=1)
    >>> np.abs(psd_root(c)).ravel().tolist(), decompress_psd(c).tolist()
    ([2.0, 0.0], [[4.0, 0.0], [0.0, 0.0]])
    """
    codes = np.asarray(c.codes)
    scales = np.asarray(c.scales)
    if codes.ndim != 2 or codes.dtype != np.int8:
        raise ValueError(f"{name!r}: codes must be a 2-D int8 array, got {codes.dtype} {codes.shape}")
    if codes.size and int(codes.min()) < -CODE_LEVELS:
        raise ValueError(f"{name!r}: code -128 is outside [-{CODE_LEVELS}, {CODE_LEVELS}]")
    if scales.shape != (codes.shape[1],):
        raise ValueError(f"{name!r}: {scales.shape} scales for {codes.shape[1]} columns")
    if not np.all(np.isfinite(scales)) or np.any(scales < 0):
        raise ValueError(f"{name!r}: scales must be finite and non-negative")
    return codes.astype(np.float64) * (scales.astype(np.float64) / CODE_LEVELS)


def compressed_nbytes(size: int, rank: int | None) -> int:
    """Bytes of :func:`compress_psd`'s payload for an ``size x size`` matrix."""
    r = size if rank is None else min(int(rank), int(size))
    return int(size * r + 4 * r)


def rank_for_budget(sizes: Sequence[int], budget_bytes: int) -> int:
    """Largest rank ``r`` such that the factors, each kept at ``min(n, r)``, fit the budget.

    Parameters
    ----------
    sizes : sequence of int
        ``n`` of every factor to upload.
    budget_bytes : int
        Bytes available for all factors together.

    Returns
    -------
    int
        The shared rank cap (``max(sizes)`` when everything fits uncompressed in rank, 0 when
        not even rank 1 fits).
    """
    sizes = [int(s) for s in sizes]
    if not sizes:
        return 0

    def cost(r: int) -> int:
        return sum(compressed_nbytes(s, r) for s in sizes)

    lo, hi = 0, max(sizes)
    if cost(hi) <= budget_bytes:
        return hi
    while lo < hi:  # cost is non-decreasing in r
        mid = (lo + hi + 1) // 2
        if cost(mid) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def layer_matrix(weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """The ``d_out x (d_in [+1])`` matrix ``[W b]`` the factors act on.

    A convolution's ``(C_out, C_in, k_h, k_w)`` weight is flattened to
    ``(C_out, C_in k_h k_w)`` (``F.unfold``'s patch order); a bias becomes the last column.

    Parameters
    ----------
    weight : np.ndarray
        Layer weight (2-D or 4-D).
    bias : np.ndarray, optional
        Layer bias of length ``d_out``.

    Returns
    -------
    np.ndarray
    """
    w = np.asarray(weight)
    w2 = w.reshape(w.shape[0], -1)
    if bias is None:
        return w2
    return np.concatenate([w2, np.asarray(bias, dtype=w2.dtype).reshape(-1, 1)], axis=1)
