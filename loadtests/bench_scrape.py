"""``python -m loadtests.bench_scrape``: how long a /metrics scrape holds the router's loop.

    python -m loadtests.bench_scrape [--backends 1000 4000] [--repeats 7] [--no-traffic]

For each fleet size: the real ``Router`` (health checks off) with that many
backends, each of which has served requests (so each has its TTFT and duration
histograms: the largest /metrics of that fleet; ``--no-traffic``: none has,
9 lines a backend), and the admin API on
127.0.0.1, in this process's loop.  A ticker in the same loop sleeps 1 ms at a
time and keeps the longest gap between two ticks: the loop stall.  Each repeat
starts a scraper process (another interpreter, so it takes no GIL from the
loop) that makes one ``GET /metrics``; the stall is the longest gap from its
start to its exit.  A baseline repeat runs a scraper that fetches ``/healthz``
instead (the process and the connection, not the metrics).  A last row
times ``GET /admin/stats`` (each backend's window holds 512 TTFTs, which its
P50/P90 sort; none with ``--no-traffic``).  Printed: the
median and the worst over ``--repeats`` of each, the size of the text and how
long the scrape took as the client saw it.  Every wait has a timeout; only
processes this script started are stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from collections import deque

from aiohttp import web

from admin.app import make_app
from router.app import Router
from router.config import build_config
from router.control.live import RouterControl
from router.metrics import DURATION_BUCKETS, TTFT_BUCKETS, WINDOW, Histogram

__all__ = ["main"]


SCRAPER = """
import http.client, sys, time
port, path = int(sys.argv[1]), sys.argv[2]
c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
t = time.perf_counter()
c.request("GET", path)
r = c.getresponse()
body = r.read()
assert r.status == 200, r.status
print(len(body), time.perf_counter() - t)
"""


class Ticker:
    """A 1 ms sleep in a loop; ``worst`` is the longest gap between two ticks."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.worst = max(self.worst, now - last)
            last = now

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def scrape(port: int, path: str, ticker: Ticker) -> tuple[float, int, float]:
    """(the worst loop gap during one scrape in ms, the body's bytes, the client's ms)."""
    ticker.worst = 0.0
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SCRAPER, str(port), path, stdout=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(300):
        out, _ = await process.communicate()
    assert process.returncode == 0, process.returncode
    size, took = out.split()
    return ticker.worst * 1000, int(size), float(took) * 1000


def fill(router: Router) -> None:
    """Every backend served requests: its samples in every per-backend family."""
    recorder = router.recorder
    ttfts = [0.02 + i / 10_000 for i in range(WINDOW)]
    for name in router.fleet.backends:
        recorder.windows[name] = deque(ttfts, maxlen=WINDOW)  # /admin/stats sorts it
        recorder.requests[name, "chat", "primary", 200] += 5
        ttft = recorder.ttft[name] = Histogram(TTFT_BUCKETS)
        duration = recorder.duration[name] = Histogram(DURATION_BUCKETS)
        ttft.observe(0.05)
        duration.observe(0.5)


async def run(backends: int, repeats: int, traffic: bool = True) -> None:
    specs = [{"name": f"b{i}", "url": f"http://127.0.0.1:{20000 + i}"} for i in range(backends)]
    config = {
        "listen": "127.0.0.1:0",
        "access_log": "off",
        "health": {"active": False},
        "backends": specs,
    }
    router = Router(build_config(config))
    await router.start()
    if traffic:
        fill(router)
    control = RouterControl(router)
    app = make_app(control, token=None)

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    ticker = Ticker()
    ticker.start()
    try:
        base = [await scrape(port, "/healthz", ticker) for _ in range(repeats)]
        runs = [await scrape(port, "/metrics", ticker) for _ in range(repeats)]
        stats = [await scrape(port, "/admin/stats", ticker) for _ in range(repeats)]
    finally:
        await ticker.stop()
        await runner.cleanup()
        await control.close()
        await router.shutdown(grace=0)
    stalls, sizes, took = zip(*runs, strict=True)
    baseline = [stall for stall, _, _ in base]
    print(
        f"{backends:>5} backends  /metrics {sizes[0] / 1e6:5.1f} MB:"
        f" loop stall median {statistics.median(stalls):6.1f} ms, worst {max(stalls):6.1f} ms"
        f" (baseline /healthz median {statistics.median(baseline):4.1f} ms,"
        f" worst {max(baseline):4.1f} ms); scrape took median"
        f" {statistics.median(took):6.0f} ms  [{repeats} repeats]",
        flush=True,
    )
    stats_stalls = [stall for stall, _, _ in stats]
    print(
        f"{'':>5}           /admin/stats {stats[0][1] / 1e6:4.1f} MB: loop stall median"
        f" {statistics.median(stats_stalls):6.1f} ms, worst {max(stats_stalls):6.1f} ms",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench_scrape")
    parser.add_argument("--backends", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-traffic", action="store_true", help="no backend has served")
    args = parser.parse_args(argv)
    for backends in args.backends:
        asyncio.run(run(backends, args.repeats, not args.no_traffic))
    return 0


if __name__ == "__main__":
    sys.exit(main())
