"""Soak: the real router process under steady load while instances die and come back.

    python -m loadtests.soak                      # 10 minutes, 100 requests/s, 4 instances
    python -m loadtests.soak --minutes 60 --rate 150 --fault-rate 0.02
    python -m loadtests.soak --seconds 20         # a smoke run
    python -m loadtests.soak --seconds 90 --attackers [--workers 2]   # abusive clients beside

What it does:
- starts ``--instances`` simulated instances, one process each (so each can be
  killed alone), and ``prefix-router serve`` in front of them (a process of its
  own, fast health checks, access log to a file); with ``--fault-rate`` each
  instance sits behind a ``loadtests.faultproxy`` that cuts, delays, stalls and
  splits that share of the router's connections;
- sends ``--rate`` requests a second (an open generator; at most
  ``--max-in-flight`` at once): streaming and whole chat completions, streaming
  completions, native ``/invocations``, ``GET /v1/models``; each answer is
  checked (status, framing, the exact generated text, the stream's end marker);
- every ``--restart-every`` seconds (jittered) kills a random instance with
  SIGKILL or SIGTERM, keeps it down for 0.5-3 s, then starts it again on the
  same port: only the router's health checks bring it back;
- samples the router's open file descriptors (``/proc/PID/fd``), RSS
  (``/proc/PID/status``) and ``/admin/stats`` every ``--sample-every`` seconds
  (with ``--workers N``: the supervisor's and its workers', summed);
- times each correct answer: TTFT (its first body bytes, streams) and latency
  (the whole answer), P50/P99 over the run and over the attack window;
- with ``--attackers``: ``loadtests.attackers`` in a process of its own,
  ``--bursts`` attacks between the first flatness window and the last (every
  kind of abusive client there, each bounded in time and bytes; the flood
  sized near the router's ``max_clients`` from its ``listening`` line, below it
  by what the checked traffic and the other attackers may hold).  The router's
  client timeouts are ``--client-timeout`` (``client_header``, ``client_body``;
  ``client_send`` twice that) with or without attackers.

At the end (exit status 1 if any check fails):
- accounting: every request sent is either complete and correct, or a visible
  failure (an HTTP error status with a JSON error, a truncated body, a closed
  connection), with counts; a complete-looking but wrong answer, or one that
  never ends, is a violation; the router's ``prefix_router_requests_total``
  equals the number of requests sent (with attackers: at least that), and its
  access log has each checked request's id (``soak-N``) once;
- failures only at instance kills (without ``--fault-rate``): no more than the
  requests in flight when a kill's signal was sent plus those started until
  the process was gone;
- attackers: every answer that does not depend on timing is the one owed
  (``attackers.EXPECTED``: 431/414/413, 400/501, 200, never a 503 for the
  flood), and they stopped by themselves;
- leases: ``/admin/stats`` ``totals.in_flight`` and every
  ``prefix_router_in_flight`` sample are 0;
- flat resources: the median fd count of the last window, less the sockets
  this process holds (the checked traffic's keep-alive connections grow after
  a stall and age out; the router holds an fd for each), is within
  ``FD_SLACK`` of the first window's after warm-up, and the median RSS within
  ``RSS_SLACK`` (relative) + ``RSS_FLOOR_MIB``.  Windows are a minute each
  on a 10-minute run (warm-up: the first minute), scaled down on shorter runs.
  With attackers the last window starts once they stopped, and with two
  bursts or more it is compared with the quiet window before the last burst
  (a repeated attack must leave nothing more behind than the first did; the
  first window's figures are shown beside).

Only processes started here are signalled, by PID; all are stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from router.metrics import percentile

from . import attackers, fleet
from .faultproxy import FaultProxy, RandomFaults
from .soak_load import (
    FLOOD_MARGIN,
    REQUEST_TIMEOUT_S,
    SIM_FLAGS,
    Instance,
    Tally,
    attack_plan,
    attackers_result,
    build,
    chaos,
    check_text,
    generate,
    max_body,
    max_clients,
    one,
    start_attackers,
    start_instance,
)
from .soak_observe import (
    FD_SLACK,
    RSS_FLOOR_MIB,
    RSS_SLACK,
    Sample,
    admin_json,
    fd_count,
    flatness,
    metrics,
    observed,
    own_sockets,
    rss_mib,
    sampler,
    windows,
)
from .supervisor import say

# Every public name of the module before its split, those now in soak_load and
# soak_observe included: their old import paths keep working.
__all__ = [
    "FD_SLACK",
    "FLOOD_MARGIN",
    "REQUEST_TIMEOUT_S",
    "ROUTER_CONFIG",
    "RSS_FLOOR_MIB",
    "RSS_SLACK",
    "SIM_FLAGS",
    "Instance",
    "Sample",
    "Tally",
    "admin_json",
    "attack_plan",
    "attackers_result",
    "build",
    "chaos",
    "check_text",
    "fd_count",
    "flatness",
    "generate",
    "latency",
    "logged_ids",
    "main",
    "max_body",
    "max_clients",
    "metrics",
    "observed",
    "one",
    "own_sockets",
    "parse_args",
    "report_progress",
    "rss_mib",
    "sampler",
    "soak",
    "start_attackers",
    "start_instance",
    "summary",
    "windows",
]

ROUTER_CONFIG = """\
[timeouts]
first_byte = 30.0
idle = 10.0
client_header = {client}
client_body = {client}
client_send = {send}
[limits]
max_body_bytes = {max_body}
listen_backlog = {backlog}
[health]
interval = 0.5
timeout = 1.0
healthy_threshold = 2
unhealthy_threshold = 2
passive_failures = 3
backoff_initial = 0.5
backoff_max = 4.0
"""


# -- the run -----------------------------------------------------------------------------------


def logged_ids(path: Path) -> Counter[str]:
    """The access log's request ids of the checked traffic (``soak-N``), counted."""
    ids: Counter[str] = Counter()
    with path.open() as log:
        for line in log:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                rid = event.get("request_id") if isinstance(event, dict) else None
                if isinstance(rid, str) and rid.startswith("soak-"):
                    ids[rid] += 1
    return ids


