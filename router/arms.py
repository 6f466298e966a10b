"""A/B on live traffic: the arms of one experiment, each a RoutingConfig over one fleet.

Contract:
- A RoutingConfig with ``Arms`` (router.config) is an experiment.  The top
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
  ring is the fleet's, and the in-flight counts it bounds are the fleet's
  (per backend, every arm's requests and every worker's and replica's
  included), so ConcurrencyThreshold and BalanceFactor bound the backends
  whatever arm the load comes from.  TRAFFIC placement is the arm's own
  (a key is in one arm), shared between workers and replicas as any
  placement, its records tagged ``"arm NAME"`` (``ARM_TAG``).
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
  ``prefix-router ab-report`` merges them.
- Hit rates (``HitAttribution``): the engines count prefix-cache hits per
  backend, not per request.  Each scrape round of router.health gives, per
  backend, the hit and query tokens since the last round (one *cell*); the
  query tokens are split over the arms by their share of the request bytes
  answered by that backend in the round, and the arms' hit rates are the
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import mmh3
import msgspec
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from hashring import hash_key

from .abtest import least_squares, mann_whitney, merge
from .metrics import TTFT_BUCKETS, Histogram, percentile

if TYPE_CHECKING:
    from .app import Router
    from .balancer import Balancer
    from .config import RoutingConfig
    from .exchange import Exchange
    from .health import Scraped

__all__ = [
    "ARM_TAG",
    "SAMPLE",
    "TEST",
    "Arm",
    "ArmCollector",
    "ArmReport",
    "ArmStats",
    "ArmView",
    "Attribution",
    "Comparison",
    "Experiment",
    "ExperimentView",
    "HitAttribution",
    "arm_seed",
    "derive",
    "merge_views",
    "rendezvous",
]

# Placement-log pools of an arm: "arm NAME", "arm NAME MODEL" (no model name has a space).
ARM_TAG = "arm "
SAMPLE = 2048  # TTFTs kept per arm and process (bottom-k); merged, as many in all
ALPHA = 0.05
TEST = (
    "Mann-Whitney U, two-sided, normal approximation with tie and continuity corrections,"
    " on the TTFT samples of 2xx answers; each arm against the first, significant below"
    " alpha = 0.05 / (arms - 1) (Bonferroni)"
)
_INV_2_64 = 1.0 / (1 << 64)
_log = math.log
_murmur = mmh3.mmh3_x64_128_utupledigest  # hash_key's, without its call: once per arm


def arm_seed(experiment: str, name: str) -> int:
    """The 32-bit murmur seed an arm hashes keys with: the experiment's and the arm's."""
    return hash_key(f"{experiment}\x1f{name}".encode()) & 0xFFFF_FFFF


def rendezvous(key_hash: int, seeds: Sequence[int], weights: Sequence[float]) -> int:
    """The index of the arm ``key_hash`` belongs to (weighted rendezvous hashing)."""
    data = key_hash.to_bytes(8, "little")
    best, best_score = 0, math.inf
    for index, weight in enumerate(weights):
        if weight > 0:
            # (h + 0.5) / 2^64 is in (0, 1): never a log of 0.
            score = _log((_murmur(data, seeds[index])[0] + 0.5) * _INV_2_64) / -weight
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

    __slots__ = ("_seeds", "_weights", "arms", "attribution", "id")

    def __init__(
        self,
        config: RoutingConfig,
        make: Callable[[str, RoutingConfig], Balancer],
        previous: Experiment | None = None,
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
        self._seeds = tuple(arm.seed for arm in arms)
        self._weights = tuple(arm.weight for arm in arms)
        names = [arm.name for arm in arms]
        self.attribution: HitAttribution = HitAttribution(len(arms))
        if same and previous is not None and [a.name for a in previous.arms] == names:
            self.attribution = previous.attribution

    def assign(self, key_hash: int) -> Arm:
        """The arm of a request routed by ``key_hash``."""
        return self.arms[rendezvous(key_hash, self._seeds, self._weights)]

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
            )
            for arm in self.arms
        ]
        view = ExperimentView(self.id, arms, self.attribution.view())
        return derive(view, [[value for _, value in arm.stats.sample()] for arm in self.arms])


# -- views: what /admin/stats, /admin/ab and ``prefix-router ab-report`` show ---------------


class Attribution(msgspec.Struct):
    """The hit-rate fit's normal equations (sums over cells: they add up across replicas)."""

    cells: int  # (backend, scrape round) pairs read
    xtx: list[list[float]]
    xty: list[float]
    yy: float


