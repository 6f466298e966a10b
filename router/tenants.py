"""Tenants in the metrics: per-tenant series with a bounded label set.

Contract:
- A tenant is the request's tenant key (``prompt_cache_key``, the
  ``X-Amzn-SageMaker-Prefix-Aware-Id`` header, or ``[tenants] header`` when
  configured: ``Exchange.tenant_key``); requests without one are the tenant
  ``none``.  ``TenantMetrics.observe`` runs once per request, at its end.
- At most ``top`` tenants have series of their own; every other request is
  counted under ``other``: at most ``top + 1`` label values per family,
  whatever the number of tenants.  Which tenants get a label is decided by a
  space-saving heavy-hitters summary (Metwally, Agrawal, El Abbadi 2005) of
  ``capacity`` counters (``max(4 * top, 64)``): bounded memory however many
  distinct keys arrive (a cardinality bomb of 100,000 keys holds ``capacity``
  entries), and every tenant with more than 1/capacity of the requests is in
  it.  A labelled tenant is pinned in the summary; a new tenant takes the
  label of the least-requested labelled one only when its *guaranteed*
  count (estimate minus the summary's error) is above that one's estimate,
  so a stream of one-off keys never churns the labels (each new label is a
  new series in Prometheus's store, a bound on the scrape is not enough).
- Series are monotonic: a request is counted once, in the series its tenant
  had at that moment.  A tenant that loses its label ends its series (its
  later requests count under ``other``); if it wins one again, its series
  starts again from zero (a counter reset, which ``rate()`` handles).
- Labels are a keyed digest of the key (BLAKE2b with ``key``, 12 hex
  characters), never the key, unless ``show_names``.  Several workers and
  replicas give a tenant the same label when they share ``key`` (the
  supervisor hands its workers one; replicas need ``[tenants] label_key``).
- Several workers: each worker counts its own requests and ``take()``s them
  (the deltas since the last take) into its report; the supervisor ``absorb``s
  the deltas into its own ``TenantMetrics``, which applies the same rule to
  the labels it receives (``other`` stays ``other``).  So the merged view is
  bounded to ``top + 1`` labels too, and monotonic, however often it is read.
"""

from __future__ import annotations

import hashlib
import heapq
import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Final

import msgspec
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .metrics import TTFT_BUCKETS, Histogram

if TYPE_CHECKING:
    from .app import Router

__all__ = [
    "NONE",
    "OTHER",
    "QUEUE_WAIT_BUCKETS",
    "REJECT_REASONS",
    "SpaceSaving",
    "TenantCollector",
    "TenantDelta",
    "TenantMetrics",
    "TenantSeries",
]

OTHER: Final = "other"
NONE: Final = "none"  # requests without a tenant key
DIGEST_BYTES = 6  # 12 hex characters: collisions need ~16 M labelled tenants
# Why a request was answered 429 (router.queue).
REJECT_REASONS: Final = ("queue_full", "wait_timeout")
QUEUE_WAIT_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class SpaceSaving:
    """The space-saving summary: at most ``capacity`` (key, count, error) entries.

    ``offer(key, n)`` adds ``n`` to the key's count; an unknown key, when the
    summary is full, replaces the entry with the smallest count and inherits it
    as its error (the count overestimates the key's true count by at most the
    error).  Keys in ``pinned`` are never replaced.  The minimum is kept by a
    lazy heap: an entry's heap record may be older (lower) than its count, and
    is brought up to date when it surfaces; the heap holds at most one record
    per unpinned entry plus one per pin released, so it stays ~``capacity``.
    """

    __slots__ = ("_heap", "capacity", "counts", "errors", "pinned")

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.counts: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.pinned: set[str] = set()
        self._heap: list[tuple[int, str]] = []

    def __len__(self) -> int:
        return len(self.counts)

    def offer(self, key: str, n: int = 1) -> int:
        """Count ``n`` more for ``key``; its estimated count."""
        counts = self.counts
        count = counts.get(key)
        if count is not None:
            count += n
            counts[key] = count
            return count
        error = 0
        if len(counts) >= self.capacity:
            victim = self._evict()
            if victim is None:  # every entry pinned: nothing can be replaced
                return 0
            error = victim
        count = counts[key] = error + n
        self.errors[key] = error
        heapq.heappush(self._heap, (count, key))
        return count

    def _evict(self) -> int | None:
        """Drop the unpinned entry with the smallest count; its count."""
        heap, counts, pinned = self._heap, self.counts, self.pinned
        while heap:
            count, key = heap[0]
            current = counts.get(key)
            if current is None or key in pinned:
                heapq.heappop(heap)  # gone or pinned: a record left behind
            elif current != count:
                heapq.heapreplace(heap, (current, key))  # stale: up to date, sift down
            else:
                heapq.heappop(heap)
                del counts[key]
                del self.errors[key]
                return count
        return None

    def guaranteed(self, key: str) -> int:
        """A lower bound of the key's true count since it entered."""
        return self.counts.get(key, 0) - self.errors.get(key, 0)

    def pin(self, key: str) -> None:
        self.pinned.add(key)

    def unpin(self, key: str) -> None:
        self.pinned.discard(key)
        count = self.counts.get(key)
        if count is not None:
            heapq.heappush(self._heap, (count, key))
        if len(self._heap) > 4 * self.capacity:  # records of pins come and gone
            self._heap = [(c, k) for k, c in self.counts.items() if k not in self.pinned]
            heapq.heapify(self._heap)


