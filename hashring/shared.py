"""Fleet-wide routing state across router replicas: what each one publishes and folds in.

Why: the ring is the same on every replica, but in-flight counts and TRAFFIC
placement are per process.  R replicas that each see a share of the requests
then bound loads they cannot see and give new keys homes of their own
(measured in ``loadtests/RESULTS.md``: ``long`` TRAFFIC+PREFILL falls from
94.1 % to 85 % hits at R=2).  Here each replica publishes its state every
period and folds in the others'; nothing here does I/O or reads a clock (the
caller passes stamps), so the same objects serve a shared-memory table
between workers, a channel between hosts and the offline model.

Contract:
- ``SharedLoads`` is a ``LoadTracker`` whose ``counts``, ``total`` and
  ``get`` are the fleet-wide view: this replica's own counts, exact, plus the
  other replicas' rows as last passed to ``fold``.  ``acquire`` and
  ``Lease.release`` change only the own row (``own``, ``own_total``), which is
  what the replica publishes; ``on_idle`` fires when a member's *own* count
  falls to zero (a drain waits for every replica's).  Folding the others'
  current rows before every read (period 0) gives every replica the exact
  fleet-wide counts; with nothing folded in it is a plain ``LoadTracker``.
- With ``extrapolate`` (what live replicas do, ``router/replicas.py``), a row
  is taken as what that replica had when it published, and the view adds,
  per other row and member, what the own row gained since that row was
  folded in (a loss counts as none).  A balancer in front spreads requests
  evenly over the replicas, so the own gain is the best guess of each
  other's; without it every replica sees the same stale counts below the
  threshold and each adds its own requests on top (herding).  Its quantum
  is R - 1 requests per own request: at R = 8 and ConcurrencyThreshold 10 it
  overflows more than the requests warrant (``loadtests/RESULTS.md``).
  Fold takes a new row object as a new publication: pass snapshots.
- ``read_from(source)`` (without ``extrapolate``) gives a way to read the
  others' count of one member as it is now, as the workers of one host read
  each other's cells (``router.shared``): ``refresh(member)`` then replaces
  that member's part of the view by it (the next ``fold`` replaces it
  again), and ``refreshes`` is True.  The offline model uses it for workers.
- ``PlacementLog`` keeps a TRAFFIC ``Placement`` in step with the other
  replicas' without a round trip on the request path.  After each routed
  request the caller reports it (``decided``); ``publish`` hands over the
  records since the last call; the others ``apply`` them.  With ``decisions``
  (the default) every request is a record, and a replica that applies
  another's record counts it in its recent-traffic window (``observe``), so
  member shares and hot keys are fleet-wide: a key hot for one replica is hot
  for all, with the same replicas (they derive from the ring, the home and
  the share).  Without it only new homes are records (each replica's window
  stays its own).  A process with several placements (one per model pool)
  keeps a log for each, told apart by ``pool``, which its records carry.
- A home carries the stamp of its placement, ``(time, replica)``: the first
  placement wins.  A replica that learns of an earlier placement of a key
  adopts its home (the loser re-homes); one that receives a later conflicting
  one keeps its own and publishes it again (a ``Record`` with no member), so
  the loser learns it even if the winner never routes the key again.  Any
  two replicas that have exchanged their records agree on every home they
  both hold: the order on stamps is total and the same everywhere, whatever
  the clocks say (skew decides only which placement wins).
- Applying every record of every replica, in the order they were made, right
  after each one (period 0) gives every replica the state of one router fed
  all the requests: the same table, window and shares.  With a period, hot
  keys compare two of their replicas (``STALE_SCAN_REPLICAS``, below).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from .load import Lease, LoadTracker
from .placement import Placement
from .ring import Ring

__all__ = ["STALE_SCAN_REPLICAS", "PlacementLog", "Record", "SharedLoads", "Stamp"]

# When and where a key's home was placed; compared as a tuple, earliest first.
Stamp = tuple[float, int]

# ``Placement.scan_replicas`` for replicas that fold in each other's loads with
# a delay.  Every replica then sees the same stale counts of the others, and
# "the least loaded of a hot key's replicas" is the same member on all of them
# until the next publication: they herd onto it (Mitzenmacher, "How useful is
# old information?", 2000).  Comparing two replicas, in a rotation of each
# replica's own, does not: on ``sysprompt`` TRAFFIC+PREFILL, 4 routers sharing
# every 0.1 s, P90 TTFT 48 ms comparing all 7 instances, 27 ms comparing two
# (one router: 27 ms; loadtests/RESULTS.md).
STALE_SCAN_REPLICAS = 1


class SharedLoads(LoadTracker):
    __slots__ = (
        "_bases",
        "_extra_total",
        "_others",
        "_others_total",
        "_rows",
        "_source",
        "_view",
        "extrapolate",
        "own",
        "refreshes",
    )

    def outside(self, changes: Mapping[str, int]) -> bool:
        """Not for a row: another process's requests would be published as this one's."""
        raise TypeError("SharedLoads counts one row and the others' sums: nothing outside")

    def __init__(self, *, extrapolate: bool = False) -> None:
        super().__init__()
        # The inherited ``_counts`` is the own row, kept (with ``total`` and
        # ``on_idle``) by ``LoadTracker``; the view beside it adds the others' sum.
        self.own: Mapping[str, int] = self.counts
        self._view: dict[str, int] = {}
        self.counts = MappingProxyType(self._view)
        self._others: dict[str, int] = {}
        self._others_total = 0
        self.extrapolate = extrapolate
        # Each other row as last folded, and the own row when it was (its base).
        self._rows: list[Mapping[str, int]] = []
        self._bases: list[dict[str, int]] = []
        self._extra_total = 0  # the extrapolated part of ``total``
        self._source: Callable[[str], int] | None = None
        self.refreshes = False

    @property
    def own_total(self) -> int:
        return self.total - self._others_total - self._extra_total

    def get(self, member: str) -> int:
        return self._view.get(member, 0)

    def acquire(self, member: str) -> Lease:
        extra = self._gaining(self._counts.get(member, 0) + 1, member)
        view = self._view
        view[member] = view.get(member, 0) + 1 + extra
        self._extra_total += extra
        self.total += extra
        return super().acquire(member)

    def _release(self, member: str) -> None:
        extra = self._gaining(self._counts[member], member)
        view = self._view
        left = view[member] - 1 - extra
        if left:
            view[member] = left
        else:
            del view[member]
        self._extra_total -= extra
        self.total -= extra
        super()._release(member)

    def _gaining(self, own: int, member: str) -> int:
        """The rows whose estimate moves with the own count between ``own - 1`` and ``own``."""
        if not self._bases:
            return 0
        return sum(1 for base in self._bases if base.get(member, 0) < own)

    def read_from(self, source: Callable[[str], int] | None) -> None:
        """Read the others' count of one member from ``source`` on ``refresh`` (the contract)."""
        if source is not None and self.extrapolate:
            raise ValueError("a SharedLoads that extrapolates has no current source to read")
        self._source = source
        self.refreshes = source is not None

    def refresh(self, member: str) -> bool:
        source = self._source
        if source is None:
            return False
        others = self._others
        value, old = source(member), others.get(member, 0)
        if value == old:
            return False
        if value:
            others[member] = value
        else:
            del others[member]
        self._others_total += value - old
        self.total += value - old
        count = self._view.get(member, 0) + value - old
        if count:
            self._view[member] = count
        else:
            self._view.pop(member, None)
        return True

    @property
    def others(self) -> Mapping[str, int]:
        return MappingProxyType(self._others)

    def fold(self, rows: Iterable[Mapping[str, int]]) -> None:
        """Replace the other replicas' part of the view by the sum of ``rows``.

        ``rows`` come in the same order at every call, one per other replica.
        A row object not seen at this position before is a new publication:
        with ``extrapolate``, the own row as it is now becomes that row's base,
        and until its next publication the view adds, for each row and
        member, what the own row gained since its base, if it gained (see
        ``SharedLoads`` in the contract).
        """
        rows = list(rows)
        own = self._counts
        if self.extrapolate:
            kept, bases = self._rows, self._bases
            del kept[len(rows) :], bases[len(rows) :]
            for i, row in enumerate(rows):
                if i == len(kept):
                    kept.append(row)
                    bases.append(dict(own))
                elif row is not kept[i]:
                    kept[i] = row
                    bases[i] = dict(own)
        others: dict[str, int] = {}
        for row in rows:
            for member, count in row.items():
                if count:
                    others[member] = others.get(member, 0) + count
        own_total = self.own_total
        self._others = others
        self._others_total = sum(others.values())
        view = self._view
        view.clear()
        view.update(others)
        for member, count in own.items():
            view[member] = view.get(member, 0) + count
        self.total = own_total + self._others_total
        self._extra_total = 0
        for base in self._bases:
            for member, count in own.items():
                gained = count - base.get(member, 0)
                if gained > 0:
                    view[member] += gained
                    self._extra_total += gained
        self.total += self._extra_total


