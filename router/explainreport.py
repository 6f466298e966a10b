"""The dry run's answer (``router.explain``): ``Explanation``, and the decision it reports.

Contract:
- ``Explanation`` and its parts (``KeyView``, ``WalkStep``, ``EngineView``,
  ``HotKey``) are what ``POST /admin/route`` answers.  ``router.explain``
  re-exports them: import them from there, as the admin API, the workers
  and the tests do.
- ``Answer`` is one explanation being assembled.  ``router.explain.explain``
  gives it the request's facts (``head``: kind, method, path, key, model,
  Responses API id; then the tenant, the model pool, the backend holding the
  response, and ``note``: said before the reason), then asks for the end:
  ``answered`` (the router answers itself: a status, no backend), ``chosen``
  (a backend, its ``decision`` the access log's: ``decision_label``) or
  ``route``: the data path's routing in its order (``routing.py``): the A/B
  arm, the key's walk (PREFIX_AWARE: the first ``k`` backends with their
  counts and bounds), the admission queue's tests
  (``AdmissionQueue.busy``, ``AdmissionQueue.holds_back``,
  ``Balancer.saturated``, ``AdmissionQueue.full``), then ``Balancer.peek``.
  ``reason`` is one sentence in words, ``note`` first.
- Read only: the balancer, fleet, placement, queue and engine signals are
  read, never changed (``Balancer.peek``; the TRAFFIC placement's ``home``,
  ``share`` and ``hot_share``); see ``router.explain``'s "Nothing changes".
- With engine signals on (``router.signals``) each backend of the walk
  shows its engine's figures and rank, and a decision that a rank settled (a
  tie on in flight) says so, with the backend it would be without them
  (``without_engine_signals``: ``Balancer.peek(..., signals=False)``).
  With the admission queue on, a keyed request that would wait in it (every
  backend of its walk at its bound, or others of its pool waiting already)
  has ``admission`` "wait" and no backend: where it then goes depends on
  what frees up first.
- An A/B experiment (``router.arms``): a keyed request's ``arm`` is the one
  its key is assigned to (``Experiment.assign``, as the data path), and the
  rest of the answer is that arm's balancer's (its strategy, walk, bounds;
  under Split BACKENDS its walk is on the ring of its own backends, named
  in ``arm_backends``).
"""

from __future__ import annotations

import math
import time
from fractions import Fraction
from typing import TYPE_CHECKING, Literal, cast

import msgspec

from hashring.bounded import FALLBACK_TOLERANCE, exact_factor

from .balancer import decision_label
from .config import Strategy
from .fleet import AdminState
from .heads import Kind
from .split import Part, Split

if TYPE_CHECKING:
    from hashring import Placement

    from .app import Router
    from .balancer import Members
    from .fleet import ModelPool
    from .queue import AdmissionQueue
    from .signals import Signal

__all__ = [
    "Answer",
    "Content",
    "EngineView",
    "Explanation",
    "HotKey",
    "KeyView",
    "Source",
    "WalkStep",
]


Source = Literal["prompt_cache_key", "header", "conversation", "prefix"]
Content = Literal["body bytes", "prompt text", "token ids", "session header", "conversation id"]


class KeyView(msgspec.Struct, frozen=True):
    source: Source  # the access log's key_source (router.sessions: the first one present)
    content: Content  # what was hashed
    session: str | None  # header: the session header's value; conversation: the id
    length: int  # in ``unit``, as hashed (a prefix: at most ``prefix_length``)
    unit: Literal["bytes", "characters", "token ids"]
    prefix_length: int | None  # PrefixLength, in ``unit`` (token ids: / 4); None: a session
    cut: bool  # the key reached PrefixLength: what follows does not count
    digest: str  # the access log's prefix_hash
    tenant_salted: bool  # the access log's tenant
    tenant_source: Literal["prompt_cache_key", "header"] | None


class EngineView(msgspec.Struct, frozen=True):
    """A backend's engine as the last scrape round read it (router.signals)."""

    waiting: float | None  # requests queued in the engine (None: not exposed, or no scrape)
    kv_cache_usage: float | None  # share of its KV cache in use, 0..1
    rank: int  # lower first: waiting, then KV use in 5 % steps; 0 without figures
    age_s: float | None  # seconds since that round read it


