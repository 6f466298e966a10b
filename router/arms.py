"""A/B on live traffic: the arms of one experiment, each a RoutingConfig over one fleet.

Contract:
- A RoutingConfig with ``Arms`` (router.routingconfig) is an experiment.  The top
  level is what every arm starts from; an arm's ``RoutingConfig`` changes any
  of its fields (strategy, threshold, BalanceFactor, BalanceMode,
  ConcurrencyScope) except the three that make the key (PrefixLength,
  SessionKeys, SessionHeader): the key decides the arm, so it is the
  experiment's.  A request without a key (a passthrough GET) belongs to no
  arm and goes to the least loaded backend, as without an experiment.
- Assignment is weighted rendezvous hashing of the request's routing key
  (its 64-bit hash, tenant salt included): each arm scores
  ``-ln(h) / weight`` with ``h`` the key's hash under the arm's seed (a hash of
  the experiment id and the arm's name) mapped into (0, 1), and the lowest
  score wins (Schindelhauer and Schomaker, "Weighted distributed hash
  tables", 2005).  An arm gets ``weight / sum of weights`` of the keys; a key
  stays in its arm across requests, workers, replicas and restarts (nothing
  but the key and the config decides); changing one arm's weight moves keys
  only to or from that arm, as few as the new shares require, and the order
  of the arms changes nothing.  A new experiment id draws the keys afresh.
  Every request of a key is in one arm, so the cache entries of a key are
  made by one arm's routing only.
- Each arm routes with a ``Balancer`` of its own over the same ``Fleet``: its
  ring is the fleet's (under Split BACKENDS, below, its own backends'), and
  the in-flight counts it bounds are the fleet's
  (per backend, every arm's requests and every worker's and replica's
  included), so ConcurrencyThreshold and BalanceFactor bound the backends
  whatever arm the load comes from.  TRAFFIC placement is the arm's own
  (a key is in one arm), shared between workers and replicas as any
  placement, its records tagged ``"arm NAME"`` (``ARM_TAG``).
- Split BACKENDS (``RoutingConfig.split``): each arm also routes over
  backends of its own only (``router.split``: the partition, a function of
  the config and the membership), so the arms share no engine and no cache;
  ``Experiment.split`` holds it and each arm's balancer its ``part``.  The
  views say which backends each arm owns (``ArmView.owns``).
- A config change keeps an arm by name: its balancer is reconfigured (its
  keys keep their homes) and, under the same experiment id, its counts go
  on; an arm no longer listed is retired (a request still holding it is
  assigned again if it retries).  A new experiment id starts the counts
  afresh.  Without Arms the experiment ends and its counts go with it.
- Accounting (``ArmStats``), once per request at its end, per process:
  requests, 5xx answers, repeats (router.cachecheck), per backend the
  requests, a TTFT histogram and a bottom-k sample of the TTFTs of 2xx
  answers (router.abtest); and at a 2xx answer's first body byte, the
  request's bytes on its backend (the hit-rate cells, below).  With
  ``--workers N`` each worker reports its totals and the supervisor adds
  them up (``absorb``); with replicas each reports its own and
  ``prefix-router ab-report`` merges them.  The views, their derived figures
  and the Prometheus families are ``router.abreport``'s.
- Hit rates (``HitAttribution``): the engines count prefix-cache hits per
  backend, not per request.  Each scrape round of router.health gives, per
  backend, the hit and query tokens since the last round (one *cell*); the
  query tokens are split over the arms by their share of the request bytes
  whose first answer byte came from that backend in the round, and the
  arms' hit rates are the
  least-squares solution of ``hits = sum over arms of rate x queries`` over
  every cell.  It separates arms that share backends as long as their mix
  varies between cells (it does: the arms' keys are drawn at random and
  land on different backends); with too few cells, or a mix that never
  varies, the rate is unknown (None).  What it assumes: an arm's hit rate is
  the same on every backend and round, its bytes per token are the other
  arms', and a request is counted in the round its first byte came (vLLM
  counts hits when it schedules the prefill, SGLang at the request's end: a
  round boundary in between moves a request's hits to another cell than its
  bytes, noise that shrinks the arms' rates towards each other; the longer
  the scrape interval against a prefill, the less of it).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING

import mmh3
import msgspec

from hashring import hash_key

from .abreport import SAMPLE, ArmView, Attribution, ExperimentView, derive
from .abtest import merge
from .metrics import TTFT_BUCKETS, Histogram
from .split import Split

if TYPE_CHECKING:
    from .balancer import Balancer
    from .config import RoutingConfig
    from .exchange import Exchange
    from .fleet import Fleet
    from .health import Scraped

__all__ = [
    "ARM_TAG",
    "Arm",
    "ArmReport",
    "ArmStats",
    "Experiment",
    "HitAttribution",
    "arm_seed",
    "rendezvous",
]

# Placement-log pools of an arm: "arm NAME", "arm NAME MODEL" (no model name has a space).
ARM_TAG = "arm "
_INV_2_64 = 1.0 / (1 << 64)
_log = math.log
_murmur = mmh3.mmh3_x64_128_utupledigest  # hash_key's, without its call: once per arm


def arm_seed(experiment: str, name: str) -> int:
    """The 32-bit murmur seed an arm hashes keys with: the experiment's and the arm's."""
    return hash_key(f"{experiment}\x1f{name}".encode()) & 0xFFFF_FFFF


def rendezvous(key_hash: int, seeds: Sequence[int], weights: Sequence[float]) -> int:
    """The index of the arm ``key_hash`` belongs to (weighted rendezvous hashing)."""
    return _lowest(key_hash, _table(seeds, weights))


_Table = tuple[tuple[int, int, float], ...]  # (index, seed, -1 / weight) of arms with a weight


def _table(seeds: Sequence[int], weights: Sequence[float]) -> _Table:
    return tuple(
        (index, seed, -1.0 / weight)
        for index, (seed, weight) in enumerate(zip(seeds, weights, strict=True))
        if weight > 0
    )


def _lowest(key_hash: int, table: _Table) -> int:
    """The arm of ``table`` with the lowest score -ln(h) / weight for ``key_hash``."""
    data = key_hash.to_bytes(8, "little")
    best, best_score = 0, math.inf
    for index, seed, scale in table:
        # (h + 0.5) / 2^64 is in (0, 1): never a log of 0.
        score = _log((_murmur(data, seed)[0] + 0.5) * _INV_2_64) * scale
        if score < best_score:
            best, best_score = index, score
    return best


class ArmReport(msgspec.Struct, array_like=True, frozen=True):
    """One arm's totals in one worker, as the supervisor adds them up."""

    experiment: str
    name: str
    requests: int
    errors: int
    repeats: int
    ttft_counts: list[int]
    ttft_total: float
    sample: list[tuple[float, float]]  # (priority, TTFT ms)
    backends: dict[str, tuple[int, int]]  # name -> (requests, request bytes of 2xx answers)


