"""The client side: one asyncio protocol per client connection, fed by httptools.

Contract:
- Bytes go straight into the C parser; its callbacks build the head (URL and
  headers, counted against ``max_header_bytes`` / ``max_headers``) and hand
  body pieces to the request's ``Exchange`` as they arrive.
- One exchange at a time is *current*.  Every request is first parsed into a
  queue and started only once ``feed_data`` has returned without error:
  llhttp checks some framing (an invalid Transfer-Encoding, say) only after
  the head callbacks, and nothing may reach a backend before that.
  Pipelined requests wait in the queue and start in order, each when the one before has
  finished and the client has read enough of its answer (the write buffer
  is under its high-water mark): responses go out in request order, and a
  client that reads nothing holds at most the high-water mark plus one
  backend read in our buffer.  The next request never starts inside a
  parser callback of the one before (it is scheduled with ``call_soon``).
- A read is parsed ``FEED_SLICE`` bytes at a time.  Once requests are
  pipelined (one waits behind another), the rest of the read waits unparsed,
  reading paused, until the queue is empty: a read of thousands of tiny
  pipelined requests costs the loop one slice at a time, never one 256 KiB
  parse, and the queue holds at most what one slice delivered.
- The body bytes of one read reach the exchange in one piece (joined when
  llhttp hands over several, as it does for each chunk of a chunked body):
  a body sent in 2-byte chunks costs one upstream write and one buffered
  piece per read, not one per chunk.
- What a request head may hold is counted as its bytes arrive, including a
  header line not yet ended; so are trailers and chunk framing (bytes that
  arrive with no body byte, after the head), against ``max_header_bytes``.
- Trailers are read and dropped; ``Upgrade`` offers (curl's ``h2c``) on
  body-less requests are ignored, as RFC 9110 allows, and the connection
  goes on as HTTP/1.1.
- Reading pauses for three reasons, tracked as bits so that each resume
  undoes only its own pause: the upstream socket is full, the upstream
  connection is not there yet, pipelined requests wait.
- Deadlines, one lazy timer per connection (``LazyDeadline``): a new connection or an idle
  keep-alive one must start a request within ``client_header`` /
  ``keepalive`` seconds; a started head must complete within
  ``client_header`` (slowloris); a body must not stall for ``client_body``,
  nor (with ``client_request`` set) take longer than that in all, the time
  reading was paused by us (a backend not taking the body) not counted;
  a client must not leave its answer unread (our write buffer above its
  high-water mark) for ``client_send``, whatever else is going on.
- With ``limits.keepalive_requests`` the Nth request of a connection is its
  last (nginx's ``keepalive_requests``, Envoy's
  ``max_requests_per_connection``): answered with ``Connection: close``, then
  the connection closes; bytes pipelined after it are not requests (as after
  any request that closes the connection).  The client opens another, which
  the kernel may give another worker of ``--workers N``.
- Malformed requests (llhttp is strict: CL+TE, duplicate CL, bad chunk
  sizes, obs-fold and bare LF are all errors) get a 400 and the connection
  is closed, never forwarded.  Requests pipelined before a refused one are
  answered first, in order, then the refusal, then the connection closes;
  nothing after the refused request is read.  A connection closed with
  request bytes still unread is half-closed and drained briefly first
  ("lingering close"), so the client reads our error instead of a reset.
- A connection the router gives up on (``client_send`` passed, a response
  that cannot show it was cut short, a close the client never lets finish)
  is aborted: a reset, and its descriptor is free at once.
- Stopping (``hold``, ``Router.shutdown``): a connection whose request may be
  on its way is not closed with the idle ones.  A head half read or a request
  parsed and not started, or a wait for a request (a new connection's first,
  the next after an answer that offered keep-alive before the stop) shorter
  than ``STOPPING_IDLE_SECONDS``, is held: counted in the router's drain
  until its request starts (then the exchange counts) or the connection
  closes; the wait is cut to what is left of ``STOPPING_IDLE_SECONDS``.  Every
  answer begun while stopping says ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from typing import TYPE_CHECKING, cast

import httptools

from .deadline import LazyDeadline
from .exchange import Exchange
from .log import get_logger
from .wire import error_response

if TYPE_CHECKING:
    from .app import Router

__all__ = ["ClientConnection", "peer_address"]

log = get_logger("client")

WRITE_HIGH_WATER = 64 * 1024
# A read is parsed this much at a time, and one callback stops after the slice
# that took FEED_EVENTS parser events (body pieces, requests): a few ms at most,
# however the read is cut (2-byte chunks: 1,170 pieces a slice).
FEED_SLICE = 8 * 1024
FEED_EVENTS = 4096
LINGER_SECONDS = 2.0
# At shutdown, a connection waiting for its next (or first) request is closed once it
# has waited this long: a busy keep-alive client sends within milliseconds of its last
# answer, and closing under it then would fail that request (the keep-alive race); a
# new client sends once connected (a round trip, two with TLS).  Longer, every stop
# waits longer for clients that keep an idle connection open (a pool) and send nothing.
STOPPING_IDLE_SECONDS = 0.25

# Reasons to stop reading from the client (bits).
UPSTREAM_BUSY = 1
PIPELINE = 2
UNFED = 4  # the rest of a read waits unparsed (FEED_SLICE)

# What the connection's timer is watching on the request side.
IDLE, HEAD, BODY, NOTHING = 0, 1, 2, 3

_CRLF2 = b"\r\n\r\n"
_LINGER_OFF = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close with a reset


def peer_address(transport: asyncio.BaseTransport) -> bytes:
    """The address of a connection's peer (b"" for a Unix socket's)."""
    peer = transport.get_extra_info("peername")
    return peer[0].encode() if isinstance(peer, tuple) else b""


class _Rejected(Exception):
    """Raised inside a parser callback to stop parsing and answer ``status``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class _Stopped(Exception):
    """Raised inside a parser callback to stop parsing: the request was answered already."""


