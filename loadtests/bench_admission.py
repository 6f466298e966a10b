"""``python -m loadtests.bench_admission``: fair admission at saturation, live.

    python -m loadtests.bench_admission --instances 4 --light-share 0.1 --duration 30 \
        --repeat 3 --reserve 0,1,2

Contract:
- Per run, a fresh simulated fleet (``loadtests.simserver``, every prompt
  unique so every request pays a full prefill: the fleet's capacity is
  ``instances / prefill`` requests a second; fresh because an engine keeps
  the prefill time of requests a client gave up on) and a fresh
  ``prefix-router serve`` (PREFIX_AWARE, ``--concurrency-threshold``, the
  default ConcurrencyScope PREFILL, ``--workers``) in front of it.  Two
  tenants send streaming chat requests, open loop (Poisson arrivals,
  seeded), each from a client process of its own (``aiohttp``; both start
  at one instant), so light's client-side TTFT does not carry the time a
  shared event loop would spend on heavy's requests: ``light`` at
  ``--light-share`` of the fleet's capacity, ``heavy`` at
  ``--heavy-factor`` times that (10x: together above what the fleet can
  take).  Keys: ``prompt_cache_key`` = the tenant.
- Runs, back to back in each pass (``--repeat`` passes, the order reversed
  on every other pass):
  ``alone``             light alone, queue on;
  ``both, queue``       light and heavy, ``--queue`` (``[admission]`` below);
  ``both, reserve N``   the same with ``reserve = N``, for each N > 0 of
                        ``--reserve`` (0 in it: the ``both, queue`` run);
  ``both, off``         light and heavy, queue off: the least-loaded fallback.
- Figures per run: light's TTFT P50/P90 (nearest rank, client side: request
  sent to first body byte, every 200 of the measured window), heavy's 200s and
  429s, fleet throughput (200 answers completed per second in the window),
  and every status seen (anything but 200 and 429 is a lost request).  Then,
  per pass and run with heavy, the ratios the issue asks for: light's TTFT
  P90 against alone (must be <= 1.10), fleet throughput against queue off
  (must not drop); the medians over passes, with their range, close the output.
- Every process is started and stopped by PID (``loadtests.supervisor``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp

from router.metrics import percentile

from .fleet import Child, start_router, start_sims, stop_checked
from .supervisor import say

__all__ = ["main"]

SPAWN_S = 5.0  # the clients' processes start (imports) before their common start


def prompt(rng: random.Random, tokens: int) -> str:
    """A unique prompt of about ``tokens`` simulated tokens (4 bytes each)."""
    head = f"{rng.getrandbits(64):016x} "
    return head + "x" * max(0, tokens * 4 - len(head))


async def one(
    http: aiohttp.ClientSession, url: str, tenant: str, text: str, out: list[dict[str, Any]]
) -> None:
    body = {
        "model": "sim-llama-3.1-70b",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "stream": True,
        "prompt_cache_key": tenant,
    }
    start = time.perf_counter()
    record: dict[str, Any] = {"tenant": tenant, "start": start, "status": 0, "ttft": None}
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            record["status"] = resp.status
            first = await resp.content.readany()
            if resp.status == 200 and first:
                record["ttft"] = time.perf_counter() - start
            await resp.read()
    except (TimeoutError, aiohttp.ClientError) as exc:
        record["error"] = type(exc).__name__
    except asyncio.CancelledError:
        record["status"] = -1  # still open when the window closed
        out.append(record)
        raise
    record["end"] = time.perf_counter()
    out.append(record)


async def drive(
    url: str,
    rates: dict[str, float],
    duration: float,
    tokens: int,
    seed: int,
    *,
    first: int = 0,
    start_at: float | None = None,
) -> tuple[list[dict[str, Any]], float, float]:
    """Open-loop Poisson arrivals per tenant for ``duration`` seconds from ``start_at``
    (``time.monotonic``; None: now); (records, t0, t1).  Tenant i of ``rates`` draws
    from ``Random(seed * 1000 + first + i)``."""
    out: list[dict[str, Any]] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        tasks: set[asyncio.Task[None]] = set()
        loop = asyncio.get_running_loop()
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.monotonic()))  # the other tenant's too
        t0 = time.perf_counter()

        async def tenant(name: str, rate: float, rng: random.Random) -> None:
            due = loop.time()
            end = due + duration
            while True:
                due += rng.expovariate(rate)
                if due >= end:
                    return
                delay = due - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(one(http, url, name, prompt(rng, tokens), out))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        await asyncio.gather(
            *(
                tenant(name, rate, random.Random(seed * 1_000 + first + i))
                for i, (name, rate) in enumerate(rates.items())
            )
        )
        t1 = time.perf_counter()
        # Requests still open: their answers come after the window (queue off piles
        # them up in the engines); wait a bounded while, then leave.
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=30)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return out, t0, t1


def drive_alone(
    url: str,
    name: str,
    rate: float,
    index: int,
    duration: float,
    tokens: int,
    seed: int,
    start_at: float,
) -> tuple[list[dict[str, Any]], float, float]:
    """``drive`` for one tenant, in a process of its own (``run_once``)."""
    rates = {name: rate}
    return asyncio.run(drive(url, rates, duration, tokens, seed, first=index, start_at=start_at))


async def drive_apart(
    url: str, rates: dict[str, float], duration: float, tokens: int, seed: int
) -> tuple[list[dict[str, Any]], float, float]:
    """``drive``, each tenant from a process of its own, all starting at one instant:
    light's client-side TTFT does not include the time its event loop spends on
    heavy's requests (a tenant is another client)."""
    loop = asyncio.get_running_loop()
    context = multiprocessing.get_context("spawn")
    start_at = time.monotonic() + SPAWN_S
    with ProcessPoolExecutor(max_workers=len(rates), mp_context=context) as pool:
        done = await asyncio.gather(
            *(
                loop.run_in_executor(
                    pool, drive_alone, url, name, rate, i, duration, tokens, seed, start_at
                )
                for i, (name, rate) in enumerate(rates.items())
            )
        )
    records = [record for part, _, _ in done for record in part]
    return records, min(t0 for _, t0, _ in done), max(t1 for _, _, t1 in done)


