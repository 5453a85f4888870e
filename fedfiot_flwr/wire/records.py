"""Names of the reply's records and Array types, and the decoded uploads (numpy + flwr only)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedfiot_flwr.psd import InputGram, KFACFactors

__all__ = [
    "ARRAYS_RECORD",
    "CURVATURE_METHODS",
    "CURVATURE_RECORD",
    "FACTOR_PREFIX",
    "OUTPUT_FACTOR",
    "METRICS_RECORD",
    "NUMPY_STYPE",
    "NUM_EXAMPLES_KEY",
    "REPLY_KINDS",
    "STYPE_F32",
    "STYPE_PSD8",
    "STYPE_WEIGHT",
    "STYPE_WEIGHT_FISHER",
    "ClientUpload",
    "CurvatureUpload",
    "reply_layout",
]

ARRAYS_RECORD = "fedfiot"
"""The ArrayRecord holding every tensor (and every curvature factor)."""
METRICS_RECORD = "metrics"
"""The MetricRecord holding ``num-examples`` and the client's own metrics."""
NUM_EXAMPLES_KEY = "num-examples"
STYPE_WEIGHT_FISHER = "fedfiot.q16wf.v1"
"""A parameter: 16-bit weight and Fisher codes."""
STYPE_WEIGHT = "fedfiot.q16w.v1"
"""A floating-point buffer (or a curvature reply's weight): 16-bit weight codes only."""
STYPE_PSD8 = "fedfiot.psd8.v1"
"""A compressed PSD factor: 8-bit low-rank codes."""
STYPE_F32 = "fedfiot.f32.v1"
"""Raw little-endian float32 values (a Gram reply's output factors)."""
NUMPY_STYPE = "numpy.ndarray"
"""Flower's plain ``Array(ndarray)``: a non-float buffer, unquantized."""
CURVATURE_RECORD = "curvature"
"""The ConfigRecord describing a curvature reply's factors."""
FACTOR_PREFIX = "curvature/"
"""Key prefix of the factor Arrays: ``curvature/<module>/<factor>``."""
OUTPUT_FACTOR = "output"
"""Name of a Gram reply layer's float32 output factor (``curvature/<module>/output``; K-FAC's curvature)."""
CURVATURE_METHODS = ("kfac", "gram")
REPLY_KINDS = ("fisher", "kfac", "gram", "gram-output", "weights")
"""What a strategy can ask :func:`~fedfiot_flwr.wire.decode_reply` for: diagonal Fisher, K-FAC
factors, input Grams, or only the weights (any reply)."""


@dataclass(frozen=True)
class ClientUpload:
    """A validated, dequantized client reply.

    Attributes
    ----------
    weights : dict[str, np.ndarray]
        Every ``state_dict`` entry: dequantized parameters and float buffers, non-float
        buffers as sent.
    fisher : dict[str, np.ndarray]
        Dequantized diagonal Fisher of the parameters only (non-negative).
    num_examples : int
        The client's number of local examples (> 0).
    metrics : dict[str, float]
        The scalar metrics of the MetricRecord other than ``num-examples``.
    """

    weights: dict[str, np.ndarray]
    fisher: dict[str, np.ndarray]
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def buffers(self) -> list[str]:
        """Names of the entries without a Fisher (pass them to the merge as ``buffers=``)."""
        return [n for n in self.weights if n not in self.fisher]


@dataclass(frozen=True)
class CurvatureUpload:
    """A validated, dequantized FedFisher (K-FAC) or RegMean reply.

    Attributes
    ----------
    weights : dict[str, np.ndarray]
        Every state-dict entry (dequantized).
    num_examples : int
        The client's number of local examples.
    method : str
        ``"kfac"`` or ``"gram"``.
    fisher_kind : str or None
        ``"true"`` or ``"empirical"`` for K-FAC, ``None`` for RegMean.
    rank : int or None
        The shared rank cap the client used (``None``: full rank).
    factors : dict[str, KFACFactors]
        K-FAC factors per module (dense, rebuilt from the 8-bit low-rank codes, which they also
        carry as ``A_root`` / ``G_root``).
    grams : dict[str, InputGram]
        RegMean Grams per module (dense, rebuilt).
    metrics : dict[str, float]
        The client's other metrics.
    """

    weights: dict[str, np.ndarray]
    num_examples: int
    method: str
    fisher_kind: str | None
    rank: int | None
    factors: dict[str, KFACFactors] = field(default_factory=dict)
    grams: dict[str, InputGram] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


def reply_layout(upload: ClientUpload | CurvatureUpload) -> tuple[tuple[str, str, str | None], ...]:
    """The curvature layers an upload carries (``()`` for a diagonal-Fisher reply).

    Replies of one round must agree on it: the server merges layer by layer.

    Parameters
    ----------
    upload : ClientUpload or CurvatureUpload
        A decoded upload.

    Returns
    -------
    tuple of (module, weight name, bias name or None)
        In the order the reply lists its layers.
    """
    if isinstance(upload, ClientUpload):
        return ()
    layers: Mapping[str, KFACFactors | InputGram] = upload.factors if upload.method == "kfac" else upload.grams
    return tuple((name, f.weight, f.bias) for name, f in layers.items())