def latency(
    timings: list[tuple[float, float | None, float]], span: tuple[float, float]
) -> dict[str, Any]:
    """TTFT (streams) and latency (all) P50/P99 of the requests started within ``span``, ms."""
    inside = [t for t in timings if span[0] <= t[0] < span[1]]
    ttft = [t[1] * 1e3 for t in inside if t[1] is not None]
    total = [t[2] * 1e3 for t in inside]
    out: dict[str, Any] = {
        "span_s": [round(span[0], 1), round(span[1], 1)],
        "requests": len(inside),
    }
    for name, values in (("ttft_ms", ttft), ("latency_ms", total)):
        p50, p99 = percentile(values, 0.5), percentile(values, 0.99)
        out[name] = [None if p is None else round(p, 2) for p in (p50, p99)]
    return out


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    seconds = args.seconds if args.seconds else args.minutes * 60
    rng = random.Random(args.seed)
    children: list[fleet.Child] = []
    proxies: list[FaultProxy] = []
    workdir = Path(args.workdir)
    config = workdir / "soak-router.toml"
    access_log = workdir / "soak-access.log"
    access_log.unlink(missing_ok=True)
    try:
        started = await asyncio.gather(
            *(start_instance(children, f"soak-{n}") for n in range(args.instances))
        )
        instances = {inst.name: inst for inst in started}
        backends = {}
        for n, inst in enumerate(started):
            if args.fault_rate > 0:
                plan = RandomFaults(args.fault_rate, seed=args.seed + n, delay=(0.01, 2.0))
                proxy = FaultProxy(("127.0.0.1", inst.port), plan, seed=args.seed + n)
                proxies.append(proxy)
                backends[inst.name] = await proxy.start()
            else:
                backends[inst.name] = f"http://127.0.0.1:{inst.port}"
        workers = ("--workers", str(args.workers)) if args.workers > 1 else ()
        router, base, admin = await fleet.start_router(
            children, backends, "--config", str(config), "--access-log", str(access_log), *workers
        )
        cap = max_clients(router)
        attacker, flood = await start_attackers(children, base, args, seconds, cap)
        say(
            f"soak: {seconds:g} s at {args.rate:g} req/s, {args.instances} instances"
            f" (restart every ~{args.restart_every:g} s), fault rate {args.fault_rate:g};"
            f" router pid {router.pid} at {base}, {args.workers} worker(s), max_clients {cap}"
            + (f"; attackers pid {attacker.pid}, flood {flood}" if attacker else "")
        )
        tally = Tally()
        samples: list[Sample] = []
        restarts: Counter[str] = Counter()
        exposed = [0]
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        zero = loop.time()
        attacks_done = [0.0]  # s since zero, when they stopped by themselves

        async def attacks_ended() -> dict[str, Any] | None:
            result = await attackers_result(attacker, seconds)
            attacks_done[0] = loop.time() - zero
            return result

        attack_task = asyncio.create_task(attacks_ended())
        watchers = [
            asyncio.create_task(
                sampler(
                    router.pid, args.workers, admin, args.sample_every, tally, stop, samples, zero
                )
            ),
            asyncio.create_task(
                chaos(children, instances, args.restart_every, rng, stop, restarts, tally, exposed)
            ),
        ]
        progress = asyncio.create_task(report_progress(tally, samples, restarts, stop))
        started_at = time.monotonic()
        await generate(base, args.rate, seconds, args.max_in_flight, args.seed, tally)
        elapsed = time.monotonic() - started_at
        attacks = await attack_task
        if attacks_done[0] > seconds - windows(seconds)[1]:
            # Attackers later than planned (a slow machine): the last window is sampled
            # once they are gone, for a window's length (a sampling period, not a wait).
            await asyncio.sleep(windows(seconds)[1])
        stop.set()
        await asyncio.gather(*watchers, progress)

        async with aiohttp.ClientSession() as http:
            in_flight = -1
            for attempt in range(50):  # the router finishes what it still relays
                stats = await admin_json(http, admin + "/admin/stats")
                in_flight = stats["totals"]["in_flight"]
                if in_flight == 0:
                    break
                await asyncio.sleep(0.1 * min(attempt + 1, 10))  # polling another process
            families = await metrics(http, admin)
        gauge = [s.value for s in families["prefix_router_in_flight"].samples]
        counted = sum(
            s.value for s in families["prefix_router_requests"].samples if s.name.endswith("_total")
        )
        pids = observed(router.pid, args.workers)
        final_fds, final_rss = fd_count(pids), rss_mib(pids)
        await fleet.stop_checked(router)  # the access log is flushed by then
        ids = logged_ids(access_log)

        start, every, _, quiet = attack_plan(
            seconds, args.client_timeout, flood, args.bursts, args.hold
        )
        span = windows(seconds)[1]
        flat = flatness(samples, seconds, quiet_from=attacks_done[0])
        if attacker and args.bursts > 1:  # after a burst, against after the next ones
            before_last = start + (args.bursts - 1) * every
            again = flatness(samples, seconds, (before_last - quiet, before_last), attacks_done[0])
            flat = {"first": flat, **again}
        checks = {
            "no violations": tally.outcomes["VIOLATION"] == 0,
            "every request accounted for": tally.ok + tally.failed == tally.sent,
            # The attackers' routed requests count too: then the access log tells.
            "router counted every request": (
                counted >= tally.sent if attacker else counted == tally.sent
            ),
            "access log: every checked request once": (
                set(ids) == {f"soak-{i}" for i in range(tally.sent)} and max(ids.values()) == 1
            ),
            "no lease held (stats)": in_flight == 0,
            "no lease held (metrics)": all(v == 0 for v in gauge),
            "fds and RSS flat": flat["ok"],
        }
        if args.fault_rate == 0:  # otherwise the proxies' faults fail requests too
            checks["failures only at instance kills"] = tally.failed <= exposed[0]
        if attacks is not None:
            checks["attackers: timing-free answers as expected"] = not attackers.unexpected(
                attacks["kinds"]
            )
            checks["attackers stopped by themselves"] = attacks["exit_status"] == 0
        return {
            "seconds": seconds,
            "elapsed_s": round(elapsed, 1),
            "rate": args.rate,
            "achieved_rate": round(tally.sent / elapsed, 1),
            "instances": args.instances,
            "workers": args.workers,
            "max_clients": cap,
            "fault_rate": args.fault_rate,
            "seed": args.seed,
            "sent": tally.sent,
            "outcomes": dict(tally.outcomes),
            "violations": tally.violations[:20],
            "restarts": dict(restarts),
            "router_requests_total": counted,
            "final_in_flight": in_flight,
            "final_fds": final_fds,
            "final_rss_mib": round(final_rss, 2),
            "proxy_faults": dict(sum((p.stats for p in proxies), Counter())),
            "flatness": flat,
            "latency": latency(tally.timings, (0.0, seconds)),
            "latency_attack_window": latency(tally.timings, (start, seconds - span)),
            # When the tail happened: (started s, TTFT s or None, latency s), slowest first.
            "slowest": sorted(tally.timings, key=lambda t: -t[2])[:30],
            "attackers": attacks,
            "flood": flood,
            "checks": checks,
            "ok": all(checks.values()),
            "samples": [vars(s) for s in samples],
        }
    finally:
        for proxy in proxies:
            await proxy.close()
        for child in children:
            await child.stop()


