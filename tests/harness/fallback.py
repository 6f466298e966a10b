"""The saturated fallback's answer, written from the contract in ``hashring.bounded``
(not from its code), for the tests that check picks against it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from hashring.bounded import FALLBACK_TOLERANCE


def expected_fallback(
    walk: Sequence[str],
    in_flight: Mapping[str, int],
    threshold: int,
    *,
    counted: Mapping[str, int] | None = None,
    ranks: Mapping[str, int] | None = None,
) -> str:
    """The member a saturated ``walk`` (members not avoided, in order) falls back to.

    The least loaded by ``in_flight`` and every member within the tolerance of
    its queue past ``threshold`` (its ``counted`` load, the threshold's own
    count; ``in_flight`` when not given) tie; of those the lowest rank wins,
    then the earliest.
    """
    counted = in_flight if counted is None else counted
    least = min(in_flight.get(m, 0) for m in walk)
    first = next(m for m in walk if in_flight.get(m, 0) == least)
    queue = max(0, counted.get(first, 0) - threshold)
    ceiling = least + math.floor(FALLBACK_TOLERANCE * queue)
    tied = [m for m in walk if in_flight.get(m, 0) <= ceiling]
    ranks = ranks or {}
    best = min(ranks.get(m, 0) for m in tied)
    return next(m for m in tied if ranks.get(m, 0) == best)
