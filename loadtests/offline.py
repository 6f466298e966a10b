"""Offline benchmark: the router's own routing code against simulated engines, no HTTP.

``python -m loadtests.offline --workload long --instances 7 --strategies random,least,prefix
--duration 3600 [--seed S] [--rate R] [--prefix-length N --concurrency-threshold N
--balance-factor C] [--replicas R [--replica-threshold each|split]
[--share-loads PERIOD_S [--share-placement none|homes|log]]] [--form openai|native]
[--out DIR [--no-plots]]``

Contract
--------
- A discrete-event simulation in *model* seconds: the clock jumps from event
  to event, nothing sleeps and nothing reads a wall clock except to report
  how long the run took. Same arguments, same results.
- Routing is the data plane's, unchanged: ``router.fleet.Fleet`` and
  ``Balancer`` under a ``router.config.RoutingConfig``, fed the key hash that
  ``router/exchange.py`` computes. OpenAI form: the chat body is encoded and
  decoded with ``decode_openai``, keyed with ``prompt_key`` cut at
  ``PrefixLength`` characters and hashed with ``hash_key`` under
  ``tenant_seed(prompt_cache_key)``. Native form: the first ``PrefixLength``
  bytes of the encoded body under ``tenant_seed`` of the tenant header.
- Each instance is a ``loadtests.simserver.model.Engine`` with its own
  ``KVCache``, given the tokens the simulated server would tokenize for the
  request. A request takes its lease when it arrives (``Balancer.choose``
  does it in the same step as the pick) and gives it back when its last
  output token is produced (``Plan.finish_at``): as in the real router, a
  streaming request is in flight until its stream ends. At equal times a
  finish is processed before an arrival.
- A run's ``duration`` is the model time at which its last request finished
  (its throughput counts the drain), its hit rate is the instances' token
  hits / queries, its hit-rate series is per minute of arrival time (or
  1/60 of the run when that is shorter), and its utilisation per instance is
  the share of the duration spent in prefill.
- ``replicas`` R > 1 puts R uncoordinated routers in front of the same
  engines: each its own ``Fleet`` (same specs, so the same ring) with its own
  in-flight counts, and its own ``Balancer`` (its own ``Placement`` in
  TRAFFIC mode). Each request goes to a router drawn uniformly at random from
  a stream of its own, seeded from ``seed``; its lease is taken and released
  on that router. R = 1 draws nothing: the run is the single-router run to
  the last digit. ``split_threshold`` gives each router ConcurrencyThreshold
  ceil(T / R) instead of T.
- ``share_period`` P (None: the routers share nothing) gives every router a
  ``hashring.shared.SharedLoads`` for its in-flight (and not-yet-answered)
  counts: its own row exact, the other routers' rows as they last published
  them. Router r publishes at model times (r / R + k) * P, k = 0, 1, ..., and
  every other router folds the row in at once (no transport delay: a row is
  between 0 and P old when read). P = 0 folds the others' current rows
  before every decision: exact sharing. In TRAFFIC mode ``share_placement``
  says what the ``hashring.shared.PlacementLog`` publishes in the same
  message: ``log`` every decision (homes, shares and hot keys fleet-wide),
  ``homes`` new homes only, ``none`` nothing; with P > 0 and R > 1 hot keys
  compare two of their replicas (``STALE_SCAN_REPLICAS``). With P > 0 and
  ``share_extrapolate`` (the default, as live replicas do, ``router/replicas.py``)
  each router adds to every other router's row what its own row gained since
  that row was published. Publications fall between
  events: one due at or before an event's time is made before it. With
  R = 1 nothing is exchanged and the run is the plain one to the last digit;
  with P = 0 and ``log``, a deterministic strategy routes as one router.
  With P > 0, R > 1 and ``spread_claims`` (the default, as live replicas
  do) every router spreads its claims (``Balancer.set_claim_spread``) by
  ``router.replicas.claim_spread(R, rate, P)``, the rate being the fleet's
  requests past their primary over the last ``RATE_WINDOW`` model seconds,
  taken at router 0's publications (``RateWindow``, as live replicas do).
  ``share_fresh`` models the workers of one host instead of replicas: no
  estimate, and each router reads the member it is about to choose in the
  others' own rows again (``SharedLoads.read_from``, as ``router.shared``'s
  ``refresh`` reads cells).
- ``simulate`` returns the ``report.Run`` and the fleets, balancers and
  engines it used, so tests can check that every lease and every pinned
  block was released.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import msgspec

from admin.cli import prefix_aware_flags
from hashring import Placement, hash_key, tenant_seed
from hashring.shared import STALE_SCAN_REPLICAS, PlacementLog, Record, SharedLoads
from router.balancer import Balancer, Choice
from router.config import BackendSpec, ConfigError, RoutingConfig, parse_routing
from router.extract import decode_openai, prompt_key
from router.fleet import Fleet
from router.replicas import RATE_MIN_SPAN, RATE_WINDOW, RateWindow, claim_spread

from . import report, workloads
from .simserver.model import Engine, KVCache, Ticket, Timing, tokenize
from .workloads import FLEET, FleetParams, Request

__all__ = ["STRATEGIES", "Outcome", "instance_names", "main", "route_keys", "simulate"]

STRATEGIES = {
    "random": "RANDOM",
    "least": "LEAST_OUTSTANDING_REQUESTS",
    "prefix": "PREFIX_AWARE",
}


def instance_names(count: int) -> list[str]:
    """``sim-0`` .. ``sim-{count-1}``: what ``simserver --name sim --count N`` calls them.

    The ring places backends by name, so the live benchmark routes keys to the
    same instances only if it uses the same names.
    """
    return [f"sim-{i}" for i in range(count)]


def route_keys(requests: Sequence[Request], prefix_length: int, form: str = "openai") -> list[int]:
    """Each request's routing hash, computed as ``router/exchange.py`` does."""
    hashes = []
    for request in requests:
        if form == "openai":
            decoded = decode_openai(workloads.encode(request.chat_body()))
            seed = tenant_seed(decoded.prompt_cache_key)
            hashes.append(hash_key(prompt_key(decoded, prefix_length), seed))
        elif form == "native":
            body = workloads.encode(request.native_body())
            seed = tenant_seed(request.native_headers().get(workloads.TENANT_HEADER))
            hashes.append(hash_key(memoryview(body)[:prefix_length], seed))
        else:
            raise ValueError(f"form must be 'openai' or 'native', not {form!r}")
    return hashes


