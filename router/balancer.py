"""Membership and the three routing strategies.

Contract:
- ``Fleet`` holds the backends, the ring over *all* of them and the set of
  those that cannot take new requests (draining, or marked down by health).
  Down and draining backends stay on the ring and are skipped by the walk,
  so their keys come back when they do.  Every change rebuilds the derived
  state once and swaps it by reference; requests only read.  A membership
  or weight change rebuilds the ring off the request path: on a running loop
  in slices of ~2 ms between which requests run on the old ring, then the new
  ring is swapped in (see ``Fleet``; ``await fleet.settled()`` waits for it).
- ``Balancer.choose`` picks a backend *and* takes its in-flight lease in the
  same synchronous step, before any await, so that concurrent requests see
  each other's load.  It returns None when no backend can take the request.
- Strategies: RANDOM (weighted uniform over available backends),
  LEAST_OUTSTANDING_REQUESTS (fewest in flight per unit of weight, ties
  broken at random) and PREFIX_AWARE (bounded-load walk of the key's
  preference list, see ``hashring.bounded``).  Requests without a key
  (passthrough GETs) go least-outstanding whatever the strategy.
- ``avoid`` names backends this request already tried (retries).
"""

from __future__ import annotations

import asyncio
import enum
import random
import time
from collections.abc import Generator, Iterable, Set

from hashring import (
    DEFAULT_VNODES,
    Decision,
    Lease,
    LoadBound,
    LoadTracker,
    Placement,
    Ring,
    pick,
)
from hashring.ring import check_weight

from .config import BackendSpec, RoutingConfig, Strategy

__all__ = ["AdminState", "Backend", "Balancer", "Choice", "Fleet"]

_PRIMARY, _OVERFLOW = Decision.PRIMARY, Decision.OVERFLOW


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


class Choice:
    """A routing decision and its lease.

    ``decision`` is one of primary, overflow, fallback (PREFIX_AWARE), random,
    least_outstanding or passthrough; ``position`` is the place in the walk.
    """

    __slots__ = ("backend", "decision", "lease", "position", "waiting")

    def __init__(
        self,
        backend: Backend,
        lease: Lease,
        decision: str,
        position: int,
        waiting: Lease | None = None,
    ):
        self.backend = backend
        self.lease = lease  # in flight until the response ends
        self.decision = decision
        self.position = position
        self.waiting = waiting  # ConcurrencyScope PREFILL: until the first body byte

    def first_byte(self) -> None:
        """The backend answered: it is done with this request's prefill."""
        if self.waiting is not None:
            self.waiting.release()

    def release(self) -> None:
        self.lease.release()
        if self.waiting is not None:
            self.waiting.release()

    @property
    def label(self) -> str:
        """What the access log says: "overflow 2" names the place in the walk."""
        if self.decision == "overflow":
            return f"overflow {self.position}"
        return self.decision


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
        steps = self.ring.steps_to({name: b.weight for name, b in self.backends.items()})
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (start-up, tools): build it now
            self._publish(_finish(steps), goal)
            return
        self._building = True
        loop.call_soon(self._slice, loop, steps, goal)

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


