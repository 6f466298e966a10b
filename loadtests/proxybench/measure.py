"""One round of one target: throughput runs, latency probes, held streams.

Contract: figures are taken over exactly the measured run (CPU of the proxy's
tree and of the client side, /proc/stat for the rest, peak RSS sampled every
0.5 s, requests per backend from their /_stats); a workload that fails gives
a row with ``error``, one that is mostly errors a row marked ``invalid``.
``combine`` makes one row of the rounds: medians, sums of counts, peak RSS.
"""

from __future__ import annotations

import asyncio
import statistics
from time import perf_counter
from typing import Any

from ..supervisor import ChildError, say
from .client import GenStats, closed_loop, fetch_json, open_streams, paced
from .procfs import RssPeak, self_cpu, system_busy, tree_cpu, tree_rss
from .targets import Ctx, Running, Target
from .workloads import path_of, raw_request
from .wrk import run_wrk


async def backend_counts(ctx: Ctx) -> list[int]:
    counts = []
    for url in ctx.backends:
        stats = await fetch_json(url, "/_stats")
        counts.append(int(stats["requests"]) if stats else 0)
    return counts


def _raw(ctx: Ctx, url: str, requests: str) -> list[bytes]:
    host = url.removeprefix("http://")
    path = path_of(requests[0])
    return [raw_request(host, path, s, b) for s, b in ctx.requests[requests]]


async def generate(ctx: Ctx, url: str, workload: str, seconds: float) -> GenStats:
    if ctx.use_wrk:
        return await run_wrk(url, ctx.scripts[workload], seconds, ctx.opt.connections, ctx.gen_cpus)
    return await closed_loop(url, _raw(ctx, url, workload), seconds, ctx.opt.connections)


def _cpu_snapshot(ctx: Ctx, pid: int | None) -> tuple[float, ...]:
    me, kids = self_cpu()
    proxy = tree_cpu(pid) if pid else 0.0
    return perf_counter(), proxy, tree_cpu(ctx.backend_pid), me, kids, *system_busy()


async def measure_load(ctx: Ctx, running: Running, workload: str, probes: bool) -> dict[str, Any]:
    """Throughput run (closed loop), then if ``probes`` the workload's paced probes."""
    opt = ctx.opt
    if opt.warmup > 0:
        await generate(ctx, running.url, workload, opt.warmup)
    split_before = await backend_counts(ctx)
    before = _cpu_snapshot(ctx, running.pid)
    peak = RssPeak(running.pid)
    stats = await generate(ctx, running.url, workload, opt.seconds)
    after = _cpu_snapshot(ctx, running.pid)
    rss = await peak.stop()
    split = [b - a for a, b in zip(split_before, await backend_counts(ctx), strict=True)]
    wall = after[0] - before[0]
    proxy_cpu = after[1] - before[1]
    client_cpu = sum(after[i] - before[i] for i in (2, 3, 4))
    others = after[5] - before[5] - proxy_cpu - client_cpu  # processes not in this run
    softirq = after[6] - before[6]
    n = stats.requests
    body = len(ctx.requests[workload][0][1])
    row: dict[str, Any] = {
        "generator": stats.generator,
        "seconds": round(stats.seconds, 3),
        "requests": n,
        "rps": round(n / stats.seconds, 1) if stats.seconds else 0.0,
        "p50_ms": stats.p50_ms,
        "p99_ms": stats.p99_ms,
        "errors": stats.errors,
        "bad_status": stats.bad_status,
        "bytes_per_response": round(stats.bytes / n) if n else 0,
        "request_mb_s": round(n * body / stats.seconds / 1e6, 1) if stats.seconds else 0.0,
        "cpu_us": round(proxy_cpu / n * 1e6, 1) if running.pid and n else None,
        "proxy_core_pct": round(proxy_cpu / wall * 100) if running.pid else None,
        "client_core_pct": round(client_cpu / wall * 100),
        "others_core_pct": max(0, round(others / wall * 100)),
        "softirq_core_pct": round(softirq / wall * 100),
        "rss_mib": round(rss / 2**20, 1) if running.pid else None,
        "split": split,
    }
    if n == 0 or stats.bad_status + stats.errors > n / 10:
        # Not a proxy of this workload (sglang-router has no /invocations, say): its
        # figures describe error answers, so no ratio may use them.
        row["invalid"] = f"{stats.bad_status} non-2xx answers, {stats.errors} errors in {n}"
        return row
    row["probes"] = []
    if opt.probe_seconds <= 0 or not probes:
        return row
    if workload == "b" and opt.ttfb_connections > 0:
        # Back to back on a few keep-alive connections: the case where a proxy that
        # holds small segments (Nagle) meets the client's delayed ACK.
        raw = _raw(ctx, running.url, "b-probe")
        probe = await closed_loop(running.url, raw, opt.probe_seconds, opt.ttfb_connections)
        achieved = round(probe.requests / probe.seconds) if probe.seconds else 0
        row["probes"].append(_probe(probe, achieved, opt.ttfb_connections))
    for rate in sorted({r for r in (opt.probe_rate, ctx.probe_rate) if r and workload == "a"}):
        if running.pid and row["rps"] < rate * 1.25:
            # Past ~80 % of what the closed loop got, an open loop measures a queue.
            row["probes"].append({"rate": rate, "over_capacity": True})
            continue
        probe = await paced(running.url, _raw(ctx, running.url, "a"), rate, opt.probe_seconds, 32)
        row["probes"].append(_probe(probe, rate))
    return row


