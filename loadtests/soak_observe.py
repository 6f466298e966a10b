"""The soak's view of the router (``loadtests.soak``): fds, RSS, stats, flatness.

Contract:
- Read only, from outside: ``/proc/PID/fd`` and ``/proc/PID/status`` of the
  router's processes (``observed``: itself, or with ``--workers`` the
  supervisor and its workers), its ``/admin/stats`` and ``/metrics``; a
  process gone meanwhile (a worker restarting) counts nothing.
- ``sampler`` appends a ``Sample`` every ``every`` s until ``stop`` is set.
- ``flatness``: the median fds (less this process's own sockets) and RSS of
  the last window against the first after warm-up (``windows``), within
  ``FD_SLACK`` and ``RSS_SLACK`` + ``RSS_FLOOR_MIB``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:  # soak_load imports this module (windows)
    from .soak_load import Tally

FD_SLACK = 16  # descriptors: pooled and client connections come and go with the load
RSS_SLACK = 0.10  # relative growth allowed between the first and the last window
RSS_FLOOR_MIB = 8.0  # plus this much: allocator noise on a small heap


def observed(pid: int, workers: int) -> list[int]:
    """The router's processes: itself, or with ``--workers`` the supervisor and its
    workers (its children; a key worker of theirs, started by a large body, is not
    counted, so that its arrival is not read as growth)."""
    if workers <= 1:
        return [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *map(int, children)]


def fd_count(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):  # a worker restarting
            total += len(os.listdir(f"/proc/{pid}/fd"))
    return total


def own_sockets() -> int:
    """Sockets this process holds: the generator's keep-alive connections (they grow
    after a stall and age out) and the sampler's; the router holds one fd for each."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def rss_mib(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(FileNotFoundError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


async def admin_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with asyncio.timeout(10), http.get(url) as resp:
        resp.raise_for_status()
        return await resp.json()


async def metrics(http: aiohttp.ClientSession, admin: str) -> dict[str, Any]:
    async with asyncio.timeout(10), http.get(admin + "/metrics") as resp:
        text = await resp.text()
    return {f.name: f for f in text_string_to_metric_families(text)}


@dataclass
class Sample:
    t: float
    fds: int
    rss_mib: float
    router_in_flight: int
    client_in_flight: int
    sent: int
    own_sockets: int  # this process's: the checked traffic's connections, the sampler's


async def sampler(
    pid: int,
    workers: int,
    admin: str,
    every: float,
    tally: Tally,
    stop: asyncio.Event,
    out: list[Sample],
    start: float,
) -> None:
    """Samples every ``every`` s, timed from ``start`` (the loop's clock)."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            stats = await admin_json(http, admin + "/admin/stats")
            pids = observed(pid, workers)
            out.append(
                Sample(
                    round(loop.time() - start, 1),
                    fd_count(pids),
                    round(rss_mib(pids), 2),
                    stats["totals"]["in_flight"],
                    tally.in_flight,
                    tally.sent,
                    own_sockets(),
                )
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every):
                    await stop.wait()  # the sampling period


def windows(seconds: float) -> tuple[float, float]:
    """(warm-up, window length): a minute each on a 10-minute run, scaled down below."""
    warm = min(60.0, seconds * 0.1)
    return warm, min(60.0, seconds * 0.2)


def flatness(
    samples: list[Sample],
    seconds: float,
    base: tuple[float, float] | None = None,
    quiet_from: float = 0.0,
) -> dict[str, Any]:
    """The last window against the first after warm-up, or against ``base``; the last
    window starts at ``quiet_from`` if that is later (the attackers' end)."""
    warm, span = windows(seconds)
    base = base or (warm, warm + span)
    end = max(seconds - span, quiet_from)
    first = [s for s in samples if base[0] <= s.t < base[1]]
    last = [s for s in samples if s.t >= end]
    if not first or not last:
        return {"ok": False, "why": "too few samples for the windows (attackers too late?)"}
    fd0, fd1 = statistics.median(s.fds for s in first), statistics.median(s.fds for s in last)
    # Less the checked client's own connections: what the router holds for nobody else.
    net0 = statistics.median(s.fds - s.own_sockets for s in first)
    net1 = statistics.median(s.fds - s.own_sockets for s in last)
    rss0 = statistics.median(s.rss_mib for s in first)
    rss1 = statistics.median(s.rss_mib for s in last)
    fd_ok = net1 <= net0 + FD_SLACK
    rss_ok = rss1 <= rss0 * (1 + RSS_SLACK) + RSS_FLOOR_MIB
    return {
        "ok": fd_ok and rss_ok,
        "windows_s": [[round(base[0], 1), round(base[1], 1)], [round(end, 1), seconds]],
        "fds_median": [fd0, fd1],
        "fds_less_own_sockets_median": [net0, net1],
        "fds_max": max(s.fds for s in samples),
        "rss_mib_median": [rss0, rss1],
        "rss_mib_max": max(s.rss_mib for s in samples),
        "tolerance": f"fds +{FD_SLACK} (less the checked client's sockets),"
        f" RSS +{RSS_SLACK:.0%} + {RSS_FLOOR_MIB:g} MiB",
    }
