"""Request accounting for /admin/stats and /metrics.

Contract:
- ``Recorder.observe`` runs once per request, at its end, and only updates
  plain integers, lists and a bounded deque: no label lookups, no locks, no
  formatting.  Everything Prometheus needs is derived at scrape time by
  ``RouterCollector`` (with a prometheus-client registry of the router's own
  for the other modules' collectors, so two routers in one process never
  share metrics).
- /metrics never holds the loop for the size of the fleet: the families that
  grow with it are written as text ``LINES`` lines at a time, the loop runs
  between (``RouterCollector.render_async``).
- Requests routed over a model pool are counted per pool (``models``: its
  model, ``ANY_MODEL`` for the backends that declare none): as many series as
  the operator declares models, never one per name a client sends.
- TTFT is the time from the request head to the first response body byte as
  the router sees it; duration runs to the last byte.  The stats view keeps
  the last ``WINDOW`` TTFTs per backend for its P50/P90.
"""

from __future__ import annotations

import asyncio
import functools
import math
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from .sessions import SOURCES

# A value as generate_latest writes it ("5.0", "+Inf", "1e+06"): the same text.
_number: Callable[[float], str] = floatToGoString

if TYPE_CHECKING:
    from .app import Router
    from .exchange import Exchange

__all__ = ["Histogram", "Recorder", "RouterCollector", "percentile"]

WINDOW = 512
# Lines of text /metrics writes per slice of the loop's time: ~1 ms on this project's
# 2-core VM (loadtests/bench_scrape.py).
LINES = 1000

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