def _probe(probe: GenStats, rate: float, connections: int | None = None) -> dict[str, Any]:
    return {
        "rate": rate,
        "connections": connections,  # None: paced (open loop); else closed loop on these
        "requests": probe.requests,
        "errors": probe.errors + probe.bad_status,
        "p50_ms": probe.p50_ms,
        "p99_ms": probe.p99_ms,
        "ttfb_p50_ms": probe.ttfb_p50_ms,
        "ttfb_p99_ms": probe.ttfb_p99_ms,
    }


def _median_rss(pid: int) -> float:
    return statistics.median(tree_rss(pid) for _ in range(3))


async def measure_streams(ctx: Ctx, running: Running) -> dict[str, Any]:
    """Open ``--streams`` slow SSE streams at once; memory per stream from the proxy's RSS."""
    count = ctx.opt.streams
    request = _raw(ctx, running.url, "d")[0]
    idle = _median_rss(running.pid) if running.pid else 0.0
    cpu0 = tree_cpu(running.pid) if running.pid else 0.0
    started = perf_counter()
    conns, ok, failed = await open_streams(running.url, request, count, within=60.0)
    setup = perf_counter() - started
    try:
        await asyncio.sleep(1.0)
        samples = []
        for _ in range(3 if running.pid else 0):
            samples.append(tree_rss(running.pid))  # type: ignore[arg-type]
            await asyncio.sleep(0.3)
        held = statistics.median(samples) if samples else 0.0
        cpu1 = tree_cpu(running.pid) if running.pid else 0.0
    finally:
        for conn in conns:
            conn.close()
    await asyncio.sleep(1.0)  # let the proxy close its upstream side before the next target
    row: dict[str, Any] = {
        "streams": count,
        "established": ok,
        "failed": failed,
        "setup_s": round(setup, 2),
    }
    if running.pid:
        row.update(
            rss_idle_mib=round(idle / 2**20, 1),
            rss_streams_mib=round(held / 2**20, 1),
            kib_per_stream=round((held - idle) / ok / 1024, 1) if ok else None,
            setup_cpu_us_per_stream=round((cpu1 - cpu0) / ok * 1e6, 1) if ok else None,
        )
    return row


async def measure_target(
    ctx: Ctx, target: Target, running: Running, last: bool
) -> dict[str, dict[str, Any]]:
    """One round of one target: each throughput run; the probes and (d) in the last round."""
    rows: dict[str, Any] = {}
    for workload in ctx.opt.workloads:
        if workload == "d" and not last:
            continue
        say(f"  {target.label}: workload {workload} ...")
        try:
            if workload == "d":
                rows[workload] = await measure_streams(ctx, running)
            else:
                rows[workload] = await measure_load(ctx, running, workload, probes=last)
        except (ChildError, OSError, TimeoutError) as exc:
            rows[workload] = {"error": f"{type(exc).__name__}: {exc}"}
        say(f"    {_brief(rows[workload])}")
        await asyncio.sleep(ctx.opt.pause)
    return rows


_MEDIANS = ("rps", "request_mb_s", "p50_ms", "p99_ms", "cpu_us", "proxy_core_pct",
            "client_core_pct", "others_core_pct", "softirq_core_pct", "bytes_per_response",
            "seconds")  # fmt: skip


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the rounds of a throughput run: medians, sums of counts, peak RSS."""
    ok = [r for r in rounds if "error" not in r and "requests" in r]
    if not ok or len(rounds) == 1:
        return rounds[-1]  # an error, a (d) run, or a single round: nothing to combine
    row = dict(ok[-1])  # probes (last round only) and anything not combined
    for key in _MEDIANS:
        values = [r[key] for r in ok if r.get(key) is not None]
        row[key] = round(statistics.median(values), 3) if values else None
    for key in ("requests", "errors", "bad_status"):
        row[key] = sum(r[key] for r in ok)
    row["split"] = [sum(column) for column in zip(*(r["split"] for r in ok), strict=True)]
    rss = [r["rss_mib"] for r in ok if r.get("rss_mib") is not None]
    row["rss_mib"] = max(rss) if rss else None
    cpu = [r["cpu_us"] for r in ok if r.get("cpu_us") is not None]
    row["cpu_us_range"] = [min(cpu), max(cpu)] if cpu else None
    row["rounds"] = len(ok)
    row["per_round"] = [{k: r.get(k) for k in ("rps", "cpu_us", "others_core_pct")} for r in ok]
    invalid = [r["invalid"] for r in ok if "invalid" in r]
    if invalid:
        row["invalid"] = invalid[0]
    return row


def combined(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """``combine``, but a long run never loses its figures to a bug in it."""
    try:
        return combine(rounds)
    except Exception as exc:  # keep the raw rounds in the JSON
        return {"error": f"could not combine the rounds: {exc!r}", "rounds_raw": rounds}


def _brief(row: dict[str, Any]) -> str:
    keys = ("rps", "cpu_us", "p50_ms", "p99_ms", "errors", "bad_status", "established",
            "kib_per_stream", "failed", "error", "invalid")  # fmt: skip
    text = ", ".join(f"{k}={row[k]}" for k in keys if row.get(k) is not None)
    for probe in row.get("probes", ()):
        got = (
            "over capacity"
            if probe.get("over_capacity")
            else (
                f"P50 {probe['p50_ms']} ms, P99 {probe['p99_ms']} ms, "
                f"TTFB P50 {probe['ttfb_p50_ms']} ms, P99 {probe['ttfb_p99_ms']} ms"
            )
        )
        text += f"; probe at {probe['rate']:g}/s: {got}"
    return text
