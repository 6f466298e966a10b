"""Fleet-wide in-flight counts on one host: a shared-memory table, one row per worker.

Contract:
- ``SharedTable`` is ONE anonymous ``os.memfd_create`` segment, mapped
  ``MAP_SHARED`` and read through ``memoryview.cast("q")``: signed 64-bit
  cells, native byte order.  The supervisor ``create``\\ s it and hands ``fd``
  to each worker (``subprocess``'s ``pass_fds``), which ``attach``\\ es.  The
  segment has no name: nothing can unlink it, it lives as long as one process
  holds the fd or a mapping (``multiprocessing.shared_memory`` is not used:
  before Python 3.13 its resource tracker can unlink the segment when any
  process exits).  Its size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW``): no
  process can truncate it under the others' mappings (that would be SIGBUS).
- Layout, in cells of 8 bytes::

      [0, 8)   header: MAGIC, VERSION, rows, slots, planes, stride, 0, 0
      then rows x planes blocks of ``stride`` cells, row-major:
      cell(row, plane, slot) = 8 + (row * planes + plane) * stride + slot

  ``stride`` is ``slots`` rounded up to 8 cells (64 bytes), so two workers'
  blocks never share a cache line.  A row is a worker; a plane is one tracker
  (plane 0 ``Fleet.loads``, plane 1 ``Fleet.waiting``); a slot is a backend,
  numbered by the supervisor (``SharedLoadTracker.assign``).  A cell holds one
  worker's in-flight count for one backend: never negative.  A router's table
  has one more plane (``TABLE_PLANES``), of which each row uses a few cells:
  until when that worker wants the admission queue's reserve
  (``SharedDeadline``, ``router.queue``), and for claim spreading
  (``router.balancer``) how many of its requests found their walk's first
  member full (``CONTENDED_CELL``) and, in the remote row, the spread
  (``SPREAD_CELL``); for the UDP rows' lag, when the worker's oldest change
  not yet sent was made (``CHANGED_CELL``, ``ChangeSignal``) and, in the
  remote row, the last of those the supervisor took (``TAKEN_CELL + row``).
- One writer per cell: a worker writes only its own row, through one
  tracker per (row, plane) (pure Python has no atomic read-modify-write: a
  cell two processes increment loses updates).  A worker's cell is its own
  count for that backend, the only copy, read and written by it alone.  The
  supervisor writes a row only through ``zero_row``, once that row's worker
  is dead (reaped) and before its replacement starts; a new tracker also
  zeroes its own (row, plane) block.  Aligned 8-byte stores and loads are
  single instructions on x86-64 and aarch64: a reader sees the old count or
  the new one.
- ``SharedLoadTracker`` is a ``LoadTracker`` (the balancer does not change):
  ``acquire``/``Lease.release`` change the worker's own count in its own
  cell; ``counts``/``total``/``get`` are fleet-wide: own count (at once) plus
  the other rows as of the last ``fold()``.  ``on_change`` (if set) is
  called after each write of the worker's own cells (``acquire``, a release,
  and an ``assign``/``forget`` that moves a count).  ``fold`` runs on a timer
  (``start(loop, period)``, default ``DEFAULT_PERIOD``, 10 ms): a worker does
  not see the others' decisions of the last period, and nothing else.  A fold
  skips the rows whose bytes are those it read last time (a copy and a
  memcmp: no change counter to write on the request path).  ``on_idle``
  fires when the worker's OWN count for a backend falls to zero.
  ``row=None`` is the supervisor's read-only tracker: counts are the sum of
  all rows after ``fold``, and ``on_idle`` fires from ``fold`` when a
  backend's fleet-wide count falls to zero (a drain across workers waits on
  it); ``in_flight(name)`` sums the column right now, without a fold.
- ``refresh(name)`` re-reads one backend's cells in the other rows now and
  updates the view; the balancer calls it on the backend it is about to
  choose and walks again if the count moved (``refreshes``: the table has
  another row).  The tracker keeps the other rows' cells as it last read them
  (a fold or a refresh; each slot's count from the others is their sum), so
  the common case, nothing moved, is two memoryview comparisons of the
  backend's cells now with those (``probes``: the own row splits the column
  in two strided views), which the balancer makes inline; only cells that
  differ are summed and kept.  So a worker
  does not add a request to a place another worker took since the last fold:
  a bound that counts requests not yet answered (ConcurrencyScope PREFILL)
  turns over faster than any fold period (on ``sysprompt`` with
  BalanceFactor, four workers folding every 10 ms let 49 % more requests
  start behind another's prefill than one process;
  ``loadtests/RESULTS.md``). The next fold reads every row again, so what a
  refresh saw is never kept past the rows' own bytes. A refresh that finds a
  count lower calls ``on_fold`` (the queue's wake), since the timed fold
  will not see that change again.
- Slots: ``assign(name, slot)`` / ``forget(name)``, the same sequence on every
  tracker of every worker, in the order the supervisor sent it.  ``forget``
  zeroes the worker's own cell and unbinds the name; a lease on it released
  later counts down the worker's own dict only and writes nowhere (it cannot
  touch a slot another backend gets later).  If the name is assigned again
  while such leases are held, they count under its new slot, as they should.
  The supervisor gives a freed slot to another backend only after every live
  worker has applied the ``forget`` (its control channel acknowledged it):
  until then a lagging worker may still write the old backend's count there.
- A dead worker's row: the supervisor zeroes it (``zero_row``).  A worker
  folding while the row is being zeroed may read part old counts, part zeros:
  for one period it counts a few of the dead worker's requests (which the
  backends are in fact still serving until they notice the reset), never a
  negative count; the next fold sees the row's bytes differ from what it
  read and reads it again.  The same holds for any torn read.
- ``ChangeSignal`` (for the UDP rows, ``router.udprows``) is a worker's
  ``on_change``: its first call in a pass of the worker's loop schedules one
  ``eventfd_write`` for the end of that pass (``call_soon``), however many
  cells the pass wrote; the supervisor reads the eventfd (``take``) and sends
  the host's counts to the other replicas.  With ``stamp`` it also writes the
  time of the first change not yet taken into the worker's ``CHANGED_CELL``,
  and the supervisor marks it taken in the remote row's ``TAKEN_CELL + row``
  (one writer per cell still).  The supervisor writes the eventfd itself
  after it zeroes a dead worker's row.  On the request path that is a flag
  test per write and one syscall per pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import sys
import time
from array import array
from collections.abc import Callable, Mapping
from itertools import compress

from hashring import Lease, LoadTracker, Probe

__all__ = [
    "CHANGED_CELL",
    "CONTENDED_CELL",
    "DEFAULT_PERIOD",
    "PLANES",
    "RESERVE_PLANE",
    "SPREAD_CELL",
    "TABLE_PLANES",
    "TAKEN_CELL",
    "ChangeSignal",
    "SharedDeadline",
    "SharedLoadTracker",
    "SharedTable",
    "stamp_cells",
]

MAGIC = 0x50_52_4C_4F_41_44_53_31  # "PRLOADS1"
VERSION = 1
HEADER = 8  # cells
LINE = 8  # cells per 64-byte cache line
CELL = 8  # bytes
PLANES = 2  # what a router shares: plane 0 Fleet.loads, plane 1 Fleet.waiting
# Past the trackers' planes, one cell per row (slot 0): until when the admission
# queue's reserve is wanted there (``SharedDeadline``, ``router.queue``).
RESERVE_PLANE = PLANES
# Further cells of that plane (a row's block of it has ``stride`` >= 8 cells,
# whatever ``slots``): what claim spreading measures and sets (router.balancer).
# a worker row's: its requests routed past their primary so far (``router.worker``)
CONTENDED_CELL = 1
SPREAD_CELL = 2  # the remote row's: the claim spread (``router.replicas``); 0 means 1
# For the UDP rows' lag (``ChangeSignal``, ``router.udprows``): a worker row's, when
# (Unix time, microseconds) the oldest change it signalled and the supervisor has
# not taken yet was made; the remote row's ``TAKEN_CELL + row``, the last of worker
# ``row``'s that the supervisor took.
CHANGED_CELL = 3
TAKEN_CELL = 3
TABLE_PLANES = PLANES + 1  # a router's table: the trackers' planes and the reserve's

# How often a worker folds the other rows in.  A fold at 1,000 backends x 8
# workers costs ~3 us when no other row changed and ~70-120 us when they did
# (python -m loadtests.bench_shared), so 10 ms is at most ~1 % of a core.  What
# a worker misses is the others' decisions of the last 10 ms, against leases
# that last a whole stream (seconds): the threshold can overshoot by the host's
# request rate x 10 ms at most, e.g. 5 requests at 500 requests/s.
DEFAULT_PERIOD = 0.01


_LITTLE = sys.byteorder == "little"  # which end of a summed row is slot 0


def _stride(slots: int) -> int:
    return -(-slots // LINE) * LINE


def _size(rows: int, slots: int, planes: int) -> int:
    return (HEADER + rows * planes * _stride(slots)) * CELL


def _check_shape(rows: int, slots: int, planes: int) -> None:
    for what, value in (("rows", rows), ("slots", slots), ("planes", planes)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive integer, got {value!r}")


class SharedTable:
    """rows x slots x planes in-flight cells in one memfd segment (see the module's contract)."""

    __slots__ = ("_mm", "cells", "fd", "planes", "rows", "slots", "stride")

    def __init__(self, fd: int, rows: int, slots: int, planes: int, *, fresh: bool):
        _check_shape(rows, slots, planes)
        size = _size(rows, slots, planes)
        actual = os.fstat(fd).st_size
        if actual != size:
            raise ValueError(
                f"shared table fd {fd} is {actual} bytes; {rows} rows x {slots} slots x "
                f"{planes} planes need {size}"
            )
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.cells = memoryview(self._mm).cast("q")
        self.fd, self.rows, self.slots, self.planes = fd, rows, slots, planes
        self.stride = _stride(slots)
        header = (MAGIC, VERSION, rows, slots, planes, self.stride, 0, 0)
        if fresh:  # a new memfd reads as zeros
            for i, value in enumerate(header):
                self.cells[i] = value
        elif tuple(self.cells[:HEADER]) != header:
            found = tuple(self.cells[:HEADER])
            self.cells.release()
            self._mm.close()  # the fd stays the caller's: attach failed
            raise ValueError(f"shared table fd {fd}: header {found}, expected {header}")

    @classmethod
    def create(cls, rows: int, slots: int, planes: int = 2) -> SharedTable:
        """A new zeroed table (the supervisor).  The fd is close-on-exec: pass it
        to each worker with ``pass_fds``."""
        _check_shape(rows, slots, planes)
        if not hasattr(os, "memfd_create"):
            raise RuntimeError("SharedTable needs os.memfd_create (Linux)")
        fd = os.memfd_create("prefix-router-loads", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, _size(rows, slots, planes))
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            )
            return cls(fd, rows, slots, planes, fresh=True)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, rows: int, slots: int, planes: int = 2) -> SharedTable:
        """Map a table created elsewhere (a worker, given ``fd``); the shape must match.
        The table owns ``fd`` from now on (``close`` closes it)."""
        return cls(fd, rows, slots, planes, fresh=False)

    def row_cell(self, row: int, cell: int) -> int:
        """The cell of ``row``'s own figures (``RESERVE_PLANE``: 0 the reserve's
        deadline, ``CONTENDED_CELL``, ``SPREAD_CELL``) in ``cells``; a row's block of
        that plane has ``stride`` >= 8 cells whatever ``slots``."""
        return self.index(row, RESERVE_PLANE) + cell

    def index(self, row: int, plane: int, slot: int = 0) -> int:
        """The cell of (row, plane, slot) in ``cells``."""
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} out of range(0, {self.rows})")
        if not 0 <= plane < self.planes:
            raise IndexError(f"plane {plane} out of range(0, {self.planes})")
        if not 0 <= slot < self.slots:
            raise IndexError(f"slot {slot} out of range(0, {self.slots})")
        return HEADER + (row * self.planes + plane) * self.stride + slot

    def column(self, plane: int, slot: int) -> memoryview:
        """``slot``'s cell on ``plane`` in every row: a strided view of ``cells``
        (release it before ``close``)."""
        first = self.index(0, plane, slot)
        step = self.planes * self.stride
        return self.cells[first : first + self.rows * step : step]

    def column_total(self, plane: int, slot: int) -> int:
        """In flight for ``slot`` on ``plane``, all rows summed, read now."""
        with self.column(plane, slot) as column:
            return sum(column)

    def plane_sums(self, plane: int, rows: int, span: int | None = None) -> memoryview:
        """Each slot's count on ``plane`` summed over rows ``[0, rows)``, read now,
        for slots ``[0, span)`` (all by default: a caller that knows the highest
        slot in use reads only that far, 56 bytes a row for 7 backends, not 64 KB).

        One integer per row, summed as 64-bit lanes (as ``SharedLoadTracker.fold``):
        cells are never negative and far below 2**63, so no carry crosses a lane.
        """
        size = (self.slots if span is None else span) * CELL
        mm = self._mm
        summed = 0
        for row in range(rows):
            start = self.index(row, plane) * CELL
            summed += int.from_bytes(mm[start : start + size], sys.byteorder)
        return memoryview(summed.to_bytes(size, sys.byteorder)).cast("q")

    def counts_bytes(self, rows: int, planes: int, span: int) -> bytes:
        """Slots ``[0, span)`` of planes ``[0, planes)`` in rows ``[0, rows)``, as
        bytes: compared with an earlier copy, says whether any of those cells
        changed (a few small copies and one memcmp)."""
        size = span * CELL
        mm = self._mm
        starts = [self.index(row, plane) * CELL for row in range(rows) for plane in range(planes)]
        return b"".join([mm[start : start + size] for start in starts])

    def zero_row(self, row: int) -> None:
        """Zero every plane of ``row`` (the supervisor, once its worker is dead)."""
        start = self.index(row, 0) * CELL
        length = self.planes * self.stride * CELL
        self._mm[start : start + length] = bytes(length)

    def close(self) -> None:
        """Unmap and close the fd (trackers on the table must be closed first)."""
        self.cells.release()
        try:
            self._mm.close()
        except BufferError:
            raise BufferError("close the SharedLoadTrackers on this table first") from None
        os.close(self.fd)


