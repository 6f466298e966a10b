"""One lazy timer per object: the deadlines of a connection or an exchange.

Contract:
- A subclass keeps at most one loop timer, in ``_timer``.  ``_arm(due)``
  makes sure it fires by ``due``: a timer due later is moved earlier, one
  due earlier is kept (it fires, finds nothing due yet, and re-arms for what
  is).  So a deadline that moves later on every read or write costs no
  timer operation at all: only the check when the timer fires.
- When it fires, ``_timer`` is None again and ``_deadline()`` runs; it
  decides what is due (and acts, or re-arms).  ``_disarm()`` cancels it.
- The loop is given once, at construction (the router's, set at start-up):
  ``_arm`` runs several times per request, so it reads an attribute, not a
  method.
"""

from __future__ import annotations

import asyncio

__all__ = ["LazyDeadline"]


class LazyDeadline:
    __slots__ = ("_clock", "_timer")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._clock = loop
        self._timer: asyncio.TimerHandle | None = None

    def _deadline(self) -> None:
        raise NotImplementedError

    def _arm(self, due: float) -> None:
        timer = self._timer
        if timer is None or timer.when() > due:
            if timer is not None:
                timer.cancel()
            self._timer = self._clock.call_at(due, self._fire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self._deadline()
