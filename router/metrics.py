"""Request accounting for /admin/stats and /metrics.

Contract:
- ``Recorder.observe`` runs once per request, at its end, and only updates
  plain integers, lists and a bounded deque: no label lookups, no locks, no
  formatting.  Everything Prometheus needs is derived at scrape time by
  ``RouterCollector`` (a prometheus-client custom collector on a registry of
  the router's own, so two routers in one process never share metrics).
- Requests routed over a model pool are counted per pool (``models``: its
  model, ``ANY_MODEL`` for the backends that declare none): as many series as
  the operator declares models, never one per name a client sends.
- TTFT is the time from the request head to the first response body byte as
  the router sees it; duration runs to the last byte.  The stats view keeps
  the last ``WINDOW`` TTFTs per backend for its P50/P90.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .sessions import SOURCES

if TYPE_CHECKING:
    from .app import Router
    from .exchange import Exchange

__all__ = ["Histogram", "Recorder", "RouterCollector", "percentile"]

WINDOW = 512

# vLLM's TTFT buckets (seconds), so router and engine histograms line up.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
DURATION_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class Histogram:
    """Prometheus buckets ("le": a value on a bound counts in it), for the router and the
    simulated engine alike (``loadtests/simserver``)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        running = 0
        out: list[tuple[str, float]] = []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out

    @property
    def count(self) -> int:
        return sum(self.counts)


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest rank: the ceil(q * n)-th smallest of ``values`` (any order), 0 <= q <= 1.

    The project's one definition: /admin/stats and every table of loadtests/ use it.
    Always a value that was observed (no interpolation between two latencies that
    never happened): P99 is a latency that at least 99 % of the values do not
    exceed, as latency tables mean it; P50 of an even count is the lower middle.
    None when ``values`` is empty.
    """
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], not {q!r}")
    ordered = sorted(values)
    if not ordered:
        return None
    # round(): 0.7 * 10 is 7.000000000000001 in floating point, and the 7th is meant.
    return ordered[max(0, math.ceil(round(q * len(ordered), 9)) - 1)]


class Recorder:
    __slots__ = (
        "decisions",
        "duration",
        "models",
        "no_backend",
        "refused",
        "requests",
        "sources",
        "ttft",
        "windows",
    )

    def __init__(self) -> None:
        # (backend, kind, decision, status) -> count; backend "" when none was chosen
        self.requests: Counter[tuple[str, str, str, int]] = Counter()
        self.decisions: Counter[str] = Counter()
        self.ttft: dict[str, Histogram] = {}
        self.duration: dict[str, Histogram] = {}
        self.windows: dict[str, deque[float]] = {}
        self.no_backend = 0
        self.refused: Counter[int] = Counter()  # status -> requests refused while parsed
        self.models: Counter[str] = Counter()  # model pool -> requests routed over it
        self.sources: Counter[str] = Counter()  # affinity key source -> requests (sessions)

    def observe(self, exchange: Exchange) -> None:
        if exchange.pool is not None:
            self.models[exchange.pool] += 1
        if exchange.key_source is not None:
            self.sources[exchange.key_source] += 1
        choice = exchange.choice
        if choice is None:
            self.requests["", exchange.kind, "none", exchange.status] += 1
            if exchange.status in (502, 503):
                self.no_backend += 1
            return
        name = choice.backend.name
        decision = choice.decision
        self.requests[name, exchange.kind, decision, exchange.status] += 1
        self.decisions[decision] += 1
        ttft = self.ttft.get(name)
        if ttft is None:
            ttft = self.ttft[name] = Histogram(TTFT_BUCKETS)
            self.duration[name] = Histogram(DURATION_BUCKETS)
            self.windows[name] = deque(maxlen=WINDOW)
        if exchange.ttft:
            seconds = exchange.ttft - exchange.started
            ttft.observe(seconds)
            self.windows[name].append(seconds * 1000)
        self.duration[name].observe(exchange.ended - exchange.started)


class RouterCollector:
    """Builds the Prometheus view of one router at scrape time."""

    def __init__(self, router: Router):
        self._router = router
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        router = self._router
        recorder = router.recorder
        fleet = router.fleet
        requests = CounterMetricFamily(
            "prefix_router_requests",
            "Requests answered, by backend, kind, routing decision and status.",
            labels=["backend", "kind", "decision", "status"],
        )
        for (name, kind, decision, status), count in recorder.requests.items():
            requests.add_metric([name, kind, decision, str(status)], count)
        yield requests

        refused = CounterMetricFamily(
            "prefix_router_refused_requests",
            "Requests refused before routing (malformed 400, slow 408, too large 413/414/431,"
            " connection limit 503).",
            labels=["status"],
        )
        for status, count in sorted(recorder.refused.items()):
            refused.add_metric([str(status)], count)
        yield refused

        in_flight = GaugeMetricFamily(
            "prefix_router_in_flight", "Requests in flight per backend.", labels=["backend"]
        )
        healthy = GaugeMetricFamily(
            "prefix_router_backend_healthy", "1 if health checks pass.", labels=["backend"]
        )
        draining = GaugeMetricFamily(
            "prefix_router_backend_draining", "1 while draining.", labels=["backend"]
        )
        weight = GaugeMetricFamily(
            "prefix_router_backend_weight", "Ring weight.", labels=["backend"]
        )
        overflow = CounterMetricFamily(
            "prefix_router_overflow",
            "Requests received as overflow from an earlier backend of the walk.",
            labels=["backend"],
        )
        fallback = CounterMetricFamily(
            "prefix_router_fallback",
            "Requests received because every backend was at its bound.",
            labels=["backend"],
        )
        errors = CounterMetricFamily(
            "prefix_router_backend_errors",
            "Connect failures, resets, timeouts and 5xx answers.",
            labels=["backend"],
        )
        idle = GaugeMetricFamily(
            "prefix_router_upstream_idle_connections",
            "Keep-alive connections to the backend waiting in the pool.",
            labels=["backend"],
        )
        cache_suspect = GaugeMetricFamily(
            "prefix_router_backend_prefix_cache_suspect",
            "1 if the backend's prefix-cache hits stay flat while it gets repeated keys"
            " (prefix caching off, or a cache too small); 0 otherwise, unknown included.",
            labels=["backend"],
        )
        ties = CounterMetricFamily(
            "prefix_router_engine_tie_breaks",
            "Requests routed here because its engine's queue or KV-cache use broke a tie"
            " (--engine-signals).",
            labels=["backend"],
        )
        cache = router.health.cache
        for name, count in sorted(router.idle_connections().items()):
            idle.add_metric([name], count)
        for name, backend in sorted(fleet.backends.items()):
            in_flight.add_metric([name], fleet.loads.get(name))
            healthy.add_metric([name], 1 if backend.healthy else 0)
            draining.add_metric([name], 0 if backend.state.value == "active" else 1)
            weight.add_metric([name], backend.weight)
            overflow.add_metric([name], backend.overflow)
            fallback.add_metric([name], backend.fallback)
            errors.add_metric([name], backend.errors)
            cache_suspect.add_metric([name], 1 if cache.status(name) == "suspect_off" else 0)
            ties.add_metric([name], backend.tie_breaks)
        yield from (in_flight, healthy, draining, weight, overflow, fallback, errors, idle)
        yield cache_suspect
        if router.signals is not None:
            yield ties

        for metric, source, text in (
            ("prefix_router_ttft_seconds", recorder.ttft, "Time to first response byte."),
            ("prefix_router_request_duration_seconds", recorder.duration, "Request duration."),
        ):
            family = HistogramMetricFamily(metric, text, labels=["backend"])
            for name, histogram in sorted(source.items()):
                family.add_metric([name], histogram.cumulative(), histogram.total)
            yield family

        transitions = CounterMetricFamily(
            "prefix_router_health_transitions",
            "Backend health state changes.",
            labels=["backend", "to"],
        )
        for (name, direction), count in sorted(router.health.transitions.items()):
            transitions.add_metric([name, direction], count)
        yield transitions

        models = CounterMetricFamily(
            "prefix_router_model_requests",
            "Requests routed over a model's pool (model * : backends declaring no model).",
            labels=["model"],
        )
        for model, count in sorted(recorder.models.items()):
            models.add_metric([model or "*"], count)
        yield models

        sources = CounterMetricFamily(
            "prefix_router_routing_key_source",
            "Requests routed by a key, by where the key came from (SessionKeys):"
            " prompt_cache_key, header, conversation or prefix.",
            labels=["source"],
        )
        for key_source in SOURCES:
            sources.add_metric([key_source], recorder.sources[key_source])
        yield sources

        yield GaugeMetricFamily(
            "prefix_router_ring_members", "Backends on the hash ring.", value=len(fleet.ring)
        )
        yield GaugeMetricFamily(
            "prefix_router_claim_spread",
            "Claim spreading's c: the walk's threshold is lowered by a draw in 0..c-1 so"
            " that replicas do not all claim one freed place (1: off, one replica).",
            value=router.balancer.claim_spread,
        )
        responses = router.responses
        counts = responses.counts()
        follow_ups = CounterMetricFamily(
            "prefix_router_response_follow_ups",
            "Requests naming a Responses API id: hit (sent to the backend that made it),"
            " miss (unknown id) or fallback (its backend unavailable); the last two are"
            " routed by the strategy.",
            labels=["result"],
        )
        for result, name in (("hit", "hits"), ("miss", "misses"), ("fallback", "fallbacks")):
            follow_ups.add_metric([result], counts[name])
        yield follow_ups
        yield CounterMetricFamily(
            "prefix_router_response_ids_learnt",
            "Response ids read from /v1/responses answers.",
            value=counts["learnt"],
        )
        yield CounterMetricFamily(
            "prefix_router_response_ids_unread",
            "/v1/responses answers whose id could not be read in their first bytes.",
            value=counts["unread"],
        )
        yield GaugeMetricFamily(
            "prefix_router_response_ids", "Response ids remembered.", value=len(responses)
        )
        yield CounterMetricFamily(
            "prefix_router_no_backend",
            "Requests answered 502/503 because no backend could take them.",
            value=recorder.no_backend,
        )
