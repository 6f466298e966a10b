"""Benchmark of the shared in-flight table (router.shared): cost per decision, cost per fold.

    python -m loadtests.bench_shared [--pairs 200] [--requests 2000] [--folds 200]

Per decision: ``counts.get``, ``refresh`` of the member chosen (a shared
tracker's: its cells in the other rows read again), ``acquire`` and
``Lease.release``, what the balancer does to the in-flight tracker per
request (ConcurrencyScope PREFILL refreshes a second tracker), in a tight loop over
random backends (half of them busy with a held lease, as in a loaded fleet),
for the plain ``LoadTracker`` and a ``SharedLoadTracker`` on the middle row
(``rows // 2``: other rows on both sides of its own) of a table of 1, 2, 4 and
8 rows (workers), with 7 and 1,000 backends; the refresh is made as
``Balancer._walk`` makes it, ``probes`` compared inline and ``refresh`` called
only where they differ.  Then the same at 1 and 8 rows for ConcurrencyScope
PREFILL: two trackers (``Fleet.loads`` and ``Fleet.waiting``), both read
again, a lease taken on each.  Plain and shared run in --pairs short runs,
alternated (order flipped every pair: the machine is shared, and a pause then
spoils one pair, not the comparison); the table prints each one's median ns
per decision and the median of the paired differences.  Times are the
thread's CPU time (``time.thread_time_ns``): a moment the VM's other tenants
take the core does not count.

Per fold, at 7 and 1,000 backends x 8 rows: the cost of one ``fold()`` when no
other row changed, when each of the 7 other rows changed 1 or 50 backends'
counts, and when each changed every backend's count.  Median of ``--folds``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial

from hashring import Lease, LoadTracker
from router.shared import DEFAULT_PERIOD, SharedLoadTracker, SharedTable

ROWS = (1, 2, 4, 8)
PREFILL_ROWS = (1, 8)
FLEETS = (7, 1000)
TARGET_NS = 300  # issue 12: at most 0.3 us added per decision at 8 workers


def decide_all(trackers: Sequence[LoadTracker], names: list[str]) -> None:
    (tracker,) = trackers
    counts = tracker.counts
    acquire = tracker.acquire
    for name in names:
        counts.get(name, 0)
        if tracker.refreshes:  # as Balancer._walk: the plain tracker pays the test
            probe = tracker.probes.get(name)  # refresh's fast path, inlined as there
            if probe is None or probe[0] != probe[1] or probe[2] != probe[3]:
                tracker.refresh(name)
        acquire(name).release()


def decide_prefill(trackers: Sequence[LoadTracker], names: list[str]) -> None:
    """``decide_all`` under ConcurrencyScope PREFILL: the walk reads both trackers
    again, and the request takes a lease on each (the waiting one ends at the
    first byte of the answer)."""
    loads, waiting = trackers
    counts = waiting.counts
    for name in names:
        counts.get(name, 0)
        if loads.refreshes:
            probe = loads.probes.get(name)
            if probe is None or probe[0] != probe[1] or probe[2] != probe[3]:
                loads.refresh(name)
            probe = waiting.probes.get(name)
            if probe is None or probe[0] != probe[1] or probe[2] != probe[3]:
                waiting.refresh(name)
        lease = loads.acquire(name)
        waiting.acquire(name).release()
        lease.release()


def timed(run: Callable[[], object], items: int) -> float:
    start = time.thread_time_ns()
    run()
    return (time.thread_time_ns() - start) / items


def table_with(
    rows: int, backends: int, planes: int = 1
) -> tuple[SharedTable, list[SharedLoadTracker]]:
    """A table and one tracker per (row, plane), row by row, every backend assigned a slot."""
    table = SharedTable.create(rows, backends, planes=planes)
    trackers = [SharedLoadTracker(table, p, row) for row in range(rows) for p in range(planes)]
    for tracker in trackers:
        for slot in range(backends):
            tracker.assign(f"instance-{slot}", slot)
    return table, trackers


def busy(tracker: LoadTracker, names: list[str]) -> list[Lease]:
    return [tracker.acquire(name) for name in names[::2]]


def alternated(
    pairs: int, requests: int, plain: Callable[[], object], shared: Callable[[], object]
) -> str:
    """The table's figures: medians of ``pairs`` alternated runs and of their differences."""
    plain_ns, shared_ns = [], []
    for pair in range(pairs):  # short runs, alternated: a pause hits one, not a trend
        if pair % 2:
            plain_ns.append(timed(plain, requests))
            shared_ns.append(timed(shared, requests))
        else:
            shared_ns.append(timed(shared, requests))
            plain_ns.append(timed(plain, requests))
    added = statistics.median(s - p for s, p in zip(shared_ns, plain_ns, strict=True))
    return f"{statistics.median(plain_ns):.0f} | {statistics.median(shared_ns):.0f} | {added:+.0f}"


