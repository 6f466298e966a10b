"""Our HTTP/1.1 load client (httptools): closed loop, paced open loop, held streams.

Contract: one ``Conn`` is one keep-alive connection with TCP_NODELAY, one
request at a time; latency and time to first body byte are measured from
when a request was sent (closed loop) or due (paced); every loop and wait is
bounded.  Percentiles are ``router.metrics.percentile`` (nearest rank).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import deque
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import httptools

from router.metrics import percentile


def split_url(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
    return host, int(port)


class Conn(asyncio.Protocol):
    """One keep-alive client connection; ``request`` -> (status, first byte, end, bytes)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[tuple[int, float, float, int]] | None = None
        self.first_waiter: asyncio.Future[float] | None = None
        self.closed = False
        self.keep = True
        self.keep_body: list[bytes] | None = None  # set to collect the body
        self._status = 0
        self._first = 0.0
        self._bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(exc or ConnectionResetError("connection closed"))

    def _fail(self, exc: Exception) -> None:
        for waiter in (self.waiter, self.first_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)
        self.waiter = self.first_waiter = None

    def on_headers_complete(self) -> None:
        self._status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if not self._first:
            self._first = perf_counter()
            first = self.first_waiter
            if first is not None and not first.done():
                first.set_result(self._first)
        self._bytes += len(body)
        if self.keep_body is not None:
            self.keep_body.append(body)

    def on_message_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()
        waiter, self.waiter = self.waiter, None
        end = perf_counter()
        if waiter is not None and not waiter.done():
            waiter.set_result((self._status, self._first or end, end, self._bytes))

    def request(self, data: bytes) -> asyncio.Future[tuple[int, float, float, int]]:
        assert self.transport is not None
        self._first, self._bytes, self._status = 0.0, 0, 0
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def connect(host: str, port: int) -> Conn:
    _, conn = await asyncio.get_running_loop().create_connection(Conn, host, port)
    return conn


@dataclass
class GenStats:
    requests: int = 0
    errors: int = 0
    bad_status: int = 0
    seconds: float = 0.0
    bytes: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)  # seconds
    ttfbs: list[float] = field(default_factory=list, repr=False)
    p50_ms: float | None = None
    p99_ms: float | None = None
    ttfb_p50_ms: float | None = None
    ttfb_p99_ms: float | None = None
    offered_rate: float | None = None
    generator: str = "python"

    def finish(self) -> GenStats:
        if self.latencies:
            self.p50_ms = _ms(percentile(self.latencies, 0.50))
            self.p99_ms = _ms(percentile(self.latencies, 0.99))
        if self.ttfbs:
            self.ttfb_p50_ms = _ms(percentile(self.ttfbs, 0.50))
            self.ttfb_p99_ms = _ms(percentile(self.ttfbs, 0.99))
        return self

    def record(self, status: int, t0: float, first: float, end: float, nbytes: int) -> None:
        self.requests += 1
        self.bytes += nbytes
        if status >= 400 or status == 0:
            self.bad_status += 1
        self.latencies.append(end - t0)
        self.ttfbs.append(first - t0)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


async def closed_loop(url: str, reqs: list[bytes], seconds: float, connections: int) -> GenStats:
    """``connections`` keep-alive connections, each sending its next request on each answer."""
    host, port = split_url(url)
    stats = GenStats()
    start = perf_counter()
    deadline = start + seconds

    async def worker(index: int) -> None:
        conn: Conn | None = None
        j = index
        while perf_counter() < deadline:
            try:
                if conn is None or conn.closed or not conn.keep:
                    if conn is not None:
                        conn.close()
                    conn = await connect(host, port)
                t0 = perf_counter()
                status, first, end, nbytes = await conn.request(reqs[j % len(reqs)])
            except (OSError, httptools.HttpParserError):
                stats.errors += 1
                conn = None
                await asyncio.sleep(0.01)
                continue
            stats.record(status, t0, first, end, nbytes)
            j += connections
        if conn is not None:
            conn.close()

    async with asyncio.timeout(seconds + 30):
        await asyncio.gather(*(worker(i) for i in range(connections)))
    stats.seconds = perf_counter() - start
    return stats.finish()