def _finish(steps: Generator[None, None, Ring]) -> Ring:
    """Run a ring build's steps to the end and return the ring."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


_Picked = tuple[Backend, str, int]


class Balancer:
    """Applies the live routing config to the fleet."""

    __slots__ = (
        "_bound",
        "_placement",
        "_prefill_scope",
        "_rng",
        "_select_keyed",
        "config",
        "fleet",
    )

    # TRAFFIC mode without a BalanceFactor: 5 % over a fair share of recent requests.
    DEFAULT_TRAFFIC_FACTOR = 1.05

    def __init__(self, fleet: Fleet, config: RoutingConfig, *, seed: int | None = None):
        self.fleet = fleet
        self._rng = random.Random(seed)
        self._placement: Placement | None = None
        self.configure(config)

    def configure(self, config: RoutingConfig) -> None:
        """Swap the routing config; requests already routed keep their leases."""
        prefix = config.prefix_aware
        self._prefill_scope = (
            config.strategy is Strategy.PREFIX_AWARE and prefix.concurrency_scope == "PREFILL"
        )
        if prefix.balance_mode == "TRAFFIC":
            factor = prefix.balance_factor or self.DEFAULT_TRAFFIC_FACTOR
            if self._placement is None:
                self._placement = Placement(factor)
            else:
                self._placement.factor = factor  # keys keep their homes across changes
            self._bound = LoadBound(prefix.concurrency_threshold)
        else:
            self._placement = None
            self._bound = LoadBound(prefix.concurrency_threshold, prefix.balance_factor)
        self._select_keyed = {
            Strategy.RANDOM: self._random,
            Strategy.LEAST_OUTSTANDING_REQUESTS: self._least_outstanding,
            Strategy.PREFIX_AWARE: self._prefix_aware,
        }[config.strategy]
        self.config = config

    def choose(self, key_hash: int | None, avoid: Set[str] = frozenset()) -> Choice | None:
        """Pick a backend for a request and count it in flight (same step)."""
        if key_hash is None:
            picked = self._least_outstanding(0, avoid)
            if picked is None:
                return None
            backend, decision, position = picked[0], "passthrough", 0
        else:
            picked = self._select_keyed(key_hash, avoid)
            if picked is None:
                return None
            backend, decision, position = picked
        backend.requests += 1
        fleet = self.fleet
        waiting = fleet.waiting.acquire(backend.name) if self._prefill_scope else None
        return Choice(backend, fleet.loads.acquire(backend.name), decision, position, waiting)

    # -- strategies: each returns (backend, decision, position) or None; none counts --

    def _prefix_aware(self, key_hash: int, avoid: Set[str]) -> _Picked | None:
        fleet = self.fleet
        skip = fleet.unavailable | avoid if avoid else fleet.unavailable
        loads = fleet.loads
        if self._placement is not None:
            # ConcurrencyScope PREFILL: the threshold counts only requests not yet
            # answered; a stream in its decode phase no longer competes for the
            # prefill that a cache hit saves.
            counts = fleet.waiting.counts if self._prefill_scope else loads.counts
            chosen = self._placement.route(
                fleet.ring,
                key_hash,
                counts,
                self._bound.threshold,
                avoid=skip,
                fallback_loads=loads.counts,  # the least busy overall, as in pick()
            )
        elif self._prefill_scope:
            # The same for the threshold; BalanceFactor still bounds every request
            # in flight, so one hot prefix cannot take a backend's whole batch.
            waiting = fleet.waiting
            chosen = pick(
                fleet.ring,
                key_hash,
                waiting.counts,
                self._bound,
                avoid=skip,
                total=waiting.total,
                balance_loads=loads.counts,
                balance_total=loads.total,
            )
        else:
            chosen = pick(
                fleet.ring, key_hash, loads.counts, self._bound, avoid=skip, total=loads.total
            )
        if chosen is None:
            return None
        member, decision, position = chosen
        backend = fleet.backends[member]
        if decision is not _PRIMARY:
            if decision is _OVERFLOW:
                backend.overflow += 1
            else:
                backend.fallback += 1
        # _value_: an Enum's .value is a descriptor, several times slower to read.
        return backend, decision._value_, position

    def _random(self, key_hash: int, avoid: Set[str]) -> _Picked | None:
        fleet = self.fleet
        candidates = fleet.available
        cum_weights: list[int] | None = fleet._cum_weights
        if avoid:
            candidates = tuple(b for b in candidates if b.name not in avoid)
            cum_weights = None
        if not candidates:
            return None
        if cum_weights is None:
            chosen = self._rng.choices(candidates, [b.weight for b in candidates])[0]
        else:
            chosen = self._rng.choices(candidates, cum_weights=cum_weights)[0]
        return chosen, "random", 0

    def _least_outstanding(self, key_hash: int, avoid: Set[str]) -> _Picked | None:
        counts = self.fleet.loads.counts
        best: Backend | None = None
        best_load = best_weight = 0
        ties = 0
        for backend in self.fleet.available:
            if avoid and backend.name in avoid:
                continue
            load = counts.get(backend.name, 0)
            # Compare load/weight without division: a/wa < b/wb  <=>  a*wb < b*wa.
            if best is None or load * best_weight < best_load * backend.weight:
                best, best_load, best_weight, ties = backend, load, backend.weight, 1
            elif load * best_weight == best_load * backend.weight:
                ties += 1  # reservoir sampling: each tied backend wins with 1/ties
                if self._rng.random() * ties < 1:
                    best, best_load, best_weight = backend, load, backend.weight
        if best is None:
            return None
        return best, "least_outstanding", 0