@dataclass
class Outcome:
    run: report.Run
    fleet: Fleet  # the first router's (the only one when replicas is 1)
    balancer: Balancer
    engines: dict[str, Engine]
    wall_s: float  # real seconds the simulation took
    fleets: list[Fleet]  # one per router
    balancers: list[Balancer]


def replica_config(config: RoutingConfig, replicas: int, split_threshold: bool) -> RoutingConfig:
    """Each router's config: ConcurrencyThreshold ceil(T / R) when split, else T."""
    if not split_threshold or replicas == 1:
        return config
    prefix = config.prefix_aware
    threshold = math.ceil(prefix.concurrency_threshold / replicas)
    return msgspec.structs.replace(
        config,
        prefix_aware_routing_config=msgspec.structs.replace(
            prefix, concurrency_threshold=threshold
        ),
    )


SHARE_PLACEMENT = ("none", "homes", "log")


class _Exchange:
    """The transport between routers, in model time (see the module contract)."""

    def __init__(
        self,
        fleets: list[Fleet],
        balancers: list[Balancer],
        period: float,
        placement: str,
        extrapolate: bool = False,
        spread: bool = False,
        fresh: bool = False,
    ):
        if period < 0:
            raise ValueError(f"share period must be >= 0, not {period}")
        if placement not in SHARE_PLACEMENT:
            raise ValueError(f"share placement must be one of {SHARE_PLACEMENT}, not {placement!r}")
        self.period = period
        self.fleets = fleets
        fresh = fresh and period > 0 and len(fleets) > 1
        # At period 0 the rows are current; the workers of one host read cells, not estimates.
        extrapolate = extrapolate and period > 0 and not fresh
        self.loads = [SharedLoads(extrapolate=extrapolate) for _ in fleets]
        self.waiting = [SharedLoads(extrapolate=extrapolate) for _ in fleets]
        if fresh:
            for trackers in (self.loads, self.waiting):
                for router, tracker in enumerate(trackers):
                    tracker.read_from(partial(_column, trackers, router))
        for fleet, loads, waiting in zip(fleets, self.loads, self.waiting, strict=True):
            fleet.loads, fleet.waiting = loads, waiting
        placements: list[Placement | None] = [b._placement for b in balancers]
        self.logs = [
            PlacementLog(p, r, decisions=placement == "log")
            if p is not None and placement != "none"
            else None
            for r, p in enumerate(placements)
        ]
        self.placements = placements
        if period > 0 and len(fleets) > 1:  # the others' loads are seen late: no herding
            for p in placements:
                if p is not None:
                    p.scan_replicas = STALE_SCAN_REPLICAS
        count = len(fleets)
        # What each router last published: its rows, and its records not yet applied.
        self.rows: list[dict[str, int]] = [{} for _ in fleets]
        self.waiting_rows: list[dict[str, int]] = [{} for _ in fleets]
        self.ticks = [0] * count  # publications made by each router
        self.phase = [r / count for r in range(count)]
        self.next_at = min(self._due(r) for r in range(count)) if period > 0 else math.inf
        # Claim spreading, as live replicas measure it (router.replicas): the
        # fleet's requests past their primary, sampled at router 0's publications.
        self.balancers = balancers
        self.window = (
            RateWindow(RATE_WINDOW, RATE_MIN_SPAN, period) if spread and period > 0 else None
        )

    def _due(self, router: int) -> float:
        return (self.phase[router] + self.ticks[router]) * self.period

    def before(self, router: int) -> None:
        """With period 0, fold in the others' rows as they are now (exact sharing)."""
        if self.period == 0 and len(self.fleets) > 1:
            others = [r for r in range(len(self.fleets)) if r != router]
            self.loads[router].fold([self.loads[r].own for r in others])
            self.waiting[router].fold([self.waiting[r].own for r in others])

    def advance(self, now: float) -> None:
        """Make the publications due at or before ``now``, in time order."""
        while self.next_at <= now:
            due = [self._due(r) for r in range(len(self.fleets))]
            first = min(range(len(due)), key=due.__getitem__)  # ties: the lowest id
            self._publish(first)
            self.ticks[first] += 1
            self.next_at = min(self._due(r) for r in range(len(self.fleets)))

    def home(self, router: int, key_hash: int) -> str | None:
        placement = self.placements[router]
        return placement.home(key_hash) if placement is not None else None

    def after(
        self, router: int, key_hash: int, member: str, before: str | None, now: float
    ) -> None:
        """A decision made: record it; with period 0, every other router applies it now."""
        log = self.logs[router]
        if log is None:
            return
        log.decided(key_hash, member, before, now)
        if self.period == 0:
            self._deliver(router, log.publish())

    def _publish(self, router: int) -> None:
        if router == 0 and self.window is not None and len(self.fleets) > 1:
            self._spread(self._due(0))
        self.rows[router] = dict(self.loads[router].own)
        self.waiting_rows[router] = dict(self.waiting[router].own)
        log = self.logs[router]
        if log is not None:
            self._deliver(router, log.publish())
        for other in range(len(self.fleets)):
            if other != router:
                rest = [r for r in range(len(self.fleets)) if r != other]
                self.loads[other].fold([self.rows[r] for r in rest])
                self.waiting[other].fold([self.waiting_rows[r] for r in rest])

    def _spread(self, now: float) -> None:
        assert self.window is not None
        contended = sum(
            b.overflow + b.fallback for fleet in self.fleets for b in fleet.backends.values()
        )
        rate = self.window.add(now, contended)
        if rate is not None:
            spread = claim_spread(len(self.fleets), rate, self.period)
            for balancer in self.balancers:
                balancer.set_claim_spread(spread)

    def _deliver(self, router: int, records: list[Record]) -> None:
        if not records:
            return
        for other, log in enumerate(self.logs):
            if other != router and log is not None:
                log.apply(self.fleets[other].ring, records)


