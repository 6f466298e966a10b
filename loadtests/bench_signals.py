"""``python -m loadtests.bench_signals``: engine signals as tie-breaks, live, A/B.

    python -m loadtests.bench_signals --rounds 3 --duration 60
    python -m loadtests.bench_signals --cost     # ns a decision, off and on, no I/O

Contract:
- One simulated fleet (``loadtests.simserver``, ``--instances``, the
  simulator's 70B timing: prefill 10,000 tokens/s serialised per instance,
  25 ms an output token) and, per run, a fresh ``prefix-router serve`` in
  front of it (PREFIX_AWARE, the default TRAFFIC + PREFILL and threshold,
  ``--scrape-metrics``).  ``--time-scale`` stretches the simulated clock (a
  model second lasts that many real ones: fewer requests a real second on a
  shared machine); every figure below is in model time, the router's scrape
  interval too (``--scrape-interval``, given to the router times the scale).
- The workload, ``mixed``: one shared system prompt (``--system-tokens``,
  longer than PrefixLength: it is the whole routing key, so the key is hot
  and served by every instance as its replicas, each request going to the
  replica with the fewest in flight: the tie path), then the request's own
  text, unique (a full prefill of it): short (``--short-tokens``) or, with
  probability ``--long-share``, a long document (``--long-tokens``, ~1 s of
  prefill).  In-flight counts mislead here: a long prefill and a short
  request's decode count one each, while a request sent behind the long one
  waits for it.  ``--max-tokens`` streamed output tokens.  Poisson arrivals
  at ``--load`` times the fleet's prefill capacity (instances / the mean
  prefill time of the mix), seeded: the same requests in both runs of a
  round, other requests in each round.
- Per round two runs, ``off`` (scraping only) and ``on``
  (``--engine-signals``), in alternating order (off first in odd rounds),
  the instances' prefix caches reset before each run.
- Figures per run, client side (request sent to the first body byte), every
  200 answer: TTFT P50/P90/P99 (nearest rank) of all requests and of the
  short ones, the fleet's hit rate (the instances' counters, tokens), the
  share of each instance, the ties the engines broke (the router's
  ``prefix_router_engine_tie_breaks_total`` over its requests) and any status
  but 200.  Per round the ratios on / off; then their medians.  The load
  average is printed before and after.
- Every process is started and stopped by PID (``loadtests.supervisor``).
- ``--cost``: what the feature adds to a decision, in process (``Balancer.choose``
  and the lease's release, 7 backends, TRAFFIC), off (``engine_ranks`` None) and
  on (a rank for every backend), alternated ``--repeats`` times, medians: new
  keys below their bound (the common case, the fast path), one hot key over its
  replicas with 8 in flight on each (the tie path), and every backend at its
  bound (the fallback).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

from router.balancer import Balancer, Choice
from router.config import BackendSpec, parse_routing
from router.fleet import Fleet
from router.metrics import percentile

from .bench_hashring import median_ns_per_item
from .fleet import Child, counters, hit_rate, reset_caches, start_router, start_sims, stop_checked
from .supervisor import say

__all__ = ["main"]

ARMS = ("off", "on")
_TIES = re.compile(r"^prefix_router_engine_tie_breaks_total\{[^}]*\} (\S+)$", re.M)
Arrival = tuple[float, str, bool]  # model seconds, the user's text, long?
_WORDS = ("invoice", "ledger", "shipment", "customer", "refund", "contract", "order", "clause")


def words(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` simulated tokens (4 bytes each) of text unique to ``rng``'s draw."""
    head = f"{rng.getrandbits(64):016x} "
    body = " ".join(rng.choice(_WORDS) for _ in range(tokens))  # ~8 bytes a word: cut
    return (head + body)[: tokens * 4]


def system_prompt(tokens: int) -> str:
    text = "You are the support assistant of a logistics company. Follow these rules. "
    rule = 0
    while len(text) < tokens * 4:
        text += f"Rule {rule}: answer about the {_WORDS[rule % len(_WORDS)]} precisely. "
        rule += 1
    return text[: tokens * 4]


