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
- A read is parsed ``FEED_SLICE`` bytes at a time.  Once the read has taken
  ``FEED_EVENTS`` parser events (a backend sending tiny chunks), its rest
  waits unparsed for the loop's next turn, reading paused: one 256 KiB read
  of 2-byte chunks is ~65,000 events, ~13 ms of callbacks, and libuv reads
  up to 32 times per poll.  What the response gathered leaves for the client
  before the rest is parsed.
- Reading is paused while either reason holds (``pause``/``resume``): the
  client does not drain (``CLIENT``), or the rest of a read waits
  (``UNFED``).  A connection given back to its pool reads again.
- An ``https://`` backend's pool connects over TLS (``router.backendtls``):
  the handshake is part of the connect and its timeout; the pooled
  connection is reused as a plain one is.
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
    from .backendtls import BackendTLS
    from .relay import Relay

__all__ = ["Pool", "UpstreamConnection"]

log = get_logger("upstream")

WRITE_HIGH_WATER = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024  # a response head larger than this is not an LLM server's
# One callback parses at most FEED_EVENTS parser events (body pieces, heads),
# a slice of FEED_SLICE bytes at a time: a few ms at most, however the backend
# frames its response.
FEED_SLICE = 8 * 1024
FEED_EVENTS = 4096

# Why reading is paused (bits of UpstreamConnection._paused).
CLIENT = 1  # the client's write buffer is full: nothing more is read for it
UNFED = 2  # the rest of a read waits unparsed for the loop's next turn

UNASKED = "invalid response from backend: bytes after a complete response"


class _Invalid(Exception):
    """A response the router refuses to relay (its text is the reason)."""


