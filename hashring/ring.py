"""An immutable consistent-hash ring over named, weighted members.

Contract:
- Point ``idx`` of member ``name`` sits at ``hash_key(b"idx:name")``; a member
  owns its points ``0 .. count - 1``.  While the whole ring fits the point
  budget (``vnodes * total_weight <= max_points``), ``count = vnodes *
  weight``; past it, ``count = max(1, max_points * weight // total_weight)``:
  points per weight unit shrink so that the ring stays at about ``max_points``
  (1,000 backends all of weight 100 get ~2,097 points each, as 2,048 of
  weight 1 would).  The two formulas agree at the boundary.
- Fractions (slow start, ``router.slowstart``): a member may own only
  ``k/n`` of its points, ``max(1, count * k // n)``, the first ones.  Its
  weight (``weights``, ``total_weight``: what load bounds and traffic shares
  compare) stays the whole one.  Since a member's points are always its first
  ``count``, raising ``k`` only adds points: keys move only *to* it.
- Points are sorted by ``(hash, name)``, so two equal 64-bit points (a
  collision) are ordered the same way everywhere: the same membership gives
  the same ring in any order of changes and in any process.
- Movement: within the budget, a change moves only keys to or from the member
  it changes (an add moves ~1/(n+1) of the keys, all to the newcomer).  Past
  the budget every member's count follows the total weight, so a change also
  trims or extends the others' last points: about as many keys again move
  between unchanged members (an add moves ~2/(n+1)).
- Rings never change.  ``steps_to(weights)`` builds the ring for a new
  membership in steps of bounded work (a generator whose return value is the
  ring; ~1 ms per step), reusing the point hashes of this ring, so that a
  caller on an event loop can interleave it with other work and publish the
  result by reference.  ``with_weights``, ``with_member``, ``without_member``,
  ``with_weight`` and the constructor run those steps at once.
- ``walk(h)`` is the preference list of a key hash: the distinct members met
  clockwise from the first point at or after ``h`` (wrapping), each once.
  ``primary(h)`` is its first element, without building the walk.
- Memory: 8 bytes per point for its hash, 2 (4 past 65,535 members) for its
  owner's rank, ~4 for the bucket index and 8 for the per-member hash cache:
  ~45 MB at the budget, in arrays: no object per point for the garbage
  collector to traverse, nothing to free point by point.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import deque
from collections.abc import Generator, Iterator, Mapping
from itertools import repeat
from operator import call, itemgetter, rshift
from types import MappingProxyType

from .keys import _murmur128 as murmur128

__all__ = ["DEFAULT_VNODES", "MAX_POINTS", "Ring", "check_weight"]

# Points per weight unit.  Ketama and nginx use 160, but a member's share of
# the hash space is a sum of k exponential gaps, so its relative spread is
# about 1/sqrt(k): with 160 points the worst of 7 members is typically 13 %
# off its share and often 18 %.  1024 points bring the worst of 7 to ~5 %
# (under 10 % in 200 trials) and the worst of 64 to ~9 % (measured: see
# tests/test_hashring_ring.py), at 8 bytes and one bisect level per doubling.
DEFAULT_VNODES = 1024

# The point budget: 2,048 members of weight 1 at the default vnodes (so 2,001
# backends keep exact consistent hashing), ~60 MB, and a rebuild of ~1 s of
# work in ~1 ms steps.  Past it, shares stay as accurate as 2,048 members'
# (1/sqrt(points per member)), and changes move a little more (see above).
MAX_POINTS = 1 << 21

_SPACE = 1 << 64
# Work per step of a build, in points: ~0.3-1 ms of pure Python.
_STEP = 2048
# Points per sorting bucket: the points are bucketed by their top bits and
# each small bucket sorted on its own, so no single C call (one big sort) runs
# for long and the build can pause between buckets.
_BUCKET_BITS = 8

_first_item = itemgetter(0)


def _hashes(name: str, start: int, stop: int) -> Iterator[int]:
    """Hashes of points ``start``..``stop - 1`` of ``name``: ``hash_key(b"idx:name")``."""
    encoded = name.encode()
    keys = map(b"%d:%b".__mod__, zip(range(start, stop), repeat(encoded)))
    return map(_first_item, map(murmur128, keys))


class Ring:
    __slots__ = (
        "_counts",
        "_first",
        "_fractions",
        "_hashes_of",
        "_max_points",
        "_names",
        "_owners",
        "_points",
        "_shift",
        "_total_weight",
        "_view",
        "_vnodes",
        "_weights",
    )

    def __init__(
        self,
        weights: Mapping[str, int] | None = None,
        *,
        vnodes: int = DEFAULT_VNODES,
        max_points: int = MAX_POINTS,
        fractions: Mapping[str, tuple[int, int]] | None = None,
    ):
        if vnodes < 1:
            raise ValueError(f"vnodes must be at least 1, got {vnodes}")
        if max_points < 1:
            raise ValueError(f"max_points must be at least 1, got {max_points}")
        self._vnodes = vnodes
        self._max_points = max_points
        for _ in self._fill(dict(weights or {}), {}, fractions):
            pass

    def _fill(
        self,
        weights: dict[str, int],
        cache: Mapping[str, array[int]],
        fractions: Mapping[str, tuple[int, int]] | None = None,
    ) -> Generator[None, None, Ring]:
        """Build this ring's tables for ``weights`` in steps; ``cache`` holds known hashes.

        A cached array holds the hashes of points 0, 1, ... of its member; it
        may be longer than the count a ring uses (rings read only their count)
        and is extended in place, which older rings sharing it never see.
        """
        for name, weight in weights.items():
            check_weight(name, weight)
        total_weight = sum(weights.values())
        names = sorted(weights)
        vnodes, budget = self._vnodes, self._max_points
        if vnodes * total_weight <= budget:
            counts = {name: vnodes * weights[name] for name in names}
        else:
            counts = {name: max(1, budget * weights[name] // total_weight) for name in names}
        kept: dict[str, tuple[int, int]] = {}
        for name, (part, whole) in (fractions or {}).items():
            if name not in weights:
                continue  # a pool's ring gets the fleet's fractions: only its members'
            if not 1 <= part <= whole:
                raise ValueError(f"fraction of {name!r} must be k/n with 1 <= k <= n")
            if part < whole:
                kept[name] = (part, whole)
                counts[name] = max(1, counts[name] * part // whole)
        hashes_of: dict[str, array[int]] = {}
        for name in names:
            count = counts[name]
            known = cache.get(name)
            if known is None:
                known = array("Q")
            elif len(known) > 2 * count + _STEP:
                known = known[:count]  # shrunk a lot: do not keep the tail alive
            while len(known) < count:
                start = len(known)
                known.extend(_hashes(name, start, min(count, start + _STEP)))
                yield
            hashes_of[name] = known

        # Bucket sort: by the top bits of the hash into buckets of 256-512 points (in
        # member order, so a stable sort within a bucket breaks hash ties by
        # name), then each bucket sorted alone.  The loops are C-level maps.
        size = sum(counts.values())
        # About one index bucket per 1-2 points: a lookup bisects 0-2 points.
        index_bits = max(1, size.bit_length() - 1)
        sort_bits = max(0, index_bits - _BUCKET_BITS)
        sort_shift = 64 - sort_bits
        bucket_hashes: list[array[int]] = []
        bucket_ranks: list[array[int]] = []
        for start in range(0, 1 << sort_bits, _STEP):
            batch = min(_STEP, (1 << sort_bits) - start)
            bucket_hashes.extend(map(array, repeat("Q", batch)))
            bucket_ranks.extend(map(array, repeat("I", batch)))
            yield
        add_hash = [bucket.append for bucket in bucket_hashes]
        add_rank = [bucket.append for bucket in bucket_ranks]
        for rank, name in enumerate(names):
            known, count = hashes_of[name], counts[name]
            for start in range(0, count, _STEP):
                chunk = known[start : min(count, start + _STEP)]
                ids = list(map(rshift, chunk, repeat(sort_shift)))
                _drain(map(call, map(add_hash.__getitem__, ids), chunk))
                _drain(map(call, map(add_rank.__getitem__, ids), repeat(rank)))
                yield
        del add_hash, add_rank

        # Sorted tables, and the index over the top ``index_bits``: first[b] is
        # the index of the first point at or above bucket b's start.
        points: array[int] = array("Q")
        # Owners as ranks into ``names``, in an array: no Python object per point
        # for the garbage collector to traverse (a tuple of a million names is
        # traversed by the first collection that meets it: milliseconds), and
        # nothing to join or free point by point when a ring is published.
        owners: array[int] = array("H" if len(names) <= 0xFFFF else "I")
        first: array[int] = array("I" if size < 1 << 32 else "Q")
        shift = 64 - index_bits
        per_sort_bucket = 1 << (index_bits - sort_bits)
        step = 1 << shift
        done = 0
        for bucket in range(1 << sort_bits):
            hashes, ranks = bucket_hashes[bucket], bucket_ranks[bucket]
            bucket_hashes[bucket] = bucket_ranks[bucket] = _EMPTY  # free as we go
            lo = len(points)
            start = bucket * per_sort_bucket * step
            if not hashes:
                first.extend(repeat(lo, per_sort_bucket))
                continue
            # Stable: equal hashes keep member (name) order.  No tuples: they
            # would be a million objects for the garbage collector to track.
            order = sorted(range(len(hashes)), key=hashes.__getitem__)
            ordered = list(map(hashes.__getitem__, order))
            points.extend(ordered)
            owners.extend(map(ranks.__getitem__, order))
            first.extend(
                map(
                    lo.__add__,
                    map(
                        bisect_left,
                        repeat(ordered),
                        range(start, start + per_sort_bucket * step, step),
                    ),
                )
            )
            done += len(ordered) + per_sort_bucket
            if done >= _STEP:
                done = 0
                yield
        first.append(len(points))

        self._weights = weights
        self._fractions = MappingProxyType(kept)
        self._view = MappingProxyType(weights)
        self._total_weight = total_weight
        self._counts = counts
        self._hashes_of = hashes_of
        self._points = points
        self._names = tuple(names)
        self._owners = owners
        self._first = first
        self._shift = shift
        return self

    def _blank(self) -> Ring:
        ring = Ring.__new__(Ring)
        ring._vnodes = self._vnodes
        ring._max_points = self._max_points
        return ring

    # -- membership changes: each returns a new ring --------------------------

    def steps_to(
        self,
        weights: Mapping[str, int],
        fractions: Mapping[str, tuple[int, int]] | None = None,
    ) -> Generator[None, None, Ring]:
        """The ring for membership ``weights``, built in steps (see the contract)."""
        return self._blank()._fill(dict(weights), self._hashes_of, fractions)

    def with_weights(
        self,
        weights: Mapping[str, int],
        fractions: Mapping[str, tuple[int, int]] | None = None,
    ) -> Ring:
        """The ring for membership ``weights``, built at once (``steps_to`` run to the end)."""
        ring = self._blank()
        for _ in ring._fill(dict(weights), self._hashes_of, fractions):
            pass
        return ring

    def with_member(self, name: str, weight: int = 1) -> Ring:
        if name in self._weights:
            raise KeyError(f"member {name!r} is already on the ring")
        return self.with_weights(
            {**self._weights, name: check_weight(name, weight)}, self._fractions
        )

    def without_member(self, name: str) -> Ring:
        if name not in self._weights:
            raise KeyError(f"member {name!r} is not on the ring")
        return self.with_weights(
            {n: w for n, w in self._weights.items() if n != name}, self._fractions
        )

    def with_weight(self, name: str, weight: int) -> Ring:
        if name not in self._weights:
            raise KeyError(f"member {name!r} is not on the ring")
        # Point idx of a member does not depend on its weight, so a reweight
        # keeps the points it had and only adds or drops the tail.
        return self.with_weights(
            {**self._weights, name: check_weight(name, weight)}, self._fractions
        )

    # -- reading ------------------------------------------------------------

    @property
    def vnodes(self) -> int:
        return self._vnodes

    @property
    def max_points(self) -> int:
        return self._max_points

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(sorted(self._weights))

    @property
    def weights(self) -> Mapping[str, int]:
        return self._view

    @property
    def fractions(self) -> Mapping[str, tuple[int, int]]:
        """Members that own only ``k/n`` of their points (slow start): name -> (k, n)."""
        return self._fractions

    @property
    def total_weight(self) -> int:
        return self._total_weight

    def weight(self, name: str) -> int:
        return self._weights[name]

    def points_of(self, name: str) -> int:
        """How many points ``name`` owns (see the contract)."""
        return self._counts[name]

    def __len__(self) -> int:
        return len(self._weights)

    def __contains__(self, name: object) -> bool:
        return name in self._weights

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Ring):
            return NotImplemented
        # Every member owns a point: equal points and owner ranks mean equal names.
        return (
            self._points == other._points
            and self._owners == other._owners
            and self._names == other._names
        )

    def __hash__(self) -> int:
        return hash((self._points.tobytes(), self._owners.tobytes(), self._names))

    def __repr__(self) -> str:
        fractions = f", fractions={dict(self._fractions)!r}" if self._fractions else ""
        return f"Ring({dict(sorted(self._weights.items()))!r}, vnodes={self._vnodes}{fractions})"

    def ownership(self) -> dict[str, float]:
        """Exact share of the 64-bit hash space each member owns as primary."""
        points, owners, names = self._points, self._owners, self._names
        owned = [0] * len(names)
        if points:
            # The key space is [0, 2**64); keys above the last point wrap to the first.
            previous = points[-1] - _SPACE
            for point, owner in zip(points, owners, strict=True):
                owned[owner] += point - previous
                previous = point
        return {name: span / _SPACE for name, span in zip(names, owned, strict=True)}

    # -- lookups --------------------------------------------------------------

    def primary(self, key_hash: int) -> str | None:
        """The member owning ``key_hash``, or None on an empty ring."""
        points = self._points
        if not points:
            return None
        return self._names[self._owners[self._index(key_hash) % len(points)]]

    def _index(self, key_hash: int) -> int:
        """Index of the first point at or after ``key_hash`` (``len`` if none)."""
        bucket = key_hash >> self._shift
        lo = self._first[bucket]
        hi = self._first[bucket + 1]
        return lo if lo == hi else bisect_left(self._points, key_hash, lo, hi)

    def walk(self, key_hash: int) -> Iterator[str]:
        """Yield each member once, in clockwise order from ``key_hash``."""
        owners, names = self._owners, self._names
        if not owners:
            return
        start = self._index(key_hash)
        remaining = len(names)
        seen: set[int] = set()
        for index in range(start, start + len(owners)):
            owner = owners[index % len(owners)]
            if owner not in seen:
                seen.add(owner)
                yield names[owner]
                remaining -= 1
                if not remaining:
                    return


_EMPTY: array[int] = array("Q")


def _drain(calls: Iterator[object]) -> None:
    """Run a lazy map for its effects, in C (a zero-length deque)."""
    deque(calls, maxlen=0)


def check_weight(name: str, weight: int) -> int:
    """``weight`` if it is a positive integer, else ValueError naming ``name``."""
    if isinstance(weight, bool) or not isinstance(weight, int) or weight < 1:
        raise ValueError(f"weight of {name!r} must be a positive integer, got {weight!r}")
    return weight
