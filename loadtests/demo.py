"""``python -m loadtests.demo [--serve]``: RANDOM vs PREFIX_AWARE on a simulated fleet.

Contract
- Run from anywhere; children run in the repository root. Starts one
  ``loadtests.simserver`` process with 4 instances, then the router, as
  subprocesses on 127.0.0.1 ephemeral ports, and prints their PIDs.
- Default: one seeded workload behind ``--strategy random``; hit rate from the
  instances' ``/metrics``; router stopped, caches reset
  (``POST /reset_prefix_cache``); the same workload behind ``--strategy
  prefix``; a markdown table and the relative change. Exit 0, or 1 with a
  message on any failure (one failed request is one), or 130 if interrupted.
- ``--serve``: fleet + PREFIX_AWARE router, URL and examples, then wait for
  SIGINT/SIGTERM and exit 0.
- Whatever happens (error, Ctrl-C, SIGTERM), every process it started is
  stopped by PID (SIGTERM, SIGKILL after ``STOP_TIMEOUT_S``) and reaped.

Parameters, and why (measured with seeds 1-5 and 7 before settling on them)
- Workload: 6 documents of 2,000-4,000 tokens (a simulator token is 4 ASCII
  bytes), ~18,000 tokens in all, each the system message of the requests
  about it, so it is the routing key; Zipf popularity (s = 1:
  41/20/14/10/8/7 %), a short distinct question each, 16 output tokens,
  8 requests in flight, 160 requests, seed 7 (picked before looking).
- ``--capacity-blocks 512`` (x 16 = 8,192 tokens an instance, ~45 % of the
  documents). RANDOM sends every document to every instance, which keeps
  two or three: the others are evicted and recomputed, so its hit rate is
  45-60 % where its cold misses alone would cost ~15 %. PREFIX_AWARE gives
  an instance 1.5 documents on average and reaches 81-89 %.
- ``--concurrency-threshold 4``, twice the average in flight per instance.
  The default 10 never binds at 8 in flight: seed 7 then puts 4 documents
  and 66 % of requests on one instance, which thrashes at 512 blocks. At 4,
  a hot document overflows to the next instance of its walk, which warms up.
  Six Zipf-popular prefixes still cannot be spread evenly over 4 instances;
  the share column shows it.
- Is prefix caching on? One more simulated instance, started with
  ``--no-prefix-caching`` (as vLLM without ``--enable-prefix-caching``;
  ``--time-scale 0.01``, so its cold prefills cost little), and ``sim-0``
  are behind a third router with ``--scrape-metrics --scrape-interval
  0.25``, started with the first measured one (so its start-up costs no
  time of its own). After the two runs, batches of 32 requests about 6
  other documents go through it until it has judged both
  (``router.cachecheck``: 20 repeated keys each), and the demo prints its
  verdicts and its warning: ~1-2 s more.
- ``--time-scale 0.25``: a cold 3,000-token prefill is ~80 ms real against
  ~6 ms for a cache hit, far above the 1-2 ms of Python and loopback
  overhead even on 2 busy cores, and the whole demo takes ~7 s. TTFTs are
  real milliseconds (model milliseconds x 0.25). ``--serve`` uses 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import random
import signal
import sys
import time
from dataclasses import dataclass

import aiohttp

from router import metrics

from .fleet import (
    Child,
    FleetError,
    counters,
    hit_rate,
    reset_caches,
    say,
    start_router,
    start_sims,
    stop_checked,
)

SIM_COUNT = 4
MODEL = "sim-llama-3.1-70b"  # the simulator's default served model name
REQUEST_TIMEOUT_S = 60.0

DemoError = FleetError


async def start_demo_fleet(
    children: list[Child], args: argparse.Namespace
) -> tuple[Child, dict[str, str]]:
    child, sims = await start_sims(
        children, SIM_COUNT, "--time-scale", str(args.time_scale),
        "--capacity-blocks", str(args.capacity_blocks),
    )  # fmt: skip
    urls = ", ".join(f"{name} {url}" for name, url in sims.items())
    say(f"fleet: {SIM_COUNT} simulated instances, pid {child.pid}: {urls}")
    return child, sims


async def start_demo_router(
    children: list[Child], sims: dict[str, str], strategy: str, *flags: str
) -> tuple[Child, str, str]:
    child, url, admin = await start_router(
        children, sims, "--strategy", strategy, "--prefix-length", "4096",
        "--concurrency-threshold", "4", "--access-log", "off", *flags,
        label=f"router ({strategy})",
    )  # fmt: skip
    say(f"router: {url} --strategy {strategy} {' '.join(flags)}".rstrip() + f", pid {child.pid}")
    return child, url, admin


NO_CACHE = "sim-nocache"  # the instance started with --no-prefix-caching
CHECK_BATCH = 32  # requests sent again until the router has judged both instances
CHECK_DEADLINE_S = 30.0
# Up from the start, beside the measured runs: 8 scrapes a second of 2 instances
# cost them next to nothing; a verdict comes ~3 rounds after enough repeats.
CHECK_SCRAPE_S = 0.25


async def start_nocache(children: list[Child]) -> tuple[Child, dict[str, str]]:
    child, sims = await start_sims(
        children, 1, "--no-prefix-caching", "--time-scale", "0.01", name=NO_CACHE
    )
    say(f"one more instance, started with --no-prefix-caching, pid {child.pid}: {sims[NO_CACHE]}")
    return child, sims


# ---------------------------------------------------------------- workload

_WORDS = (
    *("cache", "prefix", "token", "block", "router", "backend", "latency", "stream"),
    *("batch", "queue", "prefill", "decode", "model", "server", "replica", "shard"),
    *("invoice", "contract", "clause", "payment", "warranty", "delivery", "customer"),
    *("supplier", "notice", "liability", "schedule", "annex", "renewal", "audit"),
)


def workload(seed: int, requests: int, docs: int = 6) -> tuple[list[bytes], list[int]]:
    """The request bodies in order (the same for both strategies), and document sizes."""
    rng = random.Random(seed)
    sizes = [rng.randrange(2000, 4001) for _ in range(docs)]  # tokens of 4 bytes
    texts = []
    for i, size in enumerate(sizes):
        text = [f"Document {i}: handbook {rng.randrange(10**6)}.\n"]
        length = len(text[0])
        while length < size * 4:
            text.append(rng.choice(_WORDS) + (".\n" if rng.random() < 0.08 else " "))
            length += len(text[-1])
        texts.append("".join(text)[: size * 4])
    popularity = [1 / (rank + 1) for rank in range(docs)]  # Zipf, s = 1
    bodies = []
    for n in range(requests):
        doc = texts[rng.choices(range(docs), popularity)[0]]
        question = f"Q{n}: what does section {rng.randrange(1, 40)} say about {rng.choice(_WORDS)}?"
        messages = [
            {"role": "system", "content": "Answer questions about this document.\n\n" + doc},
            {"role": "user", "content": question},
        ]
        body = {"model": MODEL, "stream": True, "max_tokens": 16, "messages": messages}
        bodies.append(json.dumps(body).encode())
    return bodies, sizes


@dataclass
class Run:
    strategy: str
    ttfts: list[float]  # seconds, client side: request sent -> first SSE data line
    shares: collections.Counter[str]  # requests per answering instance (x-sim-instance)
    hit_rate: float = math.nan  # prefix-cache hits / queries, tokens, over all instances


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[float, str]:
    started = time.perf_counter()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise DemoError(f"request failed: HTTP {resp.status}: {(await resp.text())[:200]}")
        ttft = None
        async for line in resp.content:  # read to the end, as a real client would
            if ttft is None and line.startswith(b"data:"):
                ttft = time.perf_counter() - started
        if ttft is None:
            raise DemoError("a streamed response carried no SSE data line")
        return ttft, resp.headers.get("x-sim-instance", "?")


async def run_workload(url: str, bodies: list[bytes], concurrency: int) -> list[tuple[float, str]]:
    results: list[tuple[float, str]] = []
    todo = iter(bodies)  # shared by the workers: each body is sent once, in order
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            for body in todo:
                try:
                    results.append(await one_request(session, f"{url}/v1/chat/completions", body))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise DemoError(f"request failed: {exc!r}") from exc

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(concurrency):
                    group.create_task(worker())
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None
    return results


# ---------------------------------------------------------------- report


def percentile(values: list[float], q: float) -> float:
    """``router.metrics.percentile`` (nearest rank) of a run's TTFTs, never empty."""
    value = metrics.percentile(values, q)
    if value is None:
        raise DemoError("no request completed")
    return value


