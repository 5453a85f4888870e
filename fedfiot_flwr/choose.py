"""The one rule for keeping the best of several candidates by a validation score (torch-free).

Every choice on server data uses it: FedFiOT's sweep over merge knobs and its aligned / identity
/ FedAvg choice, the refinement's candidates and fine-tuning start, FedFisher's checkpoints and
RegMean's ``alpha``. The rule:

- a NaN score never wins;
- otherwise the highest score wins (the lowest for a loss, ``maximize=False``);
- ties go to the earliest candidate in the order given, so callers list the simpler or the
  earlier candidate first (the configured default before the grid, the merge before its
  refinements, step 0 before later checkpoints);
- when no score is a number, the first candidate is kept.

>>> best_index([0.5, float("nan"), 0.7, 0.7])
2
>>> best_index([float("nan"), float("nan")])
0
>>> best_index([0.3, 0.2, 0.2], maximize=False)
1
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Generic, TypeVar

__all__ = ["BestSoFar", "beats", "best_index", "higher_is_better"]

T = TypeVar("T")


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of ``metric`` is better: every metric but a loss.

    >>> higher_is_better("accuracy"), higher_is_better("val-loss")
    (True, False)
    """
    return "loss" not in metric


def beats(score: float, incumbent: float, *, maximize: bool = True) -> bool:
    """Whether ``score`` (a later candidate) replaces ``incumbent`` (the best so far).

    Parameters
    ----------
    score : float
        The later candidate's score.
    incumbent : float
        The score of the best earlier candidate.
    maximize : bool
        Higher is better (``False``: lower is better).

    Returns
    -------
    bool
        ``False`` for a NaN ``score`` or a tie; ``True`` when ``incumbent`` is NaN and ``score``
        is not, or when ``score`` is strictly better.
    """
    if math.isnan(score):
        return False
    if math.isnan(incumbent):
        return True
    return score > incumbent if maximize else score < incumbent


def best_index(scores: Sequence[float], *, maximize: bool = True) -> int:
    """Position of the winner among ``scores`` under the module's rule.

    Parameters
    ----------
    scores : sequence of float
        One score per candidate, in the callers' order of preference on ties.
    maximize : bool
        Higher is better (``False``: lower is better).

    Returns
    -------
    int
        The winner's position (0 when every score is NaN).

    Raises
    ------
    ValueError
        For no scores.
    """
    if len(scores) == 0:
        raise ValueError("best_index: no candidates")
    best = 0
    for i in range(1, len(scores)):
        if beats(float(scores[i]), float(scores[best]), maximize=maximize):
            best = i
    return best


class BestSoFar(Generic[T]):
    """The winner among candidates scored one at a time (the module's rule, without keeping them all).

    Parameters
    ----------
    maximize : bool
        Higher is better (``False``: lower is better).

    Examples
    --------
    >>> best = BestSoFar[str]()
    >>> [best.offer(s, name) for s, name in [(float("nan"), "a"), (0.4, "b"), (0.4, "c")]]
    [True, True, False]
    >>> best.item, best.score, best.index
    ('b', 0.4, 1)
    """

    def __init__(self, *, maximize: bool = True) -> None:
        self.maximize = maximize
        self.count = 0
        self.index = -1
        self.score = math.nan
        self._item: T | None = None

    def offer(self, score: float, item: T) -> bool:
        """Consider the next candidate; return whether it is now the best.

        Parameters
        ----------
        score : float
            Its validation score (NaN: unscored).
        item : object
            What to keep when it wins (a model, a name, a tuple).

        Returns
        -------
        bool
            ``True`` for the first candidate and for one that :func:`beats` the best so far.
        """
        score = float(score)
        won = self.count == 0 or beats(score, self.score, maximize=self.maximize)
        if won:
            self.index, self.score, self._item = self.count, score, item
        self.count += 1
        return won

    @property
    def item(self) -> T:
        """The winning candidate's item.

        Raises
        ------
        LookupError
            Before any candidate was offered.
        """
        if self.count == 0:
            raise LookupError("BestSoFar: no candidate was offered")
        return self._item  # type: ignore[return-value]
