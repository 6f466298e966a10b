"""What one TRAFFIC placement shared by every worker and replica costs per request.

    python -m loadtests.bench_placement_log [--pairs 40] [--requests 5000] [--keys 1000]

Per decision: ``Balancer.choose`` + ``Choice.release`` in BalanceMode TRAFFIC
on 7 backends, over ``--requests`` requests drawn from ``--keys`` keys
(Zipf-like: a few keys carry most requests, as prompts do), alone and with
``share_placement`` (every decision recorded for the others,
``hashring.shared.PlacementLog.decided``).  Per record: what every OTHER
process pays to fold one in (``PlacementLog.apply``: the home adopted, the
request counted in its window).  A request through a fleet of P processes
costs one recording here and P - 1 applies elsewhere.

Alone and recording run in --pairs short runs, alternated (order flipped
every pair); times are the thread's CPU time; the table prints medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from hashring import Placement
from hashring.shared import PlacementLog, Record
from router.balancer import Balancer
from router.config import BackendSpec, parse_routing
from router.fleet import Fleet

BACKENDS = 7


def balancer(specs: list[BackendSpec], share: bool) -> Balancer:
    routing = parse_routing(
        {"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": {"BalanceMode": "TRAFFIC"}}
    )
    made = Balancer(Fleet(specs), routing, seed=1)
    if share:
        made.share_placement(1)
    return made


def decide(made: Balancer, keys: list[int]) -> float:
    """CPU ns per choose + release."""
    start = time.thread_time_ns()
    for key in keys:
        choice = made.choose(key)
        assert choice is not None
        choice.release()
    return (time.thread_time_ns() - start) / len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_placement_log")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=1000)
    args = parser.parse_args()
    rng = random.Random(7)
    pool = [rng.getrandbits(64) for _ in range(args.keys)]
    weights = [1 / (rank + 1) for rank in range(args.keys)]
    keys = rng.choices(pool, weights, k=args.requests)
    specs = [BackendSpec(f"b{i}", f"http://127.0.0.1:{9000 + i}") for i in range(BACKENDS)]

    alone: list[float] = []
    recording: list[float] = []
    for pair in range(args.pairs):
        for share in (False, True) if pair % 2 else (True, False):
            (recording if share else alone).append(decide(balancer(specs, share), keys))

    # The records one process made, folded into another's placement.
    source = balancer(specs, True)
    decide(source, keys)
    assert source.placement_log is not None
    records: list[Record] = source.placement_log.publish()
    ring = source.fleet.ring
    applying: list[float] = []
    for _ in range(args.pairs):
        other = PlacementLog(Placement(Balancer.DEFAULT_TRAFFIC_FACTOR), 2)
        start = time.thread_time_ns()
        other.apply(ring, records)
        applying.append((time.thread_time_ns() - start) / len(records))

    a, r = statistics.median(alone), statistics.median(recording)
    print(f"{args.requests} requests over {args.keys} keys, {BACKENDS} backends, TRAFFIC mode")
    print("| per request | CPU ns (median of runs) |")
    print("|---|---:|")
    print(f"| choose + release, alone | {a:,.0f} |")
    print(f"| choose + release, recording | {r:,.0f} (+{r - a:,.0f}, {r / a:.2f}x) |")
    print(f"| apply one record in another process | {statistics.median(applying):,.0f} |")


if __name__ == "__main__":
    main()
