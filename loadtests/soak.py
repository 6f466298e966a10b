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

from router.metrics import percentile

from . import attackers, fleet
from .faultproxy import FaultProxy, RandomFaults
from .simserver.model import filler_pieces
from .supervisor import say

FD_SLACK = 16  # descriptors: pooled and client connections come and go with the load
RSS_SLACK = 0.10  # relative growth allowed between the first and the last window
RSS_FLOOR_MIB = 8.0  # plus this much: allocator noise on a small heap
REQUEST_TIMEOUT_S = 120.0  # far past every router timeout below: beyond it, a hang
SIM_FLAGS = ("--time-scale", "0.002", "--extra-token-ms", "2")
# Room past the router's cap for what the checked traffic and the other attackers
# hold besides the flood, and for connections closed but not yet seen closed.
FLOOD_MARGIN = 32

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


# -- the load ---------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    in_flight: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    # (started, s since the run's start; TTFT s or None (not a stream); latency s), ok only
    timings: list[tuple[float, float | None, float]] = field(default_factory=list)
    t0: float = 0.0

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
    # The id marks the checked requests in the access log (attackers send none).
    headers = {"X-Request-Id": f"soak-{i}"}
    sent = time.perf_counter()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            if body is None:
                request = http.get(base + path, headers=headers)
            else:
                request = http.post(base + path, json=body, headers=headers)
            async with request as resp:
                first = await resp.content.readany()  # the first body bytes: TTFT
                first_at = time.perf_counter()
                payload = first + await resp.content.read()
        done_at = time.perf_counter()
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
            tally.timings.append((sent - tally.t0, None, done_at - sent))
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
            ttft = first_at - sent if stream else None
            tally.timings.append((sent - tally.t0, ttft, done_at - sent))
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
        tally.t0 = time.perf_counter()
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
    tally: Tally,
    exposed: list[int],
) -> None:
    """Kills and revivals; ``exposed[0]`` bounds the requests a kill may fail: those in
    flight when the signal is sent, and those started until the process is gone."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(every * rng.uniform(0.5, 1.5)):
                await stop.wait()  # the chaos period, cut short by the end of the run
        if stop.is_set():
            return
        victim = instances[rng.choice(sorted(instances))]
        sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
        in_flight, sent = tally.in_flight, tally.sent
        victim.child.proc.send_signal(sig)  # a PID we started
        async with asyncio.timeout(fleet.STOP_TIMEOUT_S * 2):
            await victim.child.proc.wait()
        exposed[0] += in_flight + tally.sent - sent
        await victim.child.stop()  # reaps, drains its stderr
        restarts[sig.name] += 1
        await asyncio.sleep(rng.uniform(0.5, 3.0))  # downtime
        instances[victim.name] = await start_instance(children, victim.name, victim.port)


# -- observing the router -----------------------------------------------------------------------


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


# -- the run -----------------------------------------------------------------------------------


def attack_plan(
    seconds: float, client: float, flood: int, bursts: int, hold: float
) -> tuple[float, float, float, float]:
    """(start, every, length, quiet) of the attackers' bursts.

    They run between the first flatness window and the last, ``every`` seconds
    apart; a burst's rounds start for ``length`` seconds and are over ``quiet``
    seconds before the next burst (and before the last window): with two bursts or
    more, the quiet window before the last burst is what the last window is compared
    with (a second attack must cost nothing more than the first)."""
    warm, span = windows(seconds)
    start = warm + span
    every = (seconds - span - start) / bursts
    quiet = span / 3 if bursts > 1 else 0.0
    length = max(0.0, every - attackers.longest_round(client, flood, hold) - quiet)
    return start, every, length, quiet


def max_clients(router: fleet.Child) -> int | None:
    """The client cap on the router's ``listening`` line (per worker with --workers)."""
    for line in router.tail:
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict) and isinstance(event.get("max_clients"), int):
                return int(event["max_clients"])
    return None


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


async def start_attackers(
    children: list[fleet.Child],
    base: str,
    args: argparse.Namespace,
    seconds: float,
    cap: int | None,
) -> tuple[fleet.Child | None, int]:
    """The attackers' process (None without --attackers) and its flood's size."""
    if not args.attackers:
        return None, 0
    flood = args.flood
    if flood < 0:  # near the cap, below it by what the others may hold
        if cap is None:
            raise fleet.FleetError("no max_clients on the router's listening line: give --flood")
        flood = max(0, cap - args.max_in_flight - attackers.held_connections() - FLOOD_MARGIN)
    start, every, length, _ = attack_plan(
        seconds, args.client_timeout, flood, args.bursts, args.hold
    )
    child = await fleet.spawn(
        children, "attackers", "loadtests.attackers", "--url", base,
        "--start-after", f"{start:g}", "--seconds", f"{length:g}", "--flood", str(flood),
        "--bursts", str(args.bursts), "--every", f"{every:g}",
        "--pipelined", str(args.pipelined), "--hold", f"{args.hold:g}",
        "--max-body", str(max_body(args)),
        "--client-header", f"{args.client_timeout:g}", "--client-body", f"{args.client_timeout:g}",
        "--client-send", f"{2 * args.client_timeout:g}", stdout=True,
    )  # fmt: skip
    return child, flood


async def attackers_result(child: fleet.Child | None, seconds: float) -> dict[str, Any] | None:
    """The attackers' JSON line once they stopped by themselves (bounded wait)."""
    if child is None:
        return None
    deadline = asyncio.get_running_loop().time() + seconds + 120
    line = await fleet.next_line(child, "the attackers' result", deadline, stdout=True)
    async with asyncio.timeout(fleet.STOP_TIMEOUT_S * 2):
        await child.proc.wait()  # it ends by itself after its line
    await child.stop()
    result: dict[str, Any] = json.loads(line)
    result["exit_status"] = child.returncode
    return result


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


def max_body(args: argparse.Namespace) -> int:
    return int(args.max_body_mib * 1024 * 1024)


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