class ArmStats:
    """One arm's accounting in one process (see the contract)."""

    __slots__ = ("_heap", "backends", "errors", "repeats", "requests", "since", "ttft")

    def __init__(self, since: float | None = None) -> None:
        self.since = time.time() if since is None else since
        self.requests = 0
        self.errors = 0  # answered 5xx (the router's own included)
        self.repeats = 0  # sent to a backend this process had sent the key to before
        self.ttft = Histogram(TTFT_BUCKETS)
        self._heap: list[tuple[float, float]] = []  # (-priority, ms): the bottom-k's max on top
        self.backends: dict[str, list[int]] = {}  # name -> [requests, request bytes of 2xx]

    def observe(self, exchange: Exchange) -> None:
        self.requests += 1
        status = exchange.status
        if status >= 500:
            self.errors += 1
        choice = exchange.choice
        if choice is None:
            return
        if exchange.repeat:
            self.repeats += 1
        row = self.backends.get(choice.backend.name)
        if row is None:
            row = self.backends[choice.backend.name] = [0, 0]
        row[0] += 1
        if 200 <= status < 300 and exchange.ttft:
            seconds = exchange.ttft - exchange.started
            self.ttft.observe(seconds)
            self._keep(random.random(), seconds * 1000)

    def prefilled(self, backend: str, status: int, sent: int) -> None:
        """A 2xx answer's first body byte: its engine has done (and counted) its prefill,
        so its ``sent`` request bytes go to that backend's hit-rate cell now."""
        if 200 <= status < 300:
            row = self.backends.get(backend)
            if row is None:
                row = self.backends[backend] = [0, 0]
            row[1] += sent

    def _keep(self, priority: float, value: float) -> None:
        heap = self._heap
        if len(heap) < SAMPLE:
            heapq.heappush(heap, (-priority, value))
        elif priority < -heap[0][0]:
            heapq.heapreplace(heap, (-priority, value))

    def sample(self) -> list[tuple[float, float]]:
        """The bottom-k sample: (priority, TTFT ms) pairs, any order."""
        return [(-negative, value) for negative, value in self._heap]

    def report(self, experiment: str, name: str) -> ArmReport:
        return ArmReport(
            experiment,
            name,
            self.requests,
            self.errors,
            self.repeats,
            list(self.ttft.counts),
            self.ttft.total,
            self.sample(),
            {backend: (row[0], row[1]) for backend, row in self.backends.items()},
        )

    def absorb(self, report: ArmReport) -> None:
        """Add a worker's totals (a supervisor's stats start empty on every read)."""
        self.requests += report.requests
        self.errors += report.errors
        self.repeats += report.repeats
        for i, count in enumerate(report.ttft_counts):
            self.ttft.counts[i] += count
        self.ttft.total += report.ttft_total
        kept = merge([self.sample(), report.sample], SAMPLE)
        self._heap = [(-priority, value) for priority, value in kept]
        heapq.heapify(self._heap)
        for backend, (requests, sent) in report.backends.items():
            row = self.backends.setdefault(backend, [0, 0])
            row[0] += requests
            row[1] += sent