class ArmView(msgspec.Struct):
    name: str
    weight: float
    target_share: float  # weight / the weights' sum: the share of keys it is given
    routing: dict[str, Any]  # the arm's whole RoutingConfig (the top level and its fields)
    requests: int  # answered (or failed) since the experiment started here
    errors: int  # answered 5xx
    repeats: int  # sent where this process had sent the key before (router.cachecheck)
    backends: dict[str, int]  # requests per backend
    sample: list[tuple[float, float]]  # /admin/ab only: (priority, TTFT ms), bottom-k
    ttft_samples: int  # TTFTs in the sample the percentiles are read from
    since: float  # unix seconds: when these counts started (the earliest, merged)
    share: float = 0.0  # of the experiment's requests
    error_rate: float | None = None
    repeat_rate: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    prefix_cache_hit_rate: float | None = None  # the engines' counters, attributed
    prefix_cache_hit_rate_error: float | None = None  # its 95 % half-width under the model


class Comparison(msgspec.Struct):
    """An arm against the first arm (the control)."""

    arm: str
    baseline: str
    ttft_p50_change: float | None  # P50 of the arm / the baseline's - 1
    ttft_p90_change: float | None
    ttft_p99_change: float | None
    hit_rate_change: float | None  # in points (0.1: ten points more)
    u: float | None
    z: float | None  # < 0: the arm's TTFTs tend lower
    p_value: float | None
    effect: float | None  # P(the arm's TTFT > the baseline's): 0.5 for no difference
    alpha: float
    significant: bool | None  # None: too few samples to test
    p90_difference_ms: tuple[float, float] | None = None  # bootstrap 95 % interval (ab-report)


class ExperimentView(msgspec.Struct):
    experiment: str
    arms: list[ArmView]
    attribution: Attribution
    comparisons: list[Comparison] = msgspec.field(default_factory=list)
    test: str = TEST
    replicas: int = 1  # whose counts these are (ab-report merges several)


def derive(view: ExperimentView, values: Sequence[Sequence[float]]) -> ExperimentView:
    """Fill the derived fields of ``view`` from its counts and each arm's TTFT sample
    (``values``, in arm order); the same whether one process or a merge made them."""
    total = sum(arm.requests for arm in view.arms)
    attribution = view.attribution
    fit = least_squares(attribution.xtx, attribution.xty, attribution.yy, attribution.cells)
    for index, (arm, sample) in enumerate(zip(view.arms, values, strict=True)):
        arm.share = arm.requests / total if total else 0.0
        arm.error_rate = arm.errors / arm.requests if arm.requests else None
        arm.repeat_rate = arm.repeats / arm.requests if arm.requests else None
        arm.ttft_p50_ms = percentile(sample, 0.5)
        arm.ttft_p90_ms = percentile(sample, 0.9)
        arm.ttft_p99_ms = percentile(sample, 0.99)
        if fit is not None:
            rate, half_width = fit[0][index], fit[1][index]
            arm.prefix_cache_hit_rate = min(max(rate, 0.0), 1.0)
            arm.prefix_cache_hit_rate_error = half_width
    alpha = ALPHA / max(len(view.arms) - 1, 1)
    base, base_sample = view.arms[0], values[0]
    view.comparisons = []
    for arm, sample in zip(view.arms[1:], values[1:], strict=True):
        test = mann_whitney(sample, base_sample)
        view.comparisons.append(
            Comparison(
                arm=arm.name,
                baseline=base.name,
                ttft_p50_change=_change(arm.ttft_p50_ms, base.ttft_p50_ms),
                ttft_p90_change=_change(arm.ttft_p90_ms, base.ttft_p90_ms),
                ttft_p99_change=_change(arm.ttft_p99_ms, base.ttft_p99_ms),
                hit_rate_change=(
                    None
                    if arm.prefix_cache_hit_rate is None or base.prefix_cache_hit_rate is None
                    else arm.prefix_cache_hit_rate - base.prefix_cache_hit_rate
                ),
                u=None if test is None else test.u,
                z=None if test is None else test.z,
                p_value=None if test is None else test.p_value,
                effect=None if test is None else test.effect,
                alpha=alpha,
                significant=None if test is None else test.p_value < alpha,
            )
        )
    return view


