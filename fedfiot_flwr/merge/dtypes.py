"""The one rule for turning a float64 average of client tensors back into the tensors' dtype.

Float tensors are cast (round to nearest); integer tensors (BatchNorm's ``num_batches_tracked``)
take the average rounded to the nearest integer. FedFiOT's merge (:mod:`fedfiot_flwr.merge.engine`)
and FedAvg (:func:`fedfiot_flwr.baselines.size_weighted_average`) both apply it, so a merge without
alignment and FedAvg agree on every integer buffer.

>>> cast_average(np.array([2.5, 3.4]), np.dtype(np.int64)).tolist()
[2, 3]
>>> cast_average(np.array([0.1]), np.dtype(np.float32)).dtype
dtype('float32')
"""

from __future__ import annotations

import numpy as np

__all__ = ["cast_average"]


def cast_average(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``value`` (a float64 average) in ``dtype``: integers rounded to the nearest, other numbers cast.

    Parameters
    ----------
    value : np.ndarray
        The float64 average of one tensor over the clients.
    dtype : np.dtype
        The tensor's dtype in the client models; a non-numeric one gives float64.

    Returns
    -------
    np.ndarray
        The average in the tensor's dtype (NumPy's ``rint``: halves go to the even integer).
    """
    if np.issubdtype(dtype, np.integer):
        value = np.rint(value)
    return value.astype(dtype if np.issubdtype(dtype, np.number) else np.float64)
