"""Client uploads checked once and shared by every merge of a round (a validation sweep).

:func:`prepare_clients` validates the models and Fishers once; :class:`PreparedClients` then
serves the tempered Fishers ``(s_k F_k)**rho`` once per ``(fisher_scaling, rho)`` (cached up to
a memory budget) and caches each identity merge, which does not depend on the reference. The
models are kept as uploaded (no float64 copy): the engine converts one tensor at a time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedfiot_flwr.options import FISHER_SCALINGS
from fedfiot_flwr.options import ModelView as Model

from .reuse import AlignmentMemo, ModelCache
from .validate import check_models, check_num_examples




def fisher_scale_factors(
    fishers: Sequence[Model], scaling: str, num_examples: Sequence[float] | None
) -> list[float | None]:
    """Per-client factor of a Fisher scaling (``None``: leave the Fisher as uploaded).

    See :func:`fedfiot_flwr.merge.scale_fishers` for the scalings.

    >>> fisher_scale_factors([{"w": np.array([1., 3.])}], "normalized", None)
    [0.5]
    """
    if scaling not in FISHER_SCALINGS:
        raise ValueError(f"fisher_scaling must be one of {FISHER_SCALINGS}, got {scaling!r}")
    if scaling == "none":
        return [None] * len(fishers)
    if "size" in scaling and num_examples is None:
        raise ValueError(f"fisher_scaling={scaling!r} needs num_examples")
    factors = np.ones(len(fishers))
    if "size" in scaling:
        n = np.asarray(num_examples, dtype=np.float64)
        factors = n / n.sum() * (len(fishers) if scaling == "normalized-size" else 1.0)
    out: list[float | None] = []
    for k, fk in enumerate(fishers):
        factor = factors[k]
        if scaling.startswith("normalized"):
            total = sum(float(np.sum(f, dtype=np.float64)) for f in fk.values())  # float32 sums overflow
            count = sum(int(np.size(f)) for f in fk.values())
            mean = total / count if count else 0.0
            factor = factor / mean if mean > 0 else factor
        out.append(float(factor))
    return out


def scaled_fisher(f: np.ndarray, factor: float | None) -> np.ndarray:
    """One raw Fisher tensor in float64, times its client's factor (when there is one)."""
    return np.asarray(f, dtype=np.float64) if factor is None else np.asarray(f, dtype=np.float64) * factor


@dataclass
class PreparedClients:
    """Validated client uploads, shared by several merges (see :func:`prepare_clients`).

    Attributes
    ----------
    models, fishers : list of dict[str, np.ndarray]
        As uploaded (any numeric dtype; converted to float64 one tensor at a time).
    shapes, dtypes : dict
        Tensor shapes and the model's dtypes (the merged model keeps them).
    client_ids : list[str]
        Names used in error messages.
    num_examples : list[int] or None
        Client sizes.
    buffers : tuple[str, ...]
        Tensors without a Fisher.
    cache_bytes : int
        Memory budget of the tempered-Fisher cache (0: temper on every use).
    identity_merges : dict
        Identity merges computed so far, by ``(fisher_scaling, rho, lam, aggregation)``.
    alignments : AlignmentMemo
        Alignment iterations computed so far, shared by merges that reach the same state
        (:mod:`fedfiot_flwr.merge.reuse`).
    aligned_merges : ModelCache
        Aligned merges by ``(fisher_scaling, rho, lam, aggregation, alignment)`` (256 MiB at most).
    """

    models: list[Model]
    fishers: list[Model]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, np.dtype]
    client_ids: list[str]
    num_examples: list[int] | None
    buffers: tuple[str, ...]
    cache_bytes: int = 2**30
    _tempered: OrderedDict = field(default_factory=OrderedDict, repr=False)
    _factors: dict = field(default_factory=dict, repr=False)
    identity_merges: dict = field(default_factory=dict, repr=False)
    alignments: AlignmentMemo = field(default_factory=AlignmentMemo, repr=False)
    aligned_merges: ModelCache = field(default_factory=ModelCache, repr=False)

    def __len__(self) -> int:
        return len(self.models)

    @property
    def fisher_bytes(self) -> int:
        """Bytes of one float64 copy of every client's Fisher."""
        return 8 * len(self.fishers) * sum(int(np.prod(self.shapes[n])) for n in self.fishers[0])

    def factors(self, scaling: str) -> list[float | None]:
        """Per-client Fisher scale factors of ``scaling`` (computed once)."""
        if scaling not in self._factors:
            self._factors[scaling] = fisher_scale_factors(self.fishers, scaling, self.num_examples)
        return self._factors[scaling]

    def tempered(self, scaling: str, rho: float) -> list[Mapping[str, np.ndarray]]:
        """Per client, ``(s_k F_k)**rho`` in float64: cached when it fits ``cache_bytes``,
        otherwise a lazy mapping that tempers each tensor when it is read."""
        key = (scaling, float(rho))
        if key in self._tempered:
            self._tempered.move_to_end(key)
            return self._tempered[key]
        factors = self.factors(scaling)
        lazy = [_Tempered(fk, factor, rho) for fk, factor in zip(self.fishers, factors)]
        size = self.fisher_bytes
        if size > self.cache_bytes:
            return lazy
        while self._tempered and size * (len(self._tempered) + 1) > self.cache_bytes:
            self._tempered.popitem(last=False)
        value = [{n: t[n] for n in t} for t in lazy]
        self._tempered[key] = value
        return value

    def damped(self, scaling: str, rho: float, lam: float) -> list[Mapping[str, np.ndarray]]:
        """Per client, the merge's Fisher weights ``(s_k F_k)**rho + lam`` (read lazily)."""
        return [_Damped(t, lam) for t in self.tempered(scaling, rho)]