class UpstreamConnection(asyncio.Protocol):
    __slots__ = (
        "_body_in_read",
        "_events",
        "_head_bytes",
        "_headers",
        "_in_head",
        "_in_message",
        "_interim",
        "_paused",
        "_stale",
        "_unfed",
        "_unfed_scheduled",
        "_unparsed",
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
        self.exchange: Relay | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._in_head = False  # a response head has begun and not ended
        self._in_message = False  # a response has begun and not ended
        self._unparsed = 0  # bytes of the head, or of framing with no body byte, so far
        self._body_in_read = False
        self._events = 0  # parser events of the read being fed
        self._paused = 0  # CLIENT | UNFED: reading is paused while any is set
        self._unfed: memoryview | None = None  # the rest of a read, not parsed yet
        self._unfed_scheduled = False  # _feed_unfed is due (call_soon)
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
        if self._unfed is not None:  # reading is paused: only a stray read lands here
            self._unfed = memoryview(bytes(self._unfed) + data)
            return
        exchange.upstream_read()
        self._stale = False
        self._feed(exchange, data)

    def _feed(self, exchange: Relay, data: bytes | memoryview, whole: bool = False) -> None:
        """Parse ``data`` a slice at a time; keep the rest past ``FEED_EVENTS``
        (``whole``: parse it all now, the connection is gone)."""
        size = len(data)
        start = 0
        self._events = 0
        while start < size:
            end = start + FEED_SLICE
            piece = data if start == 0 and end >= size else memoryview(data)[start:end]
            if not self._feed_slice(exchange, piece):
                return  # given up: the exchange was told
            start = min(end, size)
            if start == size or self._stale:
                break  # a HEAD's answer ended at its head: its late bytes are no one's
            if self.exchange is not exchange:
                # The response ended inside the read: what follows it was never
                # asked for (the router sends one request at a time).
                self._give_up(self.exchange or exchange, UNASKED)
                return
            if self._events >= FEED_EVENTS and not whole:
                self._unfed = memoryview(data)[start:]
                self.pause(UNFED)
                if not self._unfed_scheduled:
                    self._unfed_scheduled = True
                    asyncio.get_running_loop().call_soon(self._feed_unfed)
                break
        exchange.flush()

    def _feed_slice(self, exchange: Relay, data: bytes | memoryview) -> bool:
        """Parse one slice; False if the connection was given up."""
        self._body_in_read = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if not isinstance(cause, _Invalid):
                log.error("response handling failed", exc_info=cause)
            self._give_up(self.exchange or exchange, str(cause) if cause else "invalid response")
            return False
        except httptools.HttpParserError as exc:
            self._give_up(self.exchange or exchange, f"invalid response from backend: {exc}")
            return False
        if self._in_message and not self._body_in_read:
            # A head not yet ended, or trailers: bounded as the bytes arrive.
            self._unparsed += len(data)
            if self._unparsed > MAX_HEAD_BYTES:
                where = "head" if self._in_head else "trailers"
                self._give_up(
                    exchange, f"invalid response from backend: {where} over {MAX_HEAD_BYTES} bytes"
                )
                return False
        return True

    def _feed_unfed(self) -> None:
        """Parse the rest of a read that waited a turn."""
        self._unfed_scheduled = False
        data, self._unfed = self._unfed, None
        exchange = self.exchange
        if data is None or exchange is None or not self.open:
            return  # the exchange ended meanwhile (the client went): the connection closed
        self._feed(exchange, data)
        if self._unfed is None and self.exchange is exchange:
            self.resume(UNFED)

    def pause(self, reason: int) -> None:
        """Stop reading the backend while ``reason`` (``CLIENT`` or ``UNFED``) holds."""
        if not self._paused and self.open:
            self.transport.pause_reading()
        self._paused |= reason

    def resume(self, reason: int) -> None:
        """``reason`` no longer holds: read again unless another one does."""
        if not self._paused:
            return
        self._paused &= ~reason
        if not self._paused and self.open:
            self.transport.resume_reading()

    def _give_up(self, exchange: Relay, reason: str) -> None:
        self.exchange = None
        self.close()
        exchange.upstream_lost(reason)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        exchange = self.exchange
        rest, self._unfed = self._unfed, None
        if rest is not None and exchange is not None:
            # Bytes that arrived before the loss: a close-delimited body ends
            # with them, not before.
            self._feed(exchange, rest, whole=True)
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
        if self.exchange is None:  # the last response ended, in this read
            raise _Invalid(UNASKED)
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
            raise _Invalid(f"invalid response from backend: head over {MAX_HEAD_BYTES} bytes")
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

    def attach(self, exchange: Relay) -> None:
        self.exchange = exchange

    def detach(self) -> None:
        """Back to the pool: no owner, reading (a backend's close must be seen)."""
        self.exchange = None
        self.resume(self._paused)

    def close(self) -> None:
        self.exchange = None
        self.open = False
        self.transport.close()


class Pool:
    """Idle keep-alive connections to one backend, most recently used first."""

    __slots__ = (
        "_idle",
        "authority",
        "closed",
        "host",
        "keepalive",
        "loop",
        "max_idle",
        "port",
        "server_name",
        "tls",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        *,
        max_idle: int,
        keepalive: float,
        tls: BackendTLS | None = None,
        server_name: str | None = None,
    ):
        self.loop = loop
        self.host = host
        self.port = port
        self.tls = tls  # an https:// backend
        self.server_name = server_name or host  # sent (SNI) and checked in its certificate
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
        tls = self.tls
        if tls is None:
            _, conn = await self.loop.create_connection(factory, self.host, self.port)
            return conn
        # The connect timeout (``connect``) covers building the context (the first
        # time: router.backendtls) and the handshake too.
        context = tls.built or await tls.get()
        _, conn = await self.loop.create_connection(
            factory, self.host, self.port, ssl=context, server_hostname=self.server_name
        )
        return conn

    def give_back(self, conn: UpstreamConnection) -> None:
        conn.detach()
        if self.closed or not conn.open or len(self._idle) >= self.max_idle:
            conn.close()
            return
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
