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
- Model pools.  A backend lists the models it serves (``BackendSpec.models``);
  an empty list serves whatever it is asked.  While no backend lists a model,
  there are no pools (``pools`` is empty) and the fleet is one pool, as
  before.  Once one does, model M's pool (``ModelPool``) is every backend that
  lists M plus every backend that lists none, and ``any_model`` the backends
  that list none (the pool of a model nobody lists; None when there are no
  such backends: that model is unknown).  Each pool has its own ring over its
  members only, built with the fleet's ring and published with it, so a
  backend of model B moves no key of model A, and bounded loads compare a
  pool's members with each other.  ``members_for(model)`` is what a request
  routes over: the whole fleet (``Fleet`` itself) for a request without a
  model or while no model is declared, else the pool, or None (unknown).
- Derived rings: a hook (``derive_rings``; an A/B split's arms, router.split)
  names more memberships to build from each new ring and its pools'; they
  are built in the same slices, published with them and read with
  ``derived_ring``, so no request has to build one.
- Slow start (``router.slowstart``): a backend added with a ``Ramp``, or up
  again after being down while a window is set (``slow_start``, or its own
  ``health.slow_start``), holds ``k/n`` of its ring points, ``k`` growing
  with time.  The fleet keeps a timer to the next step boundary of any ramp
  (on a running loop) and rebuilds the ring only when a step changes; its
  configured ``weight`` is what everything else reads.  ``effective_weight``
  and ``ramps`` are for the admin API.
- Panic (``panic``, ``[health] panic``): a backend marked down whose every
  pool (the fleet, where no model is declared) has no backend up is routed
  to all the same (``rescued``), as Envoy's panic threshold and nginx's
  reset of an upstream whose servers all failed: when health says every
  backend a request could go to is down, health is more likely wrong (a
  mistyped health path, ``/health`` too slow under peak load) than every
  engine dead, and a request tried is better than a 503 for certain; a
  backend really dead fails the request over to the next (``retries``).  A
  backend that shares a pool with one that is up is never rescued: that
  pool's traffic goes to the backend up.  Draining backends are not
  rescued.  Decided on each refresh (a health or membership change), never
  per request; every process of a host decides the same from the same
  health, each replica from its own.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Generator, Iterable, Mapping

from hashring import DEFAULT_VNODES, LoadTracker, Ring
from hashring.ring import check_weight

from .cachecheck import backend_tag
from .config import BackendSpec
from .log import get_logger
from .slowstart import Ramp, fraction, next_change

__all__ = ["ANY_MODEL", "AdminState", "Backend", "Fleet", "ModelPool"]

log = get_logger("health")

# The key of ``any_model`` among pools: not a model name (those are never empty).
ANY_MODEL = ""


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
        "repeats_answered",
        "repeats_sent",
        "requests",
        "spec",
        "state",
        "tag",
        "tie_breaks",
        "tls",
        "url",
        "weight",
    )

    def __init__(self, spec: BackendSpec):
        self.spec = spec  # as added: persisted as is, with its health override
        self.name = spec.name
        self.url = spec.url
        self.host, self.port = spec.address()
        self.tls = spec.tls
        self.weight = spec.weight
        self.state = AdminState.ACTIVE
        self.healthy = True
        self.requests = 0  # routed here
        self.overflow = 0  # routed here as an overflow from an earlier member of the walk
        self.fallback = 0  # routed here because every candidate was at its bound
        self.errors = 0
        # router.cachecheck: requests that repeat a key sent here before, when sent
        # and when their 2xx answer ended; ``tag`` marks this backend's keys.
        self.repeats_sent = 0
        self.repeats_answered = 0
        self.tag = backend_tag(self.name)
        # router.signals: routed here because its engine's signal broke a tie
        self.tie_breaks = 0

    @property
    def available(self) -> bool:
        return self.healthy and self.state is AdminState.ACTIVE

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, {self.url!r}, weight={self.weight}, {self.state.value})"


class ModelPool:
    """The backends that serve one model, and the ring over them (see the contract).

    The same reading surface as ``Fleet`` for the balancer: ``ring``,
    ``available``, ``cum_weights``, ``model`` (``ANY_MODEL`` for
    ``any_model``).  Rebuilt by the fleet on every change; never changed.
    """

    __slots__ = ("available", "created", "cum_weights", "members", "model", "ring")

    def __init__(
        self,
        model: str,
        members: tuple[str, ...],
        ring: Ring,
        available: tuple[Backend, ...],
        created: int,
    ):
        self.model = model
        self.members = members  # every backend serving it, available or not, by name
        self.ring = ring
        self.available = available
        self.cum_weights = _cum_weights(available)
        self.created = created  # when this router first saw it declared (unix seconds)

    def __repr__(self) -> str:
        return f"ModelPool({self.model!r}, {[b.name for b in self.available]})"