def _failed(exchange: Exchange) -> None:
    """A fault of ours in handling ``exchange``: logged, answered 500 (its end
    closes the connection).  A refusal reaches only the request being parsed; one
    already parsed would wait forever, counted in flight."""
    log.exception("request handling failed")
    exchange.abort_request(500, "internal error")


class _Queued:
    __slots__ = ("body", "complete", "exchange")

    def __init__(self, exchange: Exchange):
        self.exchange = exchange
        self.body: list[bytes] = []
        self.complete = False


class ClientConnection(asyncio.Protocol, LazyDeadline):
    __slots__ = (
        "_body_in_read",
        "_body_pieces",
        "_closing",
        "_events",
        "_feeding",
        "_framing_fed",
        "_head_began",
        "_head_fed",
        "_header_bytes",
        "_header_count",
        "_headers",
        "_held",
        "_in_head",
        "_last_data",
        "_last_request",
        "_next_scheduled",
        "_parsing",
        "_paused",
        "_paused_for",
        "_paused_since",
        "_queue",
        "_refusal",
        "_requests",
        "_send_since",
        "_unfed",
        "_unfed_scheduled",
        "_url",
        "_watch",
        "_watch_since",
        "_watch_timeout",
        "_write_paused",
        "current",
        "parser",
        "peer_ip",
        "router",
        "transport",
    )

    def __init__(self, router: Router):
        self.router = router
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set at once
        self.parser = httptools.HttpRequestParser(self)
        self.peer_ip = b""
        self.current: Exchange | None = None
        self._parsing: Exchange | _Queued | None = None
        self._queue: deque[_Queued] = deque()
        self._requests = 0  # heads read on this connection (limits.keepalive_requests)
        self._held = False  # counted in the router's drain until its request begins (hold)
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0
        self._header_count = 0
        self._paused = 0
        # With timeouts.client_request: how long reading was paused during the
        # current body (ours, not the client's), and since when it is paused now.
        self._paused_for = 0.0
        self._paused_since = 0.0
        self._closing = False
        # A refused request pipelined behind others: (status, message), answered
        # once the requests before it are; nothing after it is read.
        # status, message, header lines, whether the close lingers (see _refuse)
        self._refusal: tuple[int, str, bytes, bool] | None = None
        self._feeding = False  # inside parser.feed_data: heads not yet fully checked
        self._next_scheduled = False  # _start_next is due (call_soon)
        self._body_pieces: list[bytes] = []  # body bytes of the read being fed, not yet handed on
        self._unfed: memoryview | None = None  # the rest of a read, not parsed yet
        self._unfed_scheduled = False  # _feed_unfed is due (call_soon)
        self._events = 0  # parser events in the current _feed
        self._in_head = False  # a request head has begun and not ended
        self._last_request = False  # the last head closes the connection (no keep-alive)
        self._head_began = False  # ... and it began in the read being fed
        self._head_fed = 0  # bytes of the current head received so far
        self._body_in_read = 0  # body bytes of the current request in the read being fed
        self._framing_fed = 0  # bytes after the head that carried no body byte
        LazyDeadline.__init__(self, router.loop)  # the connection's deadlines: see _deadline
        self._watch = IDLE
        self._watch_since = 0.0
        self._watch_timeout = 0.0
        self._last_data = 0.0
        self._write_paused = False  # our write buffer is above its high-water mark
        self._send_since = 0.0  # ... since then (loop time)

    # -- asyncio.Protocol ------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)
        sock = self.transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if not self.peer_ip:  # else named by a PROXY header (router.admission)
            self.peer_ip = peer_address(transport)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.router.connections.add(self)
        # A new connection gets the header timeout to send its first request.
        self._watch_from(IDLE, self.router.config.timeouts.client_header)
        if self._held:  # held during its TLS handshake (hold_handshake): the stop's bound
            self.hold()

    def data_received(self, data: bytes) -> None:
        if self._closing or self._refusal is not None:
            return  # lingering close, or past a refused request: read and drop
        self._last_data = self.router.loop.time()
        if self._unfed is not None:  # reading is paused: only a stray read lands here
            self._unfed = memoryview(bytes(self._unfed) + data)
            return
        self._feed(data)

    def _feed(self, data: bytes | memoryview) -> None:
        """Parse ``data`` a slice at a time; keep the rest behind pipelined
        requests or past the parser events one callback may take."""
        size = len(data)
        start = 0
        self._events = 0
        while start < size:
            end = start + FEED_SLICE
            piece = data if start == 0 and end >= size else memoryview(data)[start:end]
            consumed = self._feed_slice(piece)
            if consumed is None:
                break
            start += consumed
            if start < size and (
                self._events >= FEED_EVENTS
                or len(self._queue) > 1
                or (self._queue and self.current is not None)
            ):
                self._unfed = memoryview(data)[start:]
                self._pause(UNFED)
                break
        if self._closing or self._refusal is not None or not self._hand_body():
            self._body_pieces.clear()  # their request was refused or failed
            return
        if self.current is None and self._queue:
            self._start_next()  # not inside a callback: at once
        if self._unfed is not None and not self._queue:
            self._schedule_unfed()

    def _feed_slice(self, data: bytes | memoryview) -> int | None:
        """Parse one slice: the bytes it consumed, or None when parsing stopped."""
        if self._last_request and self._parsing is None and not self._in_head:
            return None  # after a request that closes the connection: never parsed
        self._head_began = False
        self._body_in_read = 0
        self._feeding = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            self._feeding = False
            cause = exc.__context__
            if isinstance(cause, _Rejected):
                self._refuse(cause.status, str(cause))
            elif not isinstance(cause, _Stopped):  # _Stopped: answered already
                log.error("request handling failed", exc_info=cause)
                self._refuse(500, "internal error")
            return None
        except httptools.HttpParserUpgrade as exc:
            # An ignored upgrade offer: llhttp stops after the head; carry on
            # with a fresh parser from where it stopped.
            self._feeding = False
            self.parser = httptools.HttpRequestParser(self)
            return cast(int, exc.args[0])
        except httptools.HttpParserError as exc:
            self._feeding = False
            if self._last_request and self._parsing is None:
                # Bytes after a request that closes the connection: never a
                # request (RFC 9112 9.6), so not refused either; the close
                # after its answer drops them.
                self._pause(PIPELINE)
                return None
            self._refuse(400, f"malformed request: {exc}")
            return None
        self._feeding = False
        if self._in_head or self._parsing is not None:
            self._count_unparsed(data)
        return None if self._closing or self._refusal is not None else len(data)

    def _hand_body(self) -> bool:
        """Hand the body bytes of the read just parsed to their request, as one piece."""
        pieces = self._body_pieces
        if not pieces:
            return True
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        parsing = self._parsing
        if isinstance(parsing, _Queued):
            parsing.body.append(data)
        elif parsing is not None:
            try:
                parsing.request_body(data)
            except Exception:
                _failed(parsing)
                return False
        return True

    def _schedule_unfed(self) -> None:
        if not self._unfed_scheduled and not self._closing:
            self._unfed_scheduled = True
            self.router.loop.call_soon(self._feed_unfed)

    def _feed_unfed(self) -> None:
        """Parse the rest of a read that waited (the queue is empty, or the loop had a turn)."""
        self._unfed_scheduled = False
        if self._queue:
            return  # scheduled again when the queue empties
        data, self._unfed = self._unfed, None
        if data is None or self._closing or self._refusal is not None:
            return
        self._feed(data)
        if self._unfed is None:
            self._resume(UNFED)

    def _count_unparsed(self, data: bytes | memoryview) -> None:
        """Count what llhttp holds or skips unseen: a head not yet ended, trailers.

        httptools hands a header line over only once it ends, so a line that
        never ends would grow without limit; the bytes are counted as they
        arrive instead.  A head that began in this read holds only the bytes
        after the last head end and the body that followed it (the rest of
        the read were the requests before it).
        """
        limit = self.router.config.limits.max_header_bytes
        if self._in_head:
            if self._head_began:
                start = bytes(data).rfind(_CRLF2)
                start = start + 4 + self._body_in_read if start >= 0 else self._body_in_read
                self._head_fed += max(len(data) - start, 0)
            else:
                self._head_fed += len(data)
            if self._head_fed > limit:
                self._refuse(431, f"request head is larger than {limit} bytes")
        elif self._body_in_read:
            self._framing_fed = 0  # body bytes came: the framing around them is bounded
        else:
            self._framing_fed += len(data)
            if self._framing_fed > limit:
                self._refuse(431, f"request trailers are larger than {limit} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self._unhold()
        self._closing = True
        self._unfed = None
        self.router.connections.discard(self)
        self._disarm()
        self._queue.clear()
        current = self.current
        if current is not None:
            current.client_gone()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._send_since = self.router.loop.time()
        self._arm(self._send_since + self.router.config.timeouts.client_send)
        if self.current is not None:
            self.current.client_write_paused()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self.current is not None:
            self.current.client_write_resumed()
        elif self._queue or self._refusal is not None:
            self._schedule_next()

    # -- httptools callbacks ---------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._header_count = 0
        self._in_head = True
        self._head_began = True
        self._head_fed = 0
        self._framing_fed = 0
        self._watch_from(HEAD, self.router.config.timeouts.client_header)

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > self.router.config.limits.max_header_bytes:
            raise _Rejected(414, "request target is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        limits = self.router.config.limits
        self._header_count += 1
        self._header_bytes += len(name) + len(value) + 4
        if self._header_count > limits.max_headers:
            raise _Rejected(431, f"more than {limits.max_headers} request headers")
        if self._header_bytes > limits.max_header_bytes:
            raise _Rejected(431, f"request head is larger than {limits.max_header_bytes} bytes")
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self.parser
        self._in_head = False
        self._body_in_read = 0
        method = parser.get_method()
        if method == b"CONNECT":
            raise _Rejected(405, "CONNECT is not supported")
        if parser.should_upgrade() and any(
            name.lower() in (b"content-length", b"transfer-encoding") for name, _ in self._headers
        ):
            # llhttp would hand us the body as the new protocol's first bytes.
            raise _Rejected(501, "protocol upgrades are not supported")
        keep_alive = parser.should_keep_alive()
        self._requests += 1
        limit = self.router.config.limits.keepalive_requests
        if limit and self._requests >= limit:
            keep_alive = False  # answered with Connection: close, as nginx's keepalive_requests
        exchange = Exchange(
            self,
            method,
            self._url,
            self._headers,
            keep_alive,
            parser.get_http_version() == "1.0",
        )
        self._headers = []  # trailers, if any, land here and are dropped
        self._last_request = not keep_alive
        self._watch_from(BODY, self.router.config.timeouts.client_body)
        queued = _Queued(exchange)
        self._queue.append(queued)
        self._parsing = queued
        if self.current is not None:
            self._pause(PIPELINE)

    def on_body(self, body: bytes) -> None:
        self._events += 1
        self._body_in_read += len(body)
        self._body_pieces.append(body)  # handed on once per read: _hand_body

    def on_message_complete(self) -> None:
        self._events += 8  # a request costs more than a body piece
        if not self._hand_body():
            raise _Stopped
        parsing, self._parsing = self._parsing, None
        if self._watch == BODY:
            self._watch = NOTHING  # the response side has its own deadlines
        if isinstance(parsing, _Queued):
            parsing.complete = True
        elif parsing is not None:
            try:
                parsing.request_end()
            except Exception:
                _failed(parsing)

    # -- used by Exchange --------------------------------------------------------

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    @property
    def write_paused(self) -> bool:
        return self._write_paused

    def pause_reading_for_upstream(self, pause: bool) -> None:
        if pause:
            self._pause(UPSTREAM_BUSY)
        else:
            self._resume(UPSTREAM_BUSY)

    def hold(self) -> bool:
        """Shutdown, and no exchange is current: True (counted in the drain until its
        request begins or it closes) if a request may be on its way: a head half
        read, one parsed and not yet started, or a request awaited (a new
        connection's first, a keep-alive connection's next) for less than
        ``STOPPING_IDLE_SECONDS``, which is all it is given from then on; False:
        waiting longer, to be closed now."""
        if self._watch == IDLE and not self._queue:
            timeout = min(self._watch_timeout, STOPPING_IDLE_SECONDS)
            if self.router.loop.time() >= self._watch_since + timeout:
                return False
            self._watch_timeout = timeout
            self._arm(self._watch_since + timeout)  # then closed as a keep-alive timeout
        self._held = True
        return True

    def hold_handshake(self) -> None:
        """Shutdown, its TLS handshake under way: counted in the drain (then, made, held
        as a new connection is) until ``handshake_late``."""
        self._held = True
        self.router.exchange_started()

    def handshake_late(self) -> None:
        """The handshake held at shutdown has not completed in time: the drain goes on
        without it."""
        if self.transport is None:
            self._unhold()

    def _unhold(self) -> None:
        if self._held:
            self._held = False
            self.router.unhold()

    def exchange_done(self, exchange: Exchange) -> None:
        """The current exchange ended: close, or start the next one (soon), or idle."""
        if exchange is not self.current:
            return
        self.current = None
        self._resume(UPSTREAM_BUSY)
        if exchange.reset_client:
            self._abort()  # a response whose framing cannot show that it was cut short
        elif not exchange.client_keep_alive:  # (said so in its head: see Relay)
            # Lingering: bytes the client sent after this request (unread, or
            # still coming) would make the kernel reset the connection and
            # throw away the answer the client has not read yet.
            self._close(lingering=True)
        else:
            if self._queue or self._refusal is not None:
                self._schedule_next()
            else:
                self._go_idle()
            if self.router.stopping and self.hold():
                # Its answer began before the stop and offered keep-alive: the client
                # may be sending its next request already.  That one is answered
                # (saying close); closing now would fail it.
                self.router.exchange_started()

    def _schedule_next(self) -> None:
        """Start the next request once the caller's callbacks have unwound.

        Never inside a parser callback: the parser that called us may still
        fire events for the request that just ended (a HEAD answered without
        a body ends the upstream message right after its head).
        """
        if not self._next_scheduled and self.current is None and not self._closing:
            self._next_scheduled = True
            self.router.loop.call_soon(self._start_next)

    def _start_next(self) -> None:
        self._next_scheduled = False
        if self._closing or self.current is not None:
            return
        if self._write_paused:
            return  # resume_writing calls again: the client reads its answers first
        if self._queue:
            self._start_queued()
        elif self._refusal is not None:
            status, message, extra, lingering = self._refusal
            date = self.router.date.value
            self.write(error_response(status, message, close=True, date=date, extra=extra))
            self._close(lingering=lingering)
        else:
            self._go_idle()

    def _go_idle(self) -> None:
        self._resume(PIPELINE)
        if self._unfed is not None:
            self._schedule_unfed()  # the rest of a read waits: parse it before reading more
            return
        if self._parsing is None and not self._in_head:
            self._watch_from(IDLE, self.router.config.timeouts.keepalive)

    def _start_queued(self) -> None:
        queued = self._queue.popleft()
        exchange = queued.exchange
        self.current = exchange
        if self._parsing is queued:
            self._parsing = exchange  # the rest of its body goes straight to it
        try:
            exchange.start()
            if self._held:
                self._unhold()  # the exchange counts in the drain now
            for piece in queued.body:
                exchange.request_body(piece)
            if queued.complete:
                exchange.request_end()
        except Exception:
            _failed(exchange)
        if self._queue:
            return
        if self._unfed is not None:
            self._schedule_unfed()
        if self._refusal is None:
            self._resume(PIPELINE)

    # -- flow control ----------------------------------------------------------

    def _pause(self, reason: int) -> None:
        if not self._paused:
            if not self._closing:
                self.transport.pause_reading()
            if self._watch == BODY and self.router.config.timeouts.client_request:
                self._paused_since = self.router.loop.time()
        self._paused |= reason

    def _resume(self, reason: int) -> None:
        if self._paused & reason:
            self._paused &= ~reason
            if not self._paused:
                if not self._closing:
                    self.transport.resume_reading()
                limit = self.router.config.timeouts.client_request
                if self._watch == BODY and limit:
                    self._paused_for += self.router.loop.time() - self._paused_since
                    self._arm(self._watch_since + self._paused_for + limit)

    # -- deadlines -------------------------------------------------------------

    def _watch_from(self, what: int, timeout: float) -> None:
        now = self.router.loop.time()
        self._watch = what
        self._watch_since = now
        self._watch_timeout = timeout
        if what == BODY and self.router.config.timeouts.client_request:
            self._paused_for = 0.0
            self._paused_since = now  # (read only while paused)
            timeout = min(timeout, self.router.config.timeouts.client_request)
        self._arm(now + timeout)

    def _deadline(self) -> None:
        loop = self.router.loop
        now = loop.time()
        due = float("inf")
        if self._write_paused:
            # Checked even while closing: a close waits for the buffer to drain.
            send_due = self._send_since + self.router.config.timeouts.client_send
            if now >= send_due:
                self._give_up_on_reader()
                return
            due = send_due
        if not self._closing and self._watch != NOTHING:
            whole_due = float("inf")
            limit = self.router.config.timeouts.client_request
            if self._watch == BODY:
                if self._paused:  # we stopped reading: the client did not stall
                    self._last_data = now
                watch_due = self._last_data + self._watch_timeout
                if limit and not self._paused:  # (paused, the time is ours)
                    whole_due = self._watch_since + self._paused_for + limit
            else:
                watch_due = self._watch_since + self._watch_timeout
            if now >= min(watch_due, whole_due):
                if self._watch == IDLE:
                    self._close(lingering=False)
                elif self._watch == HEAD:
                    self._refuse(408, "request head not received in time")
                elif now >= whole_due:
                    self._refuse(408, f"request body not received within {limit:g} s")
                else:
                    self._refuse(408, "request body stalled")
                return
            due = min(due, watch_due, whole_due)
        if due != float("inf"):
            self._arm(due)

    def _give_up_on_reader(self) -> None:
        """The client left its answer unread for ``client_send``: reset it."""
        current = self.current
        if current is not None:
            current.status = current.status or 408
        self._abort()

    # -- endings ---------------------------------------------------------------

    def _refuse(
        self, status: int, message: str, extra: bytes = b"", *, lingering: bool = True
    ) -> None:
        """A request we will not serve: answer if we still can, then close
        (lingering, unless told not to: reading what the client still sends, so
        that it reads the answer before a reset).

        Requests before it on the connection were good: they are answered
        first, in order, then this one with the error, then the connection
        closes (the client retries the rest).
        """
        current, parsing = self.current, self._parsing
        if current is not None and parsing is current:
            current.abort_request(status, message)  # its end closes the connection
            return
        if self._refusal is not None or self._closing:
            return  # refused already; the connection closes after the requests before it
        if isinstance(parsing, _Queued):
            self._queue.remove(parsing)
        self._parsing = None
        self._in_head = False
        if status != 500:  # our own failure is logged where it happened, not a refusal
            self.router.request_refused(status, message, self.peer_ip)
        self._refusal = (status, message, extra, lingering)
        self._watch = NOTHING  # nothing more is read from this client
        self._pause(PIPELINE)
        self._schedule_next()

    def _close(self, lingering: bool) -> None:
        if self._closing:
            return
        self._closing = True
        self._watch = NOTHING  # only the client_send deadline still applies
        transport = self.transport
        if lingering and transport.can_write_eof():
            # Half-close and drain what the client is still sending, so it can
            # read our answer before the kernel resets the connection.
            self._paused = 0
            transport.resume_reading()
            try:
                transport.write_eof()
            except OSError:
                # The stdlib loop shuts the socket down at once when nothing is
                # buffered, and a client that reset it gives ENOTCONN: gone, close.
                transport.close()
                return
            self.router.loop.call_later(LINGER_SECONDS, self._linger_over)
        else:
            transport.close()

    def _linger_over(self) -> None:
        if self.transport.get_write_buffer_size():
            self._abort()  # the client never read our answer: do not wait for it
        else:
            self.transport.close()

    def _abort(self) -> None:
        """Reset the connection: the client sees a reset, the descriptor is free at once.

        A plain ``abort`` only skips our buffer: the kernel would still send a
        FIN after what it holds, which can pass for a complete answer.
        """
        self._closing = True
        self._disarm()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_OFF)
        self.transport.abort()