def bench_decisions(pairs: int, requests: int) -> None:
    print("| scope | backends | rows | plain ns | shared ns | added ns (median of pairs) |")
    print("|---|---:|---:|---:|---:|---:|")
    for prefill in (False, True):
        for backends in FLEETS:
            names = [f"instance-{i}" for i in range(backends)]
            rng = random.Random(backends)
            order = [rng.choice(names) for _ in range(requests)]
            for rows in PREFILL_ROWS if prefill else ROWS:
                planes = 2 if prefill else 1
                plain = [LoadTracker() for _ in range(planes)]
                table, trackers = table_with(rows, backends, planes)
                # The middle row: its column has other rows on both sides.
                shared = trackers[rows // 2 * planes : rows // 2 * planes + planes]
                held = [lease for t in plain + trackers for lease in busy(t, names)]
                for tracker in shared:
                    tracker.fold()
                decide = decide_prefill if prefill else decide_all
                figures = alternated(
                    pairs, requests, partial(decide, plain, order), partial(decide, shared, order)
                )
                scope = "PREFILL" if prefill else "IN_FLIGHT"
                print(f"| {scope} | {backends:,} | {rows} | {figures} |")
                for lease in held:
                    lease.release()
                for tracker in trackers:
                    tracker.close()
                table.close()


def bench_folds(folds: int) -> None:
    rows = 8
    print("\n| backends | rows | other rows changed x slots each | fold us |")
    print("|---:|---:|---|---:|")
    for backends in FLEETS:
        table, trackers = table_with(rows, backends)
        names = [f"instance-{i}" for i in range(backends)]
        reader, writers = trackers[0], trackers[1:]
        rng = random.Random(rows)
        for changed in (0, 1, 50, backends):
            if changed > backends:
                continue
            samples = []
            held: list[Lease] = []
            for _ in range(folds):
                # The others' traffic since the last fold (not timed): every other
                # fold ``changed`` counts go up on each other row, then back down.
                if held:
                    for lease in held:
                        lease.release()
                    held = []
                elif changed:
                    held = [w.acquire(n) for w in writers for n in rng.sample(names, changed)]
                samples.append(timed(reader.fold, 1) / 1000)
            for lease in held:
                lease.release()
            label = "none" if not changed else f"7 x {changed:,}"
            print(f"| {backends:,} | {rows} | {label} | {statistics.median(samples):.1f} |")
        for tracker in trackers:
            tracker.close()
        table.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_shared", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--folds", type=int, default=200)
    args = parser.parse_args()
    print(
        f"# shared in-flight table: Python {sys.version.split()[0]}, {args.pairs} alternated "
        f"pairs of runs of {args.requests:,} decisions, medians; target <= "
        f"{TARGET_NS} ns added at 8 rows; default fold period {DEFAULT_PERIOD * 1000:g} ms"
    )
    bench_decisions(args.pairs, args.requests)
    bench_folds(args.folds)


if __name__ == "__main__":
    main()
