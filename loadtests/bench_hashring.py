"""Benchmark of the pure routing core: cost per key and keys moved on growth.

    python -m loadtests.bench_hashring [--repeats 5] [--keys 2000]

Prints, for prefix lengths of 1 KiB, 4 KiB and 64 KiB and rings of 7, 64 and
1,024 members (default vnodes), the nanoseconds per key of:
  hash      hash_key over a memoryview of the prefix (what a native request pays)
  pick      bounded-load pick on the ring, members idle (the common case)
  saturated the pick when every member is past its threshold (30-33 in flight,
            threshold 10): the whole walk, then the fallback's
  total     hash + pick, measured together
and the median over --repeats runs (the machine is shared: medians, not means).
Then the share of keys that move when the ring grows 7->8 and 64->65, measured
over 200,000 random keys and as the exact share of hash space, against 1/(n+1).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

from hashring import LoadBound, LoadTracker, Ring, hash_key, pick

PREFIX_LENGTHS = (1024, 4096, 65536)
FLEETS = (7, 64, 1024)


def names(count: int) -> dict[str, int]:
    return {f"instance-{i}": 1 for i in range(count)}


def median_ns_per_item(run: Callable[[], None], items: int, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        run()
        samples.append((time.perf_counter_ns() - start) / items)
    return statistics.median(samples)


def bench_costs(keys: int, repeats: int) -> None:
    rng = random.Random(1)
    print(
        "| members | prefix | hash ns/key | pick ns/key | hash+pick ns/key"
        " | saturated pick ns/key |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for members in FLEETS:
        ring = Ring(names(members))
        tracker = LoadTracker()
        bound = LoadBound(threshold=10, balance=1.25)
        queued = LoadTracker()
        for name in ring.members:
            for _ in range(30 + rng.randrange(4)):
                queued.acquire(name)
        for length in PREFIX_LENGTHS:
            # One buffer per key, as each request holds its own.
            buffers = [memoryview(bytearray(rng.randbytes(length))) for _ in range(keys)]
            hashes = [hash_key(b) for b in buffers]
            runs = {
                "hash": partial(hash_all, buffers),
                "pick": partial(pick_all, ring, tracker, bound, hashes),
                "both": partial(hash_and_pick_all, ring, tracker, bound, buffers),
                "saturated": partial(pick_all, ring, queued, bound, hashes),
            }
            ns = {name: median_ns_per_item(run, keys, repeats) for name, run in runs.items()}
            figures = " | ".join(f"{ns[name]:,.0f}" for name in runs)
            print(f"| {members} | {length} | {figures} |")


def hash_all(buffers: list[memoryview]) -> None:
    for buf in buffers:
        hash_key(buf)


def pick_all(ring: Ring, tracker: LoadTracker, bound: LoadBound, hashes: list[int]) -> None:
    counts = tracker.counts
    for h in hashes:
        pick(ring, h, counts, bound, total=tracker.total)


def hash_and_pick_all(
    ring: Ring, tracker: LoadTracker, bound: LoadBound, buffers: list[memoryview]
) -> None:
    counts = tracker.counts
    for buf in buffers:
        pick(ring, hash_key(buf), counts, bound, total=tracker.total)


def bench_movement() -> None:
    rng = random.Random(2)
    keys = [rng.getrandbits(64) for _ in range(200_000)]
    print()
    print("| growth | keys moved | space moved | ideal 1/(n+1) | moved keys not to newcomer |")
    print("|---|---:|---:|---:|---:|")
    for n in (7, 64):
        before = Ring(names(n))
        after = before.with_member("newcomer")
        moved = [k for k in keys if before.primary(k) != after.primary(k)]
        stray = sum(1 for k in moved if after.primary(k) != "newcomer")
        space = after.ownership()["newcomer"]
        print(
            f"| {n}->{n + 1} | {len(moved) / len(keys):.2%} | {space:.2%} "
            f"| {1 / (n + 1):.2%} | {stray} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_hashring", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--keys", type=int, default=2000)
    args = parser.parse_args()
    print(
        f"# hashring benchmark: Python {sys.version.split()[0]}, {args.keys} keys, "
        f"median of {args.repeats}"
    )
    bench_costs(args.keys, args.repeats)
    bench_movement()


if __name__ == "__main__":
    main()