def summarize(records: list[dict[str, Any]], t0: float, t1: float) -> dict[str, Any]:
    light = [r["ttft"] for r in records if r["tenant"] == "light" and r["status"] == 200]
    light = [t for t in light if t is not None]
    statuses: dict[str, int] = {}
    for r in records:
        key = str(r["status"]) if "error" not in r else r["error"]
        statuses[key] = statuses.get(key, 0) + 1
    completed = [r for r in records if r["status"] == 200 and r.get("end", t1 + 1) <= t1]
    heavy = [r for r in records if r["tenant"] == "heavy"]
    return {
        "light_n": len(light),
        "light_p50": percentile(light, 0.5),
        "light_p90": percentile(light, 0.9),
        "heavy_200": sum(1 for r in heavy if r["status"] == 200),
        "heavy_429": sum(1 for r in heavy if r["status"] == 429),
        "throughput": len(completed) / (t1 - t0),
        "statuses": statuses,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def run_names(reserves: list[int]) -> list[str]:
    """A pass's runs: light alone, then with heavy per reserve (0: the plain queue), then off."""
    return ["alone", *(f"both, reserve {r}" if r else "both, queue" for r in reserves), "both, off"]


def reserve_of(name: str) -> int:
    return int(name.rsplit(" ", 1)[1]) if name.startswith("both, reserve") else 0


async def run_once(args: argparse.Namespace, name: str, seed: int, folder: Path) -> dict[str, Any]:
    """One run on a fresh fleet: an engine keeps the prefill time of the requests a
    client gave up on (``loadtests.simserver``), so a run after "both, off" would
    start behind its backlog."""
    children: list[Child] = []
    scale = ["--time-scale", str(args.time_scale), "--max-num-seqs", "256"]
    config = folder / f"router-{reserve_of(name)}.toml"
    config.write_text(
        "[admission]\n"
        f"max_queued_per_tenant = {args.max_queued_per_tenant}\n"
        f"max_wait = {args.max_wait}\n"
        f"reserve = {reserve_of(name)}\n"
        f"share_window = {args.share_window}\n"
    )
    flags = ["--strategy", "prefix", "--concurrency-threshold", str(args.threshold)]
    flags += ["--access-log", "off", "--no-health-checks", "--config", str(config)]
    if name != "both, off":
        flags.append("--queue")
    if args.workers > 1:
        flags += ["--workers", str(args.workers)]
    try:
        _, sims = await start_sims(children, args.instances, *scale)
        _, url, _ = await start_router(children, sims, *flags, label=f"router ({name})")
        rates = {"light": args.light_rate}
        if name != "alone":
            rates["heavy"] = args.light_rate * args.heavy_factor
        records, t0, t1 = await drive_apart(url, rates, args.duration, args.prompt_tokens, seed)
    finally:
        for child in reversed(children):  # the router first
            await stop_checked(child)
    return summarize(records, t0, t1)


async def main_async(args: argparse.Namespace) -> int:
    prefill = 0.020 + args.prompt_tokens / 10_000  # simserver's defaults, model seconds
    capacity = args.instances / (prefill * args.time_scale)
    if args.light_rate is None:
        args.light_rate = args.light_share * capacity
    say(
        f"fleet: {args.instances} instances, prefill {prefill * args.time_scale * 1000:.0f} ms"
        f" real, capacity ~{capacity:.1f} req/s; light {args.light_rate:.1f} req/s,"
        f" heavy {args.light_rate * args.heavy_factor:.1f} req/s"
    )
    runs = run_names(args.reserve)
    with tempfile.TemporaryDirectory() as folder:
        results: list[dict[str, Any]] = []
        for p in range(args.repeat):
            order = runs if p % 2 == 0 else runs[::-1]
            row: dict[str, Any] = {"pass": p + 1}
            for name in order:
                row[name] = await run_once(args, name, args.seed + p, Path(folder))
                say(f"pass {p + 1} {name}: {json.dumps(row[name])}")
            results.append(row)
    print_table(results, runs)
    if args.out:
        write_json(Path(args.out), {"args": vars(args), "results": results})
    return 0


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1))


