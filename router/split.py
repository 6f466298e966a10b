"""Split BACKENDS: each arm of an A/B experiment routes over backends of its own.

Contract:
- ``owners(experiment, arms, backends)`` says which backends each arm owns, a
  pure function of the experiment's id, its arms' names and weights and the
  backends' names (not their order, weights, health or state), so every
  worker and replica that sees one membership draws one partition, with no
  state shared.  Sizes: ``quotas``, largest remainder of ``n x weight / sum``
  (ties to the arm first by name), then at least one backend for every arm
  with a weight above 0 (taken from the arm with the most, ties to the last
  by name); an arm of weight 0 owns none.  Places: the backends in the order
  of ``hash(experiment id, name)`` (the name breaks a tie), the arms in the
  order of their names, each taking the next run of its quota's length.  A
  backend added or removed moves the others by one place at most in the
  order, and an arm's quota by one with two arms: then at most one backend
  changes arms (tests/test_arms.py).  With more arms the largest remainder
  can take a seat from one arm as the fleet grows (the Alabama paradox) and
  the runs after it shift: in 60,000 random memberships of 2-40 backends, a
  backend added moved at most 2 others with 3 arms, 4 with 4, 9 with 7-8.  A
  new experiment id draws the order afresh.  With fewer backends than arms of weight above 0
  there is no partition (None): the split is *suspended* and every arm
  routes over the whole fleet, as with Split KEYS, until there are enough
  again (a PUT of such a config is refused with 400, admin.routes).
- ``Split`` applies it to a ``Fleet``: the partition of the *published* ring's
  members (a backend added counts once its ring is published, a removed one
  until then), recomputed when the ring is swapped.  ``part(arm, members)``
  is what the arm routes a request over: the backends of ``members`` (the
  fleet, or a model's pool) that it owns, as a ``Part`` (a ``ModelPool``
  with a ring of its own, kept per membership), or ``members`` itself when
  the split is suspended, when the arm owns no backend of that pool, or
  when none of its own is available (down or draining): the request is
  served by the whole pool rather than failed.  In-flight counts stay the
  fleet's, per backend.
- The arms' rings are built by the fleet (``wanted`` is its ``derive`` hook,
  set by ``router.arms``): in the slices of each rebuild, with the pools'
  rings, and published with them, so a request finds its arm's ring ready.
  Built at once on a request they stalled the loop 5 ms for 4 of 8 backends
  and 112 ms for 128 of 256 on the project's 2-core VM.  Only a request that
  comes between the experiment's start and the end of the rebuild it starts
  builds one at once (``part`` falls back to that).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence

from hashring import Ring, hash_key

from .fleet import Backend, Fleet, ModelPool
from .log import get_logger

__all__ = ["FLEET_PART", "Part", "Split", "owners", "quotas"]

log = get_logger("split")

# The "model" of an arm's Part of the whole fleet: its key among the arm's pools
# and in its placement records' tags; no model name has a comma (router.configstructs).
FLEET_PART = ","

Members = Fleet | ModelPool
_Known = tuple[Members, Ring, tuple[Backend, ...], Members]


def quotas(weights: Sequence[tuple[str, float]], n: int) -> dict[str, int] | None:
    """How many of ``n`` backends each arm owns (see the contract); None if ``n`` is
    below the number of arms with a weight above 0."""
    active = sorted((name, weight) for name, weight in weights if weight > 0)
    if n < len(active):
        return None
    total = sum(weight for _, weight in active)
    shares = {name: n * weight / total for name, weight in active}
    sizes = {name: math.floor(share) for name, share in shares.items()}
    left = n - sum(sizes.values())
    # Largest remainder first; equal remainders to the arm first by name.
    for name, _ in sorted(active, key=lambda a: (-(shares[a[0]] - sizes[a[0]]), a[0]))[:left]:
        sizes[name] += 1
    for name, _ in active:
        if sizes[name] == 0:
            donor = max(sizes, key=lambda other: (sizes[other], other))
            sizes[donor] -= 1
            sizes[name] = 1
    for name, weight in weights:
        if weight <= 0:
            sizes[name] = 0
    return sizes


def owners(
    experiment: str, weights: Sequence[tuple[str, float]], backends: Iterable[str]
) -> dict[str, tuple[str, ...]] | None:
    """Each arm's backends, sorted by name (see the contract); None: suspended."""
    names = set(backends)
    sizes = quotas(weights, len(names))
    if sizes is None:
        return None
    order = sorted(names, key=lambda name: (hash_key(f"{experiment}\x1f{name}".encode()), name))
    owned: dict[str, tuple[str, ...]] = {}
    start = 0
    for arm in sorted(sizes):
        stop = start + sizes[arm]
        owned[arm] = tuple(sorted(order[start:stop]))
        start = stop
    return owned


