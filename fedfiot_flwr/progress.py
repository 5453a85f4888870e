"""Progress bars that need ``tqdm`` only when one is shown.

``show=False`` never imports tqdm; ``show=None`` (a bar on a terminal) uses tqdm when it is
installed and shows nothing otherwise; ``show=True`` needs it (the ``progress`` extra).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, TypeVar

from fedfiot_flwr.extras import require

__all__ = ["Bar", "progress_bar"]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Bar(Protocol[T_co]):
    """What the trainers use of a bar: iteration, a postfix and ``close``."""

    def __iter__(self) -> Iterator[T_co]: ...

    def set_postfix(self, **kwargs: Any) -> None: ...

    def close(self) -> None: ...


class _NoBar(Iterable[T]):
    """The iterable itself, with a bar's methods doing nothing."""

    def __init__(self, iterable: Iterable[T]) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[T]:
        return iter(self._iterable)

    def set_postfix(self, **kwargs: Any) -> None:
        return None

    def close(self) -> None:
        return None


def progress_bar(iterable: Iterable[T], show: bool | None, **tqdm_kwargs: Any) -> Bar[T]:
    """A tqdm bar over ``iterable`` on stderr, or the plain iterable when none is shown.

    Parameters
    ----------
    iterable : Iterable
        What the loop runs over.
    show : bool, optional
        ``True``: always a bar; ``False``: never; ``None``: only when stderr is a terminal
        (tqdm's ``disable=None``), and never without tqdm.
    **tqdm_kwargs
        Passed to ``tqdm`` (``total``, ``desc``, ``unit``, ``leave``...).

    Returns
    -------
    Bar
        Iterates like ``iterable``; ``set_postfix`` and ``close`` work either way.

    Raises
    ------
    ImportError
        For ``show=True`` without tqdm (``pip install 'fedfiot-flwr[progress]'``).
    """
    if show is False:
        return _NoBar(iterable)
    if show is None:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return _NoBar(iterable)
    else:
        tqdm = require("tqdm.auto", "tqdm", "progress", "progress bars").tqdm
    return tqdm(iterable, disable=None if show is None else False, file=sys.stderr, **tqdm_kwargs)