class SharedLoadTracker(LoadTracker):
    """A ``LoadTracker`` whose counts are fleet-wide on the host (see the module's contract).

    ``row`` is the worker's own row; ``row=None`` makes a read-only tracker
    (the supervisor) that owns no row and cannot ``acquire``.  The worker's
    own count for an assigned backend lives in its cell (the only copy); for
    a backend without a slot, in a dict.
    """

    __slots__ = (
        "_columns",
        "_folded",
        "_handle",
        "_ints",
        "_mine",
        "_names",
        "_others",
        "_own",
        "_read",
        "_seen",
        "_slot",
        "_span",
        "_split",
        "_starts",
        "_writes",
        "on_change",
        "on_fold",
        "plane",
        "probes",
        "refreshes",
        "row",
        "table",
    )

    def __init__(self, table: SharedTable, plane: int = 0, row: int | None = None):
        super().__init__()  # _counts (fleet-wide), counts, total, on_idle
        table.index(0 if row is None else row, plane)  # range checks
        self.table, self.plane, self.row = table, plane, row
        self._own: dict[str, int] = {}  # own leases on backends without a slot
        self._slot: dict[str, int] = {}  # name -> slot, as assigned
        # What acquire and release write through: the same dict for a worker, an
        # empty one for the read-only tracker (whose acquire then refuses).
        self._writes: dict[str, int] = self._slot if row is not None else {}
        self._names: list[str | None] = [None] * table.slots  # slot -> name
        if row is None:
            self._mine = _zeros(table.slots)  # owns no row: its own counts are zero
        else:
            start = table.index(row, plane)
            table._mm[start * CELL : (start + table.stride) * CELL] = bytes(table.stride * CELL)
            self._mine = table.cells[start : start + table.slots]
        # The other rows' blocks of this plane, as byte offsets, and what fold read there.
        self._starts = [table.index(r, plane) * CELL for r in range(table.rows) if r != row]
        self.refreshes = bool(self._starts)  # a table of one row has nothing to read again
        # name -> its slot's cells in every row of this plane (this worker's own
        # included): what ``in_flight`` sums, one view per assigned backend.
        self._columns: dict[str, memoryview] = {}
        # The other rows' cells as this tracker last read them (a fold or a refresh),
        # one block of ``table.slots`` cells per other row in ``_starts``' order (a
        # fold copies each row in one piece).  Each slot's count from the other rows
        # (``_others``) is the sum of its column here, so cells of the table that
        # compare equal to it have not moved.
        self._read = bytearray(len(self._starts) * table.slots * CELL)
        self._split = table.rows if row is None else row  # the other rows before the own
        # name -> (the other rows before the own row, their cells as read, the rows
        # after it, theirs as read): LoadTracker's ``probes``, two pairs because a
        # strided view cannot skip the own row.
        self.probes: dict[str, Probe] = {}
        self._span = 0  # slots folded: the highest assigned at least (grown twofold)
        self._seen = [b""] * len(self._starts)  # each row's bytes at the last fold
        self._ints = [0] * len(self._starts)  # the same, each as one integer
        self._folded = 0  # their sum: one 64-bit lane per slot
        self._others: list[int] = []  # the same, per slot
        self._handle: asyncio.TimerHandle | None = None
        # Called after a timed fold that changed a count, or a refresh that found
        # one lower (the admission queue's wake).
        self.on_fold: Callable[[], None] | None = None
        # Called after each write of this worker's own cells (a ChangeSignal).
        self.on_change: Callable[[], None] | None = None

    # -- the request path (LoadTracker's interface) ------------------------------

    def acquire(self, member: str) -> Lease:
        slot = self._writes.get(member)
        if slot is None:
            return self._acquire_own(member)
        self._mine[slot] += 1
        if self.on_change is not None:
            self.on_change()
        counts = self._counts
        counts[member] = counts.get(member, 0) + 1
        self.total += 1
        return _CellLease(self, member)

    def _acquire_own(self, member: str) -> Lease:
        """A lease on a backend without a slot: counted in the own dict."""
        if self.row is None:
            raise TypeError("a read-only SharedLoadTracker (row=None) cannot acquire")
        own = self._own
        own[member] = own.get(member, 0) + 1
        return super().acquire(member)

    def _release(self, member: str) -> None:
        # LoadTracker._release's first lines, inlined (a call fewer per request);
        # on_idle here follows the own count, not the fleet-wide one.  A lease taken
        # with a slot releases through ``_CellLease.release``, the same steps.
        counts = self._counts
        left = counts[member] - 1
        if left:
            counts[member] = left
        else:
            del counts[member]
        self.total -= 1
        slot = self._writes.get(member)
        if slot is not None:
            mine = self._mine
            n = mine[slot] - 1
            mine[slot] = n
            if self.on_change is not None:
                self.on_change()
        else:
            own = self._own
            n = own[member] - 1
            if n:
                own[member] = n
            else:
                del own[member]
        if not n and self.on_idle is not None:
            self.on_idle(member)

    def outside(self, changes: Mapping[str, int]) -> bool:
        """Another process's counts are a row of the table here (``Workers.predecessor``),
        folded in like any other: this tracker's counts are remade from the rows."""
        raise TypeError("a SharedLoadTracker's outside counts are a row of its table")

    def own(self, name: str) -> int:
        """This worker's own count for ``name``."""
        slot = self._writes.get(name)
        return self._own.get(name, 0) if slot is None else self._mine[slot]

    def own_counts(self) -> dict[str, int]:
        """This worker's own counts, a snapshot (for per-worker stats)."""
        counts = dict(self._own)
        mine = self._mine
        for name, slot in self._writes.items():
            if mine[slot]:
                counts[name] = mine[slot]
        return counts

    # -- slots -----------------------------------------------------------------

    def assign(self, name: str, slot: int) -> None:
        """Bind ``name`` to ``slot``: its own count is written there, the others' read there."""
        if not isinstance(slot, int) or not 0 <= slot < self.table.slots:
            raise ValueError(f"slot {slot!r} out of range(0, {self.table.slots})")
        current = self._slot.get(name)
        if current == slot:
            return
        if current is not None:
            raise ValueError(f"{name!r} already has slot {current}; forget it first")
        held = self._names[slot]
        if held is not None:
            raise ValueError(f"slot {slot} is {held!r}'s")
        if slot >= self._span:
            # Grown to twice at least: backends assigned one by one (a start with
            # 8,192) rebuild the folded sum a few times, not once each (5 s).
            span = min(self.table.slots, max(slot + 1, 2 * self._span))
            self._others.extend([0] * (span - self._span))
            self._span = span
            self._seen = [b""] * len(self._starts)  # re-read every row over the new span
            # The folded sum laid out for the new span: the same integer on a
            # little-endian host, shifted lanes on a big-endian one (slot 0 is
            # the top lane there, so its position moves with the span).
            self._folded = int.from_bytes(array("q", self._others).tobytes(), sys.byteorder)
        moved = self._mine[slot] = self._own.pop(name, 0)
        if moved and self.on_change is not None:
            self.on_change()  # leases held before the slot count in the row now
        self._slot[name] = slot
        self._columns[name] = self.table.column(self.plane, slot)
        self.probes[name] = self._probe(slot)
        self._names[slot] = name
        others = self._others[slot]
        self.total += others
        self._set(name, self._mine[slot] + others)

    def forget(self, name: str) -> None:
        """Unbind ``name``: zero this worker's cell; its leases count on here, writing nowhere."""
        if name not in self._slot:
            raise KeyError(f"{name!r} has no slot")
        slot = self._slot.pop(name)
        self._columns.pop(name).release()
        for view in self.probes.pop(name):
            view.release()
        self._names[slot] = None
        own = self._mine[slot]
        self._mine[slot] = 0
        if own:
            self._own[name] = own
            if self.on_change is not None:
                self.on_change()  # its count left the row
        self.total -= self._others[slot]
        self._set(name, own)

    def slot_of(self, name: str) -> int | None:
        return self._slot.get(name)

    def _probe(self, slot: int) -> Probe:
        table = self.table
        step = table.planes * table.stride
        first = table.index(0, self.plane, slot)
        end = first + table.rows * step
        split = self._split
        read = memoryview(self._read).cast("q")[slot :: table.slots]
        return (
            table.cells[first : first + split * step : step],
            read[:split],
            table.cells[first + (split + 1) * step : end : step],
            read[split:],
        )

    def _set(self, name: str, count: int) -> None:
        if count:
            self._counts[name] = count
        else:
            self._counts.pop(name, None)

    # -- reading the other rows ------------------------------------------------

    def fold(self) -> bool:
        """Fold the other rows in; True if any count changed.

        A row whose bytes are those of the last fold is skipped (one memcmp).
        The rows are summed as big integers, one 64-bit lane per slot (cells
        are never negative and far below 2**63, so no carry crosses a lane);
        only the lanes whose sum changed are visited in Python.
        """
        span_bytes = self._span * CELL
        mm = self.table._mm
        seen, ints = self._seen, self._ints
        read, width = self._read, self.table.slots * CELL
        changed = False
        for i, start in enumerate(self._starts):
            raw = mm[start : start + span_bytes]
            if raw != seen[i]:
                seen[i] = raw
                ints[i] = int.from_bytes(raw, sys.byteorder)
                # What the counts are made from is what was read (``probes``).
                read[i * width : i * width + span_bytes] = raw
                changed = True
        if not changed:
            return False
        summed = sum(ints)
        lanes = summed ^ self._folded
        if not lanes:
            return False
        self._folded = summed
        new = memoryview(summed.to_bytes(span_bytes, sys.byteorder)).cast("q")
        diff = memoryview(lanes.to_bytes(span_bytes, sys.byteorder)).cast("q")
        others, names, mine, counts = self._others, self._names, self._mine, self._counts
        idle = []
        delta = 0
        for slot in compress(range(self._span), diff):
            value = new[slot]
            old = others[slot]
            others[slot] = value
            name = names[slot]
            if name is None:
                continue
            delta += value - old
            count = mine[slot] + value
            if count:
                counts[name] = count
            elif counts.pop(name, 0):
                idle.append(name)
        self.total += delta
        if idle and self.row is None and self.on_idle is not None:
            for name in idle:
                self.on_idle(name)
        return True

    def refresh(self, name: str) -> bool:
        """Re-read ``name``'s cells in the other rows now; True if its count changed
        (the contract).  Cells equal to those read last (``probes``) are the count
        as it is: nothing else is touched.  Keeps ``fold``'s bookkeeping: the lane
        of ``_folded`` moves with the count, and the next fold reads every row again
        (a row whose bytes went back to those of the last fold would otherwise be
        skipped, and with it the lane this refresh moved)."""
        probe = self.probes.get(name)  # only an assigned backend has one
        if probe is None:
            return False
        before, read_before, after, read_after = probe
        if before == read_before and after == read_after:
            return False  # the common case: nothing moved since it was read
        read_before[:] = before  # read once: what is summed is what is kept
        read_after[:] = after
        # The next fold reads (and copies) every row again: what was read of them
        # is no longer the rows' bytes of the last fold.
        self._seen = [b""] * len(self._starts)
        value = sum(read_before) + sum(read_after)
        slot = self._slot[name]
        others = self._others
        old = others[slot]
        if value == old:
            return False  # cells moved, not their sum
        others[slot] = value
        lane = slot if _LITTLE else self._span - 1 - slot
        self._folded += (value - old) << (64 * lane)
        self.total += value - old
        counts = self._counts
        count = self._mine[slot] + value
        if count:
            counts[name] = count
        elif counts.pop(name, 0) and self.row is None and self.on_idle is not None:
            self.on_idle(name)  # as fold: the fleet-wide count fell to zero
        if value < old and self.on_fold is not None:
            self.on_fold()  # a place freed: the timed fold will not report it now
        return True

    def in_flight(self, name: str) -> int:
        """``name``'s count over all rows, read now (no fold); the own count if it has no slot."""
        column = self._columns.get(name)
        return self._own.get(name, 0) if column is None else sum(column)

    # -- the timer -------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop, period: float = DEFAULT_PERIOD) -> None:
        """Fold every ``period`` seconds on ``loop`` until ``stop``."""
        if not period > 0:
            raise ValueError(f"period must be positive, got {period!r}")
        self.stop()
        self._handle = loop.call_later(period, self._tick, loop, period)

    def _tick(self, loop: asyncio.AbstractEventLoop, period: float) -> None:
        self._handle = loop.call_later(period, self._tick, loop, period)
        if self.fold() and self.on_fold is not None:
            self.on_fold()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def close(self) -> None:
        """Stop folding and let go of the table (before ``SharedTable.close``).  Leases
        still held count down in this tracker only."""
        self.stop()
        for name in list(self._slot):
            self.forget(name)
        self._starts, self._seen, self._ints, self._span = [], [], [], 0
        self.refreshes = False
        if self.row is not None:
            self._mine.release()
            self._mine = _zeros(self.table.slots)