class Mix:
    """The ``mixed`` workload's parameters and the fleet capacity they imply."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.system = system_prompt(args.system_tokens)
        self.short = args.short_tokens
        self.long = args.long_tokens
        self.long_share = args.long_share
        self.max_tokens = args.max_tokens
        # The simulator's timing: 20 ms a request, 10,000 uncached tokens a second.
        short_s = 0.020 + sum(self.short) / 2 / 10_000
        long_s = 0.020 + sum(self.long) / 2 / 10_000
        self.mean_prefill_s = (1 - self.long_share) * short_s + self.long_share * long_s
        self.capacity = args.instances / self.mean_prefill_s  # requests a model second

    def requests(self, seed: int, rate: float, duration: float) -> list[Arrival]:
        """(arrival in model seconds, user text, long?) for ``duration`` model seconds."""
        rng = random.Random(f"bench_signals {seed}")
        out = []
        at = rng.expovariate(rate)
        while at < duration:
            long = rng.random() < self.long_share
            low, high = self.long if long else self.short
            out.append((at, words(rng, rng.randint(low, high)), long))
            at += rng.expovariate(rate)
        return out


async def one(
    http: aiohttp.ClientSession, url: str, mix: Mix, arrival: Arrival, out: list[dict[str, Any]]
) -> None:
    _, text, long = arrival
    body = {
        "model": "sim-llama-3.1-70b",
        "messages": [{"role": "system", "content": mix.system}, {"role": "user", "content": text}],
        "max_tokens": mix.max_tokens,
        "stream": True,
    }
    record: dict[str, Any] = {"long": long, "status": 0, "ttft": None, "instance": None}
    start = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            record["status"] = resp.status
            record["instance"] = resp.headers.get("x-sim-instance")
            first = await resp.content.readany()
            if resp.status == 200 and first:
                record["ttft"] = time.perf_counter() - start
            await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        record["error"] = type(exc).__name__
    out.append(record)


async def drive(url: str, mix: Mix, requests: list[Arrival], scale: float) -> list[dict[str, Any]]:
    """Send ``requests`` open loop at their arrival times (model seconds x ``scale``)."""
    out: list[dict[str, Any]] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as http:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = []
        for arrival in requests:
            delay = t0 + arrival[0] * scale - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process, not a synchronisation
            tasks.append(asyncio.create_task(one(http, url, mix, arrival, out)))
        await asyncio.gather(*tasks)
    return out


async def ties(admin: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{admin}/metrics") as resp:
        return sum(float(v) for v in _TIES.findall(await resp.text()))


def summarize(records: list[dict[str, Any]], scale: float, instances: list[str]) -> dict[str, Any]:
    ok = [r for r in records if r["status"] == 200 and r["ttft"] is not None]
    model = [r["ttft"] / scale for r in ok]
    short = [r["ttft"] / scale for r in ok if not r["long"]]
    statuses: dict[str, int] = {}
    for r in records:
        if r["status"] != 200 or "error" in r:
            key = r.get("error") or str(r["status"])
            statuses[key] = statuses.get(key, 0) + 1
    shares = {name: sum(r["instance"] == name for r in ok) / max(1, len(ok)) for name in instances}
    return {
        "n": len(ok),
        "p50": percentile(model, 0.5),
        "p90": percentile(model, 0.9),
        "p99": percentile(model, 0.99),
        "short_p50": percentile(short, 0.5),
        "short_p90": percentile(short, 0.9),
        "short_p99": percentile(short, 0.99),
        "shares": shares,
        "failed": statuses,
    }


async def run_once(
    args: argparse.Namespace, sims: dict[str, str], arm: str, requests: list[Arrival], mix: Mix
) -> dict[str, Any]:
    await reset_caches(sims)
    before = await counters(sims)
    children: list[Child] = []
    flags = ["--strategy", "prefix", "--access-log", "off", "--no-health-checks"]
    flags += ["--scrape-metrics", "--scrape-interval", str(args.scrape_interval * args.time_scale)]
    if arm == "on":
        flags.append("--engine-signals")
    if args.workers > 1:
        flags += ["--workers", str(args.workers)]
    router, url, admin = await start_router(children, sims, *flags, label=f"router ({arm})")
    try:
        records = await drive(url, mix, requests, args.time_scale)
        tie_breaks = await ties(admin)
    finally:
        await stop_checked(router)
    result = summarize(records, args.time_scale, sorted(sims))
    result["hit_rate"] = hit_rate(await counters(sims), before)
    result["ties"] = tie_breaks / max(1, result["n"])
    return result


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def print_table(results: list[dict[str, Any]]) -> None:
    print(
        "| round | arm | requests | TTFT P50 / P90 / P99 (ms) | short P50 / P90 / P99 (ms)"
        " | hit rate | shares | ties broken | failed |"
    )
    print("|---|---|---:|---:|---:|---:|---|---:|---|")
    for row in results:
        for arm in ARMS:
            r = row[arm]
            shares = "/".join(f"{v * 100:.0f}" for v in r["shares"].values())
            print(
                f"| {row['round']} | {arm} | {r['n']} | {_ms(r['p50'])} / {_ms(r['p90'])} /"
                f" {_ms(r['p99'])} | {_ms(r['short_p50'])} / {_ms(r['short_p90'])} /"
                f" {_ms(r['short_p99'])} | {r['hit_rate'] * 100:.1f} % | {shares} %"
                f" | {r['ties'] * 100:.1f} % | {r['failed'] or '-'} |"
            )
    print()
    keys = ("p50", "p90", "p99", "short_p50", "short_p90", "short_p99")
    ratios: dict[str, list[float]] = {k: [] for k in (*keys, "hit_rate")}
    for row in results:
        on, off = row["on"], row["off"]
        for key in ratios:
            if on[key] and off[key]:
                ratios[key].append(on[key] / off[key])
        print(
            f"round {row['round']} on/off: "
            + ", ".join(f"{k} {on[k] / off[k]:.3f}" for k in ratios if on[k] and off[k])
        )
    print(
        f"median over {len(results)} rounds, on/off: "
        + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in ratios.items() if v)
    )


async def main_async(args: argparse.Namespace) -> int:
    mix = Mix(args)
    rate = args.load * mix.capacity
    say(
        f"load average before: {os.getloadavg()}; fleet: {args.instances} instances, mean"
        f" prefill {mix.mean_prefill_s * 1000:.0f} model ms, capacity {mix.capacity:.1f} req per"
        f" model s; {rate:.1f} req per model s ({rate / args.time_scale:.1f} a real second),"
        f" time scale {args.time_scale}"
    )
    children: list[Child] = []
    sim_flags = ["--time-scale", str(args.time_scale)]
    if args.capacity_blocks is not None:
        sim_flags += ["--capacity-blocks", str(args.capacity_blocks)]
    _, sims = await start_sims(children, args.instances, *sim_flags)
    results: list[dict[str, Any]] = []
    try:
        for r in range(args.rounds):
            requests = mix.requests(args.seed + r, rate, args.duration)
            row: dict[str, Any] = {"round": r + 1}
            for arm in ARMS if r % 2 == 0 else tuple(reversed(ARMS)):
                row[arm] = await run_once(args, sims, arm, requests, mix)
                say(f"round {r + 1} {arm}: {json.dumps(row[arm])}")
            results.append(row)
    finally:
        for child in children:
            await stop_checked(child)
    print_table(results)
    say(f"load average after: {os.getloadavg()}")
    if args.out:
        write_json(Path(args.out), {"args": vars(args), "results": results})
    return 0


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1))


def cost(repeats: int, requests: int = 2000) -> None:
    """ns per decision (choose + release), engine signals off and on (see the contract)."""
    rng = random.Random(1)
    specs = [BackendSpec(f"instance-{i}", f"http://127.0.0.1:{10000 + i}") for i in range(7)]
    ranks = {spec.name: rng.randrange(1, 60) for spec in specs}
    routing = parse_routing({"RoutingStrategy": "PREFIX_AWARE"})  # the default: TRAFFIC + PREFILL
    keys = [rng.getrandbits(64) for _ in range(requests)]

    def chooser(signals: bool, case: str) -> tuple[Balancer, list[int], list[Choice]]:
        balancer = Balancer(Fleet(specs), routing, seed=1)
        balancer.engine_ranks = ranks if signals else None
        held: list[Choice] = []
        if case == "hot key":  # hot, and 8 in flight on each of its replicas
            for _ in range(8 * len(specs)):
                choice = balancer.choose(keys[0])
                assert choice is not None
                held.append(choice)
            return balancer, [keys[0]] * requests, held
        if case == "fallback":  # every backend at ConcurrencyThreshold (10) before it
            for key in keys[: 10 * len(specs)]:
                choice = balancer.choose(key)
                assert choice is not None
                held.append(choice)
        return balancer, keys, held

    def run(balancer: Balancer, hashes: list[int]) -> None:
        for key_hash in hashes:
            choice = balancer.choose(key_hash)
            assert choice is not None
            choice.release()

    print(f"# ns per decision (choose + release), 7 backends, median of {repeats} alternations")
    print("| case | off ns | on ns | on / off |")
    print("|---|---:|---:|---:|")
    for case in ("new keys", "hot key", "fallback"):
        figures: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for signals in (False, True):
                balancer, hashes, _held = chooser(signals, case)
                once = partial(run, balancer, hashes)
                figures[signals].append(median_ns_per_item(once, len(hashes), 1))
        off, on = statistics.median(figures[False]), statistics.median(figures[True])
        print(f"| {case} | {off:,.0f} | {on:,.0f} | {on / off:.2f} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_signals")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=2.0, help="real s a model s (2.0)")
    parser.add_argument("--load", type=float, default=0.6, help="share of prefill capacity")
    parser.add_argument("--duration", type=float, default=60.0, help="model s a run (60)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--system-tokens", type=int, default=1200)
    parser.add_argument("--short-tokens", type=_range, default=(100, 400), metavar="LOW-HIGH")
    parser.add_argument("--long-tokens", type=_range, default=(8000, 16000), metavar="LOW-HIGH")
    parser.add_argument("--long-share", type=float, default=0.08)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument(
        "--scrape-interval", type=float, default=1.0, help="model s between scrapes (1.0)"
    )
    parser.add_argument("--capacity-blocks", type=int, default=None, help="KV blocks an instance")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--cost", action="store_true", help="ns a decision off and on; no fleet")
    parser.add_argument("--repeats", type=int, default=7, help="--cost: alternations (7)")
    return parser.parse_args(argv)


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cost:
        cost(args.repeats)
        return 0
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
