"""The three routing strategies, applied to the fleet.

Contract:
- ``Balancer.choose`` picks a backend *and* takes its in-flight lease in the
  same synchronous step, before any await, so that concurrent requests see
  each other's load.  It returns None when no backend can take the request.
- Strategies: RANDOM (weighted uniform over available backends),
  LEAST_OUTSTANDING_REQUESTS (fewest in flight per unit of weight, ties
  broken at random) and PREFIX_AWARE (bounded-load walk of the key's
  preference list, see ``hashring.bounded``).  Requests without a key
  (passthrough GETs) go least-outstanding whatever the strategy.
- ``avoid`` names backends this request already tried (retries).
- ``pin`` takes a named backend, bypassing the strategy (a Responses API
  follow-up goes where its state is, ``router.responses``); it still counts
  in flight like any other request.
- ``peek`` is ``choose`` without its effects, for the admin API's dry run
  (``router.explain``): the same backend, decision and position from the
  same state, and nothing changes — no lease, no counter, no TRAFFIC
  placement (``Placement.peek``), no placement record, and no draw of the
  random generator consumed (RANDOM and LEAST_OUTSTANDING_REQUESTS ties draw
  from a copy: the answer is the draw the next request of this process would
  make, if it came next).  ``saturated`` is the admission queue's test the
  same way: what ``choose(..., queue=True)`` would answer.
- BalanceMode TRAFFIC keeps a key -> home table (``hashring.Placement``).  With
  ``share_placement(stamp)`` (several workers or replicas), every decision is
  also recorded in a ``hashring.shared.PlacementLog`` (``placement_log``) that
  the process publishes to the others and folds theirs into: one placement
  for the fleet, no round trip on the request path (``router.worker``).  A
  config change that leaves and re-enters TRAFFIC mode starts a new table and
  a new log.
- Model pools (``router.fleet``): ``choose(..., members)`` routes over a
  pool instead of the whole fleet: its ring, its available backends, bounded
  loads among its members (BalanceFactor's total is the pool's).  TRAFFIC
  keeps one placement (and one log, its records tagged with the pool) per
  pool, made on the pool's first request, so a key's home, the recent-traffic
  window and hot keys are the pool's.  ``publish_records`` and
  ``apply_records`` carry every log's records between processes.
- Engine signals (``router.signals``, off unless configured):
  ``engine_ranks`` is a rank per backend from its engine's scraped queue and
  KV-cache use, None when off.  PREFIX_AWARE passes it to the walk and the
  placement, where it breaks ties only (a hot key's replicas, the fallback);
  a decision it settled counts in ``Backend.tie_breaks``.  ``peek(...,
  signals=False)`` answers as if it were off (the dry run says what it changed).
- Admission queue (``router.queue``): ``choose(..., queue=True)`` answers
  ``SATURATED`` (takes no lease, counts nothing, records no placement) where
  PREFIX_AWARE would fall back because every backend of the walk is at its
  bound; other strategies never saturate.  With ``on_release`` set, every
  ``Choice`` calls it when it lets go of a lease (``first_byte`` included), so
  the queue wakes when a place frees up.
- A/B experiments (``router.arms``): with ``Arms`` in the config, ``arms``
  holds an ``Experiment`` whose arms are Balancers of their own over the same
  fleet (and its in-flight counts); the data path routes a keyed request with
  its arm's (``Experiment.assign``).  This balancer passes ``share_placement``,
  ``publish_records``, ``apply_records`` and its queue wake on to them; their
  placement records are tagged with the arm (``tag``).  Under Split
  BACKENDS (``router.split``) an arm's ``part`` maps what a request routes
  over (the fleet, a model's pool) to the arm's own backends of it, a
  ``Part``: ``choose``, ``peek``, ``saturated`` and ``members`` route over
  that as over a model pool (its ring, its placement, its bounds); the
  in-flight counts stay the fleet's.
- Claim spreading (``set_claim_spread``): routers that fold each other's
  counts late (replicas: a row every ``router.replicas.PERIOD``) all see a
  place freed on a hot key's backend at once, and each claims it: up to R
  requests for one place (herding).  With a spread ``c`` > 1, each
  PREFIX_AWARE walk of BalanceMode IN_FLIGHT (either ConcurrencyScope)
  lowers its threshold by a draw ``U`` uniform in 0..c-1
  (``hashring.bounded.pick``'s ``slack``): a member with ``f`` places free
  is passed over with probability ``1 - min(f, c) / c`` for a later member
  with more room, so about one of ``c`` racing claims lands on it.  Where
  no member has room beyond the draw, the fallback (the least loaded) takes
  the request, often that same member: the spread thins claims only where
  the walk has somewhere else to go.  ``c`` is set to the requests that
  pass their primary fleet-wide in one period, capped at the replicas (``router.replicas``
  ``claim_spread``, read by ``router.worker``); 1 (no draw, the exact walk)
  with one replica.  ``claim_spread`` is what applies: at most the
  ConcurrencyThreshold, 1 under TRAFFIC.  A pick the draw sends to the
  fallback is counted as one; the admission queue (``choose(...,
  queue=True)``, ``peek(..., queue=True)``, ``saturated``) walks again
  without the draw before it calls the fleet saturated.
- Counts folded in late (``LoadTracker.refreshes``: the workers of one host,
  ``router.shared``): a walk that chooses a member below its bound reads that
  member's count again (``refresh``, its fast path inline: ``probes``) and
  walks again if it moved, at most ``_REFRESHES`` walks, so a worker does
  not take a place another worker took since the last fold.  A refresh is a
  read (it changes no routing state): ``peek`` makes it too, and answers
  what ``choose`` would.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping, Set
from typing import Final, cast

from hashring import (
    Decision,
    Lease,
    LoadBound,
    Pick,
    Placement,
    Ring,
    hash_key,
    pick,
)
from hashring.bounded import Ranked
from hashring.shared import STALE_SCAN_REPLICAS, PlacementLog, Record

from .arms import ARM_TAG, Experiment
from .config import RoutingConfig, Strategy
from .fleet import ANY_MODEL, Backend, Fleet, ModelPool
from .split import FLEET_PART

__all__ = ["SATURATED", "Balancer", "Choice", "decision_label"]

_PRIMARY, _OVERFLOW, _FALLBACK = Decision.PRIMARY, Decision.OVERFLOW, Decision.FALLBACK
# Walks one decision may make when the member it chose turns out, read again, to
# have moved (``LoadTracker.refresh``): each read makes the next walk see that
# member as it is; the last walk's choice stands.
_REFRESHES: Final = 3


def decision_label(decision: str, position: int) -> str:
    """What the access log says: "overflow 2" names the place in the walk."""
    if decision == "overflow":
        return f"overflow {position}"
    return decision


class Choice:
    """A routing decision and its lease.

    ``decision`` is one of primary, overflow, fallback (PREFIX_AWARE), random,
    least_outstanding, passthrough or response_id (``pin``); ``position`` is
    the place in the walk.
    """

    __slots__ = ("backend", "decision", "lease", "notify", "position", "waiting")

    def __init__(
        self,
        backend: Backend,
        lease: Lease,
        decision: str,
        position: int,
        waiting: Lease | None = None,
        notify: Callable[[], None] | None = None,
    ):
        self.backend = backend
        self.lease = lease  # in flight until the response ends
        self.decision = decision
        self.position = position
        self.waiting = waiting  # ConcurrencyScope PREFILL: until the first body byte
        self.notify = notify  # the admission queue's wake, when it is on

    def first_byte(self) -> None:
        """The backend answered: it is done with this request's prefill."""
        if self.waiting is not None and self.waiting.release() and self.notify is not None:
            self.notify()

    def release(self) -> None:
        freed = self.lease.release()
        if self.waiting is not None:
            freed = self.waiting.release() or freed
        if freed and self.notify is not None:
            self.notify()

    @property
    def label(self) -> str:
        """What the access log says (``decision_label``)."""
        return decision_label(self.decision, self.position)