class HitAttribution:
    """The arms' prefix-cache hit rates from the backends' counters (see the contract):
    the normal equations of the least-squares fit, accumulated one cell at a time."""

    __slots__ = ("_last", "cells", "xtx", "xty", "yy")

    def __init__(self, arms: int) -> None:
        self.xtx = [[0.0] * arms for _ in range(arms)]
        self.xty = [0.0] * arms
        self.yy = 0.0
        self.cells = 0
        # backend -> (hit tokens, query tokens, each arm's request bytes) at the last round
        self._last: dict[str, tuple[float, float, tuple[int, ...]]] = {}

    def round(self, backend: str, hits: float, queries: float, sent: tuple[int, ...]) -> None:
        """One backend's counters after a scrape, and each arm's bytes answered there."""
        last = self._last.get(backend)
        self._last[backend] = (hits, queries, sent)
        if last is None:
            return
        hit_tokens, query_tokens = hits - last[0], queries - last[1]
        arm_bytes = [now - before for now, before in zip(sent, last[2], strict=True)]
        total = sum(arm_bytes)
        # An engine or a worker that restarted (a counter went down), or a round
        # without this experiment's traffic: no cell, the next round starts afresh.
        if hit_tokens < 0 or query_tokens <= 0 or total <= 0 or min(arm_bytes) < 0:
            return
        row = [query_tokens * part / total for part in arm_bytes]
        for i, x in enumerate(row):
            if x:
                self.xty[i] += x * hit_tokens
                line = self.xtx[i]
                for j, other in enumerate(row):
                    line[j] += x * other
        self.yy += hit_tokens * hit_tokens
        self.cells += 1

    def forget(self, backend: str) -> None:
        self._last.pop(backend, None)

    def view(self) -> Attribution:
        return Attribution(self.cells, [list(line) for line in self.xtx], list(self.xty), self.yy)


class Arm:
    """One arm in this process: what it routes by, and its accounting."""

    __slots__ = ("balancer", "name", "retired", "routing", "seed", "stats", "weight")

    def __init__(self, name: str, balancer: Balancer) -> None:
        self.name = name
        self.balancer = balancer
        self.weight = 0.0
        self.seed = 0
        self.routing: RoutingConfig = balancer.config
        self.stats = ArmStats()
        self.retired = False  # no longer in the config: a retry is assigned again