async def report_progress(
    tally: Tally, samples: list[Sample], restarts: Counter[str], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(30):
                await stop.wait()  # a progress line every 30 s
        last = samples[-1] if samples else None
        say(
            f"  sent {tally.sent}, ok {tally.ok}, failed {tally.failed},"
            f" restarts {sum(restarts.values())}"
            + (f", router fds {last.fds}, RSS {last.rss_mib:.1f} MiB" if last else "")
        )


def summary(result: dict[str, Any]) -> str:
    flat = result["flatness"]
    lines = [
        f"| soak | {result['seconds'] / 60:g} min, {result['rate']:g} req/s"
        f" (achieved {result['achieved_rate']:g}), {result['instances']} instances,"
        f" fault rate {result['fault_rate']:g} |",
        "|---|---|",
        f"| requests sent | {result['sent']:,} |",
        *(f"| {k} | {v:,} |" for k, v in sorted(result["outcomes"].items())),
        f"| instance restarts | {result['restarts']} |",
        f"| router's requests_total | {result['router_requests_total']:,.0f} |",
        f"| in flight at the end | {result['final_in_flight']} |",
    ]
    if "fds_median" in flat:
        lines += [
            f"| router fds, median first/last window | {flat['fds_median'][0]:g} /"
            f" {flat['fds_median'][1]:g} (max {flat['fds_max']});"
            f" less the checked client's sockets {flat['fds_less_own_sockets_median'][0]:g} /"
            f" {flat['fds_less_own_sockets_median'][1]:g} |",
            f"| router RSS MiB, median first/last window | {flat['rss_mib_median'][0]:.1f} /"
            f" {flat['rss_mib_median'][1]:.1f} (max {flat['rss_mib_max']:.1f}) |",
            f"| tolerance | {flat['tolerance']} |",
        ]
        first = flat.get("first")
        if first and "fds_median" in first:
            lines.append(
                f"| windows compared | {flat['windows_s']} (before the attacks:"
                f" fds {first['fds_median'][0]:g}, RSS {first['rss_mib_median'][0]:.1f} MiB) |"
            )
    if result["proxy_faults"]:
        lines.append(f"| proxy faults | {result['proxy_faults']} |")
    for name in ("latency", "latency_attack_window"):
        lat = result[name]
        lines.append(
            f"| {name.replace('_', ' ')} {lat['span_s'][0]:g}-{lat['span_s'][1]:g} s"
            f" ({lat['requests']:,} ok) | TTFT P50/P99 {lat['ttft_ms'][0]} /"
            f" {lat['ttft_ms'][1]} ms,"
            f" latency P50/P99 {lat['latency_ms'][0]} / {lat['latency_ms'][1]} ms |"
        )
    attacks = result["attackers"]
    if attacks is not None:
        lines.append(
            f"| attackers | flood {result['flood']:,} of max_clients {result['max_clients']} |"
        )
        for kind, got in attacks["kinds"].items():
            answers = ", ".join(f"{n:,} x {a}" for a, n in sorted(got["answers"].items()))
            lines.append(
                f"| attack: {kind} | {got['connections']:,} connections,"
                f" {got['bytes_sent']:,} B; {answers} |"
            )
    lines += [
        f"| check: {name} | {'pass' if ok else 'FAIL'} |" for name, ok in result["checks"].items()
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="length of the run")
    p.add_argument("--seconds", type=float, default=0.0, help="length in seconds (wins)")
    p.add_argument("--rate", type=float, default=100.0, help="requests per second")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--restart-every", type=float, default=20.0, help="seconds, jittered")
    p.add_argument("--fault-rate", type=float, default=0.0, help="share of links faulted")
    p.add_argument("--max-in-flight", type=int, default=256)
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workers", type=int, default=1, help="the router's --workers")
    p.add_argument(
        "--attackers", action="store_true", help="abusive clients beside (loadtests.attackers)"
    )
    p.add_argument(
        "--flood", type=int, default=-1, help="idle connections of the flood (-1: near the cap)"
    )
    p.add_argument("--bursts", type=int, default=2, help="attacks in the run")
    p.add_argument(
        "--max-body-mib", type=float, default=32.0, help="the router's max_body_bytes (MiB)"
    )
    p.add_argument(
        "--hold", type=float, default=0.0,
        help="attackers waiting on a router timeout leave after this (0: twice the timeout)",
    )  # fmt: skip
    p.add_argument(
        "--pipelined", type=int, default=attackers.PIPELINED, help="requests in one write"
    )
    p.add_argument(
        "--client-timeout", type=float, default=5.0,
        help="the router's client_header and client_body (client_send: twice this)",
    )  # fmt: skip
    p.add_argument(
        "--listen-backlog", type=int, default=4096,
        help="the router's limits.listen_backlog (1024 before it was configurable)",
    )  # fmt: skip
    p.add_argument("--workdir", default="results", help="config, access log, JSON result")
    args = p.parse_args(argv)
    if args.instances < 2:
        p.error("--instances must be >= 2 (one is always restarting)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    config = ROUTER_CONFIG.format(
        client=args.client_timeout,
        send=2 * args.client_timeout,
        max_body=max_body(args),
        backlog=args.listen_backlog,
    )
    (Path(args.workdir) / "soak-router.toml").write_text(config)
    try:
        result = asyncio.run(soak(args))
    except fleet.FleetError as exc:
        print(f"soak: {exc}", file=sys.stderr)
        return 2
    out = Path(args.workdir) / f"soak-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=1))
    say(summary(result))
    say(f"result: {out}")
    if result["violations"]:
        say("violations:" + "".join(f"\n  {v}" for v in result["violations"]))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