def _column(trackers: list[SharedLoads], router: int, member: str) -> int:
    """The other routers' own counts of ``member`` now: what a worker reads in the others'
    cells of the shared table (``router.shared``)."""
    return sum(t.own.get(member, 0) for r, t in enumerate(trackers) if r != router)


# An event: (model time, tie-break serial, instance, ticket, request index, choice,
# FIRST_TOKEN or FINISH).
_Event = tuple[float, int, str, Ticket, int, Choice, int]
FIRST_TOKEN, FINISH = 0, 1


def simulate(
    requests: Sequence[Request],
    config: RoutingConfig,
    *,
    instances: int | Sequence[str],
    params: FleetParams,
    seed: int = 0,
    form: str = "openai",
    hashes: Sequence[int] | None = None,
    target: str | None = None,
    replicas: int = 1,
    split_threshold: bool = False,
    share_period: float | None = None,
    share_extrapolate: bool = True,
    share_placement: str = "log",
    spread_claims: bool = True,
    share_fresh: bool = False,
) -> Outcome:
    """Route and serve ``requests`` (sorted by arrival); see the module contract.

    ``hashes`` may carry ``route_keys(requests, PrefixLength, form)`` computed
    once for several runs.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, not {replicas}")
    started = time.perf_counter()
    names = instance_names(instances) if isinstance(instances, int) else list(instances)
    specs = [BackendSpec(name, f"http://127.0.0.1:{10_000 + i}") for i, name in enumerate(names)]
    # Router 0 is the single router of replicas=1, seeded alike; the others and
    # the draw of a router per request use streams of their own.
    streams = random.Random(f"offline-replicas:{seed}")
    seeds = [seed] + [streams.getrandbits(64) for _ in range(replicas - 1)]
    draw = random.Random(streams.getrandbits(64))
    per_router = replica_config(config, replicas, split_threshold)
    fleets = [Fleet(specs) for _ in range(replicas)]
    balancers = [Balancer(f, per_router, seed=s) for f, s in zip(fleets, seeds, strict=True)]
    exchange = (
        _Exchange(
            fleets,
            balancers,
            share_period,
            share_placement,
            extrapolate=share_extrapolate,
            spread=spread_claims,
            fresh=share_fresh,
        )
        if share_period is not None
        else None
    )
    timing = Timing(**params.timing_kwargs())
    engines = {n: Engine(timing, KVCache(params.block_size, params.capacity_blocks)) for n in names}
    if hashes is None:
        hashes = route_keys(requests, config.prefix_aware.prefix_length, form)
    busy = dict.fromkeys(names, 0.0)  # model seconds of prefill per instance
    samples: list[report.Sample | None] = [None] * len(requests)
    # Submitted, not yet admitted: (instance, ticket id) -> (request index, choice).
    queued: dict[tuple[str, int], tuple[int, Choice]] = {}
    events: list[_Event] = []
    serial = itertools.count()

    def admitted(name: str, tickets: list[Ticket]) -> None:
        """Tickets that just got a slot: their plan is fixed, schedule their end."""
        for ticket in tickets:
            plan = ticket.plan
            assert plan is not None
            busy[name] += plan.first_token_at - plan.prefill_start
            index, choice = queued.pop((name, ticket.id))
            first = (plan.first_token_at, next(serial), name, ticket, index, choice, FIRST_TOKEN)
            heapq.heappush(events, first)
            end = (plan.finish_at, next(serial), name, ticket, index, choice, FINISH)
            heapq.heappush(events, end)

    def finish(event: _Event) -> None:
        now, _, name, ticket, index, choice, kind = event
        if kind == FIRST_TOKEN:
            choice.first_byte()  # the router sees the response start
            return
        started_now = engines[name].finish(ticket, now)
        choice.release()  # the stream has ended: the router lets go of it
        plan = ticket.plan
        assert plan is not None
        request = requests[index]
        samples[index] = report.Sample(
            at=request.at,
            instance=name,
            ok=True,
            ttft=plan.ttft,
            latency=plan.finish_at - plan.arrival,
            output_tokens=plan.output_tokens,
            decision=choice.decision,
            group=request.group,
            prompt_tokens=plan.prompt_tokens,
            cached_tokens=plan.cached_tokens,
        )
        admitted(name, started_now)

    for index, request in enumerate(requests):
        now = request.at
        while events and events[0][0] <= now:
            if exchange is not None:
                exchange.advance(events[0][0])  # rows as they were at that time
            finish(heapq.heappop(events))
        # Takes the lease on the router the request went to, as the router does;
        # Choice.release gives it back to that router's counts.
        router = draw.randrange(replicas) if replicas > 1 else 0
        key_hash = hashes[index]
        if exchange is None:
            choice = balancers[router].choose(key_hash)
        else:
            exchange.advance(now)
            exchange.before(router)
            home = exchange.home(router, key_hash)
            choice = balancers[router].choose(key_hash)
        assert choice is not None  # every backend is available
        name = choice.backend.name
        if exchange is not None:
            exchange.after(router, key_hash, name, home, now)
        ticket = engines[name].submit(tokenize(request.prompt_text()), request.max_tokens, now)
        queued[name, ticket.id] = (index, choice)
        if ticket.plan is not None:
            admitted(name, [ticket])
    while events:
        finish(heapq.heappop(events))

    done = [s for s in samples if s is not None]
    assert len(done) == len(requests)
    end = max((s.at + (s.latency or 0.0) for s in done), default=0.0)
    queries = sum(e.cache.queries for e in engines.values())
    hits = sum(e.cache.hits for e in engines.values())
    span = requests[-1].at if requests else 0.0
    window = 60.0 if span >= 3600 else max(span / 60, 1e-9)
    prefix = per_router.prefix_aware
    notes = f"form {form}, PrefixLength {prefix.prefix_length}"
    if config.strategy.value == "PREFIX_AWARE":
        notes += f", ConcurrencyThreshold {prefix.concurrency_threshold}"
        if prefix.balance_factor is not None:
            notes += f", BalanceFactor {prefix.balance_factor:g}"
        if prefix.balance_mode != "IN_FLIGHT":
            notes += f", BalanceMode {prefix.balance_mode}"
        if prefix.concurrency_scope != "IN_FLIGHT":
            notes += f", ConcurrencyScope {prefix.concurrency_scope}"
    if replicas > 1:
        notes += f", {replicas} routers"
        if split_threshold and config.strategy.value == "PREFIX_AWARE":
            total = config.prefix_aware.concurrency_threshold
            notes += f" (ConcurrencyThreshold {total} split: {prefix.concurrency_threshold} each)"
        if share_period is not None:
            notes += f", sharing state every {share_period:g} s"
            if share_fresh and share_period > 0:
                notes += " (the chosen member read again: workers)"
            if prefix.balance_mode == "TRAFFIC" and config.strategy.value == "PREFIX_AWARE":
                notes += f" (placement: {share_placement})"
    run = report.Run(
        target=target or config.strategy.value,
        samples=done,
        duration=end,
        instances=names,
        hit_rate=hits / queries if queries else None,
        hit_rate_series=report.hit_rate_series(done, window),
        notes=notes,
        utilisation=[busy[n] / end if end > 0 else 0.0 for n in names],
    )
    wall = time.perf_counter() - started
    return Outcome(run, fleets[0], balancers[0], engines, wall, fleets, balancers)


# ---------------------------------------------------------------- CLI


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.offline",
        description="Offline routing benchmark: the router's balancer against simulated engines.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workload", choices=workloads.NAMES, default="long")
    p.add_argument(
        "--instances", type=int, default=None, help="default: the workload's fleet (7; hotslots 3)"
    )
    p.add_argument(
        "--strategies",
        default="random,least,prefix",
        help="comma-separated: random, least, prefix (or the RoutingStrategy names)",
    )
    p.add_argument("--duration", type=float, default=3600.0, help="model seconds of arrivals")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests/s; default: the workload's calibrated rate scaled to --instances",
    )
    p.add_argument("--prefix-length", type=int, default=None, help="PrefixLength (default 4096)")
    p.add_argument("--concurrency-threshold", type=int, default=None, help="default 10")
    p.add_argument("--balance-factor", type=float, default=None, help="default off")
    p.add_argument("--balance-mode", choices=("IN_FLIGHT", "TRAFFIC"), default=None)
    p.add_argument("--concurrency-scope", choices=("IN_FLIGHT", "PREFILL"), default=None)
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="uncoordinated routers, each request sent to one at random",
    )
    p.add_argument(
        "--replica-threshold",
        choices=("each", "split"),
        default="each",
        help="each router gets ConcurrencyThreshold T (each) or ceil(T / replicas) (split)",
    )
    p.add_argument(
        "--share-loads",
        type=float,
        default=None,
        metavar="PERIOD_S",
        help="routers publish their state every PERIOD_S model seconds (0: exact sharing); "
        "default: they share nothing",
    )
    p.add_argument(
        "--share-placement",
        choices=SHARE_PLACEMENT,
        default="log",
        help="TRAFFIC placement shared with --share-loads: every decision (log), "
        "new homes only (homes), or nothing",
    )
    p.add_argument(
        "--share-extrapolate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --share-loads: each router adds, per other router, what its own "
        "counts gained since that router's last publication, as live replicas do "
        "(--no-share-extrapolate: the others' rows as published)",
    )
    p.add_argument(
        "--spread-claims",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --share-loads: each router spreads its claims over the routers that "
        "race for a freed place, as live replicas do (router.replicas.claim_spread)",
    )
    p.add_argument(
        "--share-fresh",
        action="store_true",
        help="with --share-loads: the routers are the workers of one host, which read "
        "the member they are about to choose in each other's cells again (router.shared) "
        "and do not estimate between rows",
    )
    p.add_argument("--capacity-blocks", type=int, default=None, help="override the fleet's")
    p.add_argument("--form", choices=("openai", "native"), default="openai")
    p.add_argument("--out", type=Path, default=None, help="write results.json and PNGs here")
    p.add_argument(
        "--no-plots", dest="plots", action="store_false", help="with --out: the JSON only"
    )
    return p.parse_args(argv)


def _routing(strategy: str, args: argparse.Namespace) -> RoutingConfig:
    prefix = prefix_aware_flags(args)  # the same flags as prefix-router serve
    return parse_routing({"RoutingStrategy": strategy, "PrefixAwareRoutingConfig": prefix})


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        strategies = [
            STRATEGIES.get(s.strip().lower(), s.strip().upper())
            for s in args.strategies.split(",")
            if s.strip()
        ]
        configs = [_routing(s, args) for s in strategies]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.instances is None:
        args.instances = FLEET[args.workload].instances
    if args.instances < 1 or args.duration <= 0 or args.replicas < 1:
        print("error: --instances and --replicas must be >= 1 and --duration > 0", file=sys.stderr)
        return 2
    if args.share_loads is not None and args.share_loads < 0:
        print("error: --share-loads must be >= 0 (0: exact sharing)", file=sys.stderr)
        return 2
    params = FLEET[args.workload]
    if args.capacity_blocks is not None:
        params = replace(params, capacity_blocks=args.capacity_blocks)
    rate = args.rate if args.rate is not None else params.rate_for(args.instances)
    clock = time.perf_counter()
    requests = workloads.build(args.workload, seed=args.seed, duration=args.duration, rate=rate)
    build_s = time.perf_counter() - clock
    print(
        f"{args.workload}: {len(requests)} requests over {args.duration:g} s "
        f"({rate:g}/s) on {args.instances} instances, {args.replicas} router(s), seed {args.seed}, "
        f"built in {build_s:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    runs = []
    walls: dict[str, float] = {}
    hashes: dict[int, list[int]] = {}
    for config in configs:
        length = config.prefix_aware.prefix_length
        clock = time.perf_counter()
        if length not in hashes:
            hashes[length] = route_keys(requests, length, args.form)
        outcome = simulate(
            requests,
            config,
            instances=args.instances,
            params=params,
            seed=args.seed,
            form=args.form,
            hashes=hashes[length],
            replicas=args.replicas,
            split_threshold=args.replica_threshold == "split",
            share_period=args.share_loads,
            share_placement=args.share_placement,
            share_extrapolate=args.share_extrapolate,
            spread_claims=args.spread_claims,
            share_fresh=args.share_fresh,
        )
        wall = time.perf_counter() - clock
        walls[outcome.run.target] = wall
        runs.append(outcome.run)
        print(f"  {outcome.run.target}: {wall:.1f} s", file=sys.stderr, flush=True)
    print(markdown_with_notes(runs))
    if args.out is not None:
        meta = {
            "harness": "offline",
            "workload": args.workload,
            "instances": args.instances,
            "duration": args.duration,
            "rate": rate,
            "seed": args.seed,
            "replicas": args.replicas,
            "replica_threshold": args.replica_threshold,
            "share_loads": args.share_loads,
            "share_placement": args.share_placement,
            "share_extrapolate": args.share_extrapolate,
            "spread_claims": args.spread_claims,
            "share_fresh": args.share_fresh,
            "form": args.form,
            "fleet": vars(params),
            "routing": [c.document() for c in configs],
            "wall_s": walls,
            "build_s": build_s,
            "argv": sys.argv[1:] if argv is None else argv,
        }
        path = args.out / f"offline-{args.workload}.json"
        report.write_json(runs, path, meta=meta)
        written = [path]
        try:
            if args.plots:
                written += report.plots(runs, args.out, prefix=f"offline-{args.workload}-")
        except ImportError:
            print("matplotlib is not installed: no plots", file=sys.stderr)
        for item in written:
            print(f"wrote {item}", file=sys.stderr)
    return 0


def markdown_with_notes(runs: list[report.Run]) -> str:
    table = report.markdown(runs)
    notes = "".join(f"- {run.target}: {run.notes}\n" for run in runs if run.notes)
    return table + ("\n" + notes if notes else "")


if __name__ == "__main__":
    sys.exit(main())
