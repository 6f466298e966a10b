"""Connections to backends: a keep-alive pool per backend, response heads and
bodies parsed by httptools and handed to the exchange that owns the connection.

Contract:
- An ``UpstreamConnection`` belongs to at most one exchange at a time; while
  it is idle it sits in its ``Pool``.  Every parser event goes to the owner
  (``response_head``/``response_body``/``response_end``/``upstream_lost``).
- A connection goes back to the pool only when its exchange says so, after
  a complete response on a connection the backend keeps alive.  An idle
  connection the backend closes is dropped from the pool at once; one idle
  longer than ``keepalive`` is closed when met (backends close theirs at
  about 5 s, and a write into a half-closed socket is the classic stale race).
- ``reused`` tells the exchange whether a failure before any response byte
  may just be that race, so that it can try again on a fresh connection.
- Interim 1xx responses are swallowed: the router answers ``Expect`` itself.
- A response head is limited to ``MAX_HEAD_BYTES``, counted as its bytes
  arrive (httptools hands a header line over only once it ends), and so are
  trailers and chunk framing (bytes after the head that carry no body
  byte): a backend cannot make the router buffer without bound.
- A parser that was replaced (a HEAD's answer ends at its head) fires
  nothing more: its late events belong to no exchange.
- A read that took more than ``YIELD_EVENTS`` body pieces (a backend sending
  tiny chunks) pauses reading until the loop's next turn: libuv reads up to
  32 times per poll, and one 256 KiB read of 2-byte chunks costs ~13 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import httptools

from .log import get_logger

if TYPE_CHECKING:
    from .exchange import Exchange

__all__ = ["Pool", "UpstreamConnection"]

log = get_logger("upstream")

WRITE_HIGH_WATER = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024  # a response head larger than this is not an LLM server's
YIELD_EVENTS = 1024  # body pieces in one read past which the next read waits a turn


class _HeadTooLarge(Exception):
    pass


class UpstreamConnection(asyncio.Protocol):
    __slots__ = (
        "_body_in_read",
        "_events",
        "_head_bytes",
        "_headers",
        "_in_head",
        "_in_message",
        "_interim",
        "_stale",
        "_unparsed",
        "_yielding",
        "exchange",
        "idle_since",
        "open",
        "parser",
        "pool",
        "reused",
        "transport",
    )

    def __init__(self, pool: Pool):
        self.pool = pool
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set at once
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._in_head = False  # a response head has begun and not ended
        self._in_message = False  # a response has begun and not ended
        self._unparsed = 0  # bytes of the head, or of framing with no body byte, so far
        self._body_in_read = False
        self._events = 0  # body pieces in the read being fed
        self._yielding = False  # reading paused until the loop's next turn
        self._stale = False  # the parser in feed_data was replaced: ignore its events
        self._interim = False
        self.open = False
        self.reused = False
        self.idle_since = 0.0

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        self.open = True
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # bytes from an idle backend: nothing can follow them
            self.close()
            return
        exchange.upstream_read()
        self._stale = False
        self._body_in_read = False
        self._events = 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if not isinstance(cause, _HeadTooLarge):
                log.error("response handling failed", exc_info=cause)
            self._give_up(exchange, str(cause) if cause else "invalid response")
            return
        except httptools.HttpParserError as exc:
            self._give_up(exchange, f"invalid response from backend: {exc}")
            return
        if self._in_message and not self._body_in_read:
            # A head not yet ended, or trailers: bounded as the bytes arrive.
            self._unparsed += len(data)
            if self._unparsed > MAX_HEAD_BYTES:
                where = "head" if self._in_head else "trailers"
                self._give_up(
                    exchange, f"invalid response from backend: {where} over {MAX_HEAD_BYTES} bytes"
                )
                return
        exchange.flush()
        if self._events > YIELD_EVENTS and self.exchange is exchange and not self._yielding:
            self._yielding = True  # (a response that ended in this read needs no turn)
            self.transport.pause_reading()
            asyncio.get_running_loop().call_soon(self._yielded)

    def _yielded(self) -> None:
        self._yielding = False
        exchange = self.exchange
        if self.open and (exchange is None or not exchange.client_paused):
            self.transport.resume_reading()  # else: the exchange resumes it when the client drains

    def _give_up(self, exchange: Exchange, reason: str) -> None:
        self.exchange = None
        self.close()
        exchange.upstream_lost(reason)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        exchange = self.exchange
        if exchange is not None:
            self.exchange = None
            # A close-delimited body ends with the connection: feed_data(b"")
            # does not signal it, so the exchange decides from its framing.
            exchange.upstream_lost(f"backend closed the connection: {exc}" if exc else None)
        else:
            self.pool.forget(self)

    def pause_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.upstream_write_paused()

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.upstream_write_resumed()

    # -- httptools callbacks ---------------------------------------------------

    def on_message_begin(self) -> None:
        self._headers = []  # trailers of the last response must not leak into this one
        self._head_bytes = 0
        self._in_head = True
        self._in_message = True
        self._unparsed = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._stale:
            return
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _HeadTooLarge(f"invalid response from backend: head over {MAX_HEAD_BYTES} bytes")
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._unparsed = 0
        if self._stale:
            return
        status = self.parser.get_status_code()
        headers, self._headers = self._headers, []
        if 100 <= status < 200:
            self._interim = True
            return
        assert self.exchange is not None
        self.exchange.response_head(status, headers, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        self._events += 1
        self._body_in_read = True
        self._unparsed = 0
        if self.exchange is not None and not self._stale:
            self.exchange.response_body(body)

    def on_message_complete(self) -> None:
        self._in_head = self._in_message = False
        if self._stale:
            return
        if self._interim:
            self._interim = False
            return
        exchange = self.exchange
        if exchange is not None:
            exchange.response_end(self.parser.should_keep_alive())

    def expect_new_response(self) -> None:
        """Forget the response in progress (it answered HEAD: it has no body)."""
        self.parser = httptools.HttpResponseParser(self)
        self._stale = True  # until the next read, which the new parser gets
        self._in_head = self._in_message = False

    # -- ownership -------------------------------------------------------------

    def attach(self, exchange: Exchange) -> None:
        self.exchange = exchange

    def close(self) -> None:
        self.exchange = None
        self.open = False
        self.transport.close()


class Pool:
    """Idle keep-alive connections to one backend, most recently used first."""

    __slots__ = ("_idle", "authority", "closed", "host", "keepalive", "loop", "max_idle", "port")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        *,
        max_idle: int,
        keepalive: float,
    ):
        self.loop = loop
        self.host = host
        self.port = port
        # The Host of clients that sent none (HTTP/1.0); an IPv6 literal in brackets.
        self.authority = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}").encode()
        self.max_idle = max_idle
        self.keepalive = keepalive
        self._idle: list[UpstreamConnection] = []
        self.closed = False  # the backend was removed: nothing comes back in

    @property
    def idle(self) -> int:
        """Pooled connections (the prefix_router_upstream_idle_connections gauge)."""
        return len(self._idle)

    def take(self) -> UpstreamConnection | None:
        """An open idle connection, or None; connections idle too long are closed."""
        idle = self._idle
        oldest_allowed = self.loop.time() - self.keepalive
        while idle:
            conn = idle.pop()
            if conn.open and conn.idle_since > oldest_allowed:
                conn.reused = True
                return conn
            conn.close()
        return None

    def connect(self, timeout: float) -> asyncio.Future[UpstreamConnection]:
        """Open a new connection; the future fails with OSError or TimeoutError."""
        return asyncio.ensure_future(asyncio.wait_for(self._open(), timeout))

    async def _open(self) -> UpstreamConnection:
        factory: Callable[[], UpstreamConnection] = lambda: UpstreamConnection(self)  # noqa: E731
        _, conn = await self.loop.create_connection(factory, self.host, self.port)
        return conn

    def give_back(self, conn: UpstreamConnection) -> None:
        conn.exchange = None
        if self.closed or not conn.open or len(self._idle) >= self.max_idle:
            conn.close()
            return
        conn.transport.resume_reading()  # idempotent; the exchange may have paused it
        conn.idle_since = self.loop.time()
        self._idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        """Drop a connection the backend closed while it was idle."""
        with contextlib.suppress(ValueError):
            self._idle.remove(conn)

    def sweep(self) -> None:
        """Close connections idle past ``keepalive`` (called every few seconds)."""
        oldest_allowed = self.loop.time() - self.keepalive
        keep = []
        for conn in self._idle:
            if conn.open and conn.idle_since > oldest_allowed:
                keep.append(conn)
            else:
                conn.close()
        self._idle = keep

    def close(self) -> None:
        self.closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
