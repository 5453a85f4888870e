"""Payload sizes of a reply, as the packing and the server's round report count them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import RecordDict

from fedfiot_flwr.wire.q16 import to_numpy
from fedfiot_flwr.wire.records import FACTOR_PREFIX

__all__ = ["content_bytes", "fedavg_payload_bytes", "payload_bytes"]


def fedavg_payload_bytes(state: Mapping[str, Any]) -> int:
    """Array payload of FedAvg's float32 upload: 4 bytes per float entry (others as-is).

    Parameters
    ----------
    state : Mapping[str, array]
        The model's ``state_dict()`` (torch tensors or NumPy arrays).

    Returns
    -------
    int
        The budget ``rank="fedavg"`` fits a curvature reply into.
    """
    total = 0
    for value in state.values():
        arr = to_numpy(value)
        total += 4 * arr.size if np.issubdtype(arr.dtype, np.floating) else arr.nbytes
    return int(total)


def payload_bytes(content: RecordDict) -> dict[str, int]:
    """Array payload of a reply, split into weights and curvature factors.

    Parameters
    ----------
    content : RecordDict
        A packed reply.

    Returns
    -------
    dict[str, int]
        ``{"weights": ..., "curvature": ..., "total": ...}``: sums of ``len(array.data)``.
    """
    weights = curvature = 0
    for rec in content.array_records.values():
        for key, arr in rec.items():
            if key.startswith(FACTOR_PREFIX):
                curvature += len(arr.data)
            else:
                weights += len(arr.data)
    return {"weights": weights, "curvature": curvature, "total": weights + curvature}


def content_bytes(content: Any) -> int:
    """Payload bytes of a reply: ``len(array.data)`` summed over every Array of every ArrayRecord.

    Parameters
    ----------
    content : Any
        A reply's content, possibly malformed.

    Returns
    -------
    int
        The bytes; anything that cannot be measured counts as 0, so that a malformed reply
        cannot stop the round.
    """
    try:
        return int(sum(len(arr.data) for rec in content.array_records.values() for arr in rec.values()))
    except Exception:  # noqa: BLE001
        return 0
