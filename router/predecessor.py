"""The requests of the process a supervisor took over from, in a row of its table.

Contract:
- After a handover (``router.handover``) the old process reports its
  requests in flight per backend as they change (``Loads``); ``report``
  takes each report's changes.  Every backend it names is kept (``reported``),
  one we do not route to as well: added back later (``write`` with its new
  column), it is as busy as it is.
- The counts go into ``row`` of the shared table (``router.shared``), planes
  0 and 1 (in flight, not answered yet), one column per backend: every
  worker folds the row in as another worker's.  The supervisor is the row's
  one writer.  Once its table is closed (``closed``), nothing is written and
  ``loads()`` still says what was reported: the supervisor reports it on to
  the process that took over from it in turn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .handover import Load
    from .shared import SharedTable

__all__ = ["Predecessor"]


class Predecessor:
    def __init__(self, table: SharedTable, row: int):
        self.table, self.row = table, row
        self.closed = False
        self.reported: dict[str, tuple[int, int]] = {}
        self._loads: list[Load] | None = None  # ``reported`` sorted, made when asked

    def report(self, changes: dict[str, tuple[int, int]], slots: dict[str, int]) -> list[str]:
        """Take a report's changes (``name -> (in flight, not answered)``) and write
        those with a column (``slots``); the backends whose last request there ended."""
        reported = self.reported
        ended = [n for n, (count, _) in changes.items() if not count and n in reported]
        for name, counts in changes.items():
            if counts[0]:
                reported[name] = counts
            else:
                reported.pop(name, None)
        self._loads = None
        for name, counts in changes.items():
            slot = slots.get(name)
            if slot is not None:  # one we do not route to: nothing to bound
                self._write(slot, counts)
        return ended

    def write(self, name: str, slot: int) -> None:
        """``name`` has column ``slot`` now (added, or back): its count there, if any."""
        counts = self.reported.get(name)
        if counts is not None:
            self._write(slot, counts)

    def _write(self, slot: int, counts: tuple[int, int]) -> None:
        if self.closed:
            return
        table = self.table
        for plane, count in enumerate(counts):
            table.cells[table.index(self.row, plane, slot)] = count

    def loads(self) -> list[Load]:
        """What it reported, as a handover reports it on (sorted by backend)."""
        if self._loads is None:
            self._loads = sorted((n, a, w) for n, (a, w) in self.reported.items())
        return self._loads
