"""Benchmark of one whole routing decision, as the data plane makes it.

    python -m loadtests.bench_decision [--repeats 7] [--requests 2000]

For an OpenAI chat body with a 4 KiB prompt (a 3.9 KiB system prompt and a
short question, PrefixLength 4096) it prints the nanoseconds per request of:
  extract   decode_openai + prompt_key (the body decoded once, the key built)
  hash      tenant_seed + hash_key of the key
  pick      Balancer.choose + release (lease taken and given back)
  decision  all three, measured together: what a request pays before any I/O
  hot       the decision for one body decoded over and over: its bytes stay in
            the CPU cache, as a request just read from its socket does
for fleets of 7, 64 and 1,024 members, BalanceMode IN_FLIGHT and TRAFFIC; each
figure the median over --repeats runs (the machine is shared). Bodies differ
per request (distinct questions, 200 distinct system prompts) so no cache of
ours or the CPU's flatters the figure.

With ``--arms N`` it then prints what an A/B experiment of N arms (router.arms)
adds: the decision with the key's arm assigned and routed by that arm's
balancer (as ``Routing._arm_balancer``), against the same decision without an
experiment, alternated pair by pair; and the assignment alone.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from functools import partial

from hashring import hash_key, tenant_seed
from router.balancer import Balancer
from router.config import BackendSpec, parse_routing
from router.extract import decode_openai, prompt_key
from router.fleet import Fleet

from .bench_hashring import median_ns_per_item

FLEETS = (7, 64, 1024)
PREFIX_LENGTH = 4096
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "are",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "be",
    "or",
    "an",
]


def bodies(count: int, rng: random.Random) -> list[bytes]:
    systems = []
    for _ in range(200):
        text = " ".join(rng.choice(WORDS) for _ in range(1400))
        systems.append(text[:3990])
    out = []
    for i in range(count):
        body = {
            "model": "m",
            "stream": True,
            "messages": [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": f"Question {i}: what does clause {i % 97} mean?"},
            ],
        }
        out.append(json.dumps(body).encode())
    return out


def balancer(members: int, mode: str) -> Balancer:
    specs = [BackendSpec(f"instance-{i}", f"http://127.0.0.1:{10000 + i}") for i in range(members)]
    routing = parse_routing(
        {
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": {"PrefixLength": PREFIX_LENGTH, "BalanceMode": mode},
        }
    )
    return Balancer(Fleet(specs), routing, seed=1)


def extract_all(items: list[bytes]) -> None:
    for body in items:
        prompt_key(decode_openai(body), PREFIX_LENGTH)


def hash_all(keys: list[tuple[bytes, str | None]]) -> None:
    for key, tenant in keys:
        hash_key(key, tenant_seed(tenant))


def pick_all(chooser: Balancer, hashes: list[int]) -> None:
    for key_hash in hashes:
        choice = chooser.choose(key_hash)
        assert choice is not None
        choice.release()


def decide_all(chooser: Balancer, items: list[bytes]) -> None:
    for body in items:
        request = decode_openai(body)
        key = prompt_key(request, PREFIX_LENGTH)
        choice = chooser.choose(hash_key(key, tenant_seed(request.prompt_cache_key)))
        assert choice is not None
        choice.release()


def experiment_balancer(members: int, arms: int) -> Balancer:
    """The fleet of ``balancer(members, "TRAFFIC")`` with ``arms`` PREFIX_AWARE arms."""
    specs = [BackendSpec(f"instance-{i}", f"http://127.0.0.1:{10000 + i}") for i in range(members)]
    routing = parse_routing(
        {
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": {"PrefixLength": PREFIX_LENGTH},
            "Experiment": "bench",
            "Arms": [{"Name": f"arm{i}", "Weight": 1} for i in range(arms)],
        }
    )
    return Balancer(Fleet(specs), routing, seed=1)


def decide_armed(chooser: Balancer, items: list[bytes]) -> None:
    experiment = chooser.arms
    assert experiment is not None
    for body in items:
        request = decode_openai(body)
        key = prompt_key(request, PREFIX_LENGTH)
        key_hash = hash_key(key, tenant_seed(request.prompt_cache_key))
        choice = experiment.assign(key_hash).balancer.choose(key_hash)
        assert choice is not None
        choice.release()


def assign_all(chooser: Balancer, hashes: list[int]) -> None:
    experiment = chooser.arms
    assert experiment is not None
    for key_hash in hashes:
        experiment.assign(key_hash)


def arms_cost(arms: int, items: list[bytes], hashes: list[int], repeats: int) -> None:
    n = len(items)
    plain, armed = balancer(64, "TRAFFIC"), experiment_balancer(64, arms)
    without, with_arms = [], []
    for _ in range(repeats):  # alternated: the shared machine drifts between runs
        without.append(median_ns_per_item(partial(decide_all, plain, items), n, 1))
        with_arms.append(median_ns_per_item(partial(decide_armed, armed, items), n, 1))
    assign_ns = median_ns_per_item(partial(assign_all, armed, hashes), n, repeats)
    hash_ns = median_ns_per_item(
        partial(hash_all, [(h.to_bytes(8, "little"), None) for h in hashes]), n, repeats
    )
    before, after = sorted(without)[repeats // 2], sorted(with_arms)[repeats // 2]
    print(f"\n# an A/B experiment of {arms} arms, 64 members, TRAFFIC, {repeats} pairs")
    print("| decision ns, no experiment | with one | ratio | assignment ns | hash_key ns |")
    print("|---:|---:|---:|---:|---:|")
    ratio = after / before
    print(f"| {before:,.0f} | {after:,.0f} | {ratio:.3f} | {assign_ns:,.0f} | {hash_ns:,.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_decision", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--arms", type=int, help="also: what an A/B experiment of N arms adds")
    args = parser.parse_args()
    rng = random.Random(1)
    items = bodies(args.requests, rng)
    requests = [decode_openai(body) for body in items]
    keys = [(prompt_key(r, PREFIX_LENGTH), r.prompt_cache_key) for r in requests]
    hashes = [hash_key(key, tenant_seed(tenant)) for key, tenant in keys]
    size = sum(map(len, items)) / len(items)
    print(
        f"# routing decision benchmark: Python {sys.version.split()[0]}, {args.requests} "
        f"chat bodies of {size / 1024:.1f} KiB, key {len(keys[0][0]):,} bytes, "
        f"median of {args.repeats}"
    )
    n = args.requests
    extract_ns = median_ns_per_item(partial(extract_all, items), n, args.repeats)
    hash_ns = median_ns_per_item(partial(hash_all, keys), n, args.repeats)
    print("| members | BalanceMode | extract ns | hash ns | pick ns | decision ns | hot ns |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    one = [items[0]] * n
    for members in FLEETS:
        for mode in ("IN_FLIGHT", "TRAFFIC"):
            chooser = balancer(members, mode)
            pick_ns = median_ns_per_item(partial(pick_all, chooser, hashes), n, args.repeats)
            total_ns = median_ns_per_item(partial(decide_all, chooser, items), n, args.repeats)
            hot_ns = median_ns_per_item(partial(decide_all, chooser, one), n, args.repeats)
            print(
                f"| {members:,} | {mode} | {extract_ns:,.0f} | {hash_ns:,.0f} "
                f"| {pick_ns:,.0f} | {total_ns:,.0f} | {hot_ns:,.0f} |"
            )
    if args.arms:
        arms_cost(args.arms, items, hashes, args.repeats)


if __name__ == "__main__":
    main()