class _CellLease(Lease):
    """A lease taken on a backend with a slot.  ``release`` does the tracker's part
    itself, ``SharedLoadTracker._release``'s steps: a call fewer per request than
    ``Lease.release`` -> ``_release``.  A backend forgotten since (no slot now)
    goes through ``_release``, which counts it down in the own dict."""

    __slots__ = ()
    _tracker: SharedLoadTracker | None

    def release(self) -> bool:
        tracker = self._tracker
        if tracker is None:
            return False
        self._tracker = None
        member = self.member
        slot = tracker._writes.get(member)
        if slot is None:
            tracker._release(member)
            return True
        counts = tracker._counts
        left = counts[member] - 1
        if left:
            counts[member] = left
        else:
            del counts[member]
        tracker.total -= 1
        mine = tracker._mine
        n = mine[slot] - 1
        mine[slot] = n
        if tracker.on_change is not None:
            tracker.on_change()
        if not n and tracker.on_idle is not None:
            tracker.on_idle(member)
        return True


class SharedDeadline:
    """One deadline per row on plane ``RESERVE_PLANE``, slot 0: CLOCK_MONOTONIC
    (``time.monotonic``, the same clock in every process of the host) in
    microseconds, 0 for none.  ``set`` writes the own row's cell (one writer per
    cell, as the trackers); ``latest`` reads every row's, now (no fold: a few
    loads)."""

    __slots__ = ("_cells", "_own", "_rows")

    def __init__(self, table: SharedTable, row: int | None, rows: int | None = None):
        """``row``: the cell ``set`` writes (None: read only); ``rows``: the rows
        ``latest`` reads, from the first (None: all)."""
        self._cells = table.cells
        self._own = None if row is None else table.index(row, RESERVE_PLANE)
        count = table.rows if rows is None else rows
        self._rows = [table.index(r, RESERVE_PLANE) for r in range(count)]

    def set(self, until: float) -> None:
        assert self._own is not None, "a read-only SharedDeadline"
        self._cells[self._own] = int(until * 1e6)

    def latest(self) -> float:
        """The latest deadline of the rows read, in ``time.monotonic`` seconds (0: none)."""
        cells = self._cells
        return max(cells[i] for i in self._rows) / 1e6