def report(runs: list[Run], names: list[str]) -> str:
    lines = [
        "| strategy | requests | hit rate | P50 TTFT | P90 TTFT | share per instance |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        n = len(run.ttfts)
        share = "/".join(f"{run.shares[name] * 100 / n:.0f}" for name in names)
        p50, p90 = (percentile(run.ttfts, q) * 1000 for q in (0.5, 0.9))
        lines.append(
            f"| {run.strategy} | {n} | {run.hit_rate:.0%} | {p50:.1f} ms | {p90:.1f} ms "
            f"| {share} % |"
        )
    old, new = runs
    change50, change90 = (
        f"{(percentile(new.ttfts, q) / percentile(old.ttfts, q) - 1) * 100:+.0f} %"
        for q in (0.5, 0.9)
    )
    lines.append(
        f"\n{new.strategy} vs {old.strategy}: P50 TTFT {change50}, P90 TTFT {change90}, "
        f"prefix-cache hit rate {old.hit_rate:.0%} -> {new.hit_rate:.0%}"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------- modes


def _verdict(line: str) -> tuple[str, str] | None:
    """(backend, status) of a router's prefix-cache verdict log line, else None."""
    try:
        event = json.loads(line)
    except ValueError:
        return None
    status = event.get("status") if isinstance(event, dict) else None
    if event.get("event", "").startswith("prefix cache") and status in ("ok", "suspect_off"):
        return str(event["backend"]), str(status)
    return None


async def start_check_router(children: list[Child], sims: dict[str, str]) -> tuple[Child, str, str]:
    return await start_demo_router(
        children, sims, "prefix", "--scrape-metrics", "--scrape-interval", str(CHECK_SCRAPE_S)
    )


async def cache_check(args: argparse.Namespace, checker: tuple[Child, str, str], n: int) -> str:
    """Requests through the checking router (over ``n`` instances) until it judged all."""
    router, url, admin = checker
    started = time.perf_counter()
    deadline = asyncio.get_running_loop().time() + CHECK_DEADLINE_S
    judged: dict[str, str] = {}
    warning = ""

    def find(line: str) -> dict[str, str] | None:
        nonlocal warning
        verdict = _verdict(line)
        if verdict is not None:
            judged[verdict[0]] = verdict[1]
            if verdict[1] == "suspect_off":
                event = json.loads(line)
                warning = " ".join(
                    [f"{event['level']}: {event['event']}"]
                    + [f"{k}={event[k]}" for k in ("backend", "repeats", "hit_tokens")]
                )
        return judged if len(judged) == n else None

    waiting = asyncio.ensure_future(router.wait_line(find, "prefix-cache verdicts", deadline))
    bodies, _ = workload(args.seed + 1, CHECK_BATCH)
    try:
        while not waiting.done():  # the verdicts need 20 repeated keys per instance
            await run_workload(url, bodies, args.concurrency)
        await waiting
    finally:
        waiting.cancel()
    async with (
        aiohttp.ClientSession(raise_for_status=True) as session,
        session.get(f"{admin}/admin/stats") as resp,
    ):
        backends = (await resp.json())["backends"]
    say(f"cache check: both instances judged in {time.perf_counter() - started:.1f} s")
    await stop_checked(router)
    lines = [
        f"Is prefix caching on? ({NO_CACHE} was started with --no-prefix-caching; the"
        " router, with --scrape-metrics, compares the keys it sends again to an"
        " instance with that instance's prefix-cache counters)"
    ]
    for backend in backends:
        check = backend["prefix_cache_check"]
        lines.append(f"  {backend['name']}: {backend['prefix_cache']} - {check['reason']}")
    lines.append(f"  router log: {warning}")
    return "\n".join(lines)


async def compare(args: argparse.Namespace, children: list[Child]) -> None:
    (fleet, sims), (nocache, nocache_url) = await asyncio.gather(
        start_demo_fleet(children, args), start_nocache(children)
    )
    bodies, sizes = workload(args.seed, args.requests)
    say(
        f"workload: {len(sizes)} documents of {min(sizes)}-{max(sizes)} tokens, "
        f"{len(bodies)} requests, {args.concurrency} in flight, seed {args.seed}"
    )
    first = sorted(sims)[0]
    check_sims = {first: sims[first], **nocache_url}
    checker = None
    runs = []
    for label, strategy in (("RANDOM", "random"), ("PREFIX_AWARE", "prefix")):
        await reset_caches(sims)
        if checker is None:  # both start at once, before anything is measured
            (router, url, _), checker = await asyncio.gather(
                start_demo_router(children, sims, strategy),
                start_check_router(children, check_sims),
            )
        else:
            router, url, _ = await start_demo_router(children, sims, strategy)
        started = time.perf_counter()
        results = await run_workload(url, bodies, args.concurrency)
        run = Run(label, [t for t, _ in results], collections.Counter(i for _, i in results))
        run.hit_rate = hit_rate(await counters(sims))
        elapsed = time.perf_counter() - started
        say(f"{label}: {len(results)} requests in {elapsed:.1f} s, hit rate {run.hit_rate:.0%}")
        runs.append(run)
        await stop_checked(router)
    assert checker is not None
    await reset_caches({first: sims[first]})  # its counters: the check's traffic alone
    check = await cache_check(args, checker, len(check_sims))
    say("\n" + report(runs, sorted(sims)) + "\n\n" + check + "\n")
    await stop_checked(nocache)
    await stop_checked(fleet)


async def serve(args: argparse.Namespace, children: list[Child], stop: asyncio.Event) -> None:
    fleet, sims = await start_demo_fleet(children, args)
    router, url, _ = await start_demo_router(children, sims, "prefix")
    hello = '[{"role": "user", "content": "Hello!"}]'
    say(f"""
Router (PREFIX_AWARE) at {url}  (pids: fleet {fleet.pid}, router {router.pid})

  curl -sN -D- {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{MODEL}", "stream": true, "max_tokens": 16, "messages": {hello}}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  stream = client.chat.completions.create(model="{MODEL}", messages={hello}, stream=True)
  for chunk in stream:
      print(chunk.choices[0].delta.content or "" if chunk.choices else "", end="")

The x-sim-instance response header names the instance that answered. Ctrl-C stops all.
""")
    waits: list[asyncio.Future[object]] = [asyncio.ensure_future(stop.wait())]
    waits += [asyncio.ensure_future(c.proc.wait()) for c in children]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in waits:
            future.cancel()
    for child in children:
        if child.proc.returncode is not None:
            raise DemoError(f"{child.name} exited on its own: {child.explain()}")
    say("stopping")
    await stop_checked(router)  # first: it drains into live instances
    await stop_checked(fleet)
    say("stopped")


async def main_async(args: argparse.Namespace) -> int:
    main_task = asyncio.current_task()
    assert main_task is not None
    stop = asyncio.Event()
    children: list[Child] = []

    def on_signal() -> None:
        # Idempotent: a terminal's Ctrl-C reaches us both directly and via the CLI.
        if not stop.is_set():
            stop.set()
            if not args.serve:
                main_task.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, on_signal)
    try:
        await (serve(args, children, stop) if args.serve else compare(args, children))
        return 0
    except asyncio.CancelledError:
        if not stop.is_set():
            raise
        say("interrupted")
        return 130
    finally:
        left = [c for c in reversed(children) if c.proc.returncode is None]
        if left:
            say("stopping " + ", ".join(f"{c.name} (pid {c.pid})" for c in left))
        for child in left:  # the router first: it drains into live instances
            await child.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.demo",
        description="Compare RANDOM and PREFIX_AWARE routing on a simulated vLLM fleet.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--serve", action="store_true", help="keep a PREFIX_AWARE router up instead")
    p.add_argument("--requests", type=int, default=160, help="requests per strategy")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--seed", type=int, default=7, help="workload seed")
    p.add_argument("--time-scale", type=float, help="real s per model s (0.25; --serve: 1.0)")
    p.add_argument("--capacity-blocks", type=int, default=512, help="KV blocks per instance")
    args = p.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        p.error("--requests and --concurrency must be >= 1")
    if args.time_scale is None:
        args.time_scale = 1.0 if args.serve else 0.25
    if not 0 < args.time_scale <= 100:
        p.error("--time-scale must be in (0, 100]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except DemoError as exc:
        print(f"demo: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