class _Tempered(Mapping):
    """``(factor * F)**rho`` of one client, computed per tensor when read."""

    def __init__(self, fisher: Model, factor: float | None, rho: float) -> None:
        self.fisher, self.factor, self.rho = fisher, factor, rho

    fresh = True  # every read returns a new array (the caller may update it in place)

    def __getitem__(self, name: str) -> np.ndarray:
        f = np.array(self.fisher[name], dtype=np.float64)  # a copy: updated in place below
        if self.factor is not None:
            f *= self.factor
        return np.power(f, self.rho, out=f)

    def __iter__(self) -> Iterator[str]:
        return iter(self.fisher)

    def __len__(self) -> int:
        return len(self.fisher)

    def __contains__(self, name: object) -> bool:
        return name in self.fisher


class _Damped(Mapping):
    """Tempered Fisher plus the damping, computed per tensor when read."""

    def __init__(self, tempered: Mapping[str, np.ndarray], lam: float) -> None:
        self.tempered, self.lam = tempered, lam

    def __getitem__(self, name: str) -> np.ndarray:
        if getattr(self.tempered, "fresh", False):
            f = self.tempered[name]
            f += self.lam
            return f
        return self.tempered[name] + self.lam

    def __iter__(self) -> Iterator[str]:
        return iter(self.tempered)

    def __len__(self) -> int:
        return len(self.tempered)

    def __contains__(self, name: object) -> bool:
        return name in self.tempered


def prepare_clients(
    models: Sequence[Model],
    fishers: Sequence[Model],
    *,
    buffers: Collection[str] = (),
    num_examples: Sequence[int] | None = None,
    client_ids: Sequence[str] | None = None,
    cache_bytes: int = 2**30,
    checked: bool = False,
) -> PreparedClients:
    """Validate client uploads once, for any number of merges (:func:`fedfiot_flwr.merge.merge`
    accepts the result in place of ``models`` with ``fishers=None``).

    The checks guard direct callers, who may pass any arrays; uploads that came over the wire
    were validated when they were decoded (:func:`fedfiot_flwr.wire.decode_reply`), and the
    server passes ``checked=True`` so that they are not validated again.

    Parameters
    ----------
    models : sequence of dict[str, np.ndarray]
        Client models (same keys and shapes).
    fishers : sequence of dict[str, np.ndarray]
        Raw (undamped, untempered) diagonal Fisher per client, same keys and shapes as the
        models except the tensors named in ``buffers``.
    buffers : collection of str
        Tensors without a Fisher (e.g. BatchNorm running statistics): they move with their
        channel's permutation and are averaged by size (see :mod:`fedfiot_flwr.merge.engine`).
    num_examples : sequence of int, optional
        Client sizes; needed for ``reference="largest"``, ``aggregation="size"`` and the
        size-based Fisher scalings.
    client_ids : sequence of str, optional
        Names used in error messages (default: the client indices ``"0"`` to ``"K-1"``).
    cache_bytes : int
        Memory budget for cached tempered Fishers (each ``(fisher_scaling, rho)`` costs one
        float64 copy of all Fishers); above it, tensors are tempered when used.
    checked : bool
        The uploads come from :func:`fedfiot_flwr.server.uploads.collect_uploads`: their shapes,
        values and sizes are not checked again, only the counts and the tensor names against
        ``buffers`` (:func:`~fedfiot_flwr.merge.validate.check_models`).

    Returns
    -------
    PreparedClients

    Raises
    ------
    ValueError
        As :func:`fedfiot_flwr.merge.merge` does for bad uploads (naming client and tensor).

    Examples
    --------
    >>> prep = prepare_clients([{"w": np.ones(2)}], [{"w": np.ones(2)}])
    >>> len(prep), prep.shapes
    (1, {'w': (2,)})
    """
    ids = [str(i) for i in range(len(models))] if client_ids is None else [str(c) for c in client_ids]
    shapes = check_models(models, fishers, buffers, ids, checked=checked)
    check_num_examples(num_examples, len(models), ids, checked=checked)
    return PreparedClients(
        models=[{n: np.asarray(x) for n, x in m.items()} for m in models],
        fishers=[{n: np.asarray(f) for n, f in fk.items()} for fk in fishers],
        shapes=shapes,
        dtypes={n: np.asarray(x).dtype for n, x in models[0].items()},
        client_ids=ids,
        num_examples=None if num_examples is None else list(num_examples),
        buffers=tuple(buffers),
        cache_bytes=int(cache_bytes),
    )


def as_prepared(models: Sequence[Model] | PreparedClients, fishers: Sequence[Model] | None, **kwargs: Any) -> PreparedClients:
    """``models`` if already prepared (then ``fishers`` must be None), else :func:`prepare_clients`."""
    if isinstance(models, PreparedClients):
        if fishers is not None:
            raise ValueError("pass fishers=None with PreparedClients: the Fishers are already in it")
        return models
    if fishers is None:
        raise ValueError("merge needs the client Fishers (or PreparedClients from prepare_clients)")
    return prepare_clients(models, fishers, **kwargs)