_Picked = tuple[Backend, str, int]
Members = Fleet | ModelPool  # what a request routes over (Fleet.members_for)

# What choose(..., queue=True) answers when every backend of the walk is at its
# bound: a Choice that holds nothing (compared by identity, never used).
SATURATED: Final[Choice] = Choice.__new__(Choice)
_SATURATED_PICK: Final = cast(_Picked, ())


class Balancer:
    """Applies the live routing config to the fleet."""

    __slots__ = (
        "_bound",
        "_draw",
        "_placement",
        "_pools",
        "_prefill_scope",
        "_rng",
        "_seed",
        "_select_keyed",
        "_spread",
        "_stamp",
        "_tag",
        "arms",
        "config",
        "engine_ranks",
        "fleet",
        "on_release",
        "part",
        "placement_log",
    )

    # TRAFFIC mode without a BalanceFactor: 5 % over a fair share of recent requests.
    DEFAULT_TRAFFIC_FACTOR = 1.05

    def __init__(
        self,
        fleet: Fleet,
        config: RoutingConfig,
        *,
        seed: int | None = None,
        tag: str | None = None,
    ):
        self.fleet = fleet
        self._rng = random.Random(seed)
        self._seed = seed
        self._tag = tag  # an experiment arm's: its placement records' pool tag
        self.arms: Experiment | None = None
        # Split BACKENDS: an arm's own backends of what a request routes over.
        self.part: Callable[[Members], Members] | None = None
        self._placement: Placement | None = None
        # TRAFFIC per model pool: its placement and, when shared, its log.
        self._pools: dict[str, tuple[Placement, PlacementLog | None]] = {}
        self._stamp: int | None = None  # this process's id in placement stamps; None: alone
        self.placement_log: PlacementLog | None = None
        self.on_release: Callable[[], None] | None = None  # the admission queue's wake
        # router.signals: each backend's engine rank (lower first), swapped by reference
        # after each scrape round; None: engine signals off.
        self.engine_ranks: Mapping[str, int] | None = None
        self._spread = 1  # claim spreading's c as set (the contract); 1: off
        self._draw = 1  # ... and as it applies (claim_spread), kept by _applied_spread
        self.configure(config)

    def share_placement(self, stamp: int) -> None:
        """Record TRAFFIC decisions for other processes (``placement_log``).

        ``stamp`` names this process in placement stamps: unique in the fleet
        (ties between two placements made at one instant go to the lower).
        Every process that shares placements sees the others' loads late, so
        hot keys compare two of their replicas (``STALE_SCAN_REPLICAS``).
        """
        self._stamp = stamp
        self._share()
        if self.arms is not None:
            for arm in self.arms.arms:
                arm.balancer.share_placement(stamp)

    def _share(self) -> None:
        placement = self._placement
        if placement is None or self._stamp is None:
            self.placement_log = None
        elif self.placement_log is None or self.placement_log.placement is not placement:
            placement.scan_replicas = STALE_SCAN_REPLICAS
            self.placement_log = PlacementLog(placement, self._stamp, pool=self._tag)
        if placement is None:
            self._pools.clear()
        for model, (pooled, log) in self._pools.items():
            if self._stamp is not None and log is None:
                self._pools[model] = self._pool_placement(model, pooled)

    def _pool_placement(
        self, model: str, placement: Placement | None = None
    ) -> tuple[Placement, PlacementLog | None]:
        """A pool's TRAFFIC placement (new, or ``placement``) and its log if shared."""
        assert self._placement is not None
        if placement is None:
            placement = Placement(self._placement.factor)
        log = None
        if self._stamp is not None:
            placement.scan_replicas = STALE_SCAN_REPLICAS
            tag = model if self._tag is None else f"{self._tag} {model}"
            log = PlacementLog(placement, self._stamp, pool=tag)
        self._pools[model] = placement, log
        return placement, log

    def publish_records(self) -> list[Record]:
        """Every log's records since the last call (``PlacementLog.publish``), the
        experiment's arms' included."""
        records: list[Record] = []
        log = self.placement_log
        if log is not None:
            records = log.publish()
            for _, pool_log in self._pools.values():
                if pool_log is not None:
                    records += pool_log.publish()
        if self.arms is not None:
            for arm in self.arms.arms:
                records += arm.balancer.publish_records()
        return records

    def apply_records(self, records: Iterable[Record]) -> None:
        """Fold in another process's records, each into its pool's placement (an
        arm's into that arm's balancer)."""
        pooled: dict[str, list[Record]] = {}
        own: list[Record] = []
        armed: dict[str, tuple[list[Record], dict[str, list[Record]]]] = {}
        for record in records:
            pool = record.pool
            if pool is None:
                own.append(record)
            elif pool.startswith(ARM_TAG):
                name, pooled_tag, model = pool[len(ARM_TAG) :].partition(" ")
                mine, pools = armed.setdefault(name, ([], {}))
                if pooled_tag:  # "arm NAME " + ANY_MODEL too
                    pools.setdefault(model, []).append(record)
                else:
                    mine.append(record)
            else:
                pooled.setdefault(pool, []).append(record)
        self._apply_records(own, pooled)
        if armed and self.arms is not None:
            for arm in self.arms.arms:
                if arm.name in armed:
                    arm.balancer._apply_records(*armed[arm.name])

    def _apply_records(self, own: list[Record], pooled: dict[str, list[Record]]) -> None:
        log = self.placement_log
        if log is None:
            return
        fleet = self.fleet
        if own:
            log.apply(fleet.ring, own)
        for model, batch in pooled.items():
            pool: Members | None
            if model == FLEET_PART:  # an arm's own backends of the fleet (router.split)
                pool = self.members(fleet)
            else:
                pool = fleet.any_model if model == ANY_MODEL else fleet.pools.get(model)
                if pool is not None and self.part is not None:
                    pool = self.part(pool)
            if pool is None or pool.model != model:
                continue  # not (or no longer) a pool here, or routed whole (the fleet's)
            known = self._pools.get(model)
            pool_log = (known or self._pool_placement(model))[1]
            if pool_log is not None:
                pool_log.apply(pool.ring, batch)

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
            for placement, _ in self._pools.values():
                placement.factor = factor
            self._bound = LoadBound(prefix.concurrency_threshold)
        else:
            self._placement = None
            self._bound = LoadBound(prefix.concurrency_threshold, prefix.balance_factor)
        self._share()
        self._select_keyed = {
            Strategy.RANDOM: self._random,
            Strategy.LEAST_OUTSTANDING_REQUESTS: self._least_outstanding,
            Strategy.PREFIX_AWARE: self._prefix_aware,
        }[config.strategy]
        self.config = config
        self._applied_spread()
        if config.arms:
            self.arms = Experiment(config, self._arm, self.arms, self.fleet)
        elif self.arms is not None:
            self.arms.retire()  # the experiment is over: every key routes by the top level
            self.fleet.derive_rings(None)
            self.arms = None

    def set_engine_ranks(self, ranks: Mapping[str, int] | None) -> None:
        """Break ties by ``ranks`` from now on (router.signals), in every arm too."""
        self.engine_ranks = ranks
        if self.arms is not None:
            for arm in self.arms.arms:
                arm.balancer.engine_ranks = ranks

    @property
    def claim_spread(self) -> int:
        """The spread this balancer's walks draw from now: the one set, at most the
        ConcurrencyThreshold (a draw that leaves no place below it anywhere only
        sends the request to the fallback), and 1 where no walk reads it (BalanceMode
        TRAFFIC, RANDOM, LEAST_OUTSTANDING_REQUESTS)."""
        return self._draw

    def set_claim_spread(self, spread: int) -> None:
        """Spread claims over ``spread`` racing routers from now on (the contract),
        in every arm too; 1 turns it off."""
        if spread < 1:
            raise ValueError(f"claim spread must be at least 1, got {spread}")
        self._spread = spread
        self._applied_spread()
        if self.arms is not None:
            for arm in self.arms.arms:
                arm.balancer.set_claim_spread(spread)

    def _applied_spread(self) -> None:
        """``claim_spread`` for the spread set and the config now: worked out when
        either changes, not on each request."""
        if self._placement is not None or self.config.strategy is not Strategy.PREFIX_AWARE:
            self._draw = 1
        else:
            self._draw = min(self._spread, self._bound.threshold)

    def _arm(self, name: str, config: RoutingConfig) -> Balancer:
        """A new arm's balancer: the same fleet and in-flight counts, its own placement."""
        seed = None if self._seed is None else hash_key(f"{self._seed}:{name}".encode())
        arm = Balancer(self.fleet, config, seed=seed, tag=ARM_TAG + name)
        arm.on_release = self._released
        arm.engine_ranks = self.engine_ranks  # the fleet's engines, whichever arm
        arm.set_claim_spread(self._spread)
        if self._stamp is not None:
            arm.share_placement(self._stamp)
        return arm

    def _released(self) -> None:
        """An arm let go of a lease: this balancer's wake (the queue's), if any."""
        if self.on_release is not None:
            self.on_release()

    def choose(
        self,
        key_hash: int | None,
        avoid: Set[str] = frozenset(),
        members: Members | None = None,
        *,
        queue: bool = False,
    ) -> Choice | None:
        """Pick a backend for a request and count it in flight (same step).

        ``members``: the model pool the request routes over; None: the fleet.
        ``queue``: answer ``SATURATED`` instead of a fallback (PREFIX_AWARE)."""
        members = self.members(members)
        if key_hash is None:
            picked = self._least_outstanding(0, avoid, members)
            if picked is None:
                return None
            backend, decision, position = picked[0], "passthrough", 0
        else:
            if queue and self.config.strategy is Strategy.PREFIX_AWARE:
                picked = self._prefix_aware(key_hash, avoid, members, True)
                if picked is _SATURATED_PICK:
                    return SATURATED
            else:
                picked = self._select_keyed(key_hash, avoid, members)
            if picked is None:
                return None
            backend, decision, position = picked
        return self._lease(backend, decision, position)

    def members(self, members: Members | None = None) -> Members:
        """What this balancer routes a request for ``members`` (None: the fleet) over:
        an arm's own backends of it under Split BACKENDS (router.split), else itself."""
        if members is None:
            members = self.fleet
        part = self.part
        return members if part is None else part(members)

    def pin(self, name: str) -> Choice | None:
        """Route to ``name`` whatever the strategy (it holds the request's state), if
        it is available; None if it is down, draining or gone."""
        backend = self.pinnable(name)
        if backend is None:
            return None
        return self._lease(backend, "response_id", 0)

    def pinnable(self, name: str) -> Backend | None:
        """``name``'s backend if ``pin`` would take it (available), else None."""
        fleet = self.fleet
        backend = fleet.backends.get(name)
        if backend is None or name in fleet.unavailable:
            return None
        return backend

    # -- the dry run (router.explain): read only ----------------------------------

    def peek(
        self,
        key_hash: int | None,
        members: Members | None = None,
        *,
        signals: bool = True,
        queue: bool = False,
    ) -> _Picked | None:
        """What ``choose(key_hash, members=members)`` would pick now; changes nothing.
        ``signals=False``: as if engine signals were off; ``queue``: as
        ``choose(..., queue=True)`` walks when it routes (a fallback it would
        answer ``SATURATED`` for is returned as the fallback)."""
        members = self.members(members)
        rng = self._rng
        # A copy: the draw the next request would make, none consumed here.
        self._rng = random.Random()
        self._rng.setstate(rng.getstate())
        try:
            if key_hash is None:
                picked = self._least_outstanding(0, frozenset(), members)
                return None if picked is None else (picked[0], "passthrough", 0)
            if self._select_keyed == self._prefix_aware:
                return self._prefix_aware(
                    key_hash, frozenset(), members, peek=True, signals=signals, rewalk=queue
                )
            return self._select_keyed(key_hash, frozenset(), members)
        finally:
            self._rng = rng

    def saturated(self, key_hash: int, members: Members | None = None) -> bool:
        """Whether ``choose(key_hash, members=members, queue=True)`` would answer
        ``SATURATED`` now (the same tests, read only); changes nothing."""
        if self.config.strategy is not Strategy.PREFIX_AWARE:
            return False  # only the bounded walk saturates
        members = self.members(members)
        fleet = self.fleet
        if self._placement is not None:
            counts = fleet.waiting.counts if self._prefill_scope else fleet.loads.counts
            if _all_at(members.ring, counts, self._bound.threshold, fleet.unavailable):
                return True
        picked = self.peek(key_hash, members, queue=True)
        return picked is not None and picked[1] is _FALLBACK

    def free_places(self, members: Members, limit: int) -> int:
        """Places below ConcurrencyThreshold on ``members``' available backends (the
        counts the threshold reads), counted up to ``limit + 1`` (the admission
        queue's reserve only asks "more than ``limit``?").  Other strategies than
        PREFIX_AWARE have no bound: ``limit + 1``."""
        if self.config.strategy is not Strategy.PREFIX_AWARE:
            return limit + 1
        fleet = self.fleet
        counts = fleet.waiting.counts if self._prefill_scope else fleet.loads.counts
        threshold = self._bound.threshold
        skip = fleet.unavailable
        free = 0
        for name in members.ring.weights:
            if name not in skip:
                load = counts.get(name, 0)
                if load < threshold:
                    free += threshold - load
                    if free > limit:
                        return free
        return free

    @property
    def bound(self) -> LoadBound:
        """ConcurrencyThreshold and, in IN_FLIGHT mode, the balance factor."""
        return self._bound

    @property
    def prefill_scope(self) -> bool:
        """ConcurrencyScope PREFILL: the threshold counts requests not yet answered."""
        return self._prefill_scope

    def placement_of(self, members: Members | None = None) -> Placement | None:
        """TRAFFIC mode: the placement ``members`` routes by (None: not made yet, or
        not TRAFFIC mode); read it, never route with it."""
        if self._placement is None or members is None or members is self.fleet:
            return self._placement
        known = self._pools.get(cast(ModelPool, members).model)
        return None if known is None else known[0]

    def _lease(self, backend: Backend, decision: str, position: int) -> Choice:
        backend.requests += 1
        fleet = self.fleet
        waiting = fleet.waiting.acquire(backend.name) if self._prefill_scope else None
        return Choice(
            backend,
            fleet.loads.acquire(backend.name),
            decision,
            position,
            waiting,
            self.on_release,
        )

    # -- strategies: each returns (backend, decision, position) or None; none counts --

    def _prefix_aware(
        self,
        key_hash: int,
        avoid: Set[str],
        members: Members,
        queue: bool = False,
        *,
        peek: bool = False,
        signals: bool = True,
        rewalk: bool = False,
    ) -> _Picked | None:
        """``rewalk`` (and ``queue``): a fallback the claim spread's draw led to is
        walked again without it (the contract)."""
        fleet = self.fleet
        skip = fleet.unavailable | avoid if avoid else fleet.unavailable
        loads = fleet.loads
        ring = members.ring
        placement = self._placement
        ranks = self.engine_ranks if signals else None  # ties only (router.signals)
        if placement is not None:
            # ConcurrencyScope PREFILL: the threshold counts only requests not yet
            # answered; a stream in its decode phase no longer competes for the
            # prefill that a cache hit saves.
            counts = fleet.waiting.counts if self._prefill_scope else loads.counts
            if peek:
                # A pool's first request makes its placement: an empty one answers the same.
                chosen = (self.placement_of(members) or Placement(placement.factor)).peek(
                    ring,
                    key_hash,
                    counts,
                    self._bound.threshold,
                    avoid=skip,
                    fallback_loads=loads.counts,
                    ranks=ranks,
                )
            else:
                log = self.placement_log
                if members is not fleet:
                    model = cast(ModelPool, members).model
                    placement, log = self._pools.get(model) or self._pool_placement(model)
                if queue and _all_at(ring, counts, self._bound.threshold, skip):
                    return _SATURATED_PICK  # before route(): a fallback would count and record
                before = placement.home(key_hash) if log is not None else None
                chosen = placement.route(
                    ring,
                    key_hash,
                    counts,
                    self._bound.threshold,
                    avoid=skip,
                    fallback_loads=loads.counts,  # the least busy overall, as in pick()
                    ranks=ranks,
                )
                if log is not None and chosen is not None:
                    log.decided(key_hash, chosen.member, before, time.time())
        else:
            spread = self._draw
            chosen = self._walk(key_hash, skip, members, ranks, spread)
            if (queue or rewalk) and chosen is not None and chosen[1] is _FALLBACK and spread > 1:
                chosen = self._walk(key_hash, skip, members, ranks, 1)  # saturated for real?
        if chosen is None:
            return None
        member, decision, position = chosen
        if queue and decision is _FALLBACK:
            return _SATURATED_PICK
        backend = fleet.backends[member]
        if decision is not _PRIMARY and not peek:
            if decision is _OVERFLOW:
                backend.overflow += 1
            else:
                backend.fallback += 1
        if type(chosen) is Ranked and not peek:
            backend.tie_breaks += 1
        return backend, decision, position  # a StrEnum: the string itself

    def _walk(
        self,
        key_hash: int,
        skip: Set[str],
        members: Members,
        ranks: Mapping[str, int] | None,
        spread: int,
    ) -> Pick | None:
        """The bounded walk of BalanceMode IN_FLIGHT, either scope (``pick``), its
        threshold lowered by a draw when claims are spread (the contract).  Where
        the counts fold other workers' in late, the member chosen below its bound
        is read again first, and the walk is made again if its count moved."""
        slack = int(self._rng.random() * spread) if spread > 1 else 0
        chosen = self._pick(key_hash, skip, members, ranks, slack)
        if chosen is None or chosen[1] is _FALLBACK or not self.fleet.loads.refreshes:
            return chosen
        loads, waiting = self.fleet.loads, self.fleet.waiting
        for _ in range(_REFRESHES - 1):
            member = chosen[0]
            # ``refresh``'s fast path inlined (``LoadTracker.probes``): a call fewer
            # per decision where the member's cells have not moved, the common case.
            probe = loads.probes.get(member)
            if probe is None or probe[0] != probe[1] or probe[2] != probe[3]:
                moved = loads.refresh(member)
            else:
                moved = False
            if self._prefill_scope:
                probe = waiting.probes.get(member)
                if (probe is None or probe[0] != probe[1] or probe[2] != probe[3]) and (
                    waiting.refresh(member)
                ):
                    moved = True
            if not moved:
                return chosen
            chosen = self._pick(key_hash, skip, members, ranks, slack)
            if chosen is None or chosen[1] is _FALLBACK:
                return chosen
        return chosen

    def _pick(
        self,
        key_hash: int,
        skip: Set[str],
        members: Members,
        ranks: Mapping[str, int] | None,
        slack: int,
    ) -> Pick | None:
        """One walk of ``_walk``'s, on the counts as they are."""
        fleet = self.fleet
        loads = fleet.loads
        if self._prefill_scope:
            # The same for the threshold; BalanceFactor still bounds every request
            # in flight, so one hot prefix cannot take a backend's whole batch.
            waiting = fleet.waiting
            total: int | None = waiting.total
            balance_total: int | None = loads.total
            if members is not fleet:
                total = balance_total = self._pool_total()
            return pick(
                members.ring,
                key_hash,
                waiting.counts,
                self._bound,
                avoid=skip,
                total=total,
                balance_loads=loads.counts,
                balance_total=balance_total,
                ranks=ranks,
                slack=slack,
            )
        in_flight = loads.total if members is fleet else self._pool_total()
        return pick(
            members.ring,
            key_hash,
            loads.counts,
            self._bound,
            avoid=skip,
            total=in_flight,
            ranks=ranks,
            slack=slack,
        )

    def _pool_total(self) -> int | None:
        """A pool's in-flight total for ``pick``: None (``pick`` adds up the pool's
        members) when BalanceFactor reads it, else 0 (unread)."""
        return None if self._bound.numerator else 0

    def _random(self, key_hash: int, avoid: Set[str], members: Members) -> _Picked | None:
        candidates = members.available
        cum_weights: list[int] | None = members.cum_weights
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

    def _least_outstanding(
        self, key_hash: int, avoid: Set[str], members: Members
    ) -> _Picked | None:
        counts = self.fleet.loads.counts
        best: Backend | None = None
        best_load = best_weight = 0
        ties = 0
        for backend in members.available:
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


def _all_at(ring: Ring, counts: Mapping[str, int], threshold: int, skip: Set[str]) -> bool:
    """Every member of ``ring`` not in ``skip`` has ``threshold`` or more in ``counts``
    (and there is one).  ``counts`` holds only members with a count: while it has
    fewer entries than the ring has candidates, one of them is at zero (O(1))."""
    if len(counts) < len(ring) - len(skip):
        return False
    candidates = 0
    for name in ring.weights:
        if name in skip:
            continue
        if counts.get(name, 0) < threshold:
            return False
        candidates += 1
    return candidates > 0
