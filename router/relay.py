"""The response side of an exchange: relayed, flushed, timed, answered on error.

``Relay`` is the base of ``router.exchange.Exchange`` (through
``router.routing.Routing``): it holds what one request crossing the router
is (every slot, set in ``__init__``), relays the backend's response to the
client as ``UpstreamConnection`` parses it (the only surface that connection
sees), and ends the exchange on an error, a timeout or the client's leaving.

Contract (the rules of ../shared/DESIGN.md "Request flow", response half):
- Every ending here (the response complete, an error, a timeout, the client
  gone) goes through ``_finish`` (``router.exchange``'s) once: it releases
  the lease before the response's last bytes are written.
- What one upstream read brought leaves in one ``writelines`` (``flush``)
  before the next read is parsed, so SSE events are never held back; a
  chunked response's body pieces of that read leave as one chunk.  Body
  bytes are relayed as they came: no JSON or SSE parsing, except that the
  2xx answers to ``POST /v1/responses`` are read for their id in their first
  bytes only (``router.responses``).
- A reused keep-alive connection that dies before any response byte is
  replaced by a fresh one to the same backend (``_connect``, the
  routing's), but only when the router still holds the whole request.
- Errors before any response byte reached the client become a JSON error
  (502/503/504); after that, the client connection is closed so a truncated
  response never looks complete: with a FIN where the framing shows the cut
  (a short ``Content-Length``, no last chunk), with a reset where it cannot
  (an HTTP/1.0 client reading until the close).
- Opt-in (``decision_header``): proxied responses carry
  ``X-Prefix-Router-Decision: decision=<the access log's>; key=<its prefix_hash>``
  (``; backend=<name>`` only with ``decision_header_backend``); answers the
  router makes itself (errors, ``/v1/models``) do not.
- Backpressure both ways: a client that does not read pauses reading from
  the backend (``CLIENT``), a backend that does not take the body pauses
  reading from the client.
- One read deadline at a time, re-armed lazily (``LazyDeadline``): ``first_byte`` from the
  moment the request head is sent to the response head (any progress either
  way, such as body bytes still being forwarded, defers it), then ``idle``
  between reads.  Time the client spends not reading (so that we stopped
  reading the backend) is the client's, bounded by ``client_send`` (the
  client connection's deadline).
"""

from __future__ import annotations

import asyncio
from time import perf_counter
from typing import TYPE_CHECKING

from .accesslog import prefix_hash
from .deadline import LazyDeadline
from .heads import CHUNKED, NO_BODY, UNTIL_CLOSE, Kind, read_request, read_response
from .responses import IdScanner
from .upstream import CLIENT
from .wire import CHUNKED_END, error_response, json_response

if TYPE_CHECKING:
    from hashring import PrefixHasher

    from .arms import Arm
    from .balancer import Choice
    from .client import ClientConnection
    from .keydigests import KeyDigests, NativeDigests
    from .tracing import Span
    from .upstream import UpstreamConnection

__all__ = ["Relay"]


