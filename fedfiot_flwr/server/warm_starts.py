"""Warm starts of a validation sweep: each candidate's alignment starts from a neighbour's.

Candidates of a sweep that share the reference and the Fisher scaling and differ by one grid
step of ``rho`` or ``lam`` usually reach the same alignment. Starting a candidate's alignment
from its nearest already-merged neighbour's permutations (``merge(..., initial_perms=...)``)
then confirms that fixed point in one inner iteration per layer instead of the cold start's two
or more. A warm start is not the paper's algorithm: the fixed point it reaches can differ from
the cold start's, so it is opt-in (``FedFiOTConfig(warm_start=True)``), and its choices are
checked against cold starts by the tests and ``research/sweep_cost.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

Permutations = dict[str, list[np.ndarray]]


@dataclass
class WarmStarts:
    """Alignments found so far in a sweep, and the nearest one for a new candidate.

    Attributes
    ----------
    max_steps : float
        Largest distance to a usable neighbour, in grid steps (one step: 0.1 in ``rho`` or a
        factor of 10 in ``lam``); farther candidates start cold.
    found : list
        ``(reference, fisher_scaling, rho, lam, permutations)`` of every aligned candidate.

    Examples
    --------
    >>> ws = WarmStarts()
    >>> ws.add("largest", "none", 0.5, 1e-4, {"P": [np.arange(3)]})
    >>> ws.nearest("largest", "none", 0.6, 1e-4) is not None, ws.nearest("largest", "size", 0.6, 1e-4)
    (True, None)
    """

    max_steps: float = 1.0
    found: list[tuple[str | int, str, float, float, Permutations]] = field(default_factory=list)

    @staticmethod
    def distance(rho_a: float, lam_a: float, rho_b: float, lam_b: float) -> float:
        """Grid steps between two ``(rho, lam)``: ``|d rho| / 0.1 + |d log10 lam|``."""
        return abs(rho_a - rho_b) / 0.1 + abs(math.log10(lam_a) - math.log10(lam_b))

    def add(self, reference: str | int, scaling: str, rho: float, lam: float, perms: Permutations) -> None:
        """Record a candidate's alignment."""
        self.found.append((reference, scaling, float(rho), float(lam), perms))

    def nearest(self, reference: str | int, scaling: str, rho: float, lam: float) -> Permutations | None:
        """The permutations of the nearest recorded candidate with the same reference and
        scaling within ``max_steps`` (the latest among equally near ones), or None."""
        best: tuple[float, Permutations] | None = None
        for ref, sc, r, la, perms in self.found:
            if ref != reference or sc != scaling:
                continue
            dist = self.distance(rho, lam, r, la)
            if dist <= self.max_steps + 1e-9 and (best is None or dist <= best[0]):
                best = (dist, perms)
        return None if best is None else best[1]