class _Families:
    """A registry-shaped holder of metric families already built (for generate_latest)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


def _escape(value: str) -> str:
    """A label value as the text format writes it (generate_latest's escapes)."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _Family:
    """One family's lines of the text format, written directly: a sample is one str
    (no Sample tuple, no label dict), so a large scrape allocates nothing the cyclic
    GC tracks and triggers no full collection (those held the loop 50-90 ms at
    4,000 backends, thread or no thread)."""

    __slots__ = ("lines", "name", "text")

    def __init__(self, name: str, kind: str, doc: str) -> None:
        self.name = name
        doc = doc.replace("\\", r"\\").replace("\n", r"\n")  # HELP's escapes
        self.lines = [f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"]
        self.text: list[bytes] = []  # the lines so far, a chunk's at a time

    def flush(self) -> None:
        if self.lines:
            self.text.append("".join(self.lines).encode())
            self.lines.clear()

    def add(self, labels: str, value: float) -> None:
        self.lines.append(f"{self.name}{{{labels}}} {_number(value)}\n")


class _Histograms(_Family):
    __slots__ = ()

    def add_histogram(self, label: str, histogram: Histogram) -> None:
        name, lines = self.name, self.lines
        running = 0
        for bound, count in zip(_bounds(histogram.bounds), histogram.counts, strict=True):
            running += count
            lines.append(f'{name}_bucket{{{label},le="{bound}"}} {_number(running)}\n')
        lines.append(f"{name}_count{{{label}}} {_number(running)}\n")
        lines.append(f"{name}_sum{{{label}}} {_number(histogram.total)}\n")


@functools.cache
def _bounds(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` labels of ``bounds`` and +Inf, as ``Histogram.cumulative`` names them."""
    return (*(repr(bound) for bound in bounds), "+Inf")


class RouterCollector:
    """Builds the Prometheus view of one router at scrape time.

    The families that grow with the fleet (a series or more per backend: some
    60 lines a backend, 16 MB of text at 4,000 backends) are written here as
    text, ``LINES`` lines at a time; ``render_async`` gives the loop back
    between chunks, so a scrape holds it a few ms at a time however large the
    fleet (loadtests/bench_scrape.py).  Not generate_latest in a thread: it
    took 287 ms of the loop at 4,000 backends, and in a thread the full
    garbage collections its 230,000 Sample objects set off still held the
    loop (with the GIL) 50-90 ms; a line here is one str, which the GC does
    not track.
    Every series is read in one step, so each is a value the router had (a
    histogram's buckets, count and sum agree); series of different backends
    may be ~a millisecond apart, as in any scrape of a live process.  A
    backend removed meanwhile is still shown, with its last values.  The small
    families, and those of ``registry`` (tenants, A/B arms, tracing), go
    through prometheus-client at the end.  Renders run one at a time.
    """

    def __init__(self, router: Router):
        self._router = router
        self.registry = CollectorRegistry(auto_describe=False)
        self._rendering = asyncio.Lock()

    def render(self) -> bytes:
        """The text at once (tests and tools; the admin API's /metrics uses
        ``render_async``)."""
        families: list[_Family] = []
        for _ in self._write(families):
            pass
        return self._finish(families)

    async def render_async(self) -> bytes:
        async with self._rendering:
            families: list[_Family] = []
            for _ in self._write(families):
                await asyncio.sleep(0)  # the rest of the loop runs between chunks
            return self._finish(families)

    def _finish(self, families: list[_Family]) -> bytes:
        small = [*_small_families(self._router), *self.registry.collect()]
        chunks = [chunk for family in families for chunk in family.text]
        chunks.append(generate_latest(_Families(small)))
        return b"".join(chunks)  # one copy of the whole text, the only one

    def _write(self, out: list[_Family]) -> Iterator[None]:
        """Append the per-backend families to ``out``; yields after every chunk."""
        router = self._router
        recorder = router.recorder
        fleet = router.fleet

        def family(name: str, kind: str, doc: str) -> _Family:
            made = _Family(name + ("_total" if kind == "counter" else ""), kind, doc)
            out.append(made)
            return made

        requests = family(
            "prefix_router_requests",
            "counter",
            "Requests answered, by backend, kind, routing decision and status.",
        )
        entries = list(recorder.requests.items())
        for start in range(0, len(entries), LINES):
            for (name, kind, decision, status), count in entries[start : start + LINES]:
                labels = (
                    f'backend="{_escape(name)}",decision="{_escape(decision)}",'
                    f'kind="{_escape(kind)}",status="{status}"'
                )
                requests.add(labels, count)
            _flush(out)
            yield

        in_flight = family("prefix_router_in_flight", "gauge", "Requests in flight per backend.")
        healthy = family("prefix_router_backend_healthy", "gauge", "1 if health checks pass.")
        draining = family("prefix_router_backend_draining", "gauge", "1 while draining.")
        weight = family("prefix_router_backend_weight", "gauge", "Ring weight.")
        overflow = family(
            "prefix_router_overflow",
            "counter",
            "Requests received as overflow from an earlier backend of the walk.",
        )
        fallback = family(
            "prefix_router_fallback",
            "counter",
            "Requests received because every backend was at its bound.",
        )
        errors = family(
            "prefix_router_backend_errors",
            "counter",
            "Connect failures, resets, timeouts and 5xx answers.",
        )
        idle = family(
            "prefix_router_upstream_idle_connections",
            "gauge",
            "Keep-alive connections to the backend waiting in the pool.",
        )
        cache_suspect = family(
            "prefix_router_backend_prefix_cache_suspect",
            "gauge",
            "1 if the backend's prefix-cache hits stay flat while it gets repeated keys"
            " (prefix caching off, or a cache too small); 0 otherwise, unknown included.",
        )
        ties = None
        if router.signals is not None:  # --engine-signals
            ties = family(
                "prefix_router_engine_tie_breaks",
                "counter",
                "Requests routed here because its engine's queue or KV-cache use broke a tie"
                " (--engine-signals).",
            )
        ttft = _Histograms(
            "prefix_router_ttft_seconds", "histogram", "Time to first response byte."
        )
        duration = _Histograms(
            "prefix_router_request_duration_seconds", "histogram", "Request duration."
        )
        out += (ttft, duration)

        idle_counts = router.idle_connections()
        idle_names = sorted(idle_counts)
        yield
        for start in range(0, len(idle_names), LINES):
            for name in idle_names[start : start + LINES]:
                idle.add(f'backend="{_escape(name)}"', idle_counts[name])
            yield
        cache = router.health.cache
        loads = fleet.loads
        members = dict(fleet.backends)  # the backends as they are now, removed ones kept
        names = sorted(members)  # names alone: sorting (name, backend) pairs costs 3x
        yield
        step = LINES // 10  # 9 or 10 lines a backend
        for start in range(0, len(names), step):
            for name in names[start : start + step]:
                backend = members[name]
                label = f'backend="{_escape(name)}"'
                in_flight.add(label, loads.get(name))
                healthy.add(label, 1 if backend.healthy else 0)
                draining.add(label, 0 if backend.state.value == "active" else 1)
                weight.add(label, backend.weight)
                overflow.add(label, backend.overflow)
                fallback.add(label, backend.fallback)
                errors.add(label, backend.errors)
                cache_suspect.add(label, 1 if cache.status(name) == "suspect_off" else 0)
                if ties is not None:
                    ties.add(label, backend.tie_breaks)
            _flush(out)
            yield

        for histograms, source in ((ttft, recorder.ttft), (duration, recorder.duration)):
            observed = dict(source)
            names = sorted(observed)
            yield
            step = LINES // (len(TTFT_BUCKETS) + 3)  # the buckets, +Inf, count, sum
            for start in range(0, len(names), step):
                for name in names[start : start + step]:
                    histograms.add_histogram(f'backend="{_escape(name)}"', observed[name])
                _flush(out)
                yield


def _flush(families: list[_Family]) -> None:
    for family in families:
        family.flush()


def _small_families(router: Router) -> Iterator[Metric]:
    """The families whose size does not grow with the fleet."""
    recorder = router.recorder
    refused = CounterMetricFamily(
        "prefix_router_refused_requests",
        "Requests refused before routing (malformed 400, slow 408, too large 413/414/431,"
        " connection limit 503).",
        labels=["status"],
    )
    for status, count in sorted(recorder.refused.items()):
        refused.add_metric([str(status)], count)
    yield refused

    open_now, accepted = router.client_connections()
    yield GaugeMetricFamily(
        "prefix_router_client_connections",
        "Client connections open (under the connection cap: a 503 at the cap is not one).",
        value=open_now,
    )
    yield CounterMetricFamily(
        "prefix_router_client_connections_accepted",
        "Client connections accepted since start, refused ones included.",
        value=accepted,
    )

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
        "prefix_router_ring_members", "Backends on the hash ring.", value=len(router.fleet.ring)
    )
    yield GaugeMetricFamily(
        "prefix_router_panic_backends",
        "Backends down that are routed to all the same: every pool they serve has"
        " none up ([health] panic).",
        value=len(router.fleet.rescued),
    )
    yield GaugeMetricFamily(
        "prefix_router_claim_spread",
        "Claim spreading's c: the walk's threshold is lowered by a draw in 0..c-1 so"
        " that replicas do not all claim one freed place (1: off, one replica).",
        value=router.balancer.claim_spread,
    )
    counts = router.responses.counts()
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
        "prefix_router_response_ids", "Response ids remembered.", value=len(router.responses)
    )
    yield CounterMetricFamily(
        "prefix_router_no_backend",
        "Requests answered 502/503 because no backend could take them.",
        value=recorder.no_backend,
    )