class Part(ModelPool):
    """An arm's own backends of a pool (or of the fleet: model ``FLEET_PART``)."""

    __slots__ = ()

    def __init__(self, source: Members, names: tuple[str, ...], ring: Ring) -> None:
        mine = set(names)
        available = tuple(b for b in source.available if b.name in mine)
        model = FLEET_PART if source.model is None else source.model
        created = source.created if isinstance(source, ModelPool) else 0
        super().__init__(model, names, ring, available, created)


class Split:
    """The partition of one fleet between an experiment's arms (see the contract)."""

    __slots__ = ("_experiment", "_fleet", "_owned", "_parts", "_ring", "_rings", "_weights")

    def __init__(self, fleet: Fleet, experiment: str, weights: Sequence[tuple[str, float]]):
        self._fleet = fleet
        self._experiment = experiment
        self._weights = tuple(weights)
        self._ring: Ring | None = None  # the published ring the partition was drawn from
        self._owned: dict[str, tuple[str, ...]] | None = None
        # (arm, pool's model or None) -> (the pool, its ring and available backends
        # then, what the arm routes it over: a Part, or the pool itself)
        self._parts: dict[tuple[str, str | None], _Known] = {}
        # membership -> ring: a health change rebuilds no ring
        self._rings: dict[tuple[frozenset[tuple[str, int]], frozenset[object]], Ring] = {}

    def owned(self) -> Mapping[str, tuple[str, ...]] | None:
        """Each arm's backends now; None: suspended (fewer backends than arms)."""
        ring = self._fleet.ring
        if ring is not self._ring:
            was = self._ring is None or self._owned is not None
            self._ring = ring
            self._owned = owners(self._experiment, self._weights, ring.weights)
            self._parts.clear()
            if len(self._rings) > 64:  # memberships seen: a bound, not a history
                self._rings.clear()
            if self._owned is None and was:
                log.warning(
                    "split suspended: fewer backends than arms",
                    experiment=self._experiment,
                    backends=len(ring),
                    arms=sum(1 for _, weight in self._weights if weight > 0),
                )
            elif self._owned is not None and not was:
                log.info("split resumed", experiment=self._experiment, backends=len(ring))
        return self._owned

    def wanted(
        self, ring: Ring, pools: Mapping[str, Ring]
    ) -> Iterator[tuple[dict[str, int], dict[str, tuple[int, int]]]]:
        """``Fleet.derive``: each arm's own backends of the fleet's ``ring`` and of each
        pool's, as ``part`` will ask for them once that ring is published."""
        owned = owners(self._experiment, self._weights, ring.weights)
        if owned is None:
            return
        for mine in owned.values():
            for source in (ring, *pools.values()):
                weights, fractions = _own(source, mine)
                if weights:
                    yield weights, fractions

    def part(self, arm: str, members: Members) -> Members:
        """What ``arm`` routes a request for ``members`` over (see the contract)."""
        if isinstance(members, Part):
            return members
        owned = self.owned()
        if owned is None:
            return members
        key = (arm, members.model)
        ring, available = members.ring, members.available
        known = self._parts.get(key)
        # A pool is rebuilt on every change, the fleet swaps its ring and its
        # available backends by reference: identity says whether this is current.
        if known is not None and known[0] is members and known[1] is ring and known[2] is available:
            return known[3]
        found = self._part(owned.get(arm, ()), members)
        self._parts[key] = (members, ring, available, found)
        return found

    def _part(self, mine: tuple[str, ...], members: Members) -> Members:
        ring = members.ring
        weights, fractions = _own(ring, mine)
        if not weights:
            return members  # it owns no backend of this pool
        membership = (frozenset(weights.items()), frozenset(fractions.items()))
        own = self._rings.get(membership) or self._fleet.derived_ring(weights, fractions)
        if own is None:  # not built by the fleet's rebuild yet (see the contract)
            own = ring.with_weights(weights, fractions)
        self._rings[membership] = own
        part = Part(members, tuple(sorted(weights)), own)
        return part if part.available else members


def _own(ring: Ring, mine: Iterable[str]) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """The weights and slow-start fractions of ``ring``'s members in ``mine``: the one
    membership ``wanted`` asks the fleet to build and ``_part`` looks up, so the two
    always name the same ring."""
    mine = set(mine)
    weights = {name: weight for name, weight in ring.weights.items() if name in mine}
    fractions = {name: part for name, part in ring.fractions.items() if name in weights}
    return weights, fractions
