"""Fair admission at saturation: a bounded per-tenant queue, served by deficit round robin.

Contract:
- Off (``[admission] queue = false``, the default) nothing here exists and a
  request whose every backend is at its bound goes to the least loaded one
  (``fallback``), as before.  On, such a request waits here instead
  (``Balancer.choose(..., queue=True)`` answers ``SATURATED``), and so does
  every new keyed request of its model pool while others wait, so that a
  newcomer cannot overtake them.  Only a request's first routing attempt
  queues (a retry after a connect failure takes the fallback); Responses API
  follow-ups pinned to their backend and passthroughs never queue.
- Tenants: the request's tenant key (``Exchange.tenant_key``; requests
  without one share the tenant ``None``).  Each tenant has a FIFO; tenants
  with waiting requests are served by deficit round robin (Shreedhar and
  Varghese 1995) with a quantum of ``weights[key]`` (default 1) requests a
  round: over any busy period each tenant gets its weight's share of the
  places that free up, whatever it sends.
- Event-driven: a place frees up when a lease is released (``Choice.release``
  or, under ConcurrencyScope PREFILL, ``Choice.first_byte``), when another
  worker's or replica's counts fall (``SharedLoadTracker.on_fold``), or when
  a backend or routing config changes; each calls ``wake()``, which runs one
  ``_pump`` at the end of the loop iteration.  ``_pump`` offers the head of
  the tenant whose turn it is to the balancer, and stops at the first
  ``SATURATED`` of each pool.  No timer polls.
- Bounds: ``max_queued_per_tenant`` per tenant and ``max_queued`` in all;
  past either the request is answered 429 at once (``queue_full``).  A
  request waits at most ``max_wait`` seconds (one timer each), then 429
  (``wait_timeout``).  Both 429s carry ``Retry-After`` (whole seconds, at
  least 1, at most ``max_wait``): the time the requests ahead of the tenant
  would take to drain at the recent admission rate.  Memory is bounded by
  ``max_queued`` requests (each holds its body: OpenAI bodies are complete
  and at most ``max_body_bytes``; a native one holds what it sent before its
  key, the client's reading is paused meanwhile).
- A client that goes away while its request waits (``Exchange.client_gone``
  through ``_finish``) leaves at once: ``leave()`` frees its place.
- The reserve (``reserve`` places, 0 by default: the queue is work-conserving).
  A work-conserving queue gives a tenant under its share the *next* place to
  free up, which at saturation is one prefill away.  With a reserve, while a
  tenant under its share of the requests (``router.shares``; counted at each
  keyed request's first routing attempt, ``asked``) sent one within the
  last ``share_window`` seconds ("the reserve is wanted"), a request of a
  tenant *not* under its share may not take a place when at
  most ``reserve`` are free (``Balancer.free_places``: below
  ConcurrencyThreshold, on the pool's available backends): it waits
  (``holds_back``, on the direct path as in ``_serve``), so those places
  stay free for the tenants under their share, whose requests take them at
  once (``_serve_under``: out of their round-robin turn, their deficit
  untouched).  The cost is the reserve's places, idle while nobody under
  share uses them.  Nobody under share (one tenant, or the window passed):
  nothing is held.  When requests are held back and nothing else would wake
  the queue, a timer pumps when the reserve lapses (``_recheck_later``).
- Several workers: each worker queues its own clients and admits them
  against the fleet-wide counts (its own at once, the others' within a fold
  period); fairness, the bounds and the shares are per worker (with
  SO_REUSEPORT spreading connections, the fleet-wide queue is N of these).
  The reserve is wanted fleet-wide: each worker writes until when it wants it
  into its own cell of the shared table (``fleet_wants``, a
  ``router.shared.SharedDeadline``) and reads every row's, so a worker that
  sees only the heavy tenant holds the reserve too.  Several replicas: the
  same, each replica's workers against the counts of all, and the deadline
  carried in each replica's row (``router.replicas``).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from .log import get_logger
from .shares import Shares

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from .app import Router
    from .balancer import Members
    from .config import AdmissionConfig
    from .routing import Routing
    from .shared import SharedDeadline

__all__ = ["QUEUE_FULL", "WAIT_TIMEOUT", "AdmissionQueue"]

QUEUE_FULL = 0  # indexes of router.tenants.REJECT_REASONS
WAIT_TIMEOUT = 1
RATE_SAMPLES = 64  # admissions the Retry-After estimate looks back on

log = get_logger("router")


class _Tenant:
    __slots__ = ("deficit", "granted", "items", "key", "weight")

    def __init__(self, key: str | None, weight: float):
        self.key = key
        self.weight = weight
        # FIFO with O(1) removal from anywhere: a client that leaves (or a timer that
        # expires) takes its request out without a scan; with a deque each leave
        # scanned the tenant's requests, 4,000 clients of one tenant closing together
        # stalled the loop 0.46 s (RELIABILITY.md, the admission queue's defects).
        self.items: OrderedDict[Routing, None] = OrderedDict()
        self.deficit = 0.0
        self.granted = False  # its quantum for the current turn has been added


class _Pool:
    """The waiting requests of one model pool (None: the fleet)."""

    __slots__ = ("active", "tenants")

    def __init__(self) -> None:
        self.tenants: dict[str | None, _Tenant] = {}
        # Tenants with waiting requests, in turn order (the first's turn now; its turn
        # over, it moves to the end): O(1) removal too, as ``_Tenant.items``.
        self.active: OrderedDict[_Tenant, None] = OrderedDict()


class AdmissionQueue:
    __slots__ = (
        "_admitted",
        "_counts",
        "_pools",
        "_recheck",
        "_scheduled",
        "_wanted",
        "config",
        "depth",
        "fleet_wants",
        "refresh",
        "reserve",
        "router",
        "shares",
    )

    def __init__(self, router: Router, config: AdmissionConfig):
        self.router = router
        self.config = config
        self.depth = 0  # requests waiting
        self._pools: dict[str | None, _Pool] = {}
        self._counts: dict[str | None, int] = {}  # waiting per tenant (all pools)
        self._scheduled = False
        self._admitted: deque[float] = deque(maxlen=RATE_SAMPLES)  # loop times
        self.reserve = config.reserve  # places held back for tenants under their share
        self.shares = Shares(config.weights, config.share_window)
        self._wanted = 0.0  # loop time until which the reserve is wanted here
        # Several workers (router.worker): until when any process wants it, and how to
        # read the other workers' counts now (not as of the last fold) near the reserve.
        self.fleet_wants: SharedDeadline | None = None
        self.refresh: Callable[[], object] | None = None
        self._recheck: asyncio.TimerHandle | None = None  # the reserve may lapse: pump then

    @property
    def tenants(self) -> int:
        return len(self._counts)

    def busy(self, pool: str | None) -> bool:
        """Requests of ``pool`` wait: a new one goes behind them."""
        return bool(self.depth) and pool in self._pools

    def full(self, key: str | None) -> bool:
        """A new request of tenant ``key`` would be refused (429 ``queue_full``): its
        ``max_queued_per_tenant`` or the ``max_queued`` in all wait already."""
        config = self.config
        waiting = self._counts.get(key, 0)
        return waiting >= config.max_queued_per_tenant or self.depth >= config.max_queued

    def waiting(self, key: str | None) -> int:
        """Requests of tenant ``key`` waiting (all pools)."""
        return self._counts.get(key, 0)

    def enter(self, exchange: Routing) -> bool:
        """Queue ``exchange`` (its tenant and pool); False if a bound refuses it."""
        key = exchange.tenant_key
        config = self.config
        if self.full(key):
            return False
        waiting = self._counts.get(key, 0)
        pool = self._pools.get(exchange.pool)
        if pool is None:
            pool = self._pools[exchange.pool] = _Pool()
        tenant = pool.tenants.get(key)
        if tenant is None:
            weight = config.weights.get(key, 1.0) if key is not None else 1.0
            tenant = pool.tenants[key] = _Tenant(key, weight)
        if not tenant.items:
            pool.active[tenant] = None
        tenant.items[exchange] = None
        self._counts[key] = waiting + 1
        self.depth += 1
        loop = self.router.loop
        exchange.queue_entered(
            loop.time(), loop.call_later(config.max_wait, self._expire, exchange)
        )
        self.wake()  # a place may be free already (a newcomer behind others)
        return True

    def leave(self, exchange: Routing) -> None:
        """Take a waiting request out (gone, expired); no-op if it is not waiting."""
        pool = self._pools.get(exchange.pool)
        tenant = None if pool is None else pool.tenants.get(exchange.tenant_key)
        if tenant is None or tenant.items.pop(exchange, False) is not None:
            return  # not waiting (the pop's default, False, says so)
        assert pool is not None
        self._left(pool, tenant)

    def _left(self, pool: _Pool, tenant: _Tenant) -> None:
        key = tenant.key
        self.depth -= 1
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]
        if not tenant.items:
            pool.active.pop(tenant, None)
            del pool.tenants[key]
            if not pool.tenants:
                del self._pools[next(k for k, p in self._pools.items() if p is pool)]

    def _expire(self, exchange: Routing) -> None:
        self.leave(exchange)
        exchange.reject(WAIT_TIMEOUT, self.retry_after(exchange.tenant_key))

    def retry_after(self, key: str | None) -> int:
        """Seconds until the requests ahead of tenant ``key`` would be admitted."""
        admitted = self._admitted
        ceiling = max(1, math.ceil(self.config.max_wait))
        if len(admitted) < 2 or admitted[-1] <= admitted[0]:
            return 1
        rate = (len(admitted) - 1) / (admitted[-1] - admitted[0])
        # Round robin: the tenant's next place comes after one of every waiting tenant's.
        ahead = min(self.depth, (self._counts.get(key, 0) + 1) * max(1, len(self._counts)))
        return min(ceiling, max(1, math.ceil(ahead / rate)))

    # -- the reserve -----------------------------------------------------------

    def holds_back(self, key: str | None, members: Members | None, now: float) -> bool:
        """A request of tenant ``key`` to ``members`` (None: the fleet) must wait
        although a place may be free: the reserve is wanted, the tenant is not
        under its share, and at most ``reserve`` places are free."""
        reserve = self.reserve
        if not reserve or not self._wants(now) or self.shares.under(key, now):
            return False
        if self.refresh is not None:
            # A fold period late, two workers could both take "the last place but
            # the reserve" (measured: light's P90 x1.2-1.4 with 2 workers, not x1.06).
            self.refresh()
        router = self.router
        return router.balancer.free_places(members or router.fleet, reserve) <= reserve

    def asked(self, key: str | None, now: float) -> None:
        """A request of tenant ``key`` arrived (its first routing attempt)."""
        if not self.reserve:
            return  # shares only say who the reserve is for
        shares = self.shares
        if shares.under(key, now):
            # A tenant under its share is active: hold the reserve for a window.
            self._wanted = now + shares.window
            if self.fleet_wants is not None:
                self.fleet_wants.set(time.monotonic() + shares.window)
        shares.asked(key, now)

    def _wants(self, now: float) -> bool:
        """A tenant under its share sent a request within a window, here or (several
        workers, replicas) anywhere."""
        if self._wanted > now:
            return True
        fleet = self.fleet_wants
        return fleet is not None and fleet.latest() > time.monotonic()

    def _recheck_later(self, now: float) -> None:
        """Requests are held back and nobody under share waits: pump again when the
        reserve lapses (no place may free up before: the reserve may be all the
        free room there is)."""
        if self._recheck is not None:
            return
        until = self._wanted
        fleet = self.fleet_wants
        if fleet is not None:
            until = max(until, now + fleet.latest() - time.monotonic())
        if until > now:
            self._recheck = self.router.loop.call_at(until, self._rechecked)

    def _rechecked(self) -> None:
        self._recheck = None
        self.wake()

    # -- admission -------------------------------------------------------------

    def wake(self) -> None:
        """A place may have freed up: pump at the end of this loop iteration."""
        if self.depth and not self._scheduled:
            self._scheduled = True
            self.router.loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._scheduled = False
        for name in list(self._pools):
            pool = self._pools.get(name)
            if pool is not None:
                self._serve(pool)

    def _serve(self, pool: _Pool) -> None:
        """Deficit round robin over the pool's tenants until the balancer says
        saturated; a tenant held back by the reserve lets those under their share go."""
        active = pool.active
        now = self.router.loop.time()
        while active:
            tenant = next(iter(active))
            if not tenant.granted:
                tenant.deficit += tenant.weight
                tenant.granted = True
            items = tenant.items
            while tenant.deficit >= 1 and items:
                exchange = next(iter(items))
                if self.reserve and self._held(exchange, now):
                    self._serve_under(pool, now)  # its turn waits for a place past the reserve
                    return
                if not exchange.admit(now):
                    return  # saturated: the next wake resumes this very turn
                del items[exchange]
                tenant.deficit -= 1
                self._took(exchange, now)
                self._left(pool, tenant)
                if tenant not in active:
                    break  # it emptied and left
            if tenant in active:
                active.move_to_end(tenant)  # its turn is over (out of deficit)
                tenant.granted = False
                if not items:  # pragma: no cover - _left removed it
                    del active[tenant]
            if not tenant.items:
                tenant.deficit = 0.0

    def _held(self, exchange: Routing, now: float) -> bool:
        members = exchange.members()
        return members is not None and self.holds_back(exchange.tenant_key, members, now)

    def _serve_under(self, pool: _Pool, now: float) -> None:
        """Admit the waiting requests of tenants under their share (out of turn,
        their deficit untouched: the reserve is theirs) until saturated."""
        shares = self.shares
        for tenant in list(pool.active):
            items = tenant.items
            while items and shares.under(tenant.key, now):
                exchange = next(iter(items))
                if not exchange.admit(now):
                    return
                del items[exchange]
                self._took(exchange, now)
                self._left(pool, tenant)
        self._recheck_later(now)

    def _took(self, exchange: Routing, now: float) -> None:
        self._admitted.append(now)
