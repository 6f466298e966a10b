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
  (``PRIMARY``); else, for a key seen before, the first member of the walk
  below ``threshold`` (``OVERFLOW``, the key keeps its home); else, for a new
  key, the first member of the walk whose share of the last ``window``
  decisions is below ``factor`` times its weighted fair share and whose
  in-flight count is below ``threshold`` (``PRIMARY`` at position 0, else
  ``OVERFLOW``), which becomes the key's home.  When nobody qualifies, the
  traffic bound is dropped first, then the threshold (``FALLBACK``, fewest
  in flight), as in ``bounded.pick``.
- Every routed request counts in the window; the table remembers at most
  ``capacity`` keys, least recently used first out.
- Trade-off, stated: placement depends on this process's recent traffic, so
  two router replicas agree on the ring but not always on new keys; and an
  added member takes only new keys until old ones age out of the table.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Mapping, Set

from .bounded import Decision, Pick
from .ring import Ring

__all__ = ["Placement"]

DEFAULT_CAPACITY = 1 << 16
WINDOW_PER_MEMBER = 100
MIN_WINDOW = 1024


class Placement:
    __slots__ = ("_counts", "_recent", "_table", "capacity", "factor")

    def __init__(self, factor: float, *, capacity: int = DEFAULT_CAPACITY):
        if factor < 1:
            raise ValueError(f"balance factor must be at least 1.0, got {factor}")
        self.factor = factor
        self.capacity = capacity
        self._table: OrderedDict[int, str] = OrderedDict()
        self._recent: deque[str] = deque(maxlen=MIN_WINDOW)
        self._counts: Counter[str] = Counter()

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

    def route(
        self,
        ring: Ring,
        key_hash: int,
        loads: Mapping[str, int],
        threshold: int,
        *,
        avoid: Set[str] = frozenset(),
        fallback_loads: Mapping[str, int] | None = None,
    ) -> Pick | None:
        """The member for ``key_hash``.  ``loads`` is what ``threshold`` bounds;
        when every member is at it, the one with the fewest ``fallback_loads``
        (default ``loads``) takes the request."""
        if fallback_loads is None:
            fallback_loads = loads
        self._fit_window(len(ring))
        home = self._table.get(key_hash)
        if home is not None and home in ring and home not in avoid:
            self._table.move_to_end(key_hash)
            if loads.get(home, 0) < threshold:
                chosen: Pick | None = Pick(home, Decision.PRIMARY, 0)
            else:
                # Home is at its threshold: the walk passes it by (or, when all are
                # at theirs, may return it as the least loaded).  Not a new home.
                chosen = self._walk(
                    ring, key_hash, loads, fallback_loads, threshold, avoid, bounded=False
                )
                if chosen is not None and chosen.decision is Decision.PRIMARY:
                    chosen = Pick(chosen.member, Decision.OVERFLOW, chosen.position)
        else:
            chosen = self._walk(
                ring, key_hash, loads, fallback_loads, threshold, avoid, bounded=True
            )
            if chosen is not None and chosen.decision is not Decision.FALLBACK:
                self._remember(key_hash, chosen.member)
        if chosen is not None:
            self._count(chosen.member)
        return chosen

    def _walk(
        self,
        ring: Ring,
        key_hash: int,
        loads: Mapping[str, int],
        fallback_loads: Mapping[str, int],
        threshold: int,
        avoid: Set[str],
        *,
        bounded: bool,
    ) -> Pick | None:
        weights = ring.weights
        total_weight = sum(w for name, w in weights.items() if name not in avoid)
        # c * (window decisions + this one) * weight / total weight, as in bounded.py
        scale = self.factor * (len(self._recent) + 1) / total_weight if total_weight else 0.0
        below_threshold: Pick | None = None
        least: Pick | None = None
        least_load = 0
        position = 0
        for member in ring.walk(key_hash):
            if member in avoid:
                continue
            if loads.get(member, 0) < threshold:
                decision = Decision.PRIMARY if position == 0 else Decision.OVERFLOW
                if not bounded or self._counts[member] < scale * weights[member]:
                    return Pick(member, decision, position)
                if below_threshold is None:
                    below_threshold = Pick(member, decision, position)
            load = fallback_loads.get(member, 0)
            if least is None or load < least_load:
                least, least_load = Pick(member, Decision.FALLBACK, position), load
            position += 1
        return below_threshold if below_threshold is not None else least

    def _remember(self, key_hash: int, member: str) -> None:
        table = self._table
        table[key_hash] = member
        table.move_to_end(key_hash)
        if len(table) > self.capacity:
            table.popitem(last=False)

    def _count(self, member: str) -> None:
        recent = self._recent
        if len(recent) == recent.maxlen:
            self._counts[recent[0]] -= 1
        recent.append(member)
        self._counts[member] += 1

    def _fit_window(self, members: int) -> None:
        size = max(MIN_WINDOW, WINDOW_PER_MEMBER * members)
        if size != self._recent.maxlen:
            kept = list(self._recent)[-size:]
            self._recent = deque(kept, maxlen=size)
            self._counts = Counter(kept)
