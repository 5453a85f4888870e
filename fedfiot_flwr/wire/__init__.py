"""The FedFiOT wire format: what a client sends and how the server reads it back (numpy + flwr only).

Every reply is one Flower :class:`~flwr.app.RecordDict`. This package packs replies on the
client, and on the server decodes and validates each reply exactly once
(:func:`decode_reply`); nothing here imports torch, so the server decodes without it and the
client packs without server code.

- :mod:`~fedfiot_flwr.wire.records`: the record and Array-type names, the decoded uploads;
- :mod:`~fedfiot_flwr.wire.q16`: the 16-bit weight and Fisher codec (:func:`pack_reply`,
  :func:`unpack_reply`);
- :mod:`~fedfiot_flwr.wire.psd8`: the compressed-PSD curvature codec (:func:`pack_kfac_reply`,
  :func:`pack_gram_reply`, :func:`unpack_curvature_reply`);
- :mod:`~fedfiot_flwr.wire.decode`: :func:`decode_reply`, the server's one decoder;
- :mod:`~fedfiot_flwr.wire.sizes`: payload sizes.

FedFiOT (and FedFisher with diagonal Fishers) replies hold exactly one ArrayRecord and one
MetricRecord (the shape Flower's own strategies check for):

- ``"fedfiot"`` (:data:`ARRAYS_RECORD`): one :class:`~flwr.app.Array` per ``state_dict``
  entry, keyed by its name, in ``state_dict`` order;

  - a parameter: ``stype="fedfiot.q16wf.v1"``, ``dtype="int16"``, ``shape`` = the tensor's
    shape, ``data`` = little-endian float32 weight scale, float32 Fisher scale, then the
    int16 weight codes and the int16 Fisher codes (both C order): ``8 + 4 n`` bytes;
  - a floating-point buffer (BatchNorm running statistics; no Fisher):
    ``stype="fedfiot.q16w.v1"``, ``data`` = float32 scale then int16 codes: ``4 + 2 n`` bytes;
  - any other buffer (``num_batches_tracked``, integers): a plain ``Array(ndarray)``
    (``stype="numpy.ndarray"``), unquantized.

  Codes and scales follow :mod:`fedfiot_flwr.quantize` (``l_q = 2**15 - 1``).
- ``"metrics"`` (:data:`METRICS_RECORD`): a MetricRecord with ``"num-examples"`` (int > 0)
  and the client's own training metrics, under the client's own names.

FedFisher (K-FAC) and RegMean replies add, in the same ArrayRecord, one Array per compressed
factor keyed ``"curvature/<module>/<factor>"`` (``A`` and ``G`` for K-FAC, ``gram`` for
RegMean; ``stype="fedfiot.psd8.v1"``, ``dtype="int8"``, ``shape=(n, r)``, ``data`` = ``r``
float32 column scales then the ``n r`` int8 codes, see :mod:`fedfiot_flwr.psd`), and a
ConfigRecord ``"curvature"`` with ``method`` (``"kfac"``/``"gram"``), ``fisher-kind``,
``layers``, ``weights``, ``biases`` (``""`` for none) and ``rank`` (``-1``: full rank).

Projects on Flower's legacy ``flwr.server.strategy`` API carry the same RecordDict inside a
``FitRes`` (:mod:`fedfiot_flwr.server.legacy_envelope`).

Full byte-level description: ``docs/wire-format.md``.
"""

from fedfiot_flwr.wire.decode import decode_reply
from fedfiot_flwr.wire.psd8 import pack_gram_reply, pack_kfac_reply, unpack_curvature_reply
from fedfiot_flwr.wire.q16 import fedavg_reply, pack_reply, unpack_reply
from fedfiot_flwr.wire.records import (
    ARRAYS_RECORD,
    CURVATURE_METHODS,
    CURVATURE_RECORD,
    FACTOR_PREFIX,
    METRICS_RECORD,
    NUM_EXAMPLES_KEY,
    REPLY_KINDS,
    STYPE_PSD8,
    STYPE_WEIGHT,
    STYPE_WEIGHT_FISHER,
    ClientUpload,
    CurvatureUpload,
    reply_layout,
)
from fedfiot_flwr.wire.sizes import content_bytes, fedavg_payload_bytes, payload_bytes

__all__ = [
    "ARRAYS_RECORD",
    "CURVATURE_METHODS",
    "CURVATURE_RECORD",
    "FACTOR_PREFIX",
    "METRICS_RECORD",
    "NUM_EXAMPLES_KEY",
    "REPLY_KINDS",
    "STYPE_PSD8",
    "STYPE_WEIGHT",
    "STYPE_WEIGHT_FISHER",
    "ClientUpload",
    "CurvatureUpload",
    "content_bytes",
    "decode_reply",
    "fedavg_payload_bytes",
    "fedavg_reply",
    "pack_gram_reply",
    "pack_kfac_reply",
    "pack_reply",
    "payload_bytes",
    "reply_layout",
    "unpack_curvature_reply",
    "unpack_reply",
]