async def paced(url: str, reqs: list[bytes], rate: float, seconds: float, pool: int) -> GenStats:
    """Open loop at ``rate``/s in 1 ms ticks (uvloop timers are millisecond-grained).

    Latency runs from the tick a request became due, so waiting for a free
    connection counts (no coordinated omission beyond the tick).
    """
    host, port = split_url(url)
    stats = GenStats(offered_rate=rate)
    loop = asyncio.get_running_loop()
    idle: deque[Conn] = deque([await connect(host, port) for _ in range(pool)])
    waiting: deque[tuple[float, int]] = deque()
    outstanding = 0
    quiet = asyncio.Event()
    reconnects: set[asyncio.Task[None]] = set()

    def launch(conn: Conn, due: float, j: int) -> None:
        nonlocal outstanding
        outstanding += 1
        try:
            future = conn.request(reqs[j % len(reqs)])
        except Exception:  # a transport that closed meanwhile
            future = loop.create_future()
            future.set_exception(ConnectionResetError())
        future.add_done_callback(lambda f: finished(conn, due, f))

    def finished(conn: Conn, due: float, future: asyncio.Future[Any]) -> None:
        nonlocal outstanding
        outstanding -= 1
        ok = future.exception() is None
        if ok:
            status, first, end, nbytes = future.result()
            stats.record(status, due, first, end, nbytes)
        else:
            stats.errors += 1
        if ok and conn.keep and not conn.closed:
            ready(conn)
        else:  # a new connection takes its place
            conn.close()
            task = loop.create_task(replace())
            reconnects.add(task)
            task.add_done_callback(reconnects.discard)
        if not outstanding and not waiting:
            quiet.set()

    def ready(conn: Conn) -> None:
        if waiting:
            launch(conn, *waiting.popleft())
        else:
            idle.append(conn)

    async def replace() -> None:
        with contextlib.suppress(OSError):
            ready(await connect(host, port))

    total = max(1, round(rate * seconds))
    sent = 0
    start = perf_counter()
    while sent < total:
        now = perf_counter()
        due_count = min(total, int((now - start) * rate) + 1)
        while sent < due_count:
            if idle:
                launch(idle.popleft(), now, sent)
            else:
                waiting.append((now, sent))
            sent += 1
        await asyncio.sleep(0.001)
    stats.seconds = perf_counter() - start
    if outstanding or waiting:
        quiet.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):
                await quiet.wait()
    stats.errors += outstanding + len(waiting)
    for conn in idle:
        conn.close()
    for task in list(reconnects):
        task.cancel()
    return stats.finish()


async def open_streams(
    url: str, request: bytes, count: int, within: float
) -> tuple[list[Conn], int, int]:
    """Open ``count`` streams; (connections, established, failed) once each has its
    first body byte, or ``within`` seconds have passed."""
    host, port = split_url(url)
    gate = asyncio.Semaphore(200)  # connects in flight: under every listen backlog
    conns: list[Conn] = []

    async def one() -> bool:
        async with gate:
            conn = await connect(host, port)
            conns.append(conn)
            first = conn.first_waiter = asyncio.get_running_loop().create_future()
            # Never awaited: a stream that fails leaves its exception here, read.
            conn.request(request).add_done_callback(_ignore)
            await first
            conn.waiter = None  # never awaited: the stream stays open until we close it
            return True

    tasks = [asyncio.ensure_future(one()) for _ in range(count)]
    done, pending = await asyncio.wait(tasks, timeout=within)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    ok = sum(1 for t in done if not t.cancelled() and t.exception() is None)
    return conns, ok, count - ok


def _ignore(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def fetch_json(url: str, path: str) -> Any:
    host, port = split_url(url)
    conn = await connect(host, port)
    body: list[bytes] = []
    conn.keep_body = body
    try:
        async with asyncio.timeout(5):
            status, *_ = await conn.request(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    finally:
        conn.close()
    return json.loads(b"".join(body)) if status == 200 else None
