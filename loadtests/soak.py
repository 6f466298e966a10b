"""Soak: the real router process under steady load while instances die and come back.

    python -m loadtests.soak                      # 10 minutes, 100 requests/s, 4 instances
    python -m loadtests.soak --minutes 60 --rate 150 --fault-rate 0.02
    python -m loadtests.soak --seconds 20         # a smoke run

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
  (``/proc/PID/status``) and ``/admin/stats`` every ``--sample-every`` seconds.

At the end (exit status 1 if any check fails):
- accounting: every request sent is either complete and correct, or a visible
  failure (an HTTP error status with a JSON error, a truncated body, a closed
  connection), with counts; a complete-looking but wrong answer, or one that
  never ends, is a violation; the router's ``prefix_router_requests_total``
  equals the number of requests sent;
- leases: ``/admin/stats`` ``totals.in_flight`` and every
  ``prefix_router_in_flight`` sample are 0;
- flat resources: the median fd count of the last window is within
  ``FD_SLACK`` of the first window after warm-up, and the median RSS within
  ``RSS_SLACK`` (relative) + ``RSS_FLOOR_MIB``.  Windows are a minute each
  on a 10-minute run (warm-up: the first minute), scaled down on shorter runs.

Only processes started here are signalled, by PID; all are stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from . import fleet
from .faultproxy import FaultProxy, RandomFaults
from .simserver.model import filler_pieces
from .supervisor import say

FD_SLACK = 16  # descriptors: pooled and client connections come and go with the load
RSS_SLACK = 0.10  # relative growth allowed between the first and the last window
RSS_FLOOR_MIB = 8.0  # plus this much: allocator noise on a small heap
REQUEST_TIMEOUT_S = 120.0  # far past every router timeout below: beyond it, a hang
SIM_FLAGS = ("--time-scale", "0.002", "--extra-token-ms", "2")

ROUTER_CONFIG = """\
[timeouts]
first_byte = 30.0
idle = 10.0
[health]
interval = 0.5
timeout = 1.0
healthy_threshold = 2
unhealthy_threshold = 2
passive_failures = 3
backoff_initial = 0.5
backoff_max = 4.0
"""


# -- the load ---------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    in_flight: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return self.outcomes["ok"]

    @property
    def failed(self) -> int:
        return sum(v for k, v in self.outcomes.items() if k != "ok")


def build(i: int, rng: random.Random) -> tuple[str, str, dict[str, Any] | None, int, bool]:
    """(kind, path, body, max_tokens, stream) of request number ``i``."""
    pick = rng.random()
    doc = f"Soak document {rng.randrange(30)}. " * rng.randrange(20, 120)
    tokens = rng.randrange(2, 24)
    if pick < 0.40:
        kind, stream = "chat", True
    elif pick < 0.70:
        kind, stream = "chat", False
    elif pick < 0.80:
        kind, stream = "completion", True
    elif pick < 0.95:
        kind, stream = "native", rng.random() < 0.5
    else:
        return "models", "/v1/models", None, 0, False
    if kind == "chat":
        messages = [{"role": "system", "content": doc}, {"role": "user", "content": f"q{i}"}]
        body: dict[str, Any] = {"model": "m", "messages": messages}
        path = "/v1/chat/completions"
    elif kind == "completion":
        body, path = {"model": "m", "prompt": doc + f" q{i}"}, "/v1/completions"
    else:
        body, path = {"inputs": doc, "parameters": {"max_new_tokens": tokens}}, "/invocations"
    if kind != "native":
        body["max_tokens"] = tokens
    body["stream"] = stream
    return kind, path, body, tokens, stream


def check_text(kind: str, stream: bool, payload: bytes) -> str | None:
    """The generated text, or None if a stream never reached its end marker."""
    if not stream:
        data = json.loads(payload)
        if kind == "native":
            return str(data["generated_text"])
        choice = data["choices"][0]
        return str(choice["message"]["content"] if kind == "chat" else choice["text"])
    events = [line[6:] for line in payload.split(b"\n") if line.startswith(b"data: ")]
    pieces, ended = [], False
    for event in events:
        if event == b"[DONE]":
            ended = True
            continue
        data = json.loads(event)
        if kind == "native":
            pieces.append(data["token"]["text"])
            ended = data["generated_text"] is not None  # TGI-style: no [DONE]
        else:
            pieces += [
                (c["delta"].get("content") or "") if kind == "chat" else c["text"]
                for c in data["choices"]
            ]
    return "".join(pieces) if ended else None


async def one(http: aiohttp.ClientSession, base: str, i: int, seed: int, tally: Tally) -> None:
    kind, path, body, tokens, stream = build(i, random.Random(seed * 1_000_003 + i))
    tally.sent += 1
    tally.in_flight += 1
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            if body is None:
                async with http.get(base + path) as resp:
                    payload = await resp.read()
            else:
                async with http.post(base + path, json=body) as resp:
                    payload = await resp.read()
        if resp.status != 200:
            error = json.loads(payload)["error"]
            if error["code"] != resp.status:
                raise ValueError(f"error code {error['code']} under status {resp.status}")
            tally.outcomes[f"HTTP {resp.status}"] += 1
            return
        if kind == "models":
            if not isinstance(json.loads(payload)["data"], list):
                raise ValueError("/v1/models without a data list")
            tally.outcomes["ok"] += 1
            return
        text = check_text(kind, stream, payload)
        if text is None:
            tally.outcomes["VIOLATION"] += 1
            tally.violations.append(f"{i}: complete HTTP, unfinished stream")
        elif text != "".join(filler_pieces(tokens)):
            tally.outcomes["VIOLATION"] += 1
            tally.violations.append(f"{i}: wrong text {text[:80]!r}")
        else:
            tally.outcomes["ok"] += 1
    except aiohttp.ClientPayloadError:
        tally.outcomes["truncated body"] += 1
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        tally.outcomes["connection closed"] += 1
    except TimeoutError:
        tally.outcomes["VIOLATION"] += 1
        tally.violations.append(f"{i}: no end within {REQUEST_TIMEOUT_S:g} s")
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        tally.outcomes["VIOLATION"] += 1
        tally.violations.append(f"{i}: malformed answer: {exc!r}")
    finally:
        tally.in_flight -= 1


async def generate(
    base: str, rate: float, seconds: float, max_in_flight: int, seed: int, tally: Tally
) -> None:
    """Open loop: request i starts at i/rate s, unless max_in_flight are out (then later)."""
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(max_in_flight)
    tasks: set[asyncio.Task[None]] = set()
    connector = aiohttp.TCPConnector(limit=max_in_flight)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def gated(i: int) -> None:
            try:
                await one(http, base, i, seed, tally)
            finally:
                gate.release()

        start = loop.time()
        for i in range(int(rate * seconds)):
            delay = start + i / rate - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)  # the generator's rate
            await gate.acquire()
            task = asyncio.create_task(gated(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        async with asyncio.timeout(REQUEST_TIMEOUT_S + 10):
            await asyncio.gather(*tasks)


# -- instances that die and come back ----------------------------------------------------------


@dataclass
class Instance:
    name: str
    port: int
    child: fleet.Child


async def start_instance(children: list[fleet.Child], name: str, port: int = 0) -> Instance:
    flags = (*SIM_FLAGS, "--port", str(port)) if port else SIM_FLAGS
    child, sims = await fleet.start_sims(children, 1, *flags, name=name)
    return Instance(name, int(sims[name].rsplit(":", 1)[1]), child)


async def chaos(
    children: list[fleet.Child],
    instances: dict[str, Instance],
    every: float,
    rng: random.Random,
    stop: asyncio.Event,
    restarts: Counter[str],
) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(every * rng.uniform(0.5, 1.5)):
                await stop.wait()  # the chaos period, cut short by the end of the run
        if stop.is_set():
            return
        victim = instances[rng.choice(sorted(instances))]
        sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
        victim.child.proc.send_signal(sig)  # a PID we started
        async with asyncio.timeout(fleet.STOP_TIMEOUT_S * 2):
            await victim.child.proc.wait()
        await victim.child.stop()  # reaps, drains its stderr
        restarts[sig.name] += 1
        await asyncio.sleep(rng.uniform(0.5, 3.0))  # downtime
        instances[victim.name] = await start_instance(children, victim.name, victim.port)


# -- observing the router -----------------------------------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


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


async def sampler(
    pid: int, admin: str, every: float, tally: Tally, stop: asyncio.Event, out: list[Sample]
) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    async with aiohttp.ClientSession() as http:
        while not stop.is_set():
            stats = await admin_json(http, admin + "/admin/stats")
            out.append(
                Sample(
                    round(loop.time() - start, 1),
                    fd_count(pid),
                    round(rss_mib(pid), 2),
                    stats["totals"]["in_flight"],
                    tally.in_flight,
                    tally.sent,
                )
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(every):
                    await stop.wait()  # the sampling period


def windows(seconds: float) -> tuple[float, float]:
    """(warm-up, window length): a minute each on a 10-minute run, scaled down below."""
    warm = min(60.0, seconds * 0.1)
    return warm, min(60.0, seconds * 0.2)


def flatness(samples: list[Sample], seconds: float) -> dict[str, Any]:
    warm, span = windows(seconds)
    first = [s for s in samples if warm <= s.t < warm + span]
    last = [s for s in samples if s.t >= seconds - span]
    if not first or not last:
        return {"ok": False, "why": "too few samples for the windows"}
    fd0, fd1 = statistics.median(s.fds for s in first), statistics.median(s.fds for s in last)
    rss0 = statistics.median(s.rss_mib for s in first)
    rss1 = statistics.median(s.rss_mib for s in last)
    fd_ok = fd1 <= fd0 + FD_SLACK
    rss_ok = rss1 <= rss0 * (1 + RSS_SLACK) + RSS_FLOOR_MIB
    return {
        "ok": fd_ok and rss_ok,
        "windows_s": [[warm, warm + span], [seconds - span, seconds]],
        "fds_median": [fd0, fd1],
        "fds_max": max(s.fds for s in samples),
        "rss_mib_median": [rss0, rss1],
        "rss_mib_max": max(s.rss_mib for s in samples),
        "tolerance": f"fds +{FD_SLACK}, RSS +{RSS_SLACK:.0%} + {RSS_FLOOR_MIB:g} MiB",
    }


# -- the run -----------------------------------------------------------------------------------


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    seconds = args.seconds if args.seconds else args.minutes * 60
    rng = random.Random(args.seed)
    children: list[fleet.Child] = []
    proxies: list[FaultProxy] = []
    workdir = Path(args.workdir)
    config = workdir / "soak-router.toml"
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
        router, base, admin = await fleet.start_router(
            children, backends, "--config", str(config),
            "--access-log", str(workdir / "soak-access.log"),
        )  # fmt: skip
        say(
            f"soak: {seconds:g} s at {args.rate:g} req/s, {args.instances} instances"
            f" (restart every ~{args.restart_every:g} s), fault rate {args.fault_rate:g};"
            f" router pid {router.pid} at {base}"
        )
        tally = Tally()
        samples: list[Sample] = []
        restarts: Counter[str] = Counter()
        stop = asyncio.Event()
        watchers = [
            asyncio.create_task(
                sampler(router.pid, admin, args.sample_every, tally, stop, samples)
            ),
            asyncio.create_task(
                chaos(children, instances, args.restart_every, rng, stop, restarts)
            ),
        ]
        progress = asyncio.create_task(report_progress(tally, samples, restarts, stop))
        started_at = time.monotonic()
        await generate(base, args.rate, seconds, args.max_in_flight, args.seed, tally)
        stop.set()
        await asyncio.gather(*watchers, progress)
        elapsed = time.monotonic() - started_at

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
        final_fds, final_rss = fd_count(router.pid), rss_mib(router.pid)
        await fleet.stop_checked(router)

        flat = flatness(samples, seconds)
        checks = {
            "no violations": tally.outcomes["VIOLATION"] == 0,
            "every request accounted for": tally.ok + tally.failed == tally.sent,
            "router counted every request": counted == tally.sent,
            "no lease held (stats)": in_flight == 0,
            "no lease held (metrics)": all(v == 0 for v in gauge),
            "fds and RSS flat": flat["ok"],
        }
        return {
            "seconds": seconds,
            "elapsed_s": round(elapsed, 1),
            "rate": args.rate,
            "achieved_rate": round(tally.sent / elapsed, 1),
            "instances": args.instances,
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
            f" {flat['fds_median'][1]:g} (max {flat['fds_max']}) |",
            f"| router RSS MiB, median first/last window | {flat['rss_mib_median'][0]:.1f} /"
            f" {flat['rss_mib_median'][1]:.1f} (max {flat['rss_mib_max']:.1f}) |",
            f"| tolerance | {flat['tolerance']} |",
        ]
    if result["proxy_faults"]:
        lines.append(f"| proxy faults | {result['proxy_faults']} |")
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
    p.add_argument("--workdir", default="results", help="config, access log, JSON result")
    args = p.parse_args(argv)
    if args.instances < 2:
        p.error("--instances must be >= 2 (one is always restarting)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    (Path(args.workdir) / "soak-router.toml").write_text(ROUTER_CONFIG)
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