class TenantSeries:
    """One label's counts (also a delta between two ``take``\\ s)."""

    __slots__ = ("queued", "rejected", "requests", "ttft", "wait")

    def __init__(self) -> None:
        self.requests = 0
        self.queued = 0  # requests that waited in the admission queue
        self.rejected = [0] * len(REJECT_REASONS)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.wait = Histogram(QUEUE_WAIT_BUCKETS)  # time queued, of those admitted


class TenantDelta(msgspec.Struct, array_like=True, frozen=True):
    """A label's counts since the worker's last report (``router.channel.Report``)."""

    label: str
    requests: int
    queued: int
    rejected: list[int]
    ttft: list[int]
    ttft_sum: float
    wait: list[int]
    wait_sum: float


class TenantMetrics:
    """Per-tenant series under ``top`` labels plus ``other`` (see the module contract)."""

    __slots__ = (
        "_floor",
        "_label",
        "capacity",
        "deltas",
        "labels",
        "other",
        "retired",
        "summary",
        "top",
    )

    def __init__(
        self,
        top: int = 20,
        *,
        key: bytes | None = None,
        show_names: bool = False,
        labelled: bool = False,
        deltas: bool = False,
    ):
        self.top = top
        # A worker's: its series are deltas taken by the supervisor; a label lost
        # between two takes leaves its delta to ``other`` instead of ending it.
        self.deltas = deltas
        self.capacity = max(4 * top, 64)
        self.summary = SpaceSaving(self.capacity)
        self.labels: dict[str, tuple[str, TenantSeries]] = {}  # tenant key -> label, series
        self.other = TenantSeries()
        self.retired = 0  # requests counted in series that ended (a label lost)
        self._floor = 0  # a lower bound of the smallest labelled estimate
        digest_key = key if key is not None else os.urandom(16)
        if labelled:  # the keys are labels already (a supervisor's merge)
            self._label: Callable[[str], str] = _same
        elif show_names:
            self._label = _same
        else:
            self._label = _digest(digest_key)

    def series(self, key: str | None) -> TenantSeries:
        """The series that counts a request of tenant ``key`` now (None: ``none``)."""
        return self._series(NONE if key is None else key, 1)

    def _series(self, key: str, n: int) -> TenantSeries:
        if not self.top:
            return self.other
        labelled = self.labels.get(key)
        summary = self.summary
        if labelled is not None:  # the common case, inline: a labelled key is in the summary
            counts = summary.counts
            counts[key] += n
            return labelled[1]
        count = summary.offer(key, n)
        if key == OTHER:
            return self.other
        labels = self.labels
        if len(labels) < self.top:
            return self._promote(key)
        guaranteed = count - summary.errors[key] if count else 0
        if guaranteed <= self._floor:
            return self.other  # the common case, one-off keys included: O(1)
        weakest, weakest_count = _min_label(labels, summary.counts)
        self._floor = weakest_count
        if guaranteed <= weakest_count:
            return self.other
        self._retire(labels.pop(weakest)[1])
        summary.unpin(weakest)
        self._floor = 0  # recomputed at the next contest
        return self._promote(key)

    def _retire(self, series: TenantSeries) -> None:
        if not self.deltas:
            self.retired += series.requests
            return
        other = self.other
        other.requests += series.requests
        other.queued += series.queued
        for i, count in enumerate(series.rejected):
            other.rejected[i] += count
        _add(other.ttft, series.ttft.counts, series.ttft.total)
        _add(other.wait, series.wait.counts, series.wait.total)

    def _promote(self, key: str) -> TenantSeries:
        label = NONE if key == NONE else self._label(key)
        series = TenantSeries()
        self.labels[key] = label, series
        self.summary.pin(key)
        return series

    def observe(
        self,
        key: str | None,
        *,
        ttft: float | None,
        queued: bool = False,
        wait: float | None = None,
        rejected: int | None = None,
    ) -> None:
        """Count one request (``rejected``: an index of ``REJECT_REASONS``)."""
        series = self._series(NONE if key is None else key, 1)
        series.requests += 1
        if ttft is not None:
            histogram = series.ttft  # Histogram.observe, inline (once per request)
            histogram.counts[bisect_left(histogram.bounds, ttft)] += 1
            histogram.total += ttft
        if queued:
            series.queued += 1
            if wait is not None:
                series.wait.observe(wait)
        if rejected is not None:
            series.rejected[rejected] += 1

    def items(self) -> Iterator[tuple[str, TenantSeries]]:
        """(label, series), labelled tenants first by label, then ``other``."""
        yield from sorted(self.labels.values(), key=lambda pair: pair[0])
        yield OTHER, self.other

    # -- several workers -----------------------------------------------------

    def take(self) -> list[TenantDelta]:
        """The counts since the last call, per label; every series starts again at
        zero (a worker's, whose supervisor keeps the sums)."""
        out = []
        for label, series in self.items():
            if series.requests or series.queued or any(series.rejected):
                out.append(_delta(label, series))
        for key, (label, _) in self.labels.items():
            self.labels[key] = label, TenantSeries()
        self.other = TenantSeries()
        return out

    def absorb(self, deltas: Iterable[TenantDelta]) -> None:
        """Add a worker's deltas (``take``), each under its label or ``other``."""
        for delta in deltas:
            weight = max(1, delta.requests)
            series = self.other if delta.label == OTHER else self._series(delta.label, weight)
            series.requests += delta.requests
            series.queued += delta.queued
            for i, count in enumerate(delta.rejected[: len(REJECT_REASONS)]):
                series.rejected[i] += count
            _add(series.ttft, delta.ttft, delta.ttft_sum)
            _add(series.wait, delta.wait, delta.wait_sum)

    def state_size(self) -> int:
        """Entries held (summary, its heap, labels): bounded by the capacity."""
        return len(self.summary) + len(self.summary._heap) + len(self.labels)


