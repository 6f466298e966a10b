"""``python -m loadtests.bench_tenants``: what per-tenant metrics cost a request, and hold.

    python -m loadtests.bench_tenants [--repeats 5] [--requests 20000] [--top 20]

Prints the median over ``--repeats`` runs (the machine is shared) of the time
``TenantMetrics.observe`` takes per request (the one call a request makes, at
its end) for: 50 tenants taking turns; a stream of distinct keys (a
cardinality bomb: every request a new tenant); and, once, the entries the
component holds and the bytes it allocated (tracemalloc) after 100,000
distinct keys.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc

from router.tenants import TenantMetrics

__all__ = ["main"]


def per_request_ns(metrics: TenantMetrics, keys: list[str]) -> float:
    observe = metrics.observe
    start = time.perf_counter()
    for key in keys:
        observe(key, ttft=0.05)
    return (time.perf_counter() - start) / len(keys) * 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_tenants")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    turns = [f"tenant-{i % 50}" for i in range(args.requests)]
    rows = []
    for name in ("50 tenants", "distinct keys"):
        runs = []
        for r in range(args.repeats):
            metrics = TenantMetrics(args.top, key=b"bench-key-0123456789")
            keys = turns if name == "50 tenants" else [f"b{r}-{i}" for i in range(args.requests)]
            runs.append(per_request_ns(metrics, keys))
        rows.append((name, statistics.median(runs)))
    for name, ns in rows:
        print(f"observe, {name}, top {args.top}: {ns:,.0f} ns a request (median of {args.repeats})")
    tracemalloc.start()
    metrics = TenantMetrics(args.top, key=b"bench-key-0123456789")
    before, _ = tracemalloc.get_traced_memory()
    for i in range(100_000):
        metrics.observe(f"bomb-{i}", ttft=0.05)
    after, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    labels = sum(1 for _ in metrics.items())
    print(
        f"after 100,000 distinct keys: {labels} labels, {metrics.state_size()} entries held"
        f" (capacity {metrics.capacity}), {(after - before) / 1024:,.0f} KiB allocated"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