class WalkStep(msgspec.Struct, frozen=True):
    """One backend of the key's walk (its ring preference list), in order."""

    backend: str
    position: int | None  # the N of "overflow N"; None: skipped (down or draining)
    state: Literal["available", "down", "draining"]
    weight: int
    in_flight: int
    waiting: int | None  # ConcurrencyScope PREFILL: not yet answered (what the threshold counts)
    threshold: int  # ConcurrencyThreshold
    balance_bound: int | None  # BalanceMode IN_FLIGHT with BalanceFactor: ceil(c (total+1) w / W)
    recent: int | None  # BalanceMode TRAFFIC: its requests among the last ``window``
    share_bound: int | None  # TRAFFIC: a new key is placed here only while recent < it
    eligible: bool  # below its threshold (and balance bound): takes the request at its turn
    engine: EngineView | None = None  # engine signals on: what breaks its ties


class HotKey(msgspec.Struct, frozen=True):
    share: float  # the key's share of recent traffic, in average backends' shares
    replicas: list[str]  # its home, then the next backends of its walk


class Explanation(msgspec.Struct, frozen=True):
    kind: Literal["openai", "native", "passthrough"]
    method: str
    path: str  # as the backend's framework will route on it
    key: KeyView | None  # None: no routing key (passthrough)
    model: str | None  # the body's, where the fleet declares models
    pool: list[str] | None  # the backends of its model pool; None: the whole fleet
    response_id: str | None  # a Responses API follow-up's id
    response_backend: str | None  # the backend known to hold it (None: unknown here)
    strategy: Literal["RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE"]
    home: str | None  # BalanceMode TRAFFIC: the key's home now (None: a new key)
    hot_key: HotKey | None
    walk: list[WalkStep]  # the first k backends of the key's walk (PREFIX_AWARE)
    backend: str | None  # where it would go
    decision: str | None  # the access log's decision ("primary", "overflow 1", ...)
    router_answer: int | None  # the router would answer itself, with this status
    reason: str
    # The admission queue (on): "wait" (it would queue), "full" (429); None: routed now.
    admission: Literal["wait", "full"] | None = None
    view: str = "this process"  # whose counts these are
    # Engine signals broke a tie: where it would go without them (None: nowhere else).
    without_engine_signals: str | None = None
    # An A/B experiment (router.arms): the arm the key falls in, whose RoutingConfig
    # decides (``strategy`` is the arm's); None: no experiment, or no key.
    arm: str | None = None
    # Split BACKENDS (router.split): the backends the arm owns, the only ones it routes
    # over (``walk`` is on their ring); None: it shares the fleet.
    arm_backends: list[str] | None = None
    # Claim spreading (router.balancer): the walk's threshold lowered by a draw in
    # 0..claim_spread-1 (BalanceMode IN_FLIGHT); 1: the exact walk.
    claim_spread: int = 1


