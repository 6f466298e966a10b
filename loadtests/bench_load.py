"""The live bench's client (``loadtests.bench``): open-loop load and what it measures.

Contract:
- ``drive`` sends every request at its arrival time (``Request.at`` model
  seconds times ``--time-scale``), whatever the ones before it are doing,
  request i to ``urls[plan[i]]`` (``replica_plan``: the draw
  ``loadtests.offline`` makes with ``--replicas R``); at most
  ``MAX_IN_FLIGHT`` at once, each within ``REQUEST_TIMEOUT_S``.
- ``send`` streams one request and times it client-side in model seconds:
  TTFT (request sent -> first SSE data line) and end-to-end latency; the
  instance, prompt and cached tokens from the simulator's headers.
- Beside the load: a progress line on stderr, the instances' windowed hit
  rate (``sample_hit_rate``) and the ``--scale-event`` (``Event``) through
  the admin API; ``lag_note`` says how late the client sent the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass

import aiohttp

from .fleet import FleetError, counters, hit_rate
from .report import Sample, percentile
from .workloads import Request, encode

# An open loop still needs a ceiling: past it we would measure the client, not the fleet.
MAX_IN_FLIGHT = 2048
REQUEST_TIMEOUT_S = 600.0


@dataclass
class Event:
    kind: str  # "add" or "remove"
    at: float  # model seconds

    @classmethod
    def parse(cls, text: str) -> Event:
        kind, _, at = text.partition("@")
        if kind not in ("add", "remove") or not at:
            raise argparse.ArgumentTypeError("--scale-event must look like add@60 or remove@60")
        return cls(kind, float(at))


def replica_plan(seed: int, replicas: int, count: int) -> tuple[list[int], list[int]]:
    """(each replica's router seed, the replica of each request), as ``loadtests.offline``
    draws them: replica 0 is the single router of R = 1, seeded alike; the other seeds and
    the per-request draw (uniform, independent) come from streams of their own."""
    streams = random.Random(f"offline-replicas:{seed}")
    seeds = [seed] + [streams.getrandbits(64) for _ in range(replicas - 1)]
    draw = random.Random(streams.getrandbits(64))
    return seeds, [draw.randrange(replicas) if replicas > 1 else 0 for _ in range(count)]


@dataclass
class Live:
    """What the progress line shows."""

    sent: int = 0
    done: int = 0
    failed: int = 0
    in_flight: int = 0


# ---------------------------------------------------------------- one request


async def send(
    session: aiohttp.ClientSession,
    url: str,
    request: Request,
    form: str,
    scale: float,
    origin: float,
    live: Live,
) -> tuple[Sample, str]:
    """Send one streaming request; the sample in model seconds, and its request id."""
    if form == "native":
        target, body, headers = (
            f"{url}/invocations",
            request.native_body(),
            request.native_headers(),
        )
    else:
        target, body, headers = f"{url}/v1/chat/completions", request.chat_body(), {}
    started = time.perf_counter()
    sample = Sample(at=(started - origin) / scale, instance=None, ok=False, ttft=None,
                    latency=None, group=request.group)  # fmt: skip
    request_id = ""
    live.sent += 1
    live.in_flight += 1
    try:
        # The same bytes as the offline benchmark: native keys are raw bytes.
        headers = {"Content-Type": "application/json", **headers}
        async with session.post(target, data=encode(body), headers=headers) as resp:
            request_id = resp.headers.get("x-request-id", "")
            sample.instance = resp.headers.get("x-sim-instance")
            # The simulator's own count of this request's prompt and cached tokens.
            sample.prompt_tokens = int(resp.headers.get("x-sim-prompt-tokens", 0))
            sample.cached_tokens = int(resp.headers.get("x-sim-cached-tokens", 0))
            tokens = 0
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                if sample.ttft is None:
                    sample.ttft = (time.perf_counter() - started) / scale
                if b'"usage"' in line and b"completion_tokens" in line:
                    usage = json.loads(line[5:]).get("usage") or {}
                    tokens = usage.get("completion_tokens", tokens)
            sample.latency = (time.perf_counter() - started) / scale
            sample.output_tokens = tokens
            sample.ok = resp.status == 200 and sample.ttft is not None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        sample.ok = False
    finally:
        live.in_flight -= 1
        live.done += 1
        live.failed += not sample.ok
    return sample, request_id


# ---------------------------------------------------------------- the load


async def progress(live: Live, label: str, seconds: float, origin: float) -> None:
    """A status line on stderr: rewritten in place on a terminal, every 10 s otherwise."""
    width = 30
    tty = sys.stderr.isatty()
    period = 0.5 if tty else 10.0
    start, end = ("\r", "") if tty else ("", "\n")
    try:
        while True:
            await asyncio.sleep(period)  # a display refresh, not a synchronisation
            elapsed = time.perf_counter() - origin
            filled = min(width, int(width * elapsed / seconds))
            sys.stderr.write(
                f"{start}{label:<28} [{'#' * filled}{'.' * (width - filled)}] "
                f"{elapsed:5.0f}/{seconds:.0f} s  sent {live.sent}  done {live.done}  "
                f"failed {live.failed}  in flight {live.in_flight}   {end}"
            )
            sys.stderr.flush()
    finally:
        if tty:
            sys.stderr.write("\n")


async def sample_hit_rate(
    sims: dict[str, str],
    every: float,
    scale: float,
    origin: float,
    series: list[tuple[float, float]],
) -> None:
    """Windowed hit rate every ``every`` real seconds, as (model t, rate)."""
    before = await counters(sims)
    while True:
        await asyncio.sleep(every)  # a sampling period
        now = await counters(sims)
        rate = hit_rate(now, before)
        if rate == rate:  # not NaN: the window had queries
            series.append(((time.perf_counter() - origin) / scale, rate))
        before = now


async def scale_event(event: Event, admins: list[str], sim: tuple[str, str], scale: float) -> None:
    """The event at its time, on each of ``admins`` (every replica's when each has its own
    membership; the first one's when they share it)."""
    await asyncio.sleep(event.at * scale)  # the event's scheduled time
    name, url = sim
    async with aiohttp.ClientSession() as session:
        for admin in admins:
            if event.kind == "add":
                request = session.post(f"{admin}/admin/backends", json={"name": name, "url": url})
            else:
                request = session.delete(f"{admin}/admin/backends/{name}")
            async with request as resp:
                if resp.status not in (201, 202):
                    raise FleetError(
                        f"scale event {event.kind} on {admin}: HTTP {resp.status} "
                        f"{await resp.text()}"
                    )


async def drive(
    urls: list[str],
    plan: list[int],
    requests: list[Request],
    args: argparse.Namespace,
    sims: dict[str, str],
    label: str,
    admins: list[str],
) -> tuple[list[Sample], list[str], list[tuple[float, float]], float]:
    """Open-loop load: every request at its time, request i to ``urls[plan[i]]``.  Samples,
    request ids, hit-rate series, and the hit rate of the whole run."""
    scale = args.time_scale
    live = Live()
    series: list[tuple[float, float]] = []
    gate = asyncio.Semaphore(MAX_IN_FLIGHT)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    start_counts = await counters(sims)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        origin = time.perf_counter()
        helpers = [
            asyncio.create_task(progress(live, label, args.duration, origin)),
            asyncio.create_task(sample_hit_rate(sims, args.sample_every, scale, origin, series)),
        ]
        if args.scale_event and admins:
            last = list(sims.items())[-1]
            helpers.append(asyncio.create_task(scale_event(args.scale_event, admins, last, scale)))

        async def one(request: Request, url: str) -> tuple[Sample, str]:
            async with gate:
                return await send(session, url, request, args.form, scale, origin, live)

        tasks = []
        try:
            for request, replica in zip(requests, plan, strict=True):
                delay = origin + request.at * scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # the request's arrival time
                tasks.append(asyncio.create_task(one(request, urls[replica])))
            results = await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*tasks, *helpers, return_exceptions=True)
    rate = hit_rate(await counters(sims), start_counts)
    return [s for s, _ in results], [r for _, r in results], series, rate


def lag_note(samples: list[Sample], requests: list[Request], limit: float) -> str:
    """How late the client sent the requests (P99, max; model seconds), and whether that is
    late enough to distort what it measures: more than ``limit``, the engine's fixed cost per
    request (most of a cached request's TTFT), the client measures itself as much as the fleet."""
    late = [max(0.0, s.at - r.at) for s, r in zip(samples, requests, strict=True)]
    p99 = percentile(late, 0.99) or 0.0
    note = f"client sent late by P99 {1000 * p99:.0f} ms, max {1000 * max(late, default=0):.0f} ms"
    return note + (" (model): the client fell behind" if p99 > limit else " (model)")