class Experiment:
    """The arms of a RoutingConfig with ``Arms``, kept across config changes by name."""

    __slots__ = ("_table", "_weights", "arms", "attribution", "id", "split")

    def __init__(
        self,
        config: RoutingConfig,
        make: Callable[[str, RoutingConfig], Balancer],
        previous: Experiment | None = None,
        fleet: Fleet | None = None,
    ) -> None:
        assert config.experiment is not None
        self.id = config.experiment
        same = previous is not None and previous.id == self.id
        kept = {arm.name: arm for arm in previous.arms} if previous is not None else {}
        arms = []
        for spec, routing in zip(config.arms, config.arm_configs(), strict=True):
            arm = kept.pop(spec.name, None)
            if arm is None:
                arm = Arm(spec.name, make(spec.name, routing))
            else:
                arm.balancer.configure(routing)  # its keys keep their homes
                if not same:
                    arm.stats = ArmStats()
            arm.weight, arm.routing = spec.weight, routing
            arm.seed = arm_seed(self.id, spec.name)
            arms.append(arm)
        for gone in kept.values():
            gone.retired = True
        self.arms: tuple[Arm, ...] = tuple(arms)
        self._weights = tuple(arm.weight for arm in arms)
        # Split BACKENDS: the arms' own backends (router.split); None: they share them.
        self.split: Split | None = None
        if config.split == "BACKENDS" and fleet is not None:
            self.split = Split(fleet, self.id, [(arm.name, arm.weight) for arm in arms])
        if fleet is not None:  # the arms' rings built in the fleet's slices, not on a request
            fleet.derive_rings(None if self.split is None else self.split.wanted)
        for arm in arms:
            arm.balancer.part = None if self.split is None else partial(self.split.part, arm.name)
        self._table = _table([arm.seed for arm in arms], self._weights)
        names = [arm.name for arm in arms]
        self.attribution: HitAttribution = HitAttribution(len(arms))
        if same and previous is not None and [a.name for a in previous.arms] == names:
            self.attribution = previous.attribution

    def assign(self, key_hash: int) -> Arm:
        """The arm of a request routed by ``key_hash``."""
        return self.arms[_lowest(key_hash, self._table)]

    def retire(self) -> None:
        for arm in self.arms:
            arm.retired = True

    def reset(self) -> None:
        """Empty counts (a supervisor's, before its workers' totals are added up)."""
        for arm in self.arms:
            arm.stats = ArmStats(arm.stats.since)

    def absorb(self, reports: Sequence[ArmReport]) -> None:
        arms = {arm.name: arm for arm in self.arms}
        for report in reports:
            arm = arms.get(report.name)
            if arm is not None and report.experiment == self.id:
                arm.stats.absorb(report)

    def reports(self) -> list[ArmReport]:
        return [arm.stats.report(self.id, arm.name) for arm in self.arms]

    def attribute(self, scraped: Mapping[str, Scraped], fresh: Sequence[str]) -> None:
        """After a scrape round: one cell per backend read in it (``fresh``)."""
        attribution = self.attribution
        for name in fresh:
            figures = scraped.get(name)
            if figures is None or figures.hits is None or figures.queries is None:
                attribution.forget(name)
                continue
            sent = tuple(arm.stats.backends.get(name, (0, 0))[1] for arm in self.arms)
            attribution.round(name, figures.hits, figures.queries, sent)

    def view(self, *, samples: bool = False) -> ExperimentView:
        """This process's figures (a supervisor's: its workers' added up)."""
        total_weight = sum(self._weights)
        owned = None if self.split is None else self.split.owned()
        arms = [
            ArmView(
                name=arm.name,
                weight=arm.weight,
                target_share=arm.weight / total_weight,
                routing=arm.routing.document()["RoutingConfig"],
                requests=arm.stats.requests,
                errors=arm.stats.errors,
                repeats=arm.stats.repeats,
                backends={name: row[0] for name, row in sorted(arm.stats.backends.items())},
                sample=arm.stats.sample() if samples else [],
                ttft_samples=len(arm.stats._heap),
                since=arm.stats.since,
                owns=None if owned is None else list(owned.get(arm.name, ())),
            )
            for arm in self.arms
        ]
        split = "KEYS" if self.split is None else "BACKENDS"
        view = ExperimentView(
            self.id,
            arms,
            self.attribution.view(),
            split=split,
            split_suspended=self.split is not None and owned is None,
        )
        return derive(view, [[value for _, value in arm.stats.sample()] for arm in self.arms])