def merge_views(views: Sequence[ExperimentView]) -> ExperimentView:
    """Several replicas' ``/admin/ab`` as one: counts added up, samples merged
    (bottom-k), the hit-rate fit's sums added up; ValueError if they do not run one
    experiment with the same arms."""
    first = views[0]
    names = [arm.name for arm in first.arms]
    for view in views[1:]:
        if view.experiment != first.experiment or [a.name for a in view.arms] != names:
            raise ValueError(
                f"not one experiment: {first.experiment!r} with arms {names} and"
                f" {view.experiment!r} with arms {[a.name for a in view.arms]}"
            )
    arms = []
    for index, arm in enumerate(first.arms):
        parts = [view.arms[index] for view in views]
        backends: dict[str, int] = {}
        for part in parts:
            for name, count in part.backends.items():
                backends[name] = backends.get(name, 0) + count
        sample = merge([part.sample for part in parts], SAMPLE)
        arms.append(
            ArmView(
                name=arm.name,
                weight=arm.weight,
                target_share=arm.target_share,
                routing=arm.routing,
                requests=sum(part.requests for part in parts),
                errors=sum(part.errors for part in parts),
                repeats=sum(part.repeats for part in parts),
                backends=dict(sorted(backends.items())),
                sample=sample,
                ttft_samples=len(sample),
                since=min(part.since for part in parts),
            )
        )
    k = len(names)
    attribution = Attribution(
        sum(view.attribution.cells for view in views),
        [[sum(v.attribution.xtx[i][j] for v in views) for j in range(k)] for i in range(k)],
        [sum(view.attribution.xty[i] for view in views) for i in range(k)],
        sum(view.attribution.yy for view in views),
    )
    replicas = sum(view.replicas for view in views)
    merged = ExperimentView(first.experiment, arms, attribution, replicas=replicas)
    return derive(merged, [[value for _, value in arm.sample] for arm in arms])


def _change(value: float | None, baseline: float | None) -> float | None:
    if value is None or not baseline:
        return None
    return value / baseline - 1


class ArmCollector:
    """The per-arm families (``arm`` label: at most ``MAX_ARMS`` values), built at
    scrape time from the experiment's counts."""

    def __init__(self, router: Router):
        self._router = router

    def collect(self) -> Iterator[Metric]:
        experiment = self._router.balancer.arms
        requests = CounterMetricFamily(
            "prefix_router_arm_requests",
            "Requests of an A/B experiment's arm (keys assigned to it), answered or failed.",
            labels=["arm"],
        )
        errors = CounterMetricFamily(
            "prefix_router_arm_errors", "Requests of an arm answered 5xx.", labels=["arm"]
        )
        repeats = CounterMetricFamily(
            "prefix_router_arm_repeats",
            "Requests of an arm sent to a backend this process had sent their key to before.",
            labels=["arm"],
        )
        ttft = HistogramMetricFamily(
            "prefix_router_arm_ttft_seconds",
            "Time to first response byte of an arm's 2xx answers.",
            labels=["arm"],
        )
        weight = GaugeMetricFamily(
            "prefix_router_arm_weight_share",
            "An arm's share of the keys (its weight).",
            labels=["arm"],
        )
        hit_rate = GaugeMetricFamily(
            "prefix_router_arm_prefix_cache_hit_rate",
            "An arm's prefix-cache hit rate, the backends' counters attributed by"
            " least squares over (backend, scrape round) cells; absent while unknown.",
            labels=["arm"],
        )
        if experiment is not None:
            view = experiment.view()
            for arm, shown in zip(experiment.arms, view.arms, strict=True):
                stats = arm.stats
                requests.add_metric([arm.name], stats.requests)
                errors.add_metric([arm.name], stats.errors)
                repeats.add_metric([arm.name], stats.repeats)
                ttft.add_metric([arm.name], stats.ttft.cumulative(), stats.ttft.total)
                weight.add_metric([arm.name], shown.target_share)
                if shown.prefix_cache_hit_rate is not None:
                    hit_rate.add_metric([arm.name], shown.prefix_cache_hit_rate)
        yield from (requests, errors, repeats, ttft, weight, hit_rate)
