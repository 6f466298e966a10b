"""Abusive clients, for the soak: one process of attackers on their own connections.

    python -m loadtests.attackers --url http://127.0.0.1:8080 --start-after 6 --seconds 30

``python -m loadtests.soak --attackers`` starts it beside its checked traffic,
as a child of its own (its CPU and descriptors are not the generator's).
Each kind below runs rounds from ``--start-after`` until ``--seconds`` later;
every round is bounded in time (an answer, or the kind's own bound) and in
bytes (fixed per round), and the number of rounds is capped, so the process
stops by itself.  Everything is on the loopback address the router listens on.

Kinds (the answer the router owes, with the soak's timeouts):

- ``slowloris``: ``SLOW`` connections trickle a request head, a byte a second:
  408 at ``client_header`` (progress does not extend it);
- ``slow body``: OpenAI and native bodies a byte a second (native ones are
  routed: they hold a backend connection and a lease) until the kind's bound,
  then the attacker leaves; ``stalled body``: half a body, then nothing: 408
  at ``client_body``;
- ``2-byte chunks``: a chat and a native body of ``TINY_BYTES`` in 2-byte
  chunks, one write: 200 (a complete, routed request);
- ``pipelined``: ``PIPELINED`` requests in one write that the router answers
  itself (a chat body it cannot read: 400, keep-alive): that many 400s;
- ``oversized``: a 40 kB header (431), a 40 kB target (414), 101 headers
  (431), a declared OpenAI body over ``max_body_bytes`` (413), the same body
  sent chunked until refused (413);
- ``never read``: streaming chat answers of ``NEVER_READ_TOKENS`` tokens,
  pipelined, on connections with a small receive buffer that read nothing:
  once the router's buffer is full it pauses the backend and resets the
  client at ``client_send``; but on loopback the kernel's send buffer grows
  to ``tcp_wmem``'s maximum (4 MiB here) and takes what the router writes,
  so the router holds nothing and has nothing to time out: then ``left``;
  ``never read: pipelined 400s``: ``PIPELINED`` requests the router answers
  itself (~5 MB of answers), none read: the same;
- ``half-open``: a write side shut at once, after a whole request and after
  half a head: nothing or an answer, then the close;
- ``flood``: ``--flood`` idle connections at once (the soak sizes it near the
  router's client cap, below it by what the checked traffic and the other
  attackers may hold): closed at ``client_header`` without an answer, never a
  503;
- ``malformed``: one request of each of ``MALFORMED`` (smuggling framings,
  bad versions and methods, control bytes, a TLS hello): 400/501/505.

The result is one JSON line on stdout: per kind, the connections opened,
bytes sent, rounds, and the router's answers (``HTTP nnn`` for the first
status line, ``closed``, ``reset``, or ``left`` when the attacker's own bound
came first).  ``EXPECTED`` says which answers a kind must always get: those
that do not depend on timing; ``unexpected()`` lists the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import socket
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

__all__ = [
    "EXPECTED",
    "MALFORMED",
    "PIPELINED",
    "Tally",
    "held_connections",
    "longest_round",
    "main",
    "unexpected",
    "wait_for",
]

SLOW = 16  # slowloris connections
SLOW_BODIES = 8  # 4 OpenAI, 4 native
STALLED_BODIES = 4
NEVER_READ = 4  # connections
NEVER_READ_REQUESTS = 8  # pipelined on each
NEVER_READ_TOKENS = 3000  # ~6 s of stream each at the soak's 2 ms a token
HALF_OPEN = 3
PIPELINED = 20_000  # the default of --pipelined
TINY_BYTES = 256 * 1024
ROUND_GAP_S = 0.5  # between two rounds of a kind
ANSWER_S = 20.0  # a kind that is answered at once gets this long
# A timed kind waits twice the router's timeout, then leaves; the flood also gets
# CONNECT_S a connection for its connects (~0.7 ms each measured, 9,500 in 6 s).
CONNECT_S = 0.001


def wait_for(timeout: float, hold: float) -> float:
    """How long a timed kind waits for the router's answer (its ``timeout``): twice
    that, or ``hold`` seconds when that is shorter (a quick run leaves first)."""
    return min(2 * timeout, hold) if hold > 0 else 2 * timeout


def longest_round(client: float, flood: int, hold: float = 0.0) -> float:
    """The longest a round of any kind lasts, with the soak's timeouts (``client_header``
    = ``client_body`` = ``client``, ``client_send`` = 2 ``client``); kinds answered at
    once end at their answer (ANSWER_S is only their safety bound)."""
    send = wait_for(2 * client, hold)
    return max(send + min(1.0, send), wait_for(client, hold) + CONNECT_S * flood)


MAX_ROUNDS = {  # per run, whatever its length
    "pipelined": 4,
    "2-byte chunks": 20,
    "oversized": 10,
    "malformed": 10,
    "half-open": 20,
    "slowloris": 3,
    "slow body": 3,
    "stalled body": 3,
    "never read": 2,
    "never read: pipelined 400s": 2,
    "flood": 1,
}

_CHAT = b'{"model":"m","max_tokens":2,"messages":[{"role":"user","content":"%s"}]}'
_HOST = b"Host: attacker\r\n"
# A request the router answers itself (400: a chat body it cannot read; keep-alive).
LOCAL_400 = (
    b"POST /v1/chat/completions HTTP/1.1\r\n" + _HOST
    + b"Content-Type: application/json\r\nContent-Length: 15\r\n\r\n" + b'{"messages": 1}'
)  # fmt: skip

MALFORMED: dict[str, bytes] = {
    "CL+TE": b"POST /invocations HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "duplicate CL": b"POST /invocations HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n"
    b"Content-Length: 5\r\n\r\nabcde",
    "bad chunk size": b"POST /invocations HTTP/1.1\r\nHost: a\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    "obs-fold": b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n",
    "bare LF": b"GET /v1/models HTTP/1.1\nHost: a\n\n",
    "space before colon": b"GET /v1/models HTTP/1.1\r\nHost : a\r\n\r\n",
    "NUL in a header": b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-A: b\x00c\r\n\r\n",
    "HTTP/9.9": b"GET /v1/models HTTP/9.9\r\nHost: a\r\n\r\n",
    "bad method": b"G(T /v1/models HTTP/1.1\r\nHost: a\r\n\r\n",
    "no Host": b"GET /v1/models HTTP/1.1\r\n\r\n",
    "gzip coding": b"POST /invocations HTTP/1.1\r\nHost: a\r\n"
    b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "TLS hello": bytes.fromhex("16030100a5010000a10303") + bytes(32) + b"\r\n\r\n",
}

# The answers that do not depend on timing: a kind's every attempt gets one of them.
EXPECTED: dict[str, set[str]] = {
    "oversized: 40 kB header": {"HTTP 431"},
    "oversized: 40 kB target": {"HTTP 414"},
    "oversized: 101 headers": {"HTTP 431"},
    "oversized: declared body": {"HTTP 413"},
    "oversized: chunked body": {"HTTP 413"},
    "2-byte chunks: chat": {"HTTP 200"},
    "2-byte chunks: native": {"HTTP 200"},
    "pipelined": {"HTTP 400", "left"},  # left: not all answered within its bound
    **{f"malformed: {name}": {"HTTP 400", "HTTP 501", "HTTP 505"} for name in MALFORMED},
    # An idle connection is closed at client_header without an answer; never a 503
    # (the flood stays under the cap) and never an early close.
    "flood": {"closed", "left"},
    "slowloris": {"HTTP 408", "left"},
    "stalled body": {"HTTP 408", "left"},
}


def held_connections() -> int:
    """Connections the attackers other than the flood may hold at once (the soak's margin)."""
    return SLOW + SLOW_BODIES + STALLED_BODIES + NEVER_READ + 1 + HALF_OPEN + 8


@dataclass
class Kind:
    rounds: int = 0
    connections: int = 0
    bytes_sent: int = 0
    answers: Counter[str] = field(default_factory=Counter)


@dataclass
class Tally:
    kinds: dict[str, Kind] = field(default_factory=dict)

    def kind(self, name: str) -> Kind:
        return self.kinds.setdefault(name, Kind())

    def as_json(self) -> dict[str, dict[str, object]]:
        return {
            name: {
                "rounds": k.rounds,
                "connections": k.connections,
                "bytes_sent": k.bytes_sent,
                "answers": dict(k.answers),
            }
            for name, k in sorted(self.kinds.items())
        }


def unexpected(kinds: dict[str, dict[str, object]]) -> list[str]:
    """Answers outside ``EXPECTED`` (the timing-free ones), as lines."""
    out = []
    for name, allowed in EXPECTED.items():
        answers = kinds.get(name, {}).get("answers", {})
        assert isinstance(answers, dict)
        out += [f"{name}: {n} x {a}" for a, n in answers.items() if a not in allowed]
    return out


# -- one connection -------------------------------------------------------------------


@dataclass
class Target:
    host: str
    port: int
    client_header: float
    client_body: float
    client_send: float
    pipelined: int
    hold: float
    max_body: int


async def connect(
    target: Target, kind: Kind, rcvbuf: int = 0
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (target.host, target.port))
    except BaseException:
        sock.close()
        raise
    kind.connections += 1
    # With a small receive buffer the stream's own buffer is small too: it stops
    # reading from the socket at twice its limit (a client that reads nothing).
    return await asyncio.open_connection(sock=sock, limit=rcvbuf or 1 << 20)


def send(writer: asyncio.StreamWriter, kind: Kind, data: bytes) -> None:
    writer.write(data)
    kind.bytes_sent += len(data)


async def status(reader: asyncio.StreamReader, until: float) -> str:
    """The first status line as ``HTTP nnn``; ``closed``, ``reset`` or ``left`` (our bound)."""
    try:
        async with asyncio.timeout_at(until):
            line = await reader.readline()
    except TimeoutError:
        return "left"
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    if not line:
        return "closed"
    parts = line.split()
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/"):
        return f"HTTP {parts[1].decode(errors='replace')}"
    return "not HTTP"


def drop(writer: asyncio.StreamWriter) -> None:
    """Leave at once: an abort (a reset), the descriptor freed now."""
    writer.transport.abort()


async def write_then_status(
    target: Target, kind: Kind, data: bytes, until: float, pieces: int = 1
) -> str:
    reader, writer = await connect(target, kind)
    try:
        size = -(-len(data) // pieces)
        for at in range(0, len(data), size):
            send(writer, kind, data[at : at + size])
            with contextlib.suppress(ConnectionError):
                await writer.drain()  # the router may refuse before the rest
        return await status(reader, until)
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    finally:
        drop(writer)


# -- the kinds -------------------------------------------------------------------------


async def oversized(target: Target, tally: Tally, now: float) -> None:
    until = now + ANSWER_S
    cases = {
        "40 kB header": b"GET /v1/models HTTP/1.1\r\n" + _HOST + b"X-Big: "
        + b"a" * 40_000 + b"\r\n\r\n",
        "40 kB target": b"GET /" + b"a" * 40_000 + b" HTTP/1.1\r\n" + _HOST + b"\r\n",
        "101 headers": b"GET /v1/models HTTP/1.1\r\n" + _HOST
        + b"".join(b"X-H%d: v\r\n" % i for i in range(101)) + b"\r\n",
        "declared body": b"POST /v1/chat/completions HTTP/1.1\r\n" + _HOST
        + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (target.max_body + 1)
        + b'{"messages":[{"role":"user","content":"' + b"a" * 65536,
    }  # fmt: skip
    for name, data in cases.items():
        kind = tally.kind(f"oversized: {name}")
        kind.rounds += 1
        kind.answers[await write_then_status(target, kind, data, until)] += 1
    kind = tally.kind("oversized: chunked body")
    kind.rounds += 1
    kind.answers[await chunked_oversize(target, kind, until)] += 1


async def chunked_oversize(target: Target, kind: Kind, until: float) -> str:
    """An OpenAI body sent chunked, 1 MiB a chunk, until refused or past the limit."""
    reader, writer = await connect(target, kind)
    head = b"POST /v1/chat/completions HTTP/1.1\r\n" + _HOST + b"Transfer-Encoding: chunked\r\n\r\n"
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"a" * (1 << 20))
    answer = asyncio.ensure_future(status(reader, until))
    try:
        send(writer, kind, head)
        for _ in range(target.max_body // (1 << 20) + 2):  # bounded: the limit + 2 MiB
            if answer.done():
                break
            send(writer, kind, chunk)
            await writer.drain()
        return await answer
    except (ConnectionResetError, BrokenPipeError):
        return await answer if answer.done() else "reset"
    finally:
        answer.cancel()
        drop(writer)


async def malformed(target: Target, tally: Tally, now: float) -> None:
    for name, data in MALFORMED.items():
        kind = tally.kind(f"malformed: {name}")
        kind.rounds += 1
        kind.answers[await write_then_status(target, kind, data, now + ANSWER_S)] += 1


async def tiny_chunks(target: Target, tally: Tally, now: float) -> None:
    text = b"a" * (TINY_BYTES - 80)
    chunked = _HOST + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
    close = b"Connection: close\r\n\r\n"
    for name, path, body in (
        ("chat", b"/v1/chat/completions", _CHAT % text),
        ("native", b"/invocations", b'{"inputs":"' + text + b'","parameters":{}}'),
    ):
        kind = tally.kind(f"2-byte chunks: {name}")
        kind.rounds += 1
        framed = b"".join(b"2\r\n%s\r\n" % body[i : i + 2] for i in range(0, len(body) - 1, 2))
        if len(body) % 2:
            framed += b"1\r\n%s\r\n" % body[-1:]
        data = b"POST " + path + b" HTTP/1.1\r\n" + chunked + close + framed + b"0\r\n\r\n"
        kind.answers[await write_then_status(target, kind, data, now + ANSWER_S)] += 1


async def pipelined(target: Target, tally: Tally, now: float) -> None:
    kind = tally.kind("pipelined")
    kind.rounds += 1
    reader, writer = await connect(target, kind)
    send(writer, kind, LOCAL_400 * target.pipelined)
    marker, tail, seen = b"HTTP/1.1 ", b"", Counter[str]()
    try:
        async with asyncio.timeout_at(now + wait_for(target.client_send, target.hold)):
            while sum(seen.values()) < target.pipelined:
                data = await reader.read(1 << 16)
                if not data:
                    seen["closed"] += 1
                    break
                window = tail + data
                at = window.find(marker)
                while at >= 0 and at + 12 <= len(window):
                    seen[f"HTTP {window[at + 9 : at + 12].decode()}"] += 1
                    at = window.find(marker, at + 12)
                keep = at if at >= 0 else len(window) - len(marker) + 1
                tail = window[max(0, keep) :]
    except TimeoutError:
        seen["left"] += target.pipelined - sum(seen.values())
    except ConnectionResetError:
        seen["reset"] += 1
    finally:
        drop(writer)
    kind.answers.update(seen)


async def slowloris(target: Target, tally: Tally, now: float) -> None:
    kind = tally.kind("slowloris")
    kind.rounds += 1
    until = now + wait_for(target.client_header, target.hold)  # the router's 408 first

    async def one() -> str:
        reader, writer = await connect(target, kind)
        head = b"GET /v1/models HTTP/1.1\r\n" + _HOST + b"X-Slow: " + b"a" * 60 + b"\r\n\r\n"
        answer = asyncio.ensure_future(status(reader, until))
        try:
            for byte in head:
                send(writer, kind, bytes([byte]))
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):  # a byte a second, unless answered
                        await asyncio.shield(answer)
                if answer.done():
                    break
            return await answer
        except ConnectionError:
            return await answer if answer.done() else "reset"
        finally:
            answer.cancel()
            drop(writer)

    for answer in await asyncio.gather(*(one() for _ in range(SLOW))):
        kind.answers[answer] += 1


async def slow_bodies(target: Target, tally: Tally, now: float) -> None:
    """Bodies a byte a second, until our bound (``client_body`` is a stall, not a pace)."""
    kind = tally.kind("slow body")
    kind.rounds += 1
    until = now + wait_for(max(target.client_body, target.client_header), target.hold)
    body = _CHAT % b"slow"

    async def one(path: bytes) -> str:
        reader, writer = await connect(target, kind)
        head = b"POST " + path + b" HTTP/1.1\r\n" + _HOST + b"Content-Length: %d\r\n\r\n"
        answer = asyncio.ensure_future(status(reader, until))
        try:
            send(writer, kind, head % len(body))
            for byte in body:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):  # a byte a second, unless answered
                        await asyncio.shield(answer)
                if answer.done():
                    break
                send(writer, kind, bytes([byte]))
            return await answer
        except ConnectionError:
            return await answer if answer.done() else "reset"
        finally:
            answer.cancel()
            drop(writer)

    paths = [b"/v1/chat/completions", b"/invocations"] * (SLOW_BODIES // 2)
    for answer in await asyncio.gather(*(one(path) for path in paths)):
        kind.answers[answer] += 1


async def stalled_bodies(target: Target, tally: Tally, now: float) -> None:
    kind = tally.kind("stalled body")
    kind.rounds += 1
    until = now + wait_for(target.client_body, target.hold)
    body = _CHAT % b"stalled"
    head = b"POST /v1/chat/completions HTTP/1.1\r\n" + _HOST + b"Content-Length: %d\r\n\r\n"
    data = head % len(body) + body[: len(body) // 2]

    async def one() -> str:
        reader, writer = await connect(target, kind)
        try:
            send(writer, kind, data)
            return await status(reader, until)
        finally:
            drop(writer)

    for answer in await asyncio.gather(*(one() for _ in range(STALLED_BODIES))):
        kind.answers[answer] += 1


async def never_read(target: Target, tally: Tally, now: float) -> None:
    """Streams asked for and never read; after our bound, what the socket says."""
    kind = tally.kind("never read")
    kind.rounds += 1
    until = now + wait_for(target.client_send, target.hold)
    body = (
        b'{"model":"m","stream":true,"max_tokens":%d,"messages":[{"role":"user",'
        b'"content":"never read %d"}]}'
    )

    async def one(n: int) -> str:
        reader, writer = await connect(target, kind, rcvbuf=4096)
        try:
            for i in range(NEVER_READ_REQUESTS):
                payload = body % (NEVER_READ_TOKENS, n * 100 + i)
                send(writer, kind, b"POST /v1/chat/completions HTTP/1.1\r\n" + _HOST
                     + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)  # fmt: skip
            with contextlib.suppress(ConnectionError):
                await writer.drain()
            await asyncio.sleep(max(0.0, until - asyncio.get_running_loop().time()))  # unread
            return await after_silence(reader, until - now)
        finally:
            drop(writer)

    for answer in await asyncio.gather(*(one(n) for n in range(NEVER_READ))):
        kind.answers[answer] += 1


async def never_read_pipelined(target: Target, tally: Tally, now: float) -> None:
    """``PIPELINED`` requests the router answers itself (~5 MB of 400s), none read."""
    kind = tally.kind("never read: pipelined 400s")
    kind.rounds += 1
    until = now + wait_for(target.client_send, target.hold)
    reader, writer = await connect(target, kind, rcvbuf=4096)
    try:
        send(writer, kind, LOCAL_400 * target.pipelined)  # not drained: the router stops reading
        await asyncio.sleep(max(0.0, until - asyncio.get_running_loop().time()))  # unread
        kind.answers[await after_silence(reader, until - now)] += 1
    finally:
        drop(writer)


async def after_silence(reader: asyncio.StreamReader, waited: float) -> str:
    """What the router did while we read nothing: the bytes it sent, then a reset or not
    (read for at most a second, or as long as we waited)."""
    try:
        async with asyncio.timeout(min(1.0, waited)):
            while await reader.read(1 << 16):
                pass
        return "closed"
    except TimeoutError:
        return "left"
    except ConnectionResetError:
        return "reset"


async def half_open(target: Target, tally: Tally, now: float) -> None:
    cases = {
        "nothing": b"",
        "a whole request": b"GET /v1/models HTTP/1.1\r\n" + _HOST + b"\r\n",
        "half a head": b"GET /v1/models HTTP/1.1\r\nHo",
    }
    for name, data in cases.items():
        kind = tally.kind(f"half-open: {name}")
        kind.rounds += 1
        reader, writer = await connect(target, kind)
        try:
            if data:
                send(writer, kind, data)
            writer.write_eof()
            kind.answers[await status(reader, now + ANSWER_S)] += 1
        finally:
            drop(writer)


async def flood(target: Target, tally: Tally, now: float, count: int) -> None:
    """``count`` idle connections at once, held until the router answers them (408)."""
    kind = tally.kind("flood")
    kind.rounds += 1
    until = now + wait_for(target.client_header, target.hold) + CONNECT_S * count
    gate = asyncio.Semaphore(256)  # connects in flight; all stay open together

    async def one() -> str:
        async with gate:
            try:
                reader, writer = await connect(target, kind)
            except OSError as exc:
                return f"connect failed: {exc.strerror}"
        try:
            return await status(reader, until)
        finally:
            drop(writer)

    for answer in await asyncio.gather(*(one() for _ in range(count))):
        kind.answers[answer] += 1


# -- the run ---------------------------------------------------------------------------

Attack = Callable[[Target, Tally, float], Awaitable[None]]


async def rounds(name: str, attack: Attack, target: Target, tally: Tally, end: float) -> None:
    """Rounds of ``attack`` until ``end`` (a round started runs to its own bound)."""
    loop = asyncio.get_running_loop()
    for _ in range(MAX_ROUNDS[name]):
        await attack(target, tally, loop.time())
        if loop.time() + ROUND_GAP_S >= end:
            return
        await asyncio.sleep(ROUND_GAP_S)  # the kind's pace: bounded rounds per second


async def run(args: argparse.Namespace) -> dict[str, object]:
    host, _, port = args.url.removeprefix("http://").rpartition(":")
    target = Target(
        host, int(port), args.client_header, args.client_body, args.client_send, args.pipelined,
        args.hold, args.max_body,
    )  # fmt: skip
    tally = Tally()
    loop = asyncio.get_running_loop()
    began = loop.time()

    async def flooded(target: Target, tally: Tally, now: float) -> None:
        if args.flood:
            await flood(target, tally, now, args.flood)

    kinds: dict[str, Attack] = {
        "flood": flooded,
        "slowloris": slowloris,
        "slow body": slow_bodies,
        "stalled body": stalled_bodies,
        "never read": never_read,
        "never read: pipelined 400s": never_read_pipelined,
        "pipelined": pipelined,
        "2-byte chunks": tiny_chunks,
        "oversized": oversized,
        "malformed": malformed,
        "half-open": half_open,
    }
    kinds = {name: attack for name, attack in kinds.items() if args.only in name}
    bursts = []
    for burst in range(args.bursts):
        start = began + args.start_after + burst * args.every
        await asyncio.sleep(max(0.0, start - loop.time()))  # the soak's quiet windows
        end = start + args.seconds
        await asyncio.gather(
            *(rounds(name, attack, target, tally, end) for name, attack in kinds.items())
        )
        bursts.append([round(start - began, 1), round(loop.time() - began, 1)])
    return {"bursts_s": bursts, "flood": args.flood, "kinds": tally.as_json()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtests.attackers", description=__doc__.split("\n")[0]
    )
    p.add_argument("--url", required=True, help="the router's client listener")
    p.add_argument("--start-after", type=float, default=0.0, help="seconds before attacking")
    p.add_argument("--seconds", type=float, default=30.0, help="a burst's rounds start until then")
    p.add_argument("--flood", type=int, default=0, help="idle connections at once (0: none)")
    p.add_argument("--bursts", type=int, default=1, help="attacks, --every seconds apart")
    p.add_argument("--only", default="", help="the kinds whose name contains this")
    p.add_argument("--every", type=float, default=0.0, help="seconds between two bursts")
    p.add_argument("--pipelined", type=int, default=PIPELINED, help="requests in one write")
    p.add_argument(
        "--max-body", type=int, default=32 * 1024 * 1024, help="the router's max_body_bytes"
    )
    p.add_argument(
        "--hold", type=float, default=0.0, help="timed kinds leave after this (0: 2 x timeout)"
    )
    p.add_argument("--client-header", type=float, default=10.0, help="the router's timeout")
    p.add_argument("--client-body", type=float, default=60.0, help="the router's timeout")
    p.add_argument("--client-send", type=float, default=60.0, help="the router's timeout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard and args.flood + 256 > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the flood's descriptors
    wall = time.monotonic()
    result = asyncio.run(run(args))
    result["wall_s"] = round(time.monotonic() - wall, 1)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