class Relay(LazyDeadline):
    """One exchange's state, its response side and its endings (see the module)."""

    __slots__ = (
        "_attempts",
        "_body",
        "_chunk",
        "_client_paused",
        "_conn",
        "_connecting",
        "_digesting",
        "_entered",
        "_framing",
        "_hasher",
        "_head_sent",
        "_id_wait",
        "_last_read",
        "_listing",
        "_out",
        "_queue_timer",
        "_read_timeout",
        "_replayable",
        "_request",
        "_response_id",
        "_router",
        "_scan",
        "_stale_retried",
        "_tried",
        "_upstream_bytes",
        "_upstream_framed",
        "arm",
        "bytes_in",
        "bytes_out",
        "choice",
        "client_keep_alive",
        "done",
        "ended",
        "http10",
        "key_bytes",
        "key_digests",
        "key_hash",
        "key_source",
        "kind",
        "method",
        "model",
        "path",
        "pool",
        "queue_wait",
        "queued",
        "rejected",
        "repeat",
        "request_complete",
        "request_id",
        "reset_client",
        "span",
        "started",
        "status",
        "tenant",
        "tenant_key",
        "ttft",
        "upstream",
    )

    def __init__(
        self,
        conn: ClientConnection,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        http10: bool,
    ):
        self._conn = conn
        self._router = conn.router
        self.method = method
        # The head's meaning, decided now (pure); acted on when the exchange starts.
        self._request = read_request(
            method,
            target,
            headers,
            http10=http10,
            via_name=conn.router.via_name,
            session_header=conn.router.sessions.header,
        )
        self.path = self._request.path  # as the backend's framework will see it
        self.client_keep_alive = keep_alive
        self.http10 = http10
        self.kind = self._request.kind
        self.started = 0.0
        self.ended = 0.0
        self.ttft = 0.0
        self.status = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.key_hash: int | None = None
        self.key_source: str | None = None  # router.sessions.SOURCES, once keyed
        self.key_bytes = 0  # the key's length (router.cachecheck counts long ones only)
        self.repeat = False  # its key was sent to the chosen backend before (cachecheck)
        self.model: str | None = None  # the body's, where the fleet declares models
        self.pool: str | None = None  # the model pool it was routed over (ANY_MODEL too)
        self.arm: Arm | None = None  # its A/B experiment arm, once routed (router.arms)
        self._listing = False  # GET /v1/models of a fleet that declares models: ours
        self.tenant = False
        self.tenant_key: str | None = None  # who the request is for (metrics, the queue)
        tenant_header = conn.router.tenant_header
        if tenant_header is not None:
            for name, value in headers:
                if name.lower() == tenant_header:
                    self.tenant_key = value.decode("latin-1")
                    break
        self.queued = False  # waited in the admission queue
        self.queue_wait: float | None = None  # seconds, once admitted
        self.rejected: int | None = None  # answered 429 by the queue (REJECT_REASONS index)
        self._queue_timer: asyncio.TimerHandle | None = None  # set while waiting in the queue
        self._entered = 0.0
        self.request_id = b""
        self.choice: Choice | None = None
        self.upstream: UpstreamConnection | None = None
        self.done = False
        self.request_complete = False
        self.reset_client = False  # cut short where the framing cannot show it: reset
        self.span: Span | None = None  # tracing on: this request's trace context
        # body pieces held: not yet sent, or kept to resend
        self._body: list[bytes | bytearray | memoryview] = []
        self._out: list[bytes] = []  # response bytes gathered during one upstream read
        self._chunk: list[bytes] = []  # ... and the body pieces of it still to frame as a chunk
        self._replayable = True  # _body holds every body piece sent upstream so far
        self._hasher: PrefixHasher | None = None
        # [advisor] key_digests on (router.keydigests): the access line's field, and
        # the native body's digests as its pieces arrive.
        self.key_digests: KeyDigests | NativeDigests | None = None
        self._digesting: NativeDigests | None = None
        self._connecting = False
        self._head_sent = False  # to the client
        self._framing = NO_BODY
        self._tried: set[str] = set()  # backends that could not be reached
        self._attempts = 0
        LazyDeadline.__init__(self, conn.router.loop)  # the read deadline: first_byte, then idle
        self._last_read = 0.0
        self._read_timeout = 0.0
        self._upstream_bytes = False
        self._stale_retried = False
        self._upstream_framed = False  # the backend's response has a length or chunks
        self._client_paused = False  # the client's write buffer is full: the backend is not read
        self._response_id: str | None = None  # a Responses API id: route to its backend
        self._id_wait: asyncio.TimerHandle | None = None  # waiting for that id to be shared
        self._scan: IdScanner | None = None  # reading a new response's id (router.responses)

    if TYPE_CHECKING:
        # The layers above's, called from here: a stale keep-alive connection is
        # replaced (router.routing); every ending goes through _finish
        # (router.exchange), which also ends the waits only routing starts.
        def _connect(self) -> None: ...
        def _finish(self, upstream_reusable: bool) -> None: ...

    # -- response side (driven by UpstreamConnection) ---------------------------

    def upstream_read(self) -> None:
        self._upstream_bytes = True
        self._last_read = self._router.loop.time()

    def response_head(
        self, status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool
    ) -> None:
        if self.done:
            return
        self.status = status
        self._use_read_timeout(self._router.config.timeouts.idle)
        response = read_response(
            status,
            headers,
            method=self.method,
            http10=self.http10,
            # The backend may answer before reading it all: then the connection ends.
            # A stopping router says so too (as nginx does while it exits): the
            # client sends its next request elsewhere, not into the close.
            keep_alive=self.client_keep_alive
            and self.request_complete
            and not self._router.stopping,
            request_id=self.request_id,
            extra=self._decision() if self._router.decision_header else b"",
        )
        if response is None:
            self._fail(502, "the backend used a transfer coding an HTTP/1.0 client cannot take")
            return
        self._framing = response.framing
        self._upstream_framed = response.framed
        if (
            status < 300
            and self.kind is Kind.OPENAI
            and self.path == b"/v1/responses"
            and self._router.responses.enabled
        ):
            self._scan = IdScanner()
        self.client_keep_alive = response.keep_alive
        self._head_sent = True
        self._out.append(response.head)
        if self.method == b"HEAD":
            # httptools cannot be told that a response answers HEAD and would
            # wait for a body that never comes: end here, on a fresh parser.
            assert self.upstream is not None
            self.upstream.expect_new_response()
            self._finish(upstream_reusable=keep_alive and self.request_complete)

    def _decision(self) -> bytes:
        """X-Prefix-Router-Decision (opt-in): the access log's decision and key digest,
        and the backend's name only where ``decision_header_backend`` says so."""
        choice = self.choice
        assert choice is not None
        line = b"x-prefix-router-decision: decision=" + choice.label.encode()
        if self.key_hash is not None:
            line += b"; key=" + prefix_hash(self.key_hash).encode()
        if self._router.decision_header == 2:
            line += b"; backend=" + choice.backend.name.encode()
        return line + b"\r\n"

    def response_body(self, data: bytes) -> None:
        if self.done:
            return
        if not self.ttft:
            self.ttft = perf_counter()
            # The first body byte, not the head: vLLM and SGLang send a streaming
            # head before prefill, their first SSE event after it.
            assert self.choice is not None
            self.choice.first_byte()  # ConcurrencyScope PREFILL lets go of its lease
            if self.arm is not None:  # its engine has counted its prefix-cache hits by now
                self.arm.stats.prefilled(self.choice.backend.name, self.status, self.bytes_in)
        self.bytes_out += len(data)
        if self._scan is not None:
            self._learn(self._scan, data)
        if self._framing == CHUNKED:
            self._chunk.append(data)  # one chunk per upstream read: _seal_chunk
        else:
            self._out.append(data)

    def _learn(self, scan: IdScanner, data: bytes) -> None:
        found = scan.feed(data)
        if found is None:
            return
        self._scan = None
        responses = self._router.responses
        if found:
            assert self.choice is not None
            responses.learn(found, self.choice.backend.name)
        else:
            responses.unread += 1

    def response_end(self, keep_alive: bool) -> None:
        if self.done:
            return
        if self._scan is not None:  # ended before the id could be read
            self._scan = None
            self._router.responses.unread += 1
        if self._framing == CHUNKED:
            self._seal_chunk()
            self._out.append(CHUNKED_END)
        choice = self.choice
        assert choice is not None
        if self.repeat and 200 <= self.status < 300:
            choice.backend.repeats_answered += 1  # the engine has counted its hits by now
        self._router.backend_answered(choice.backend, self.status)
        self._finish(upstream_reusable=keep_alive and self.request_complete)

    def upstream_lost(self, reason: str | None) -> None:
        """The backend connection ended (or sent garbage) before the response did."""
        if self.done:
            return
        upstream, self.upstream = self.upstream, None
        if self._head_sent and not self._upstream_framed and reason is None:
            # A response without length or chunks ends when the backend closes.
            if self._framing == CHUNKED:
                self._seal_chunk()
                self._out.append(CHUNKED_END)
            assert self.choice is not None
            self._router.backend_answered(self.choice.backend, self.status)
            self._finish(upstream_reusable=False)
            return
        choice = self.choice
        assert choice is not None
        assert upstream is not None
        if (
            not self._head_sent
            and upstream.reused
            and not self._upstream_bytes
            and self._replayable
            and self.request_complete
            and not self._stale_retried
        ):
            # The stale keep-alive race: the backend closed an idle connection as
            # we wrote to it.  We hold the whole request: resend it on a new one.
            self._stale_retried = True
            self._connect()
            return
        self._router.backend_failed(choice.backend, reason or "connection closed")
        name = choice.backend.name
        if self._head_sent:
            self._truncate()
        elif reason is not None and reason.startswith("invalid"):
            self._fail(502, f"backend {name} sent an {reason}")
        else:
            self._fail(502, f"backend {name} closed the connection before responding")

    # -- deadlines ----------------------------------------------------------------

    def _arm_read_deadline(self) -> None:
        timeouts = self._router.config.timeouts
        self._last_read = self._router.loop.time()
        # Set the timer for the shorter of the two timeouts: when the head comes,
        # the switch to ``idle`` then needs no new timer (one timer per request).
        self._use_read_timeout(timeouts.first_byte, min(timeouts.first_byte, timeouts.idle))

    def _use_read_timeout(self, timeout: float, wake: float | None = None) -> None:
        """Switch the read deadline; move the timer only if it must fire earlier."""
        self._read_timeout = timeout
        self._arm(self._last_read + (timeout if wake is None else wake))

    def _deadline(self) -> None:
        if self.done:
            return
        loop = self._router.loop
        now = loop.time()
        if self._client_paused:
            # We stopped reading the backend because the client does not read:
            # the client's stall, not the backend's (the client connection
            # bounds it by client_send).
            self._last_read = now
            self._arm(now + self._read_timeout)
            return
        due = self._last_read + self._read_timeout
        if now < due:  # there was progress since the timer was set
            self._arm(due)
            return
        assert self.choice is not None
        backend = self.choice.backend
        self._router.backend_failed(backend, "timeout")
        if self._head_sent:
            self._truncate()
        else:
            self._fail(
                504, f"backend {backend.name} did not answer within {self._read_timeout:g} s"
            )

    # -- endings: each goes through _finish (router.exchange's), exactly once -------

    def _reply(self, body: object) -> None:
        """Answer 200 with ``body`` as JSON, from the router itself."""
        self.status = 200
        router = self._router
        keep_alive = self.client_keep_alive and self.request_complete and not router.stopping
        self.client_keep_alive = keep_alive
        self._out.append(  # written by _finish, after the lease is released
            json_response(
                200,
                body,
                close=not keep_alive,
                date=router.date.value,
                request_id=self.request_id,
            )
        )
        self._finish(upstream_reusable=False)

    def _fail(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        extra: bytes = b"",
    ) -> None:
        """Answer with a JSON error; only possible before the response head left."""
        if self._head_sent:
            self._truncate()
            return
        self.status = status
        if self.span is not None:
            self.span.error = message
        keep_alive = (
            self.client_keep_alive
            and self.request_complete
            and status < 500
            and not self._router.stopping
        )
        self.client_keep_alive = keep_alive
        self._out.append(  # written by _finish, after the lease is released
            error_response(
                status,
                message,
                param=param,
                code=code,
                close=not keep_alive,
                date=self._router.date.value,
                request_id=self.request_id,
                extra=extra,
            )
        )
        self._finish(upstream_reusable=False)

    def _truncate(self) -> None:
        """The response already started: close so the client sees it incomplete.

        A response read until the close (HTTP/1.0 without a length) would
        look complete after a FIN: that one is ended with a reset.
        """
        self.client_keep_alive = False
        self.reset_client = self._framing == UNTIL_CLOSE
        if self.span is not None:
            self.span.error = "the response was cut short"
        self._finish(upstream_reusable=False)

    def abort_request(self, status: int, message: str) -> None:
        """The client's request went wrong mid-way (malformed, stalled)."""
        if not self.done:
            self._fail(status, message)

    def client_gone(self) -> None:
        if not self.done:
            self.client_keep_alive = False
            self.status = self.status or 499  # nginx's "client closed request"
            self._finish(upstream_reusable=False)

    def flush(self) -> None:
        """Write what the response gathered during one upstream read, in one call.

        Head, body chunks and terminator that arrive in the same read leave in
        one ``writelines`` (one system call) instead of one write each; each
        upstream read still reaches the client before the next is parsed, so
        SSE events are never held back.  The body pieces of a chunked
        response leave as one chunk: a backend that sends 2-byte chunks costs
        the client connection one chunk per read, not one per piece.
        """
        if self._chunk:
            self._seal_chunk()
        out = self._out
        if out:
            self._out = []
            transport = self._conn.transport
            if not transport.is_closing():
                transport.writelines(out)

    def _seal_chunk(self) -> None:
        pieces = self._chunk
        if pieces:
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
            pieces.clear()
            self._out += (b"%x\r\n" % len(data), data, b"\r\n")

    # -- flow control ----------------------------------------------------------

    def upstream_write_paused(self) -> None:
        self._conn.pause_reading_for_upstream(True)

    def upstream_write_resumed(self) -> None:
        self._conn.pause_reading_for_upstream(False)

    def client_write_paused(self) -> None:
        self._client_paused = True
        if self.upstream is not None:
            self.upstream.pause(CLIENT)

    def client_write_resumed(self) -> None:
        self._client_paused = False
        if self.upstream is not None:
            self._last_read = self._router.loop.time()
            self.upstream.resume(CLIENT)
