"""Post-merge refinement on server data: the linear algebra (NumPy/SciPy only, no torch, no Flower).

After alignment and aggregation the merged network's hidden activations drift away from the
clients' (variance collapse, mean shift); the error compounds layer after layer. Two
corrections, each applied layer by layer on activations the server computes on its own data
(:mod:`fedfiot_flwr.refine.ops` runs the models):

* **REPAIR** (Jordan et al., 2023): rescale each merged neuron so that its pre-activation
  mean and standard deviation match the (aligned) clients' average; folded into the weights
  (the row scale) and, when the layer has one, the bias (the shift). A bias-free layer can
  take only the scale.
* **Least-squares refinement** (PLeaS-style, RegMean's closed form): choose the layer's
  weights so that the merged model's own inputs to that layer reproduce the mean of the
  aligned clients' outputs, with a ridge pulling toward the merged weights::

      W* = argmin_W ||X W^T - Y||^2 + r s ||W - W0||^2,    s = trace(X^T X) / d,

  i.e. ``W* = (Y^T X + r s W0) (X^T X + r s I)^-1``. ``r`` is relative to the mean input
  energy ``s``, so one grid fits every layer.

Statistics come in as accumulated sums (:class:`LayerMoments`), so the caller can stream
batches and never hold a layer's inputs in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.linalg

__all__ = [
    "LayerMoments",
    "NeuronStats",
    "reconstruction_error",
    "repair_rescale",
    "ridge_refit",
]


@dataclass
class LayerMoments:
    """Running sums of one layer's least-squares problem: ``X^T X``, ``Y^T X``, ``Y^T Y`` and the row count.

    Attributes
    ----------
    d_in, d_out : int
        Input features (bias column included when the layer has one) and output neurons.
    xtx : np.ndarray
        ``(d_in, d_in)`` sum of ``x x^T`` over rows.
    ytx : np.ndarray
        ``(d_out, d_in)`` sum of ``y x^T``.
    yty : float
        Sum of ``||y||^2`` (for the reconstruction error).
    rows : int
        Rows accumulated (examples x spatial positions for a convolution).
    """

    d_in: int
    d_out: int
    xtx: np.ndarray = field(init=False)
    ytx: np.ndarray = field(init=False)
    yty: float = 0.0
    rows: int = 0

    def __post_init__(self) -> None:
        self.xtx = np.zeros((self.d_in, self.d_in))
        self.ytx = np.zeros((self.d_out, self.d_in))

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """Accumulate rows ``x`` ``(n, d_in)`` and their targets ``y`` ``(n, d_out)``.

        Raises
        ------
        ValueError
            On shape mismatches or non-finite values (the message says which).
        """
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.d_in:
            raise ValueError(f"inputs must be (rows, {self.d_in}), got {x.shape}")
        if y.shape != (x.shape[0], self.d_out):
            raise ValueError(f"targets must be ({x.shape[0]}, {self.d_out}), got {y.shape}")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
            raise ValueError("non-finite inputs or targets in the refinement data")
        self.add_products(x.T @ x, y.T @ x, float(np.sum(y * y)), x.shape[0])

    def add_products(self, xtx: np.ndarray, ytx: np.ndarray, yty: float, rows: int) -> None:
        """Accumulate sums already taken over ``rows`` rows: ``X^T X``, ``Y^T X`` and ``||Y||^2``.

        For callers that form the products where the rows live (a GPU, say) and hand over only
        the small matrices.
        """
        if np.shape(xtx) != self.xtx.shape or np.shape(ytx) != self.ytx.shape:
            raise ValueError(f"products must be {self.xtx.shape} and {self.ytx.shape}, "
                             f"got {np.shape(xtx)} and {np.shape(ytx)}")
        self.xtx += xtx
        self.ytx += ytx
        self.yty += float(yty)
        self.rows += int(rows)


def ridge_refit(moments: LayerMoments, w0: np.ndarray, ridge: float) -> np.ndarray:
    """Weights ``(d_out, d_in)`` minimising ``||X W^T - Y||^2 + ridge * s * ||W - w0||^2``.

    Parameters
    ----------
    moments : LayerMoments
        Accumulated ``X^T X`` and ``Y^T X``.
    w0 : np.ndarray
        ``(d_out, d_in)`` weights to shrink toward (the merged layer, flattened).
    ridge : float
        ``r > 0``, relative to ``s = trace(X^T X) / d_in``.

    Returns
    -------
    np.ndarray
        The refitted weights (float64).

    Raises
    ------
    ValueError
        For a non-positive ridge, mismatched shapes or an empty accumulator.
    """
    if not ridge > 0:
        raise ValueError(f"ridge must be > 0, got {ridge}")
    w0 = np.asarray(w0, dtype=np.float64)
    if w0.shape != (moments.d_out, moments.d_in):
        raise ValueError(f"w0 must be ({moments.d_out}, {moments.d_in}), got {w0.shape}")
    if moments.rows == 0:
        raise ValueError("no rows accumulated: nothing to fit")
    scale = float(np.trace(moments.xtx)) / moments.d_in
    damp = ridge * max(scale, 1e-12)
    a = moments.xtx + damp * np.eye(moments.d_in)
    b = moments.ytx + damp * w0
    # W a = b with a symmetric positive definite: solve a W^T = b^T.
    return scipy.linalg.solve(a, b.T, assume_a="pos").T


def reconstruction_error(moments: LayerMoments, w: np.ndarray) -> float:
    """Mean squared error ``||X W^T - Y||^2 / rows`` from the accumulated moments."""
    w = np.asarray(w, dtype=np.float64)
    if moments.rows == 0:
        raise ValueError("no rows accumulated")
    sq = moments.yty - 2.0 * float(np.sum(w * moments.ytx)) + float(np.sum((w @ moments.xtx) * w))
    return max(sq, 0.0) / moments.rows


@dataclass
class NeuronStats:
    """Per-neuron running mean and variance of pre-activations (sums over rows).

    Attributes
    ----------
    size : int
        Neurons (output channels).
    """

    size: int
    total: np.ndarray = field(init=False)
    total_sq: np.ndarray = field(init=False)
    rows: int = 0

    def __post_init__(self) -> None:
        self.total = np.zeros(self.size)
        self.total_sq = np.zeros(self.size)

    def add(self, z: np.ndarray) -> None:
        """Accumulate ``z`` of shape ``(rows, size)``."""
        z = np.asarray(z, dtype=np.float64)
        if z.ndim != 2 or z.shape[1] != self.size:
            raise ValueError(f"pre-activations must be (rows, {self.size}), got {z.shape}")
        self.total += z.sum(axis=0)
        self.total_sq += (z * z).sum(axis=0)
        self.rows += z.shape[0]

    @property
    def mean(self) -> np.ndarray:
        return self.total / max(self.rows, 1)

    @property
    def std(self) -> np.ndarray:
        var = self.total_sq / max(self.rows, 1) - self.mean ** 2
        return np.sqrt(np.maximum(var, 0.0))


def repair_rescale(
    weight: np.ndarray,
    bias: np.ndarray | None,
    merged: NeuronStats,
    target_mean: np.ndarray,
    target_std: np.ndarray,
    eps: float = 1e-8,
    max_scale: float = 10.0,
) -> tuple[np.ndarray, np.ndarray | None]:
    """REPAIR's correction of one layer, folded into its weights.

    Neuron ``i``'s pre-activation ``z_i`` becomes ``a_i z_i + c_i`` with
    ``a_i = target_std_i / merged_std_i`` (clipped to ``[1/max_scale, max_scale]``) and
    ``c_i = target_mean_i - a_i merged_mean_i``: row ``i`` of the weight (any trailing axes:
    a convolution's kernel) is multiplied by ``a_i``; with a bias, ``b_i <- a_i b_i + c_i``.
    Without a bias only the scale is applied (the mean stays ``a_i`` times the merged mean).

    Parameters
    ----------
    weight : np.ndarray
        ``(out, ...)`` layer weight.
    bias : np.ndarray or None
        ``(out,)`` bias, or None for a bias-free layer.
    merged : NeuronStats
        The merged layer's pre-activation statistics on the server's data.
    target_mean, target_std : np.ndarray
        ``(out,)`` statistics to restore (the aligned clients' average).
    eps : float
        Neurons whose merged std is below ``eps`` are left as they are (dead neurons).
    max_scale : float
        Largest allowed rescaling factor (either way).

    Returns
    -------
    tuple
        ``(weight, bias)`` corrected (float64; bias None when it was None).
    """
    w = np.asarray(weight, dtype=np.float64)
    if w.shape[0] != merged.size or np.shape(target_mean) != (merged.size,) or np.shape(target_std) != (merged.size,):
        raise ValueError(f"REPAIR: weight has {w.shape[0]} neurons, statistics have {merged.size}, "
                         f"targets {np.shape(target_mean)} / {np.shape(target_std)}")
    live = merged.std > eps
    scale = np.ones(merged.size)
    scale[live] = np.clip(np.asarray(target_std)[live] / merged.std[live], 1.0 / max_scale, max_scale)
    w = w * scale.reshape((-1,) + (1,) * (w.ndim - 1))
    if bias is None:
        return w, None
    shift = np.where(live, np.asarray(target_mean) - scale * merged.mean, 0.0)
    return w, np.asarray(bias, dtype=np.float64) * scale + shift
