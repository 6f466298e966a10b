"""In-flight accounting: the one place that counts requests per member.

Contract:
- ``acquire(member)`` counts one request in flight and returns a ``Lease``;
  ``Lease.release()`` uncounts it exactly once, however often it is called
  (completion, error, cancellation and client disconnect may all try).
- ``counts`` is a live read-only mapping (absent means 0; members at zero are
  dropped, so the map stays as small as the set of busy members) and
  ``total`` is its sum, kept incrementally.
- ``on_idle``, when set, is called with a member's name when its count falls
  to zero (a drain waits on it instead of polling).
- This is the seam for sharing counts between worker processes: the
  balancer reads loads only through ``counts``/``total`` and writes them only
  through ``acquire``/``release``.  A tracker that folds other processes'
  counts in late says so with ``refreshes`` and re-reads one member's on
  demand with ``refresh(member)`` (True if its count changed); the balancer
  calls it on the member it is about to choose.  Here both are no-ops: a
  plain tracker is the count itself.
- ``outside(changes)``: requests another process has in flight (a router
  that handed over and drains, ``router.handover``), counted in ``counts``
  and ``total`` as if acquired here; ``changes`` gives members' new counts
  there (0: none), no lease releases them.  ``on_idle`` then fires when a
  member's count with them falls to zero.
- ``probes`` is ``refresh``'s fast path, for a caller that inlines it (the
  balancer, once per decision): member -> ``(now, then, now, then)``,
  buffers that compare equal pairwise while nothing the member's count was
  made from has moved.  Then ``refresh`` would return False; otherwise, or
  for a member without a probe, call it.  Empty here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

__all__ = ["Lease", "LoadTracker", "Probe"]

# ``LoadTracker.probes``: (now, then, now, then), equal pairwise while nothing moved.
Probe = tuple[memoryview, memoryview, memoryview, memoryview]


class Lease:
    __slots__ = ("_tracker", "member")

    def __init__(self, tracker: LoadTracker, member: str):
        self._tracker: LoadTracker | None = tracker
        self.member = member

    @property
    def held(self) -> bool:
        return self._tracker is not None

    def release(self) -> bool:
        """Uncount this request; True the first time, False ever after."""
        tracker = self._tracker
        if tracker is None:
            return False
        self._tracker = None
        tracker._release(self.member)
        return True

    def __repr__(self) -> str:
        return f"Lease({self.member!r}, held={self.held})"


class LoadTracker:
    __slots__ = ("_counts", "_outside", "counts", "on_idle", "total")

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        # A read-only view, set once: an attribute read is cheaper than a property
        # call, and the balancer reads it on every request.
        self.counts: Mapping[str, int] = MappingProxyType(self._counts)
        self.total = 0
        self.on_idle: Callable[[str], None] | None = None
        self._outside: dict[str, int] = {}  # another process's requests (``outside``)

    # Whether ``refresh`` can change a count (the contract): a class attribute,
    # read on every decision.
    refreshes = False
    probes: Mapping[str, Probe] = MappingProxyType({})

    def get(self, member: str) -> int:
        return self._counts.get(member, 0)

    def refresh(self, member: str) -> bool:
        """Re-read ``member``'s count where others keep part of it; True if it changed."""
        return False

    def acquire(self, member: str) -> Lease:
        counts = self._counts
        counts[member] = counts.get(member, 0) + 1
        self.total += 1
        return Lease(self, member)

    def _release(self, member: str) -> None:
        counts = self._counts
        left = counts[member] - 1
        self.total -= 1
        if left:
            counts[member] = left
        else:
            del counts[member]
            if self.on_idle is not None:
                self.on_idle(member)

    def outside(self, changes: Mapping[str, int]) -> bool:
        """Count another process's requests in flight: ``changes`` gives members' new
        counts there (0: none; members not named keep theirs).  True if a count fell
        (a place freed).  Not on the request path: the members that changed."""
        own, outside = self._counts, self._outside
        fell = False
        for member, now in changes.items():
            delta = now - outside.get(member, 0)
            if not delta:
                continue
            if now:
                outside[member] = now
            else:
                del outside[member]
            fell = fell or delta < 0
            count = own.get(member, 0) + delta
            self.total += delta
            if count:
                own[member] = count
            else:
                del own[member]
                if self.on_idle is not None:
                    self.on_idle(member)
        return fell