class Answer:
    """An explanation being assembled: the request's facts, then the decision."""

    def __init__(self, router: Router, k: int, view: str):
        self.router = router
        self.k = k
        self.view = view or "this process"
        self.note = ""  # said before the reason
        self.pool: list[str] | None = None
        self.response_backend: str | None = None
        self.walk: list[WalkStep] = []
        self.home: str | None = None
        self.hot: HotKey | None = None
        self.tenant_key: str | None = None  # the admission queue's tenant
        self.unsignalled: str | None = None  # the backend without engine signals, if another
        self.balancer = router.balancer  # an experiment's arm's, once the key is known
        self.arm: str | None = None
        self.arm_backends: list[str] | None = None

    def head(
        self,
        kind: Kind,
        method: str,
        path: str,
        key: KeyView | None,
        model: str | None,
        response_id: str | None,
    ) -> None:
        self.kind, self.method, self.path = kind, method, path
        self.key, self.model, self.response_id = key, model, response_id

    def _done(
        self,
        backend: str | None,
        decision: str | None,
        answer: int | None,
        reason: str,
        admission: Literal["wait", "full"] | None = None,
    ) -> Explanation:
        return Explanation(
            kind=self.kind.value,
            method=self.method,
            path=self.path,
            key=self.key,
            model=self.model,
            pool=self.pool,
            response_id=self.response_id,
            response_backend=self.response_backend,
            strategy=self.balancer.config.strategy.value,
            home=self.home,
            hot_key=self.hot,
            walk=self.walk,
            backend=backend,
            decision=decision,
            router_answer=answer,
            reason=self.note + reason,
            view=self.view,
            admission=admission,
            without_engine_signals=self.unsignalled if backend is not None else None,
            arm=self.arm,
            arm_backends=self.arm_backends,
            claim_spread=self.balancer.claim_spread,
        )

    def answered(self, status: int, reason: str) -> Explanation:
        return self._done(None, None, status, reason)

    def chosen(self, backend: str, decision: str, position: int, reason: str) -> Explanation:
        return self._done(backend, decision_label(decision, position), None, reason)

    def route(self, key_hash: int | None, members: Members | None) -> Explanation:
        experiment = self.router.balancer.arms
        if experiment is not None and key_hash is not None:
            arm = experiment.assign(key_hash)  # the data path's Exchange._balancer
            self.arm, self.balancer = arm.name, arm.balancer
            total = sum(a.weight for a in experiment.arms)
            self.note += (
                f"A/B experiment {experiment.id!r}: the key falls in arm {arm.name!r}"
                f" ({arm.weight:g} of {total:g} by weight), which routes by"
                f" {arm.routing.strategy.value}; "
            )
        balancer = self.balancer
        strategy = balancer.config.strategy
        ring_of = balancer.members(members)  # an arm's own backends under Split BACKENDS
        if experiment is not None and experiment.split is not None and self.arm is not None:
            self._split(experiment.split, ring_of)
        placement = balancer.placement_of(ring_of)
        if key_hash is not None and strategy is Strategy.PREFIX_AWARE:
            self._walk(key_hash, ring_of, placement)
            spread = balancer.claim_spread
            if spread > 1:  # BalanceMode IN_FLIGHT (else 1)
                self.note += (
                    f"claims spread over {spread} (replicas race for freed places): this"
                    f" request's threshold is lowered by a draw in 0..{spread - 1}; "
                )
        queue = self.router.queue
        if queue is not None and key_hash is not None:  # a keyed first attempt: _route's test
            waits = self._queued(queue, key_hash, members)
            if waits is not None:
                return waits
        queued = queue is not None  # _route passes queue=True to choose then
        picked = balancer.peek(key_hash, members, queue=queued)
        if picked is None:
            serving = "" if self.model is None else f" for model `{self.model[:256]}`"
            return self.answered(503, f"no backend{serving} is available")
        backend, decision, position = picked
        name = backend.name
        if key_hash is not None and self.router.signals is not None:
            plain = balancer.peek(key_hash, members, signals=False, queue=queued)
            if plain is not None and plain[0] is not backend:
                self.unsignalled = plain[0].name
        if decision == "passthrough":
            why = (
                f"no routing key ({self.method} {self.path}): the backend with the fewest in flight"
            )
        elif decision == "random":
            why = (
                "RANDOM: a draw weighted by weight among the available backends (the draw this"
                " process's next request would make, if it came next)"
            )
        elif decision == "least_outstanding":
            why = f"LEAST_OUTSTANDING_REQUESTS: {name} has the fewest in flight per unit of weight"
        else:
            why = self._why(name, decision, position, placement)
        return self.chosen(name, decision, position, why)

    def _split(self, split: Split, ring_of: Members) -> None:
        """Split BACKENDS: the arm's own backends, and whether it routes over them."""
        owned = split.owned()
        if owned is None:
            self.note += "Split BACKENDS suspended (fewer backends than arms): the fleet; "
            return
        assert self.arm is not None
        self.arm_backends = list(owned.get(self.arm, ()))
        mine = ", ".join(self.arm_backends)
        if isinstance(ring_of, Part):
            self.note += f"Split BACKENDS: it routes over its own {mine}; "
        else:
            self.note += (
                f"Split BACKENDS: it owns {mine}, none of them available here (or serving"
                " its model): it routes over them all; "
            )

    def _queued(
        self, queue: AdmissionQueue, key_hash: int, members: Members | None
    ) -> Explanation | None:
        """The admission queue's answer (the data path's order), or None: routed now."""
        pool = None if members is None else cast("ModelPool", members).model
        until = "a backend of its walk is below its bound"
        if queue.busy(pool):
            why = (
                "other requests of its pool wait in the admission queue already"
                f" ({queue.depth} waiting in all): it would go behind them"
            )
        elif queue.holds_back(self.tenant_key, members, self.router.loop.time()):
            why = (
                f"no more places are free than the reserve ({queue.reserve}), kept for the"
                " tenants under their share of the requests, and this one is not"
            )
            until = "more places are free or nobody is under its share"
        elif self.balancer.saturated(key_hash, members):
            why = "every backend of the walk is at its bound"
        else:
            return None
        tenant = "no tenant" if self.tenant_key is None else f"tenant {self.tenant_key[:64]!r}"
        config = queue.config
        if queue.full(self.tenant_key):
            return self._done(
                None,
                None,
                429,
                f"{why}, and the admission queue is full ({queue.waiting(self.tenant_key)}"
                f" of {config.max_queued_per_tenant} waiting for {tenant},"
                f" {queue.depth} of {config.max_queued} in all): the router would answer 429"
                " (queue_full)",
                "full",
            )
        return self._done(
            None,
            None,
            None,
            f"{why}: it would wait in the admission queue ({tenant}) until {until}, at most"
            f" {config.max_wait:g} s (then 429)",
            "wait",
        )

    def _walk(self, key_hash: int, members: Members, placement: Placement | None) -> None:
        """The first ``k`` backends of the key's walk with their counts and bounds."""
        balancer = self.balancer
        fleet = self.router.fleet
        ring = members.ring
        weights = ring.weights
        bound = balancer.bound
        prefill = balancer.prefill_scope
        loads, waiting = fleet.loads, fleet.waiting
        skip = fleet.unavailable
        total_weight = sum(w for name, w in weights.items() if name not in skip)
        balance_total = sum(loads.get(name) for name in weights if name not in skip)
        share: Fraction | None = None
        if placement is not None:
            home = placement.home(key_hash)
            self.home = home if home in ring else None
            if self.home is not None:
                hot = placement.hot_share(key_hash, len(ring))
                if hot:
                    count = min(math.ceil(hot), len(ring))
                    self.hot = HotKey(
                        round(hot, 2), placement.replicas_of(ring, key_hash, self.home, count)
                    )
            share = exact_factor(placement.factor) * (placement.decisions + 1)
        signals = self.router.signals
        now = time.time()
        position = 0
        for name in ring.walk(key_hash):
            if len(self.walk) == self.k:
                break
            backend = fleet.backends.get(name)
            if backend is None or name in fleet.unavailable:  # panic: a down one taken
                state: Literal["available", "down", "draining"] = (
                    "draining"
                    if backend is None or backend.state is AdminState.DRAINING
                    else "down"
                )
                at: int | None = None
            else:
                state, at = "available", position
                position += 1
            weight = weights[name]
            in_flight = loads.get(name)
            counted = waiting.get(name) if prefill else in_flight
            eligible = state == "available" and counted < bound.threshold
            balance: int | None = None
            recent = share_bound = None
            if placement is not None and share is not None and total_weight:
                recent = placement.share(name)
                share_bound = math.ceil(share * weight / total_weight)
            elif bound.numerator and total_weight:
                balance = bound.limit(weight, balance_total, total_weight)
                eligible = eligible and in_flight < balance
            self.walk.append(
                WalkStep(
                    backend=name,
                    position=at,
                    state=state,
                    weight=weight,
                    in_flight=in_flight,
                    waiting=waiting.get(name) if prefill else None,
                    threshold=bound.threshold,
                    balance_bound=balance,
                    recent=recent,
                    share_bound=share_bound,
                    eligible=eligible,
                    engine=None if signals is None else _engine(signals.figures.get(name), now),
                )
            )

    def _why(self, name: str, decision: str, position: int, placement: Placement | None) -> str:
        """One sentence for a PREFIX_AWARE decision."""
        balancer = self.balancer
        fleet = self.router.fleet
        unit = "waiting" if balancer.prefill_scope else "in flight"
        threshold = balancer.bound.threshold

        def counted(member: str) -> str:
            tracker = fleet.waiting if balancer.prefill_scope else fleet.loads
            return f"{tracker.get(member)} {unit}, threshold {threshold}"

        hot, home = self.hot, self.home
        if hot is not None and name in hot.replicas and decision != "fallback":
            return (
                f"a hot key ({hot.share:g} average backends' shares of recent traffic) is served"
                f" by its {len(hot.replicas)} replicas {', '.join(hot.replicas)}: {name} has the"
                f" fewest in flight among those below the threshold ({counted(name)})"
                + self._tie(name)
            )
        if decision == "fallback":
            which = "the earliest of the walk" if self.unsignalled is None else "one"
            return (
                f"every backend of the walk is at its bound: {name} is {which} among the least"
                f" loaded ({fleet.loads.get(name)} in flight; past the threshold, counts within"
                f" {FALLBACK_TOLERANCE} of the shortest queue tie) (fallback)" + self._tie(name)
            )
        if placement is not None and home is not None:
            if decision == "primary":
                return (
                    f"the key's home is {name} (placed by an earlier request) and it is below"
                    f" the threshold ({counted(name)})"
                )
            state = fleet.backends[home].state if home in fleet.backends else None
            if home in fleet.unavailable:
                why = "is down" if state is AdminState.ACTIVE else "is draining"
            else:
                why = f"is at its threshold ({counted(home)})"
            return (
                f"the key's home {home} {why}: {name} is the next backend of the walk below the"
                f" threshold (place {position}, {counted(name)}); the key keeps its home"
            )
        if placement is not None:
            if decision == "primary":
                return (
                    f"a new key: {name}, first of its walk, is below its share of recent traffic"
                    f" and its threshold; it becomes the key's home"
                )
            return (
                f"a new key: the backends before it in the walk are over their share of recent"
                f" traffic or at their threshold; {name} (place {position}) becomes its home"
            )
        if decision == "primary":
            return (
                f"{name} is the first backend of the key's walk and is below its bound"
                f" ({counted(name)})"
            )
        return (
            f"the backends before it in the key's walk are at their bound: {name} is the first"
            f" below it (place {position}, {counted(name)})"
        )

    def _tie(self, name: str) -> str:
        """What engine signals changed, said after the decision ("" if nothing)."""
        other = self.unsignalled
        signals = self.router.signals
        if other is None or signals is None:
            return ""
        loads = self.router.fleet.loads
        now = time.time()
        return (
            f"; it ties with {other} ({loads.get(name)} and {loads.get(other)} in flight) and"
            f" the engine signals break the tie: {name}'s engine"
            f" {_figures(signals.figures.get(name), now)}, {other}'s"
            f" {_figures(signals.figures.get(other), now)} (without them: {other})"
        )


def _engine(signal: Signal | None, now: float) -> EngineView:
    if signal is None:
        return EngineView(None, None, 0, None)
    age = round(max(0.0, now - signal.at), 3)
    return EngineView(signal.waiting, signal.kv_usage, signal.rank, age)


def _figures(signal: Signal | None, now: float) -> str:
    """An engine's figures in words, for the reason sentence."""
    if signal is None:
        return "has no figures (rank 0)"
    waiting = "?" if signal.waiting is None else f"{signal.waiting:g}"
    kv = "?" if signal.kv_usage is None else f"{signal.kv_usage * 100:.0f} %"
    return (
        f"has {waiting} waiting and KV cache {kv} in use (rank {signal.rank},"
        f" read {max(0.0, now - signal.at):.1f} s ago)"
    )
