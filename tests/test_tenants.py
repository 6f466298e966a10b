"""Per-tenant metrics with a bounded label set (router.tenants), driven directly.

The end-to-end tests (through the router, one and two workers) are in
``tests/test_router_tenants.py``.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest

from router.tenants import NONE, OTHER, SpaceSaving, TenantMetrics

pytestmark = pytest.mark.timeout(60)


def test_space_saving_keeps_its_capacity_and_finds_the_heavy_hitters() -> None:
    summary = SpaceSaving(16)
    rng = random.Random(1)
    heavy = [f"heavy-{i}" for i in range(4)]
    for i in range(20_000):
        key = heavy[i % 4] if rng.random() < 0.4 else f"once-{i}"
        summary.offer(key)
        assert len(summary) <= 16
    for key in heavy:
        # Each carries ~10 % of the stream; space-saving keeps anything above 1/16.
        assert key in summary.counts
        assert summary.guaranteed(key) > 1_000
    assert len(summary._heap) <= 4 * 16


def test_pinned_entries_are_never_replaced() -> None:
    summary = SpaceSaving(4)
    for key in "abcd":
        summary.offer(key)
    summary.pin("a")
    for i in range(100):
        summary.offer(f"new-{i}")
    assert "a" in summary.counts
    summary.unpin("a")
    for i in range(100):
        summary.offer(f"later-{i}")
    assert "a" not in summary.counts


def test_labels_are_digests_unless_names_are_shown() -> None:
    hidden = TenantMetrics(4, key=b"k")
    hidden.observe("acme", ttft=0.01)
    hidden.observe(None, ttft=0.01)
    labels = [label for label, _ in hidden.items()]
    assert "acme" not in labels
    assert NONE in labels
    assert OTHER in labels
    # Keyed: the same key gives the same label, another key another.
    again = TenantMetrics(4, key=b"k")
    again.observe("acme", ttft=None)
    other_key = TenantMetrics(4, key=b"x")
    other_key.observe("acme", ttft=None)
    digest = next(label for label, _ in again.items() if label not in (NONE, OTHER))
    assert digest in labels
    assert digest not in [label for label, _ in other_key.items()]
    assert len(digest) == 12
    shown = TenantMetrics(4, show_names=True)
    shown.observe("acme", ttft=None)
    assert "acme" in [label for label, _ in shown.items()]


def test_a_cardinality_bomb_of_100k_tenants_stays_bounded() -> None:
    top = 20
    metrics = TenantMetrics(top, key=b"secret")
    heavy = [f"tenant-{i}" for i in range(5)]
    tracemalloc.start()
    try:
        for i in range(100_000):
            key = heavy[i // 10 % 5] if i % 10 == 0 else f"bomb-{i}"
            metrics.observe(key, ttft=0.02)
            if i == 5_000:
                settled, _ = tracemalloc.get_traced_memory()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    labels = [label for label, _ in metrics.items()]
    assert len(labels) <= top + 1
    assert len(set(labels)) == len(labels)
    assert metrics.state_size() <= 2 * metrics.capacity + top
    # 95,000 more one-off keys after the first 5,000 added no memory to speak of.
    assert after - settled < 64 * 1024
    # Every request is counted exactly once.
    counted = sum(series.requests for _, series in metrics.items())
    assert counted + metrics.retired == 100_000
    # The heavy tenants (2 % of the requests each, 1/50 > 1/capacity) hold labels.
    label_of = {key: label for key, (label, _) in metrics.labels.items()}
    for key in heavy:
        assert key in label_of


def test_one_off_keys_do_not_churn_the_labels() -> None:
    metrics = TenantMetrics(3, key=b"k")
    for key in ("a", "b", "c"):
        for _ in range(5):
            metrics.observe(key, ttft=None)
    first = dict(metrics.labels)
    for i in range(10_000):
        metrics.observe(f"x{i}", ttft=None)
    assert metrics.labels.keys() == first.keys()
    assert metrics.other.requests == 10_000


def test_a_heavier_tenant_takes_the_weakest_label_and_series_stay_monotonic() -> None:
    metrics = TenantMetrics(2, key=b"k")
    for key, n in (("a", 10), ("b", 3)):
        for _ in range(n):
            metrics.observe(key, ttft=None)
    for _ in range(5):
        metrics.observe("c", ttft=None)  # guaranteed count rises past b's 3
    assert set(metrics.labels) == {"a", "c"}
    counts = {label: series.requests for label, series in metrics.items()}
    # b's series ended (its 3 requests retired); c's first requests, before it won
    # the label, stayed in other: every request counted exactly once.
    assert metrics.retired == 3
    assert sum(counts.values()) == 15
    assert counts[OTHER] == 15 - 10 - counts[metrics.labels["c"][0]]


def test_workers_deltas_merge_bounded_and_monotonic() -> None:
    workers = [TenantMetrics(3, key=b"shared", deltas=True) for _ in range(2)]
    merged = TenantMetrics(3, labelled=True)
    rng = random.Random(3)
    seen: dict[str, int] = {}
    retired = 0
    for round_ in range(20):
        for worker in workers:
            for _ in range(200):
                key = f"t{rng.randrange(4)}" if rng.random() < 0.6 else f"one-{rng.random()}"
                worker.observe(key, ttft=0.01, queued=round_ % 2 == 0, wait=0.001)
            merged.absorb(worker.take())
        now = {label: series.requests for label, series in merged.items()}
        assert len(now) <= 4
        for label, count in now.items():
            # Monotonic, unless the label's series ended since (then it is retired).
            assert count >= seen.get(label, 0) or merged.retired > retired
        retired = merged.retired
        seen = now
    assert sum(seen.values()) + merged.retired == 20 * 2 * 200
    # Worker labels are digests under the shared key: the heavy tenants' agree.
    heavy = {w.labels[f"t{i}"][0] for w in workers for i in range(4) if f"t{i}" in w.labels}
    assert len(heavy) <= 4
    assert set(seen) - {OTHER} <= heavy


def test_top_zero_counts_everything_as_other() -> None:
    metrics = TenantMetrics(0)
    metrics.observe("a", ttft=0.1, rejected=0)
    assert [label for label, _ in metrics.items()] == [OTHER]
    assert metrics.other.rejected == [1, 0]