def _same(key: str) -> str:
    return key


def _digest(key: bytes) -> Callable[[str], str]:
    def label(tenant: str) -> str:
        data = tenant.encode("utf-8", "surrogateescape")
        return hashlib.blake2b(data, digest_size=DIGEST_BYTES, key=key[:64]).hexdigest()

    return label


def _min_label(
    labels: dict[str, tuple[str, TenantSeries]], counts: dict[str, int]
) -> tuple[str, int]:
    weakest = min(labels, key=lambda k: counts.get(k, 0))
    return weakest, counts.get(weakest, 0)


def _delta(label: str, series: TenantSeries) -> TenantDelta:
    return TenantDelta(
        label,
        series.requests,
        series.queued,
        list(series.rejected),
        list(series.ttft.counts),
        series.ttft.total,
        list(series.wait.counts),
        series.wait.total,
    )


def _add(histogram: Histogram, counts: list[int], total: float) -> None:
    if len(counts) != len(histogram.counts):
        return  # another build's buckets: not comparable
    for i, count in enumerate(counts):
        histogram.counts[i] += count
    histogram.total += total


class TenantCollector:
    """The per-tenant families, built at scrape time from ``router.tenants``
    (and the admission queue's gauges when it is on)."""

    def __init__(self, router: Router):
        self._router = router

    def collect(self) -> Iterator[Metric]:
        router = self._router
        tenants = router.tenants
        requests = CounterMetricFamily(
            "prefix_router_tenant_requests",
            "Requests answered per tenant (top tenants by requests, the rest `other`;"
            " labels are keyed digests of the tenant key unless names are shown).",
            labels=["tenant"],
        )
        queued = CounterMetricFamily(
            "prefix_router_tenant_queued",
            "Requests that waited in the admission queue, per tenant.",
            labels=["tenant"],
        )
        rejected = CounterMetricFamily(
            "prefix_router_tenant_rejected",
            "Requests answered 429 by the admission queue, per tenant and reason.",
            labels=["tenant", "reason"],
        )
        ttft = HistogramMetricFamily(
            "prefix_router_tenant_ttft_seconds",
            "Time to first response byte per tenant, queueing included.",
            labels=["tenant"],
        )
        wait = HistogramMetricFamily(
            "prefix_router_tenant_queue_wait_seconds",
            "Time admitted requests waited in the admission queue, per tenant.",
            labels=["tenant"],
        )
        for label, series in tenants.items():
            requests.add_metric([label], series.requests)
            queued.add_metric([label], series.queued)
            for reason, count in zip(REJECT_REASONS, series.rejected, strict=True):
                rejected.add_metric([label, reason], count)
            ttft.add_metric([label], series.ttft.cumulative(), series.ttft.total)
            wait.add_metric([label], series.wait.cumulative(), series.wait.total)
        yield from (requests, queued, rejected, ttft, wait)
        yield CounterMetricFamily(
            "prefix_router_tenant_requests_retired",
            "Requests counted in tenant series that ended (their tenant lost its label to a"
            " busier one): the tenant series plus this add up to every request.",
            value=tenants.retired,
        )
        yield GaugeMetricFamily(
            "prefix_router_tenant_labels",
            "Tenants with a label of their own (at most [tenants] metrics_top).",
            value=len(tenants.labels),
        )
        queue = router.queue
        if queue is not None:
            depth, waiting = router.reported_queue or (queue.depth, queue.tenants)
            yield GaugeMetricFamily(
                "prefix_router_queue_depth",
                "Requests waiting in the admission queue (this process, or the workers' sum).",
                value=depth,
            )
            yield GaugeMetricFamily(
                "prefix_router_queue_tenants",
                "Tenants with requests waiting in the admission queue (per worker, summed).",
                value=waiting,
            )
