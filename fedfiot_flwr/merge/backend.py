"""Array backends of the merge's heavy arithmetic: numpy (default) or torch (CPU or CUDA).

Only the per-layer stack of client data (:class:`fedfiot_flwr.merge.costs.ClientLayers`)
lives in a backend: the cost GEMMs and the gathers of the aggregation run there; the
assignment (on the CPU) and the final model are numpy. torch is imported lazily, so the merge
engine stays importable without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedfiot_flwr.options import BACKENDS



class NumpyBackend:
    """Plain numpy arrays on the CPU."""

    name = "numpy"
    device = "cpu"

    def asarray(self, x: np.ndarray, dtype: str) -> np.ndarray:
        """``x`` as a backend array of ``dtype`` (no copy when it already is one)."""
        return np.asarray(x, dtype=dtype)

    def empty(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype=dtype)

    def to_numpy(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def matmul_t(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``a @ b.T``."""
        return a @ b.T

    def take_rows(self, x: np.ndarray, index: np.ndarray) -> np.ndarray:
        return x[index]


class TorchBackend:
    """torch tensors on ``device`` (``"auto"``: CUDA when available, else the CPU)."""

    name = "torch"

    def __init__(self, device: str | None = "auto") -> None:
        import torch  # lazily: the engine must not need torch

        self.torch = torch
        if device in (None, "auto"):
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)

    def _dtype(self, dtype: str) -> Any:
        return {"float64": self.torch.float64, "float32": self.torch.float32}[dtype]

    def asarray(self, x: Any, dtype: str) -> Any:
        if isinstance(x, self.torch.Tensor):
            return x.to(device=self.device, dtype=self._dtype(dtype))
        return self.torch.as_tensor(np.asarray(x), device=self.device).to(self._dtype(dtype))

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self.torch.empty(shape, dtype=self._dtype(dtype), device=self.device)

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self.torch.zeros(shape, dtype=self._dtype(dtype), device=self.device)

    def to_numpy(self, x: Any) -> np.ndarray:
        return x.detach().cpu().numpy()

    def matmul_t(self, a: Any, b: Any) -> Any:
        return a @ b.T

    def take_rows(self, x: Any, index: np.ndarray) -> Any:
        return x[self.torch.as_tensor(index, device=self.device)]


Backend = NumpyBackend | TorchBackend


def get_backend(backend: str = "numpy", device: str | None = "auto") -> Backend:
    """The backend named ``backend`` (``"numpy"`` or ``"torch"``); ``device`` is torch's.

    >>> get_backend("numpy").name
    'numpy'
    """
    if backend == "numpy":
        return NumpyBackend()
    if backend == "torch":
        return TorchBackend(device)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