class ChangeSignal:
    """A worker's "my row changed" to the supervisor: 1 added to an eventfd once per
    pass of the loop in which ``__call__`` was called (see the module's contract).
    The supervisor ``open``\\ s the eventfd and reads it (``take``).

    With ``stamp`` (``stamp_cells``: the worker's ``CHANGED_CELL`` and the
    supervisor's ``TAKEN_CELL`` for it), the first call of a pass also writes
    the time into the changed cell, unless the supervisor has not taken the
    time there yet: the cell then keeps the oldest change not yet sent, however
    many passes signal before the supervisor wakes (what the lag is measured
    from, ``router.udprows``)."""

    __slots__ = ("_cells", "_changed", "_loop", "_pending", "_taken", "fd")

    def __init__(
        self,
        fd: int,
        loop: asyncio.AbstractEventLoop,
        cells: memoryview | None = None,
        stamp: tuple[int, int] | None = None,
    ):
        self.fd = fd
        self._loop = loop
        self._pending = False
        self._cells = cells if stamp is not None else None
        self._changed, self._taken = stamp if stamp is not None else (0, 0)

    @staticmethod
    def open() -> int:
        """A new eventfd for the workers to signal on (non-blocking, not inherited
        but through ``pass_fds``)."""
        return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    @staticmethod
    def take(fd: int) -> bool:
        """Reset the eventfd; True if any worker had signalled since the last take."""
        try:
            return os.eventfd_read(fd) > 0
        except BlockingIOError:
            return False

    def __call__(self) -> None:
        if not self._pending:
            self._pending = True
            cells = self._cells
            if cells is not None and cells[self._changed] <= cells[self._taken]:
                cells[self._changed] = time.time_ns() // 1000
            self._loop.call_soon(self._signal)  # after this pass's other writes

    @staticmethod
    def notify(fd: int) -> None:
        """Add 1 to the eventfd.  The writer holds its own copy of the fd, so a dead
        reader does not make this fail; only a counter at its maximum could (EAGAIN):
        it is unread anyway."""
        with contextlib.suppress(OSError):
            os.eventfd_write(fd, 1)

    def _signal(self) -> None:
        self._pending = False
        self.notify(self.fd)


def stamp_cells(table: SharedTable, row: int) -> tuple[int, int] | None:
    """Worker ``row``'s ``CHANGED_CELL`` and the remote (last) row's ``TAKEN_CELL``
    for it, in ``table.cells``; None if the remote row's block has no cell for it."""
    if TAKEN_CELL + row >= table.stride:
        return None
    return table.row_cell(row, CHANGED_CELL), table.row_cell(table.rows - 1, TAKEN_CELL + row)


def _zeros(slots: int) -> memoryview:
    return memoryview(bytearray(slots * CELL)).cast("q")
