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
  strategy, a real ``prefix-router serve`` process) and the peers ``sglang``
  and ``vllm`` (from ``loadtests.peers``; a peer that cannot run here is
  skipped with the reason printed and recorded).
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
- ``--scale-event add@T`` / ``remove@T`` (model seconds) adds the last
  instance at T (it starts outside the ring) or drains it, through the admin
  API; the report gives the share of groups that moved and the time the
  windowed hit rate takes to come back to its level before the event.
- Output: a progress line while running, the markdown tables of
  ``loadtests.report`` on stdout, and ``results.json`` plus PNG plots in
  ``--out``.  Every process started is stopped by PID, on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

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
from .report import Run, Sample, markdown, plots, write_json
from .workloads import FLEET, NAMES, Request, build, encode

__all__ = ["Event", "main", "scale_report"]

OURS = {
    "random": ("RANDOM", "random"),
    "least": ("LEAST_OUTSTANDING_REQUESTS", "least"),
    "prefix": ("PREFIX_AWARE", "prefix"),
    "prefix-traffic": ("PREFIX_AWARE TRAFFIC", "prefix"),  # BalanceMode TRAFFIC
    # ConcurrencyScope PREFILL, BalanceFactor --balance-factor or PREFILL_FACTOR
    "prefix-prefill": ("PREFIX_AWARE PREFILL", "prefix"),
    # BalanceMode TRAFFIC and ConcurrencyScope PREFILL: the one setting that wins on
    # long, short and sysprompt alike (RESULTS.md)
    "prefix-traffic-prefill": ("PREFIX_AWARE TRAFFIC PREFILL", "prefix"),
}
PREFILL_FACTOR = 1.5
PEERS = ("sglang", "vllm")
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


async def scale_event(event: Event, admin: str, sim: tuple[str, str], scale: float) -> None:
    await asyncio.sleep(event.at * scale)  # the event's scheduled time
    name, url = sim
    async with aiohttp.ClientSession() as session:
        if event.kind == "add":
            request = session.post(f"{admin}/admin/backends", json={"name": name, "url": url})
        else:
            request = session.delete(f"{admin}/admin/backends/{name}")
        async with request as resp:
            if resp.status not in (201, 202):
                raise FleetError(
                    f"scale event {event.kind}: HTTP {resp.status} {await resp.text()}"
                )


async def drive(
    url: str,
    requests: list[Request],
    args: argparse.Namespace,
    sims: dict[str, str],
    label: str,
    admin: str | None,
) -> tuple[list[Sample], list[str], list[tuple[float, float]], float]:
    """Open-loop load: every request at its time.  Samples, request ids, hit-rate series,
    and the hit rate of the whole run."""
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
        if args.scale_event and admin is not None:
            last = list(sims.items())[-1]
            helpers.append(asyncio.create_task(scale_event(args.scale_event, admin, last, scale)))

        async def one(request: Request) -> tuple[Sample, str]:
            async with gate:
                return await send(session, url, request, args.form, scale, origin, live)

        tasks = []
        try:
            for request in requests:
                delay = origin + request.at * scale - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # the request's arrival time
                tasks.append(asyncio.create_task(one(request)))
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


async def run_target(
    key: str,
    requests: list[Request],
    args: argparse.Namespace,
    sims: dict[str, str],
    children: list[Child],
    out: Path,
) -> Run | None:
    await reset_caches(sims)
    adding = args.scale_event is not None and args.scale_event.kind == "add"
    in_ring = dict(list(sims.items())[:-1]) if adding else sims  # the last one joins later
    notes = ""
    if key in OURS:
        label, strategy = OURS[key]
        access_log = out / f"access-{key}.log"
        flags = [
            "--strategy", strategy, "--access-log", str(access_log), "--seed", str(args.seed),
            "--prefix-length", str(args.prefix_length),
            "--concurrency-threshold", str(args.concurrency_threshold),
        ]  # fmt: skip
        factor = args.balance_factor
        if key in ("prefix-traffic", "prefix-traffic-prefill"):
            flags += ["--balance-mode", "TRAFFIC"]
        if key in ("prefix-prefill", "prefix-traffic-prefill"):
            flags += ["--concurrency-scope", "PREFILL"]
        if key == "prefix-prefill":
            factor = factor or PREFILL_FACTOR
        if factor:
            flags += ["--balance-factor", str(factor)]
        router, url, admin = await start_router(children, in_ring, *flags, label=f"router {key}")
        try:
            samples, ids, series, rate = await drive(url, requests, args, sims, label, admin)
        finally:
            await stop_checked(router)
        decided = decisions_from(access_log)
        for sample, request_id in zip(samples, ids, strict=True):
            sample.decision = decided.get(request_id)
    else:
        from .peers import start_peer

        try:
            peer = await start_peer(key, list(in_ring.values()), venv=args.peers_venv)
        except Exception as exc:
            say(f"{key}: skipped: {exc}")
            return Run(key, [], 0.0, list(sims), None, notes=f"skipped: {exc}")
        label = peer.name
        try:
            samples, _, series, rate = await drive(peer.url, requests, args, sims, label, None)
        finally:
            await peer.stop()
        if args.scale_event:
            notes = "scale event not applied (prefix-router's admin API only)"
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


async def main_async(args: argparse.Namespace) -> int:
    main_task = asyncio.current_task()
    assert main_task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, main_task.cancel)
    children: list[Child] = []
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    params = FLEET[args.workload]
    rate = args.rate or params.rate_for(args.instances)
    model_seconds = args.duration / args.time_scale
    requests = build(args.workload, seed=args.seed, duration=model_seconds, rate=rate)
    say(
        f"workload {args.workload}: {len(requests)} requests over {model_seconds:.0f} model s "
        f"({args.duration:.0f} s wall per target, time scale {args.time_scale}), "
        f"{rate} requests/s, seed {args.seed}, {args.form} form"
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
        for key in args.strategies:
            run = await run_target(key, requests, args, sims, children, out)
            if run is not None:
                runs.append(run)
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
        "scale_events": scale,
    }
    write_json(runs, out / "results.json", meta=meta)
    (out / "results.md").write_text(table + "\n")
    for path in plots([r for r in runs if r.samples], out):
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
        help="comma list of random, least, prefix, prefix-traffic, prefix-prefill,"
        " prefix-traffic-prefill, sglang, vllm",
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
    p.add_argument("--peers-venv", type=Path, default=ROOT / ".venv-peers")
    p.add_argument("--out", type=Path, help="results folder (default: results/DATE-WORKLOAD)")
    args = p.parse_args(argv)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in args.strategies if s not in OURS and s not in PEERS]
    if unknown:
        p.error(f"unknown strategies: {', '.join(unknown)}")
    if args.instances < 2 or args.duration <= 0 or not 0 < args.time_scale <= 10:
        p.error("need --instances >= 2, --duration > 0, 0 < --time-scale <= 10")
    if args.out is None:
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        args.out = ROOT / "results" / f"{stamp}-{args.workload}"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except FleetError as exc:
        print(f"bench: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
