"""Reply sizes as Flower counts them, for the size comparisons of the benchmarks and tests.

The sizes the shipped code needs (the payload of a reply, FedAvg's float32 budget) stay in
:mod:`fedfiot_flwr.wire.sizes`.
"""

from __future__ import annotations

from flwr.app import RecordDict

__all__ = ["reply_num_bytes"]


def reply_num_bytes(content: RecordDict, arrays_only: bool = False) -> int:
    """Bytes of a reply as Flower counts them (``count_bytes()`` summed over its records).

    Parameters
    ----------
    content : RecordDict
        A reply (e.g. :func:`fedfiot_flwr.wire.pack_reply` or :func:`fedfiot_flwr.wire.fedavg_reply`).
    arrays_only : bool
        Count the ArrayRecords only.

    Returns
    -------
    int
        The bytes.
    """
    records = content.array_records.values() if arrays_only else content.values()
    return int(sum(r.count_bytes() for r in records))
