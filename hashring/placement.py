"""Sticky placement bounded by traffic share (``BalanceMode`` TRAFFIC).

Why: bounding *in-flight* counts (``bounded.pick``) is exact and stateless, but
at the low concurrency of cached LLM traffic (a few requests in flight per
server) the bound is crossed by noise, and every crossing sends a prefix to a
cold neighbour.  With a few hot prefixes hashed onto few servers, shares then
follow the luck of the hash (Zipf keys on 7 servers: 11-17 %, measured).
Here the bound is applied once, when a key is *placed*, against each
member's share of recent traffic; the key then sticks to where it was put.

Contract:
- ``route`` returns the member for a key hash: its sticky member if it has one
  that is on the ring, not avoided and below ``threshold`` in flight
  (``PRIMARY``); else, for a key whose home is on the ring (avoided or at its
  threshold), the first member of the walk below ``threshold`` (``OVERFLOW``,
  the key keeps its home); else, for a new key or one whose home left the
  ring, the first member of the walk whose share of the last ``window``
  decisions is below ``factor`` times its weighted fair share and whose
  in-flight count is below ``threshold`` (``PRIMARY`` at position 0, else
  ``OVERFLOW``), which becomes the key's home.  When nobody qualifies, the
  traffic bound is dropped first, then the threshold (``FALLBACK``, fewest
  in flight), as in ``bounded.pick``.
- Hot keys are served by replicas.  A key is *hot* when its share of the
  decisions so far (the last ``window``, or all of them while fewer) is above
  ``HOT_SHARE`` (1.5) average members' shares *and* that count is evidence,
  not luck: a key that carried no more than one member's fair share would
  reach it with probability below ``HOT_EVIDENCE`` (1e-3, the Chernoff bound
  ``exp(-n D(k/n || 1/members))`` on the binomial tail of its count ``k`` in
  ``n`` decisions).  So a key in every request is hot after 4 decisions on 7
  members (10 on 2), a key in 11 of the first 22 after those 22, one of 37 %
  of requests on 7 members after ~45 (``hotdocs``: 59; the former rule: 596),
  while in a full window (>= 100 decisions a member) 1.5 shares always pass
  the test: there the rule is the plain share test.  Tested on every decision,
  a key of exactly one fair share (the hardest case) was called hot in 4 of
  400 seeded runs of 3,000 decisions on 7 members, 1 of 400 on 2 (at 1e-4:
  none, but the 37 % key takes ~60 decisions, and on ``hotdocs`` a fresh
  start's P90 TTFT lost to RANDOM's in one of three seeds).  A false hot key
  costs a few cold prefills on a replica, a missed one a queue.  A hot key
  would, on its home alone, be a hot spot that no placement of other keys can
  offset (one shared system prompt: every request).  Its requests go to
  ``ceil(share)`` replicas, its home and the next members of its walk (an
  avoided one is replaced by the next), each request to the replica with the
  fewest ``fallback_loads`` in flight among those below ``threshold``
  (``PRIMARY`` for the home, else ``OVERFLOW`` at its place among the
  replicas, counting, as walks do, only members not avoided); the key keeps
  its home.  Past
  ``SCAN_REPLICAS`` replicas a request compares two of them, in rotation
  (the power of two choices), so the cost per request does not grow with the
  fleet.  ``Placement(..., hot_evidence=None)`` restores the former rule:
  shares count against the full window, so no key looks hot before ~1.5
  shares of it (220 decisions on 7 members) have gone by.
- ``ranks`` (optional, lower first: the router's engine queues,
  ``router.signals``) breaks ties and nothing else: between a hot key's
  replicas with the same ``fallback_loads`` (before the fewest recent
  requests), and in the fallback (``bounded.walk``).  A key's home, its
  overflow in walk order and every bound are decided without it.
- Every routed request counts in the window; the table remembers at most
  ``capacity`` keys, least recently used first out.
- ``peek`` is ``route`` without its effects (the admin API's dry run,
  ``router.explain``): the same answer from the same state, and nothing
  changes: no home placed or refreshed, nothing counted, no replica rotation
  advanced, no replica list cached, no window refitted (a window ``route``
  would refit first, after a membership change, is read as refitted).
- ``adopt`` and ``observe`` apply another router replica's decisions (a home
  it placed, a request it counted), so that replicas share one placement
  (``hashring.shared.PlacementLog``); a replica alone never calls them.
  ``scan_replicas`` (default ``SCAN_REPLICAS``) is where two replicas start
  to be compared instead of all: replicas that see each other's loads late
  set it lower (``hashring.shared.STALE_SCAN_REPLICAS``).
- Trade-off, stated: placement depends on this process's recent traffic, so
  two router replicas agree on the ring but not always on new keys; and an
  added member takes only new keys until old ones age out of the table.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping, Set
from itertools import islice

from .bounded import Decision, Pick, Ranked, exact_factor, walk
from .ring import Ring

__all__ = ["Placement"]

_new_pick = tuple.__new__  # NamedTuple's __new__ is Python code (hashring.bounded)

DEFAULT_CAPACITY = 1 << 16
WINDOW_PER_MEMBER = 100
MIN_WINDOW = 1024
# A key above this many average members' shares of recent traffic is served by
# replicas. Measured offline (loadtests/RESULTS.md): on `long` and `short` no
# key reaches it, and nothing changes; on `sysprompt` it ends the hot spot.
HOT_SHARE = 1.5
# ... and when its count in n decisions would be this unlikely (Chernoff bound) for
# a key of one member's fair share: the evidence a hot key needs, from few decisions.
HOT_EVIDENCE = 1e-3
# n D(1.5 p || p) at 1.5 shares in a full window (>= WINDOW_PER_MEMBER decisions a
# member, n p >= 100): at least 100 (1.5 ln 1.5 - 0.5) = 10.8 nats, more for larger p.
_FULL_WINDOW_SURPRISE = WINDOW_PER_MEMBER * (1.5 * math.log(1.5) - 0.5)
# Up to this many replicas each request compares them all; past it, two of them
# (the power of two choices), so a hot key costs O(1) per request on any fleet.
SCAN_REPLICAS = 8


class Placement:
    __slots__ = (
        "_counts",
        "_factor",
        "_hot_log",
        "_key_counts",
        "_recent",
        "_replica_ring",
        "_replicas",
        "_share_ratio",
        "_table",
        "_tick",
        "capacity",
        "scan_replicas",
    )

    def __init__(
        self,
        factor: float,
        *,
        capacity: int = DEFAULT_CAPACITY,
        hot_evidence: float | None = HOT_EVIDENCE,
    ):
        self.factor = factor  # checked, and kept as an exact fraction too (below)
        self.capacity = capacity
        if hot_evidence is not None and not 0 < hot_evidence < 1:
            raise ValueError(f"hot_evidence must be in (0, 1) or None, got {hot_evidence}")
        # -ln(evidence): what n * D(k/n || 1/members) must exceed; None: full window.
        self._hot_log = None if hot_evidence is None else -math.log(hot_evidence)
        self._table: OrderedDict[int, str] = OrderedDict()
        # The last ``window`` decisions, (member, key hash), and their tallies.
        self._recent: deque[tuple[str, int]] = deque(maxlen=MIN_WINDOW)
        self._counts: Counter[str] = Counter()
        self._key_counts: dict[int, int] = {}
        # Hot keys' replica lists (home, then its walk), for the ring they came from.
        self._replicas: dict[int, list[str]] = {}
        self._replica_ring: Ring | None = None
        self._tick = 0
        self.scan_replicas = SCAN_REPLICAS  # past it, two replicas (see the contract)

    @property
    def factor(self) -> float:
        return self._factor

    @factor.setter
    def factor(self, factor: float) -> None:
        if factor < 1:
            raise ValueError(f"balance factor must be at least 1.0, got {factor}")
        self._factor = factor
        self._share_ratio = exact_factor(factor)

    def __len__(self) -> int:
        return len(self._table)

    def home(self, key_hash: int) -> str | None:
        return self._table.get(key_hash)

    def share(self, member: str) -> int:
        """Requests routed to ``member`` among the last ``window`` decisions."""
        return self._counts[member]

    @property
    def window(self) -> int:
        return self._recent.maxlen or MIN_WINDOW

    @property
    def decisions(self) -> int:
        """Decisions in the window now (at most ``window``)."""
        return len(self._recent)

    def peek(
        self,
        ring: Ring,
        key_hash: int,
        loads: Mapping[str, int],
        threshold: int,
        *,
        avoid: Set[str] = frozenset(),
        fallback_loads: Mapping[str, int] | None = None,
        ranks: Mapping[str, int] | None = None,
    ) -> Pick | None:
        """What ``route`` would return now, with the same arguments; changes nothing.

        Admin-path code (a dry run): it may allocate, never on the request path."""
        size = max(MIN_WINDOW, WINDOW_PER_MEMBER * len(ring))
        if size != self._recent.maxlen:
            # ``route`` would refit the window first: read a refitted copy instead.
            shadow = Placement(self.factor, capacity=self.capacity)
            shadow._hot_log = self._hot_log
            shadow._table = self._table  # read only below
            shadow._tick = self._tick
            shadow.scan_replicas = self.scan_replicas
            shadow._recent = deque(list(self._recent)[-size:], maxlen=size)
            shadow._counts = Counter(member for member, _ in shadow._recent)
            shadow._key_counts = dict(Counter(key for _, key in shadow._recent))
            return shadow.peek(
                ring,
                key_hash,
                loads,
                threshold,
                avoid=avoid,
                fallback_loads=fallback_loads,
                ranks=ranks,
            )
        if fallback_loads is None:
            fallback_loads = loads
        home = self._table.get(key_hash)
        if home is None or home not in ring:
            chosen = self._walk(
                ring, key_hash, loads, fallback_loads, threshold, avoid, ranks, bounded=True
            )
            return chosen
        members = len(ring)
        share = self._hot(self._key_counts.get(key_hash, 0), members)
        chosen = None
        if share:
            chosen = self._replica(
                ring,
                key_hash,
                home,
                share,
                threshold,
                loads,
                fallback_loads,
                avoid,
                ranks,
                peek=True,
            )
        if chosen is None and home not in avoid and loads.get(home, 0) < threshold:
            return Pick(home, Decision.PRIMARY, 0)
        if chosen is None:
            chosen = self._walk(
                ring, key_hash, loads, fallback_loads, threshold, avoid, ranks, bounded=False
            )
            if chosen is not None and chosen.decision is Decision.PRIMARY:
                chosen = Pick(chosen.member, Decision.OVERFLOW, chosen.position)
        return chosen

    def route(
        self,
        ring: Ring,
        key_hash: int,
        loads: Mapping[str, int],
        threshold: int,
        *,
        avoid: Set[str] = frozenset(),
        fallback_loads: Mapping[str, int] | None = None,
        ranks: Mapping[str, int] | None = None,
    ) -> Pick | None:
        """The member for ``key_hash``.  ``loads`` is what ``threshold`` bounds;
        when every member is at it, the one with the fewest ``fallback_loads``
        (default ``loads``) takes the request; ``ranks`` breaks ties (the contract)."""
        if fallback_loads is None:
            fallback_loads = loads
        members = len(ring)
        self._fit_window(members)
        home = self._table.get(key_hash)
        chosen: Pick | None = None
        if home is not None and home in ring:
            self._table.move_to_end(key_hash)
            count = self._key_counts.get(key_hash, 0)
            # The common case inline (a method call costs more than the test): a
            # key at most 1.5 shares of the decisions so far is not hot by any rule.
            share = (
                self._hot(count, members)
                if count * members > HOT_SHARE * len(self._recent)
                else 0.0
            )
            if share:
                chosen = self._replica(
                    ring, key_hash, home, share, threshold, loads, fallback_loads, avoid, ranks
                )
            if chosen is None and home not in avoid and loads.get(home, 0) < threshold:
                chosen = Pick(home, Decision.PRIMARY, 0)
            elif chosen is None:
                # Home is avoided (down, draining, tried) or at its threshold: the
                # walk passes it by (or, when all are at theirs, may return it as
                # the least loaded).  Not a new home.
                chosen = self._walk(
                    ring, key_hash, loads, fallback_loads, threshold, avoid, ranks, bounded=False
                )
                if chosen is not None and chosen.decision is Decision.PRIMARY:
                    chosen = Pick(chosen.member, Decision.OVERFLOW, chosen.position)
            # else: a hot key's replica
        else:
            chosen = self._walk(
                ring, key_hash, loads, fallback_loads, threshold, avoid, ranks, bounded=True
            )
            if chosen is not None and chosen.decision is not Decision.FALLBACK:
                self._remember(key_hash, chosen.member)
        if chosen is not None:
            self._count(chosen.member, key_hash)
        return chosen

    def hot_share(self, key_hash: int, members: int) -> float:
        """The key's share in average members' shares if it is hot, else 0.0."""
        return self._hot(self._key_counts.get(key_hash, 0), members)

    def _hot(self, count: int, members: int) -> float:
        if self._hot_log is None:  # the former rule: against the full window
            share = count * members / self.window
            return share if share > HOT_SHARE else 0.0
        decisions = len(self._recent)
        if count * members <= HOT_SHARE * decisions:
            return 0.0
        if decisions == self._recent.maxlen and self._hot_log < _FULL_WINDOW_SURPRISE:
            # A full window holds >= 100 decisions a member, where more than 1.5
            # shares always pass the test below: skip it.
            return count * members / decisions
        # Chernoff: P(X >= k | n, p) <= exp(-n D(k/n || p)) for a key of fair share p.
        fair = 1 / members
        rate = count / decisions
        surprise = count * math.log(rate / fair)
        if count < decisions:
            surprise += (decisions - count) * math.log((1 - rate) / (1 - fair))
        return rate * members if surprise > self._hot_log else 0.0

    def adopt(self, key_hash: int, member: str) -> None:
        """Make ``member`` the key's home, as another router replica placed it
        (``hashring.shared``): the key becomes the most recently used, as when
        routed here; nothing is counted."""
        self._remember(key_hash, member)

    def observe(self, ring: Ring, key_hash: int, member: str) -> None:
        """Count a request another router replica routed to ``member`` in the
        recent-traffic window (member shares, hot keys), as ``route`` counts its
        own: fed every replica's requests, the window is the fleet's."""
        self._fit_window(len(ring))
        self._count(member, key_hash)

    def _replica(
        self,
        ring: Ring,
        key_hash: int,
        home: str,
        share: float,
        threshold: int,
        loads: Mapping[str, int],
        fallback_loads: Mapping[str, int],
        avoid: Set[str],
        ranks: Mapping[str, int] | None = None,
        *,
        peek: bool = False,
    ) -> Pick | None:
        """The least loaded of a hot key's replicas below ``threshold``, or None.

        Ties (common: a few requests in flight each) go to the lowest of
        ``ranks`` if given, then to the replica with the fewest recent requests;
        by walk order alone the home would win them all.
        Past ``SCAN_REPLICAS`` only two replicas, taken in rotation, are compared;
        if neither can take the request, all are.  ``peek``: neither the rotation
        nor the kept replica lists change.
        """
        count = min(math.ceil(share), len(ring))
        wanted = min(count + len(avoid), len(ring))
        if peek:
            replicas = self.replicas_of(ring, key_hash, home, wanted)
        else:
            replicas = self._replica_list(ring, key_hash, home, wanted)
        if avoid:  # the first ``count`` that can take it: an avoided replica is replaced
            replicas = list(islice((m for m in replicas if m not in avoid), count))
            count = len(replicas)
            if not count:
                return None
        if count > self.scan_replicas:
            tick = self._tick + 1
            if not peek:
                self._tick = tick
            first = tick % count
            second = (first + 1 + (tick // count) % (count - 1)) % count
            chosen = self._least_loaded(
                replicas, (first, second), home, threshold, loads, fallback_loads, ranks
            )
            if chosen is not None:
                return chosen
        return self._least_loaded(
            replicas, range(count), home, threshold, loads, fallback_loads, ranks
        )

    def _least_loaded(
        self,
        replicas: list[str],
        positions: Iterable[int],
        home: str,
        threshold: int,
        loads: Mapping[str, int],
        fallback_loads: Mapping[str, int],
        ranks: Mapping[str, int] | None,
    ) -> Pick | None:
        recent = self._counts
        # Positions: the least loaded by (in flight, recent), and by (in flight, rank,
        # recent) with ranks; integers compared, no tuple a replica.
        plain = best = -1
        plain_load = plain_recent = best_load = best_rank = best_recent = 0
        for position in positions:  # counting only replicas not avoided, as walks do
            member = replicas[position]
            if loads.get(member, 0) >= threshold:
                continue
            load = fallback_loads.get(member, 0)
            seen = recent[member]
            if plain < 0 or load < plain_load or (load == plain_load and seen < plain_recent):
                plain, plain_load, plain_recent = position, load, seen
            if ranks is not None:
                rank = ranks.get(member, 0)
                if (
                    best < 0
                    or load < best_load
                    or (
                        load == best_load
                        and (rank < best_rank or (rank == best_rank and seen < best_recent))
                    )
                ):
                    best, best_load, best_rank, best_recent = position, load, rank, seen
        if ranks is None:
            best = plain
        if best < 0:
            return None
        member = replicas[best]
        decision = Decision.PRIMARY if member == home else Decision.OVERFLOW
        return _new_pick(Ranked if best != plain else Pick, (member, decision, best))

    def _replica_list(self, ring: Ring, key_hash: int, home: str, count: int) -> list[str]:
        """``home`` then the next members of the key's walk, at least ``count`` in
        all; kept per key until the ring changes (a ring is immutable: a change is
        a new one), so a share that wavers does not rebuild it."""
        if ring is not self._replica_ring:
            self._replicas.clear()
            self._replica_ring = ring
        replicas = self._replicas.get(key_hash)
        if replicas is None or len(replicas) < count or replicas[0] != home:
            replicas = self.replicas_of(ring, key_hash, home, count)
            if len(self._replicas) >= len(ring):  # only a few keys are hot at a time
                self._replicas.clear()
            self._replicas[key_hash] = replicas
        return replicas

    @staticmethod
    def replicas_of(ring: Ring, key_hash: int, home: str, count: int) -> list[str]:
        """``home`` then the next members of the key's walk, ``count`` in all."""
        replicas = [home]
        for member in ring.walk(key_hash):
            if len(replicas) == count:
                break
            if member != home:
                replicas.append(member)
        return replicas

    def _walk(
        self,
        ring: Ring,
        key_hash: int,
        loads: Mapping[str, int],
        fallback_loads: Mapping[str, int],
        threshold: int,
        avoid: Set[str],
        ranks: Mapping[str, int] | None,
        *,
        bounded: bool,
    ) -> Pick | None:
        share_num = share_den = 0
        if bounded:
            weights = ring.weights
            total_weight = sum(w for name, w in weights.items() if name not in avoid)
            if total_weight:
                # c * (window decisions + this one) * weight / total weight, in
                # integers as bounded.walk does: ceil(share_num * weight / share_den).
                factor = self._share_ratio
                share_num = factor.numerator * (len(self._recent) + 1)
                share_den = factor.denominator * total_weight
        return walk(
            ring,
            key_hash,
            avoid,
            loads,
            threshold,
            share_num,
            share_den,
            self._counts,
            fallback_loads,
            soft=True,
            ranks=ranks,
        )

    def _remember(self, key_hash: int, member: str) -> None:
        table = self._table
        table[key_hash] = member
        table.move_to_end(key_hash)
        if len(table) > self.capacity:
            table.popitem(last=False)

    def _count(self, member: str, key_hash: int) -> None:
        recent, counts, key_counts = self._recent, self._counts, self._key_counts
        if len(recent) == recent.maxlen:
            old_member, old_key = recent[0]
            counts[old_member] -= 1
            left = key_counts[old_key] - 1
            if left:
                key_counts[old_key] = left
            else:
                del key_counts[old_key]  # the tally stays as small as the window
        recent.append((member, key_hash))
        counts[member] = counts.get(member, 0) + 1  # dict.get: no Counter.__missing__ call
        key_counts[key_hash] = key_counts.get(key_hash, 0) + 1

    def _fit_window(self, members: int) -> None:
        size = max(MIN_WINDOW, WINDOW_PER_MEMBER * members)
        if size != self._recent.maxlen:
            kept = list(self._recent)[-size:]
            self._recent = deque(kept, maxlen=size)
            self._counts = Counter(member for member, _ in kept)
            self._key_counts = dict(Counter(key for _, key in kept))
