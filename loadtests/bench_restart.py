"""Restarting the router under load: stop-then-start against a handover.

    python -m loadtests.bench_restart [--rounds 3] [--clients 8] [--workers 1]

Contract:
- One simulated fleet (3 instances) and, per round and method, a router on one
  fixed port with clients sending streamed completions all along: half on a
  fresh connection each (``Connection: close``), half on keep-alive
  connections (aiohttp's pool).  A client waits ``BACKOFF_S`` after a failure,
  as a client with retries would, so the failure count is not the speed of a
  loop on ECONNREFUSED.
- Methods: ``restart`` is what ``systemctl restart`` does: SIGTERM, wait for
  the drain and the exit, start the new process.  ``handover`` starts the new
  process with the old one's ``--handover-socket`` (``router.handover``) and
  waits for the old one to exit.
- Each request asks about one of ``DOCUMENTS`` (a system prompt of ~1,200
  tokens) in turn.  Per round it prints the requests that succeeded and
  failed (by client kind and cause), the longest time no request succeeded,
  and the fleet's prefix-cache hit rate (the instances' counters) before and
  after the restart; at the end the medians over the rounds.  Bounded:
  ``--seconds`` of load around each restart, every step under a deadline;
  only processes it started are stopped, by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from .fleet import Child, counters, hit_rate, start_router, start_sims, stop_checked
from .supervisor import free_port

__all__ = ["main"]

MODEL = "sim-llama-3.1-70b"
# The documents the clients ask about (~1,200 tokens each, more than PrefixLength's
# 4,096 bytes): a prefix-aware router keeps each on one instance, whose prefix cache
# then serves it; the hit rate before and after a restart says whether it still does.
DOCUMENTS = [
    f"Document {d}. " + " ".join(f"section {d}.{w} says w{w * 7919 % 10007}." for w in range(200))
    for d in range(8)
]
BACKOFF_S = 0.05
EXIT_WAIT_S = 60.0


@dataclass
class Tally:
    ok: Counter[str] = field(default_factory=Counter)  # client kind -> successes
    failed: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, cause)
    done: list[float] = field(default_factory=list)  # when each success ended

    def longest_gap(self, start: float, end: float) -> float:
        times = [start, *sorted(t for t in self.done if start <= t <= end), end]
        return max(b - a for a, b in itertools.pairwise(times))


async def client(url: str, kind: str, stop: asyncio.Event, tally: Tally, i: int) -> None:
    connector = aiohttp.TCPConnector(force_close=kind == "fresh")
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        n = 0
        while not stop.is_set():
            n += 1
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": DOCUMENTS[(i + n) % len(DOCUMENTS)]},
                    {"role": "user", "content": f"{kind} client {i}, question {n}"},
                ],
                "max_tokens": 16,
                "stream": True,
            }
            try:
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    payload = await resp.read()
                if resp.status != 200:
                    cause = f"HTTP {resp.status}"
                elif not payload.rstrip().endswith(b"data: [DONE]"):
                    cause = "stream cut short"
                else:
                    tally.ok[kind] += 1
                    tally.done.append(time.monotonic())
                    continue
            except aiohttp.ClientConnectorError:
                cause = "refused"
            except (aiohttp.ClientError, TimeoutError) as exc:
                cause = type(exc).__name__
            tally.failed[(kind, cause)] += 1
            await asyncio.sleep(BACKOFF_S)  # a client's retry backoff, not synchronisation


async def one_round(
    method: str, sims: dict[str, str], args: argparse.Namespace, workdir: Path
) -> dict[str, object]:
    port = free_port()
    flags = ["--access-log", "off", "--workers", str(args.workers)]
    socket_path = str(workdir / f"{method}-{port}.sock")
    if method == "handover":
        flags += ["--handover-socket", socket_path]
    children: list[Child] = []
    old, url, _ = await start_router(children, sims, "--listen", f"127.0.0.1:{port}", *flags)
    url = f"http://127.0.0.1:{port}"
    stop = asyncio.Event()
    tally = Tally()
    clients = [
        asyncio.create_task(client(url, kind, stop, tally, i))
        for i in range(args.clients)
        for kind in ("fresh", "keep-alive")
    ]
    try:
        start_counts = await counters(sims)
        await asyncio.sleep(args.seconds)  # load before the restart (a bounded run)
        before_counts = await counters(sims)
        began = time.monotonic()
        if method == "restart":
            await stop_checked(old)  # SIGTERM, the drain, the exit
            new, _, _ = await start_router(children, sims, "--listen", f"127.0.0.1:{port}", *flags)
        else:
            new, _, _ = await start_router(children, sims, "--listen", f"127.0.0.1:{port}", *flags)
            async with asyncio.timeout(EXIT_WAIT_S):
                await old.proc.wait()
        serving = time.monotonic() - began
        await asyncio.sleep(args.seconds)  # load after it
        ended = time.monotonic()
        stop.set()
        await asyncio.gather(*clients)
        after_counts = await counters(sims)
        await stop_checked(new)
    finally:
        stop.set()
        for child in children:
            await child.stop()
    return {
        "method": method,
        "ok": sum(tally.ok.values()),
        "failed": dict(tally.failed),
        "failed_total": sum(tally.failed.values()),
        "longest_gap_s": tally.longest_gap(began, ended),
        "old_exit": old.returncode,
        "new_up_s": serving,
        "hit_before": hit_rate(before_counts, start_counts),
        "hit_after": hit_rate(after_counts, before_counts),
    }


def show(result: dict[str, object]) -> None:
    failed = result["failed"]
    assert isinstance(failed, dict)
    causes = ", ".join(f"{kind} {cause}: {n}" for (kind, cause), n in sorted(failed.items()))
    print(
        f"{result['method']:9} ok {result['ok']:5}  failed {result['failed_total']:4}"
        f"  longest gap {result['longest_gap_s']:.2f} s  hit rate {result['hit_before']:.1%}"
        f" -> {result['hit_after']:.1%}  ({causes or 'none'})",
        flush=True,
    )


async def main_async(args: argparse.Namespace) -> int:
    children: list[Child] = []
    try:
        _, sims = await start_sims(children, 3, "--time-scale", str(args.time_scale))
        results: list[dict[str, object]] = []
        with tempfile.TemporaryDirectory(prefix="bench-restart-") as workdir:
            for _ in range(args.rounds):
                for method in ("restart", "handover"):
                    result = await one_round(method, sims, args, Path(workdir))
                    show(result)
                    results.append(result)
    finally:
        for child in children:
            await child.stop()
    print(
        f"\nmedians over {args.rounds} rounds, {args.clients} fresh-connection and"
        f" {args.clients} keep-alive clients, --workers {args.workers}:"
    )
    for method in ("restart", "handover"):
        mine = [r for r in results if r["method"] == method]
        failed = statistics.median(float(r["failed_total"]) for r in mine)  # type: ignore[arg-type]
        gap = statistics.median(float(r["longest_gap_s"]) for r in mine)  # type: ignore[arg-type]
        ok = statistics.median(float(r["ok"]) for r in mine)  # type: ignore[arg-type]
        before = statistics.median(float(r["hit_before"]) for r in mine)  # type: ignore[arg-type]
        after = statistics.median(float(r["hit_after"]) for r in mine)  # type: ignore[arg-type]
        print(
            f"  {method:9} ok {ok:6.0f}  failed {failed:5.0f}  longest gap {gap:.2f} s"
            f"  hit rate before {before:.1%}, after {after:.1%}"
        )
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_restart",
        description="restart the router under load: stop-then-start against a handover",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8, help="of each kind")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=2.0, help="load before and after")
    parser.add_argument(
        "--time-scale", type=float, default=0.05, help="the simulated instances' (smaller: faster)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import uvloop

    return uvloop.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
