"""The statistics of an A/B experiment (router.arms), pure and bounded: no I/O, no numpy.

Contract:
- Samples are *bottom-k* samples: each observation gets a uniform priority in
  [0, 1) and a sample keeps the ``k`` observations of lowest priority.  That is
  a uniform sample without replacement of everything observed, and samples
  merge exactly: the bottom-k of a union is the bottom-k of the parts'
  bottom-ks (``merge``).  So N workers' or R replicas' samples add up to the
  sample one process would have drawn, whatever the order of the merge, and
  reading them twice gives the same answer (no draw at read time).
- ``mann_whitney(a, b)``: the Mann-Whitney U test (two-sided; normal
  approximation, tie correction, continuity correction).  ``u`` counts the
  pairs (x in a, y in b) with x > y, ties as a half; ``effect`` is
  u / (n_a n_b), the probability that a random value of ``a`` exceeds one of
  ``b`` (0.5: no difference).  Needs at least ``MIN_SAMPLES`` on each side
  (the approximation is poor below; None then).
- ``bootstrap_difference(a, b, q)``: a percentile-bootstrap 95 % interval of
  ``percentile(b, q) - percentile(a, q)``, seeded (the same samples give the
  same interval).  O(rounds x n log n): run where the time is the reader's
  (the ``ab-report`` command), not on a router's loop.
- ``least_squares``: the normal equations of a small linear model (the arms'
  prefix-cache hit rates, router.arms), solved by Gaussian elimination with
  partial pivoting, with each coefficient's 95 % half-width; None when the
  system says nothing (too few rows, or singular).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from .metrics import percentile

__all__ = [
    "MIN_SAMPLES",
    "MannWhitney",
    "bootstrap_difference",
    "least_squares",
    "mann_whitney",
    "merge",
]

MIN_SAMPLES = 20  # per side, for the normal approximation of U (a common textbook bound)

Sample = list[tuple[float, float]]  # (priority, value), any order


def merge(samples: Iterable[Sample], k: int) -> Sample:
    """The bottom-k (lowest priorities) of the union of bottom-k samples."""
    return heapq.nsmallest(k, (pair for sample in samples for pair in sample))


class MannWhitney(NamedTuple):
    u: float  # pairs (x in a, y in b) with x > y, a tie counting a half
    z: float  # normal approximation, continuity-corrected; < 0: a tends lower than b
    p_value: float  # two-sided
    effect: float  # u / (n_a n_b): P(a random x > a random y), 0.5 for no difference


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> MannWhitney | None:
    """Two-sided Mann-Whitney U of ``a`` against ``b`` (see the contract)."""
    n_a, n_b = len(a), len(b)
    if n_a < MIN_SAMPLES or n_b < MIN_SAMPLES:
        return None
    pooled = sorted([(x, 0) for x in a] + [(y, 1) for y in b])
    n = n_a + n_b
    rank_sum_a = 0.0
    ties = 0.0  # sum of t^3 - t over groups of tied values
    i = 0
    while i < n:
        j = i
        while j + 1 < n and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        rank = (i + j) / 2 + 1  # the mean of ranks i+1 .. j+1
        group = j - i + 1
        if group > 1:
            ties += group**3 - group
        for m in range(i, j + 1):
            if pooled[m][1] == 0:
                rank_sum_a += rank
        i = j + 1
    u = rank_sum_a - n_a * (n_a + 1) / 2
    mean = n_a * n_b / 2
    variance = n_a * n_b / 12 * ((n + 1) - ties / (n * (n - 1)))
    if variance <= 0:  # every value the same: no evidence of a difference
        return MannWhitney(u, 0.0, 1.0, u / (n_a * n_b))
    shift = u - mean
    corrected = math.copysign(max(abs(shift) - 0.5, 0.0), shift)  # continuity
    z = corrected / math.sqrt(variance)
    return MannWhitney(u, z, math.erfc(abs(z) / math.sqrt(2)), u / (n_a * n_b))


def bootstrap_difference(
    a: Sequence[float], b: Sequence[float], q: float, *, rounds: int = 1000, seed: int = 1
) -> tuple[float, float] | None:
    """95 % percentile-bootstrap interval of P_q(b) - P_q(a) (nearest rank)."""
    if len(a) < MIN_SAMPLES or len(b) < MIN_SAMPLES:
        return None
    rng = random.Random(seed)
    differences = []
    for _ in range(rounds):
        resampled_a = rng.choices(a, k=len(a))
        resampled_b = rng.choices(b, k=len(b))
        differences.append(_at(resampled_b, q) - _at(resampled_a, q))
    return _at(differences, 0.025), _at(differences, 0.975)


def _at(values: Sequence[float], q: float) -> float:
    """``percentile`` of values known not to be empty."""
    found = percentile(values, q)
    assert found is not None
    return found


def least_squares(
    xtx: Sequence[Sequence[float]], xty: Sequence[float], yy: float, rows: int
) -> tuple[list[float], list[float]] | None:
    """Solve (X'X) r = X'y; return r and each coefficient's 95 % half-width
    (1.96 standard errors, from the residuals' variance), or None if the rows
    cannot tell the coefficients apart."""
    k = len(xty)
    if rows < k + 2:
        return None
    scale = max((xtx[i][i] for i in range(k)), default=0.0)
    if scale <= 0:
        return None
    # [X'X | X'y | I]: one elimination gives the solution and the inverse's columns.
    table = [
        [*map(float, xtx[i]), float(xty[i]), *(1.0 if j == i else 0.0 for j in range(k))]
        for i in range(k)
    ]
    for col in range(k):
        pivot = max(range(col, k), key=lambda row: abs(table[row][col]))
        if abs(table[pivot][col]) <= 1e-12 * scale:
            return None  # collinear: e.g. every row had the same mix of arms
        table[col], table[pivot] = table[pivot], table[col]
        head = table[col]
        factor = head[col]
        for j in range(len(head)):
            head[j] /= factor
        for row in range(k):
            if row != col and table[row][col]:
                times = table[row][col]
                line = table[row]
                for j in range(len(line)):
                    line[j] -= times * head[j]
    solution = [table[i][k] for i in range(k)]
    inverse_diagonal = [table[i][k + 1 + i] for i in range(k)]
    fitted = sum(solution[i] * xty[i] for i in range(k))
    quadratic = sum(solution[i] * xtx[i][j] * solution[j] for i in range(k) for j in range(k))
    residuals = max(yy - 2 * fitted + quadratic, 0.0)
    variance = residuals / (rows - k)
    half_widths = [1.96 * math.sqrt(max(variance * d, 0.0)) for d in inverse_diagonal]
    return solution, half_widths
