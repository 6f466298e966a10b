"""Membership: the backends, their state, and the ring over all of them.

Contract:
- ``Fleet`` holds the backends, the ring over *all* of them and the set of
  those that cannot take new requests (draining, or marked down by health).
  Down and draining backends stay on the ring and are skipped by the walk,
  so their keys come back when they do.  Every change rebuilds the derived
  state once and swaps it by reference; requests only read.  A membership
  or weight change rebuilds the ring off the request path: on a running loop
  in slices of ~2 ms between which requests run on the old ring, then the new
  ring is swapped in (see ``Fleet``; ``await fleet.settled()`` waits for it).
- ``Fleet.loads`` counts the requests in flight per backend (leases taken by
  ``Balancer.choose``), ``Fleet.waiting`` those not answered yet (for
  ConcurrencyScope PREFILL).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Generator, Iterable

from hashring import DEFAULT_VNODES, LoadTracker, Ring
from hashring.ring import check_weight

from .config import BackendSpec

__all__ = ["AdminState", "Backend", "Fleet"]


class AdminState(enum.Enum):
    ACTIVE = "active"
    DRAINING = "draining"


class Backend:
    """One inference server: identity, address, weight, state and counters."""

    __slots__ = (
        "errors",
        "fallback",
        "healthy",
        "host",
        "name",
        "overflow",
        "port",
        "requests",
        "spec",
        "state",
        "url",
        "weight",
    )

    def __init__(self, spec: BackendSpec):
        self.spec = spec  # as added: persisted as is, with its health override
        self.name = spec.name
        self.url = spec.url
        self.host, self.port = spec.address()
        self.weight = spec.weight
        self.state = AdminState.ACTIVE
        self.healthy = True
        self.requests = 0  # routed here
        self.overflow = 0  # routed here as an overflow from an earlier member of the walk
        self.fallback = 0  # routed here because every candidate was at its bound
        self.errors = 0

    @property
    def available(self) -> bool:
        return self.healthy and self.state is AdminState.ACTIVE

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, {self.url!r}, weight={self.weight}, {self.state.value})"


class Fleet:
    """The backends, the published ring, and the rebuild that follows changes.

    ``add``, ``remove`` and ``set_weight`` change ``backends`` at once; the
    ring follows: on a running loop it is rebuilt in slices of at most
    ``SLICE_SECONDS`` scheduled with ``call_soon`` (requests run between
    slices, on the old ring), then swapped by reference; without a loop it is
    built before the call returns.  Until it is swapped, a removed backend
    still on the ring is in ``unavailable`` (skipped), and a new one is not on
    it yet (RANDOM and LEAST_OUTSTANDING_REQUESTS may already choose it).
    ``await settled()`` returns once the published ring has every change made
    before the call.  Changes made during a build are folded into one more.
    """

    __slots__ = (
        "_applied",
        "_available",
        "_building",
        "_changes",
        "_cum_weights",
        "_waiters",
        "backends",
        "loads",
        "ring",
        "unavailable",
        "waiting",
    )

    # Work per slice of a ring rebuild.  A step of the build is ~0.1-1 ms of
    # pure Python, so the loop waits at most about this plus one step.
    SLICE_SECONDS = 0.002

    def __init__(self, specs: Iterable[BackendSpec] = (), *, vnodes: int = DEFAULT_VNODES):
        self.backends: dict[str, Backend] = {}
        self.loads = LoadTracker()  # requests in flight
        self.waiting = LoadTracker()  # of those, not yet answered (ConcurrencyScope PREFILL)
        weights: dict[str, int] = {}
        for spec in specs:
            if spec.name in self.backends:
                raise KeyError(f"backend {spec.name!r} already exists")
            self.backends[spec.name] = Backend(spec)
            weights[spec.name] = spec.weight
        # One ring for the whole membership: adding members one by one would
        # rebuild the ring each time.
        self.ring = Ring(weights, vnodes=vnodes)
        self._changes = 0  # membership or weight changes made
        self._applied = 0  # of those, how many the published ring has
        self._building = False
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._refresh()

    # -- changes ---------------------------------------------------------------

    def add(self, spec: BackendSpec) -> Backend:
        if spec.name in self.backends:
            raise KeyError(f"backend {spec.name!r} already exists")
        check_weight(spec.name, spec.weight)
        backend = self.backends[spec.name] = Backend(spec)
        self._ring_changed()
        return backend

    def remove(self, name: str) -> Backend:
        backend = self.backends.pop(name)
        self._ring_changed()
        return backend

    def set_weight(self, name: str, weight: int) -> None:
        backend = self.backends[name]
        backend.weight = check_weight(name, weight)
        self._ring_changed()

    def set_state(self, name: str, state: AdminState) -> None:
        self.set_states((name,), state)

    def set_states(self, names: Iterable[str], state: AdminState) -> None:
        """Set several backends' state with one refresh (start-up from a state file)."""
        for name in names:
            self.backends[name].state = state
        self._refresh()

    def set_healthy(self, name: str, healthy: bool) -> None:
        backend = self.backends.get(name)
        if backend is not None and backend.healthy != healthy:
            backend.healthy = healthy
            self._refresh()

    async def settled(self) -> None:
        """Return once the published ring has every change made before this call."""
        if self._applied >= self._changes:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((self._changes, future))
        await future

    def _refresh(self) -> None:
        backends = self.backends
        available = tuple(b for b in backends.values() if b.available)
        self._available = available
        unavailable = {n for n, b in backends.items() if not b.available}
        if self._applied != self._changes:
            # Removed, but still on the ring until the rebuild is published.
            unavailable.update(n for n in self.ring.weights if n not in backends)
        self.unavailable = frozenset(unavailable)
        running = 0
        cum_weights = []
        for backend in available:
            running += backend.weight
            cum_weights.append(running)
        self._cum_weights = cum_weights

    # -- the ring rebuild ------------------------------------------------------

    def _ring_changed(self) -> None:
        self._changes += 1
        self._refresh()
        if not self._building:
            self._rebuild()

    def _rebuild(self) -> None:
        goal = self._changes
        weights = {name: b.weight for name, b in self.backends.items()}
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (start-up, tools): build it now
            self._publish(self.ring.with_weights(weights), goal)
            return
        self._building = True
        loop.call_soon(self._slice, loop, self.ring.steps_to(weights), goal)

    def _slice(
        self, loop: asyncio.AbstractEventLoop, steps: Generator[None, None, Ring], goal: int
    ) -> None:
        deadline = time.perf_counter() + self.SLICE_SECONDS
        try:
            next(steps)  # at least one step per slice, however short the slice
            while time.perf_counter() < deadline:
                next(steps)
        except StopIteration as done:
            self._building = False
            self._publish(done.value, goal)
            if self._applied < self._changes:
                self._rebuild()
            return
        except Exception as exc:  # a bug: tell the waiters rather than hang them
            self._building = False
            for _, future in self._waiters:
                if not future.done():
                    future.set_exception(exc)
            self._waiters.clear()
            raise
        loop.call_soon(self._slice, loop, steps, goal)

    def _publish(self, ring: Ring, goal: int) -> None:
        self.ring = ring
        self._applied = goal
        self._refresh()
        waiting = []
        for wanted, future in self._waiters:
            if wanted <= goal:
                if not future.done():
                    future.set_result(None)
            else:
                waiting.append((wanted, future))
        self._waiters = waiting

    # -- reading ---------------------------------------------------------------

    @property
    def available(self) -> tuple[Backend, ...]:
        return self._available
