"""The legacy ``FitRes`` envelope: a FedFiOT reply inside a ``flwr.server.strategy`` result.

A ``NumPyClient`` of a project on Flower's legacy API returns the reply RecordDict (built by
:func:`fedfiot_flwr.client.fisher_reply` or :func:`fedfiot_flwr.wire.pack_reply`) as the one
``uint8`` array of its ``FitRes``: Flower's protobuf serialization of the RecordDict. The legacy
strategy (:class:`fedfiot_flwr.server.legacy.FedFiOTLegacy`) takes it out again and decodes it as
the Message API strategy does. Numpy + flwr only: a client can import this without torch.
"""

from __future__ import annotations

import numpy as np
from flwr.app import RecordDict
from flwr.common import Code, FitRes, NDArrays, parameters_to_ndarrays
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

__all__ = ["fitres_to_reply", "ndarrays_to_reply", "reply_to_ndarrays"]


def reply_to_ndarrays(content: RecordDict) -> NDArrays:
    """Serialize a reply RecordDict into the one-array payload of a legacy ``FitRes``.

    Parameters
    ----------
    content : RecordDict
        A reply built by :func:`fedfiot_flwr.wire.pack_reply` (or a curvature reply).

    Returns
    -------
    list of np.ndarray
        A single ``uint8`` array holding Flower's protobuf serialization of ``content``.
    """
    blob = recorddict_to_proto(content).SerializeToString()
    return [np.frombuffer(blob, dtype=np.uint8).copy()]


def ndarrays_to_reply(ndarrays: NDArrays, client: str = "?") -> RecordDict:
    """Inverse of :func:`reply_to_ndarrays`.

    Parameters
    ----------
    ndarrays : list of np.ndarray
        The parameters of a legacy ``FitRes``.
    client : str
        Who sent them (named in every error).

    Returns
    -------
    RecordDict
        The reply, not yet decoded (:func:`fedfiot_flwr.wire.decode_reply` does that).

    Raises
    ------
    ValueError
        If the payload is not exactly one uint8 array holding a serialized RecordDict.
    """
    if len(ndarrays) != 1 or np.asarray(ndarrays[0]).dtype != np.uint8:
        raise ValueError(
            f"client {client!r}: a FedFiOT legacy FitRes must carry exactly one uint8 array "
            f"(reply_to_ndarrays), got {len(ndarrays)} array(s) of dtype "
            f"{sorted({str(np.asarray(a).dtype) for a in ndarrays})}"
        )
    try:
        proto = ProtoRecordDict.FromString(np.asarray(ndarrays[0]).tobytes())
        return recorddict_from_proto(proto)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise ValueError(f"client {client!r}: undecodable FedFiOT legacy payload: {exc}") from exc


def fitres_to_reply(fit_res: FitRes, client: str = "?") -> RecordDict:
    """Take out the RecordDict a FedFiOT legacy client put into its ``FitRes``.

    Parameters
    ----------
    fit_res : FitRes
        A legacy client's result.
    client : str
        Who sent it (named in every error).

    Returns
    -------
    RecordDict
        The reply, not yet decoded (:func:`fedfiot_flwr.wire.decode_reply` does that).

    Raises
    ------
    ValueError
        If the FitRes reports a failure or its parameters are not a FedFiOT payload.
    """
    if fit_res.status.code != Code.OK:
        raise ValueError(f"client {client!r}: FitRes status {fit_res.status.code.name}: {fit_res.status.message}")
    try:
        ndarrays = parameters_to_ndarrays(fit_res.parameters)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"client {client!r}: undecodable FitRes parameters: {exc}") from exc
    return ndarrays_to_reply(ndarrays, client)