def print_table(results: list[dict[str, Any]], runs: list[str]) -> None:
    print(
        "| pass | run | light TTFT P50 | light TTFT P90 | light n | heavy 200 / 429"
        " | fleet 200/s | statuses |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for row in results:
        for name in runs:
            r = row[name]
            heavy = "-" if name == "alone" else f"{r['heavy_200']} / {r['heavy_429']}"
            print(
                f"| {row['pass']} | {name} | {_ms(r['light_p50'])} | {_ms(r['light_p90'])}"
                f" | {r['light_n']} | {heavy} | {r['throughput']:.1f} | {r['statuses']} |"
            )
    print()
    print("Per pass: light's P90 with heavy / light's P90 alone; fleet throughput / queue off.")
    ratios: dict[str, tuple[list[float], list[float]]] = {}
    for row in results:
        alone, off = row["alone"], row["both, off"]
        cells = []
        for name in runs[1:]:
            r = row[name]
            p90 = (
                r["light_p90"] / alone["light_p90"]
                if r["light_p90"] and alone["light_p90"]
                else None
            )
            tp = r["throughput"] / off["throughput"] if off["throughput"] else None
            p90s, tps = ratios.setdefault(name, ([], []))
            if p90 is not None:
                p90s.append(p90)
            if tp is not None:
                tps.append(tp)
            cells.append(f"{name}: P90 x{_f(p90)}, throughput x{_f(tp)}")
        print(f"pass {row['pass']}: " + "; ".join(cells))
    for name, (p90s, tps) in ratios.items():
        if p90s and tps:
            print(
                f"median over {len(p90s)} passes, {name}: light P90 ratio "
                f"{statistics.median(p90s):.3f} ({min(p90s):.3f}-{max(p90s):.3f}; target <= 1.10),"
                f" throughput ratio {statistics.median(tps):.3f}"
                f" ({min(tps):.3f}-{max(tps):.3f}; target >= 1.00)"
            )


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_admission")
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=0.25)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--threshold", type=int, default=1, help="ConcurrencyThreshold (1)")
    parser.add_argument(
        "--light-share", type=float, default=0.3, help="light's rate, share of capacity (0.3)"
    )
    parser.add_argument("--light-rate", type=float, default=None, help="req/s; overrides share")
    parser.add_argument("--heavy-factor", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per run")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-queued-per-tenant", type=int, default=32)
    parser.add_argument("--max-wait", type=float, default=10.0)
    parser.add_argument(
        "--reserve",
        type=lambda text: [int(x) for x in text.split(",")],
        default=[0, 2],
        help="[admission] reserve per run with heavy, comma-separated (0,2); 0: the plain queue",
    )
    parser.add_argument("--share-window", type=float, default=10.0, help="[admission] share_window")
    parser.add_argument("--out", help="write the results as JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
