"""What model pools cost per routing decision, and a pool's ring against a filtered walk.

    python -m loadtests.bench_models [--pairs 15] [--requests 2000] [--members 64]

Table 1, the whole decision as the data plane makes it for an OpenAI chat body
with a 4 KiB prompt (``decode_openai``, ``prompt_key``, ``hash_key``; with
models declared also ``model_name``, ``Fleet.members_for``; then
``Balancer.choose`` + ``Choice.release``), on 64 backends (``--members``): no model declared
(the fleet as before) against the same 64 backends split into ``P`` models
(each backend serves one; requests spread evenly over the models),
BalanceMode IN_FLIGHT and TRAFFIC.  The two run alternated in ``--pairs``
pairs (order flipped every pair), timed in the thread's CPU time; medians and
their ratio.  The "pick" columns time the routing step alone, on bodies decoded
and keyed beforehand (``model_name`` and ``members_for`` included): what pools
add, without the decode's noise around it.

Table 2, the choice this design made: finding a key's first backend within
its model's backends, by the pool's own ring (``Ring.primary``: what
``pick``'s fast path does) against a walk of the fleet's one ring filtered to
the pool (the first member of ``Ring.walk`` that serves the model), for 64
backends in 2, 8 and 32 models.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable

from hashring import Ring, hash_key, tenant_seed
from router.balancer import Balancer
from router.config import BackendSpec, parse_routing
from router.extract import decode_openai, model_name, prompt_key
from router.fleet import Fleet

from .bench_decision import PREFIX_LENGTH, bodies

POOLS = (2, 8, 32)


def specs(members: int, pools: int) -> list[BackendSpec]:
    """``members`` backends; with ``pools``, backend i serves ``model-{i % pools}``."""
    return [
        BackendSpec(
            f"instance-{i}",
            f"http://127.0.0.1:{10000 + i}",
            models=(f"model-{i % pools}",) if pools else (),
        )
        for i in range(members)
    ]


def chooser(members: int, pools: int, mode: str) -> Balancer:
    routing = parse_routing(
        {
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": {"PrefixLength": PREFIX_LENGTH, "BalanceMode": mode},
        }
    )
    return Balancer(Fleet(specs(members, pools)), routing, seed=1)


def decide(made: Balancer, items: list[bytes]) -> float:
    """CPU ns per decision, as ``Exchange`` makes it (``_route_openai`` .. ``_route``)."""
    fleet = made.fleet
    start = time.thread_time_ns()
    for body in items:
        request = decode_openai(body, PREFIX_LENGTH)
        key = prompt_key(request, PREFIX_LENGTH)
        model = model_name(request.model) if fleet.pools else None
        key_hash = hash_key(key, tenant_seed(request.prompt_cache_key))
        members = None if model is None else fleet.members_for(model)
        choice = made.choose(key_hash, frozenset(), members)
        assert choice is not None
        choice.release()
    return (time.thread_time_ns() - start) / len(items)


def pick(made: Balancer, prepared: list[tuple[int, bytes]]) -> float:
    """CPU ns per routing step: ``decide`` after the key's hash."""
    fleet = made.fleet
    start = time.thread_time_ns()
    for key_hash, raw in prepared:
        model = model_name(raw) if fleet.pools else None
        members = None if model is None else fleet.members_for(model)
        choice = made.choose(key_hash, frozenset(), members)
        assert choice is not None
        choice.release()
    return (time.thread_time_ns() - start) / len(prepared)


def prepare(items: list[bytes]) -> list[tuple[int, bytes]]:
    out = []
    for body in items:
        request = decode_openai(body, PREFIX_LENGTH)
        key = prompt_key(request, PREFIX_LENGTH)
        out.append((hash_key(key, tenant_seed(request.prompt_cache_key)), bytes(request.model)))
    return out


def with_models(items: list[bytes], pools: int) -> list[bytes]:
    """The same bodies, each naming one of ``pools`` models in turn."""
    return [
        body.replace(b'"model": "m"', b'"model": "model-%d"' % (i % pools), 1)
        for i, body in enumerate(items)
    ]


def per_key(find: Callable[[int], str | None], hashes: list[int], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.thread_time_ns()
        for key_hash in hashes:
            find(key_hash)
        samples.append((time.thread_time_ns() - start) / len(hashes))
    return statistics.median(samples)


def filtered(ring: Ring, serves: frozenset[str]) -> Callable[[int], str | None]:
    def first(key_hash: int) -> str | None:
        for member in ring.walk(key_hash):
            if member in serves:
                return member
        return None

    return first


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_models", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--pairs", type=int, default=15)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--members", type=int, default=64, help="backends (at least 32)")
    args = parser.parse_args()
    members = args.members
    items = bodies(args.requests, random.Random(1))
    print(
        f"# model pools: Python {sys.version.split()[0]}, {args.requests} chat bodies, "
        f"{members} backends, CPU ns per decision, median of {args.pairs} alternated pairs"
    )
    print(
        "| models | BalanceMode | decision, no model declared ns | models declared ns | ratio"
        " | pick, no model ns | models ns | ratio |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    plain_keys = prepare(items)
    for pools in POOLS:
        named = with_models(items, pools)
        named_keys = prepare(named)
        for mode in ("IN_FLIGHT", "TRAFFIC"):
            plain, pooled = chooser(members, 0, mode), chooser(members, pools, mode)
            decide(plain, items), decide(pooled, named)  # warm: placements, caches
            times: dict[str, list[float]] = {"b": [], "a": [], "pb": [], "pa": []}
            for pair in range(args.pairs):
                for declared in (False, True) if pair % 2 else (True, False):
                    if declared:
                        times["a"].append(decide(pooled, named))
                        times["pa"].append(pick(pooled, named_keys))
                    else:
                        times["b"].append(decide(plain, items))
                        times["pb"].append(pick(plain, plain_keys))
            b, a, pb, pa = (statistics.median(times[k]) for k in ("b", "a", "pb", "pa"))
            print(
                f"| {pools} | {mode} | {b:,.0f} | {a:,.0f} | {a / b:.3f}"
                f" | {pb:,.0f} | {pa:,.0f} | {pa / pb:.3f} |"
            )

    print()
    print("| models | pool ring primary ns/key | filtered walk of the fleet ring ns/key | ratio |")
    print("|---:|---:|---:|---:|")
    rng = random.Random(2)
    hashes = [rng.getrandbits(64) for _ in range(args.requests)]
    for pools in POOLS:
        fleet = Fleet(specs(members, pools))
        pool = fleet.pools["model-0"]
        own = per_key(pool.ring.primary, hashes, args.pairs)
        walk = per_key(filtered(fleet.ring, frozenset(pool.members)), hashes, args.pairs)
        print(f"| {pools} | {own:,.0f} | {walk:,.0f} | {walk / own:.1f} |")


if __name__ == "__main__":
    main()
