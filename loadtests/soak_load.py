"""The soak's load on the router (``loadtests.soak``): checked traffic, kills, attackers.

Contract:
- Checked traffic: ``build`` draws request ``i`` from a stream of its own
  (streaming and whole chat completions, streaming completions, native
  ``/invocations``, ``GET /v1/models``); ``one`` sends it with
  ``X-Request-Id: soak-i`` and counts it in the ``Tally`` exactly once: ok
  (status, framing, the exact generated text, the stream's end marker, then
  timed: TTFT, latency), a visible failure (an HTTP error status with a JSON
  error, a truncated body, a closed connection) or a violation (a
  complete-looking but wrong answer, or none within ``REQUEST_TIMEOUT_S``).
  ``generate`` is the open loop: request i at i/rate s, unless
  ``max_in_flight`` are out (then later).
- Instances that die and come back: ``chaos`` sends SIGKILL or SIGTERM to a
  random instance (a PID started here) every ``every`` s, jittered, and
  starts it again on the same port after 0.5-3 s; ``exposed[0]`` bounds the
  requests the kills may fail.
- Attackers: ``attack_plan`` places the bursts between the first flatness
  window and the last (``soak_observe.windows``); ``start_attackers`` starts
  ``loadtests.attackers``, its flood sized below the router's ``max_clients``;
  ``attackers_result`` waits, bounded, for its JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from . import attackers, fleet
from .simserver.model import filler_pieces
from .soak_observe import windows

REQUEST_TIMEOUT_S = 120.0  # far past every router timeout (soak.ROUTER_CONFIG): beyond it, a hang
SIM_FLAGS = ("--time-scale", "0.002", "--extra-token-ms", "2")
# Room past the router's cap for what the checked traffic and the other attackers
# hold besides the flood, and for connections closed but not yet seen closed.
FLOOD_MARGIN = 32


# -- the checked traffic -------------------------------------------------------------------


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


# -- the attackers ---------------------------------------------------------------------------


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


def max_body(args: argparse.Namespace) -> int:
    return int(args.max_body_mib * 1024 * 1024)