# A home whose stamp was forgotten is older than any remembered.
_OLDEST = float("-inf")


class Record(NamedTuple):
    """One routing decision (or a re-published home) as the other replicas see it."""

    stamp: Stamp  # when and where ``home`` was placed (not when this request came)
    key_hash: int
    member: str | None  # where the request went; None: a home published again
    home: str | None  # the key's home after the decision; None: it has none
    pool: str | None = None  # the PlacementLog's ``pool``: whose placement it is


# NamedTuple's generated __new__ is Python code; tuple.__new__ is not (as bounded.py).
_new_record = tuple.__new__


class PlacementLog:
    """One replica's side of a shared TRAFFIC placement (see the module contract)."""

    __slots__ = ("_outbox", "_resent", "_stamps", "decisions", "placement", "pool", "replica")

    def __init__(
        self,
        placement: Placement,
        replica: int,
        *,
        decisions: bool = True,
        pool: str | None = None,
    ):
        self.placement = placement
        self.replica = replica
        self.decisions = decisions
        self.pool = pool  # names this log's placement in its records (several per process)
        # Placement stamps of the homes in the table, oldest first, as many as
        # the table holds.
        self._stamps: dict[int, Stamp] = {}
        self._outbox: list[Record] = []
        self._resent: set[int] = set()  # keys published again since the last publish

    def decided(self, key_hash: int, member: str, before: str | None, now: float) -> None:
        """Record a request this replica routed; ``before`` is the key's home before it."""
        home = self.placement.home(key_hash)
        if home is not None and home != before:  # placed here, now
            stamp = self._stamp(key_hash, (now, self.replica))
            if not self.decisions:
                self._outbox.append(_new_record(Record, (stamp, key_hash, None, home, self.pool)))
        elif not self.decisions:
            return
        elif home is not None:  # the common case: a known key
            stamp = self._stamps.get(key_hash) or (_OLDEST, self.replica)
        else:
            stamp = (now, self.replica)
        if self.decisions:
            self._outbox.append(_new_record(Record, (stamp, key_hash, member, home, self.pool)))

    def publish(self) -> list[Record]:
        """The records made since the last call, in order: this period's message."""
        out, self._outbox = self._outbox, []
        self._resent.clear()
        return out

    def apply(self, ring: Ring, records: Iterable[Record]) -> None:
        """Fold in another replica's records, in the order it made them."""
        placement = self.placement
        for record in records:
            key_hash, home = record.key_hash, record.home
            if home is not None and home in ring:
                mine = placement.home(key_hash)
                if mine is None:
                    placement.adopt(key_hash, home)
                    self._stamp(key_hash, record.stamp)
                elif mine == home:
                    placement.adopt(key_hash, home)  # most recently used, as here
                    stamp = self._stamps.get(key_hash)
                    if stamp is None or record.stamp < stamp:
                        stamp = record.stamp
                    self._stamp(key_hash, stamp)
                else:
                    stamp = self._stamps.get(key_hash) or (_OLDEST, self.replica)
                    if record.stamp < stamp:  # placed there first: re-home here
                        placement.adopt(key_hash, home)
                        self._stamp(key_hash, record.stamp)
                    elif key_hash not in self._resent:  # placed here first: say so again
                        self._resent.add(key_hash)
                        self._outbox.append(Record(stamp, key_hash, None, mine, self.pool))
            if record.member is not None and self.decisions and record.member in ring:
                placement.observe(ring, key_hash, record.member)

    def _stamp(self, key_hash: int, stamp: Stamp) -> Stamp:
        stamps = self._stamps
        stamps.pop(key_hash, None)  # re-stamped: now the newest
        stamps[key_hash] = stamp
        if len(stamps) > self.placement.capacity:
            # The oldest stamp goes; its home, if still held, then counts as
            # placed before any other (it is at least that old).
            del stamps[next(iter(stamps))]
        return stamp