def _cum_weights(available: tuple[Backend, ...]) -> list[int]:
    running = 0
    cum_weights = []
    for backend in available:
        running += backend.weight
        cum_weights.append(running)
    return cum_weights


_Membership = tuple[frozenset[tuple[str, int]], frozenset[tuple[str, tuple[int, int]]]]
# The fleet's ring, each pool's, and the derived ones (``Fleet.derive``) by membership.
_Built = tuple[Ring, dict[str, Ring], dict[_Membership, Ring]]
_RingBuild = Generator[None, None, _Built]
# What a hook wants built beside the pools' rings: memberships (weights, fractions).
_Fractions = Mapping[str, tuple[int, int]]
Derive = Callable[[Ring, Mapping[str, Ring]], Iterable[tuple[dict[str, int], _Fractions]]]


def _membership(weights: Mapping[str, int], fractions: _Fractions) -> _Membership:
    return frozenset(weights.items()), frozenset(
        (name, part) for name, part in fractions.items() if name in weights
    )


def _run(steps: _RingBuild) -> _Built:
    """A ring build run to its end at once (no loop to slice it on)."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        result: _Built = done.value
        return result


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
        "_clock",
        "_created",
        "_derived",
        "_pool_rings",
        "_ramp_timer",
        "_steps",
        "_waiters",
        "any_model",
        "backends",
        "cum_weights",
        "derive",
        "loads",
        "panic",
        "pools",
        "ramps",
        "rescued",
        "ring",
        "slow_start",
        "unavailable",
        "waiting",
    )

    model = None  # the whole fleet serves any model: ``members_for`` returns it

    # Work per slice of a ring rebuild.  A step of the build is ~0.1-1 ms of
    # pure Python, so the loop waits at most about this plus one step.
    SLICE_SECONDS = 0.002

    def __init__(
        self,
        specs: Iterable[BackendSpec] = (),
        *,
        vnodes: int = DEFAULT_VNODES,
        slow_start: float = 0.0,
        panic: bool = False,
        clock: Callable[[], float] = time.time,
    ):
        self.backends: dict[str, Backend] = {}
        # Panic (the contract): whether to route to down backends where all are
        # down, and which backends are routed to so now.
        self.panic = panic
        self.rescued: frozenset[str] = frozenset()
        # Slow start: the window of a recovery ramp (0: none), the clock ramps are
        # read on (unix seconds: every process of a host and every replica share
        # it), the ramps under way and the step each is at.
        self.slow_start = slow_start
        self._clock = clock
        self.ramps: dict[str, Ramp] = {}
        self._steps: dict[str, tuple[int, int]] = {}
        self._ramp_timer: asyncio.TimerHandle | None = None
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
        self.pools: dict[str, ModelPool] = {}
        self.any_model: ModelPool | None = None
        self._created: dict[str, int] = {}
        self._changes = 0  # membership or weight changes made
        self._applied = 0  # of those, how many the published ring has
        self._building = False
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._pool_rings: dict[str, Ring] = {}
        # Rings a hook derives from each membership (an A/B split's arms, router.split),
        # built in the same slices as the pools' and published with them.
        self.derive: Derive | None = None
        self._derived: dict[_Membership, Ring] = {}
        self._pool_rings = _run(self._build(weights, self._pool_weights(), self.ring))[1]
        self._refresh()

    # -- changes ---------------------------------------------------------------

    def add(self, spec: BackendSpec, ramp: Ramp | None = None) -> Backend:
        """Add a backend; with ``ramp``, its ring share ramps up (slow start)."""
        if spec.name in self.backends:
            raise KeyError(f"backend {spec.name!r} already exists")
        check_weight(spec.name, spec.weight)
        backend = self.backends[spec.name] = Backend(spec)
        if ramp is not None:
            self._start_ramp(spec.name, ramp)
        self._ring_changed()
        return backend

    def remove(self, name: str) -> Backend:
        backend = self.backends.pop(name)
        self.ramps.pop(name, None)
        self._steps.pop(name, None)
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

    def set_healthy(self, name: str, healthy: bool, *, since: float | None = None) -> None:
        """Mark a backend up or down.  Up again with a slow-start window, it ramps
        from ``since`` (default now: a supervisor passes its own to its workers)."""
        backend = self.backends.get(name)
        if backend is None or backend.healthy == healthy:
            return
        backend.healthy = healthy
        window = self.window(backend.spec)
        if healthy and window > 0:
            start = self._clock() if since is None else since
            if self._start_ramp(name, Ramp(start, window)):
                self._ring_changed()
                return
        elif not healthy:
            # Skipped while down; its next recovery ramps again from its own start.
            self.ramps.pop(name, None)
            if self._steps.pop(name, None) is not None:
                self._ring_changed()
                return
        self._refresh()

    def window(self, spec: BackendSpec) -> float:
        """The slow-start window of a backend (0: none): its own, else the fleet's."""
        override = spec.health
        if override is not None and override.slow_start is not None:
            return override.slow_start_seconds
        return self.slow_start

    def ramp_for(self, spec: BackendSpec) -> Ramp | None:
        """The slow start of ``spec`` added now (None: at once), for the add op."""
        window = self.window(spec)
        return Ramp(self._clock(), window) if window > 0 else None

    def set_ramp(self, name: str, ramp: Ramp) -> None:
        """Take over a ramp under way (a worker that starts mid-ramp)."""
        if name in self.backends and self._start_ramp(name, ramp):
            self._ring_changed()

    def effective_weight(self, name: str) -> float:
        """The weight ``name``'s ring points stand for now (its weight once ramped)."""
        weight = self.backends[name].weight
        part = self._steps.get(name)
        return weight if part is None else weight * part[0] / part[1]

    # -- slow start ------------------------------------------------------------

    def _start_ramp(self, name: str, ramp: Ramp) -> bool:
        """Record ``ramp``; True if it is under way now (the ring must follow)."""
        part = fraction(ramp, self._clock())
        if part is None:
            self.ramps.pop(name, None)
            return self._steps.pop(name, None) is not None
        self.ramps[name] = ramp
        self._steps[name] = part
        self._schedule_step()
        return True

    def _schedule_step(self) -> None:
        """A timer to the next step boundary of any ramp (one timer for all)."""
        if self._ramp_timer is not None:
            self._ramp_timer.cancel()
            self._ramp_timer = None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (start-up, tools): stepped on the next change
            return
        now = self._clock()
        changes = [t for r in self.ramps.values() if (t := next_change(r, now)) is not None]
        if changes:
            # 1 ms past the boundary: float rounding must not leave the step unchanged.
            delay = max(0.0, min(changes) - now) + 0.001
            self._ramp_timer = loop.call_later(delay, self._step)

    def _step(self) -> None:
        self._ramp_timer = None
        now = self._clock()
        changed = False
        for name, ramp in list(self.ramps.items()):
            part = fraction(ramp, now)
            if part is None:
                del self.ramps[name]
            if self._steps.get(name) != part:
                changed = True
                if part is None:
                    del self._steps[name]
                else:
                    self._steps[name] = part
        self._schedule_step()
        if changed:
            self._ring_changed()

    def close(self) -> None:
        """Stop the ramp timer (the router stops)."""
        if self._ramp_timer is not None:
            self._ramp_timer.cancel()
            self._ramp_timer = None

    async def settled(self) -> None:
        """Return once the published ring has every change made before this call."""
        if self._applied >= self._changes:
            return
        future = asyncio.get_running_loop().create_future()
        self._waiters.append((self._changes, future))
        await future

    def _refresh(self) -> None:
        backends = self.backends
        declared = self._pool_weights()  # read by panic and the pools alike
        rescued = self._rescue(declared) if self.panic else frozenset()
        if rescued != self.rescued:
            if rescued:
                log.warning(
                    "panic: no backend is up for these backends' requests; routing to them anyway",
                    backends=sorted(rescued),
                )
            else:
                log.info("panic over: routing to backends up only")
            self.rescued = rescued
        available = tuple(b for b in backends.values() if b.available or b.name in rescued)
        self._available = available
        unavailable = {n for n, b in backends.items() if not b.available and n not in rescued}
        if self._applied != self._changes:
            # Removed, but still on the ring until the rebuild is published.
            unavailable.update(n for n in self.ring.weights if n not in backends)
        self.unavailable = frozenset(unavailable)
        self.cum_weights = _cum_weights(available)
        self._refresh_pools(available, declared)

    def _rescue(self, declared: dict[str, dict[str, int]]) -> frozenset[str]:
        """The backends down that panic routes to (the contract): active, and every
        pool they serve without a backend up."""
        backends = self.backends
        down = [b.name for b in backends.values() if not b.healthy and b.state is AdminState.ACTIVE]
        if not down:
            return frozenset()
        # Without a model declared, the fleet is the one pool.
        pools: Mapping[str, Mapping[str, object]] = declared or {ANY_MODEL: backends}
        served = [
            members
            for members in pools.values()
            if any(backends[name].available for name in members)
        ]
        return frozenset(name for name in down if not any(name in m for m in served))

    def _refresh_pools(
        self, available: tuple[Backend, ...], declared: dict[str, dict[str, int]]
    ) -> None:
        """The pools of the models the backends declare now (``declared``:
        ``_pool_weights``), on the rings published."""
        if not declared:
            self.pools, self.any_model = {}, None
            return
        now = int(time.time())
        rings = self._pool_rings
        pools = {}
        for model, members in declared.items():
            ring = rings.get(model)
            if ring is None:  # declared since the last build: until the next is published
                ring = Ring(vnodes=self.ring.vnodes)
            pool_available = tuple(b for b in available if b.name in members)
            created = self._created.setdefault(model, now)
            pools[model] = ModelPool(model, tuple(sorted(members)), ring, pool_available, created)
        self.any_model = pools.pop(ANY_MODEL, None)
        self.pools = pools

    def _pool_weights(self) -> dict[str, dict[str, int]]:
        """Each declared model's members and weights (``ANY_MODEL``: the backends that
        declare none); empty while no backend declares a model."""
        models: dict[str, dict[str, int]] = {}
        anything: dict[str, int] = {}
        for name, backend in self.backends.items():
            declared = backend.spec.models
            if not declared:
                anything[name] = backend.weight
            for model in declared:
                models.setdefault(model, {})[name] = backend.weight
        if not models:
            return {}
        for members in models.values():
            members.update(anything)
        if anything:
            models[ANY_MODEL] = anything
        return models

    def members_for(self, model: str) -> Fleet | ModelPool | None:
        """What a request for ``model`` routes over; None: no backend serves it."""
        if not self.pools:
            return self
        return self.pools.get(model, self.any_model)

    def models(self) -> list[ModelPool]:
        """The declared models' pools, by name (``GET /v1/models``)."""
        return [self.pools[model] for model in sorted(self.pools)]

    # -- the ring rebuild ------------------------------------------------------

    def derive_rings(self, derive: Derive | None) -> None:
        """Build (None: stop building) the rings ``derive`` asks for beside the pools':
        from now on in the slices of every rebuild, and for the published membership
        by a rebuild started now."""
        self.derive = derive
        self._derived = {}
        if derive is not None:
            self._ring_changed()

    def derived_ring(self, weights: Mapping[str, int], fractions: _Fractions) -> Ring | None:
        """The published ring of this membership that ``derive`` asked for, if built."""
        return self._derived.get(_membership(weights, fractions))

    def _ring_changed(self) -> None:
        self._changes += 1
        self._refresh()
        if not self._building:
            self._rebuild()

    def _rebuild(self) -> None:
        goal = self._changes
        weights = {name: b.weight for name, b in self.backends.items()}
        steps = self._build(weights, self._pool_weights(), fractions=dict(self._steps))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (start-up, tools): build it now
            self._publish(*_run(steps), goal)
            return
        self._building = True
        loop.call_soon(self._slice, loop, steps, goal)

    def _build(
        self,
        weights: dict[str, int],
        pools: dict[str, dict[str, int]],
        ring: Ring | None = None,
        fractions: _Fractions | None = None,
    ) -> _RingBuild:
        """The fleet's ring, then each pool's ring.  A ring is a function of its
        members and weights, so pools with the same ones share one (a backend's
        LoRA adapters, a fleet where every backend serves one model: the fleet's
        ring), an unchanged pool keeps its own, and a new one reuses the point
        hashes of the fleet's.  ``ring``: the fleet's, already built.  ``fractions``:
        the ramps' steps (slow start)."""
        fractions = fractions or {}
        if ring is None:
            ring = yield from self.ring.steps_to(weights, fractions)
        known = {_membership(old.weights, old.fractions): old for old in self._pool_rings.values()}
        known[_membership(weights, fractions)] = ring
        rings: dict[str, Ring] = {}
        for model, members in pools.items():
            key = _membership(members, fractions)
            pool_ring = known.get(key)
            if pool_ring is None:
                pool_ring = known[key] = yield from ring.steps_to(members, fractions)
            rings[model] = pool_ring
        derived: dict[_Membership, Ring] = {}
        if self.derive is not None:
            for members, parts in self.derive(ring, rings):
                key = _membership(members, parts)
                derived_ring = known.get(key) or self._derived.get(key)
                if derived_ring is None:
                    derived_ring = known[key] = yield from ring.steps_to(members, parts)
                derived[key] = derived_ring
        return ring, rings, derived

    def _slice(self, loop: asyncio.AbstractEventLoop, steps: _RingBuild, goal: int) -> None:
        deadline = time.perf_counter() + self.SLICE_SECONDS
        try:
            next(steps)  # at least one step per slice, however short the slice
            while time.perf_counter() < deadline:
                next(steps)
        except StopIteration as done:
            self._building = False
            built: _Built = done.value
            self._publish(*built, goal)
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

    def _publish(
        self,
        ring: Ring,
        pool_rings: dict[str, Ring],
        derived: dict[_Membership, Ring],
        goal: int,
    ) -> None:
        self.ring = ring
        self._pool_rings = pool_rings
        self._derived = derived
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
