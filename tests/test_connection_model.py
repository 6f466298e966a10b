"""One client connection through the real router, against a reference model (issue 10).

A hypothesis state machine drives a raw client socket into a real ``Router``
(127.0.0.1, port 0) in front of two real backends (``tests.harness.backends.
Backend``, scripted per request).  Its steps:

- ``add``: queue one more pipelined request of any kind (GET, HEAD, OpenAI,
  native, chunked, ``Expect: 100-continue``, malformed; large heads,
  ``Connection: close``), each telling the backend how to answer
  (Content-Length, chunked, close-delimited, 204; HEAD answers have no body);
- ``send``: write the next ``n`` queued bytes, wherever they cut requests;
- ``read`` / ``read_slowly``: read up to ``n`` bytes, or many small pieces;
- ``stall``: read nothing while the router does all it can.

After every step the invariants hold (``tests.harness.http_model``): what
the client read is a prefix of the model's answers, in order, byte for byte;
the backends received a prefix of the requests the model forwards (nothing
after a refusal); the router's write buffer towards this client never went
over ``BUFFER_BOUND``.  At the end the client sends whatever is left, reads
everything at once, and the answers must be complete, the connection closed
exactly when the model says, no exchange running and no lease held.

No check depends on timing.  Between steps the machine lets the loop run
until nothing changes for ``QUIET_ROUNDS`` rounds (``settle``): stopping
early only makes a step weaker, never a correct router fail.  Liveness at the
end is bounded by ``WAIT``.  The client socket and the router's socket towards
it get small kernel buffers (the router's through ``router.connections``):
on loopback the kernel would otherwise absorb ~4 MB of unread answers and the
router's own buffering would never show.

CI-sized by default (a few seconds); run longer with, e.g.,

    MODEL_EXAMPLES=2000 pytest tests/test_connection_model.py -o timeout=0 -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import struct
import termios
from collections.abc import Callable

import pytest
import uvloop
from hypothesis import HealthCheck, Phase, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from router import client, upstream
from router.app import Router
from router.client import WRITE_HIGH_WATER
from router.config import build_config
from tests.harness.backends import Backend, Seen, StartBackend
from tests.harness.http import connect, req, response
from tests.harness.http_model import (
    FRAMINGS,
    KINDS,
    MALFORMED,
    Model,
    Request,
    check_stream,
    model_of,
    parse_stream,
    pattern,
)
from tests.harness.routers import StartRouter, router_config

MODEL_EXAMPLES = int(os.environ.get("MODEL_EXAMPLES", "0")) or None
WAIT = 5.0  # seconds: the bound on the final read and on every wait
MAX_REQUESTS = 8
QUIET_ROUNDS = 50  # loop rounds without any change: the router has done what it can
SETTLE_ROUNDS = 20_000
KERNEL_BUFFER = 4096  # SO_RCVBUF of the client, SO_SNDBUF of the router's socket to it
# The contract: a client that does not read stops the backend's reads once the
# write buffer passes the high-water mark, so it holds at most that plus one
# upstream read (256 KiB: asyncio's recv size; uvloop's is 256,000) plus heads.
BUFFER_BOUND = WRITE_HIGH_WATER + 256 * 1024 + 4096
BLOCK = 16 * 1024  # the backend writes bodies in blocks (chunks) of this size, draining


def requests() -> st.SearchStrategy[Request]:
    sizes = st.one_of(
        st.integers(0, 300),
        st.sampled_from([0, 4096, 48_000, 100_000, 140_000]),
        st.integers(0, 140_000),
    )
    bodies = st.one_of(st.integers(0, 64), st.sampled_from([4095, 4096, 4097, 9000]))
    return st.builds(
        Request,
        kind=st.sampled_from(KINDS),
        framing=st.sampled_from(FRAMINGS),
        size=sizes,
        body=bodies,
        pieces=st.lists(st.integers(1, 5000), max_size=3).map(tuple),
        pad=st.sampled_from([0, 0, 100, 8000, 8000]),
        close=st.sampled_from([False] * 7 + [True]),
        variant=st.integers(0, len(MALFORMED) - 1),
    )


class Script:
    """The backends' handler: answers each request as its ``X-Model`` header says."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []  # complete requests, every backend, in arrival order
        self.bytes_out = 0

    async def __call__(self, backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        self.seen.append(seen)
        spec = seen.value("x-model")
        if spec is None:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            return True
        ident, framing, size = spec.split()
        name = b"X-Model-Id: %s\r\n" % ident
        if framing == b"204":
            writer.write(b"HTTP/1.1 204 No Content\r\n%s\r\n" % name)
            return True
        framed = {
            b"cl": b"Content-Length: %s\r\n" % size,
            b"chunked": b"Transfer-Encoding: chunked\r\n",
        }
        writer.write(b"HTTP/1.1 200 OK\r\n%s%s\r\n" % (name, framed.get(framing, b"")))
        if seen.method != b"HEAD":
            body = pattern(b"r" + ident, int(size))
            for at in range(0, len(body), BLOCK):
                block = body[at : at + BLOCK]
                writer.write(
                    b"%x\r\n%s\r\n" % (len(block), block) if framing == b"chunked" else block
                )
                self.bytes_out += len(block)
                await writer.drain()
            if framing == b"chunked":
                writer.write(b"0\r\n\r\n")
        return framing != b"close"


async def until(predicate: Callable[[], bool]) -> None:
    """Let the loop run until ``predicate`` holds (callers bound it with a timeout)."""
    for _ in range(10_000_000):
        if predicate():
            return
        await asyncio.sleep(0)


def _queued(sock: socket.socket, request: int) -> int:
    """Bytes in the socket's receive (FIONREAD) or send (TIOCOUTQ) queue."""
    try:
        return int(struct.unpack("i", fcntl.ioctl(sock, request, b"\0\0\0\0"))[0])
    except OSError:
        return -1


class ConnectionModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.runner: asyncio.Runner | None = None
        self.router: Router | None = None
        self.backends: list[Backend] = []
        self.script = Script()
        self.sock: socket.socket | None = None
        self.requests: list[Request] = []
        self.outbox = bytearray()  # written by the client, not sent yet
        self.received = bytearray()
        self.eof = False  # the router closed (or reset) the connection
        self.reset = False
        self.write_closed = False
        self.max_buffer = 0
        self.failed = False

    @property
    def model(self) -> Model:
        return model_of(self.requests)

    def _run(self, coro: object) -> None:
        assert self.runner is not None
        try:
            self.runner.run(coro)  # type: ignore[arg-type]
        except BaseException:
            self.failed = True
            raise

    # -- setup ---------------------------------------------------------------------

    @initialize(loop=st.sampled_from(["uvloop", "asyncio"]))
    def start(self, loop: str) -> None:
        factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
        self.runner = asyncio.Runner(loop_factory=factory)
        self._run(self._start())

    async def _start(self) -> None:
        for i in range(2):
            backend = Backend(self.script, f"model-{i}")
            await backend.start()
            self.backends.append(backend)
        config = router_config([b.spec for b in self.backends], health={"active": False}, seed=0)
        self.router = Router(build_config(config))
        await self.router.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, KERNEL_BUFFER)  # before connect
        sock.setblocking(False)
        async with asyncio.timeout(WAIT):
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.router.port))
            await until(lambda: bool(self.router and self.router.connections))
        (conn,) = self.router.connections
        conn.transport.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_BUFFER
        )

    # -- steps ---------------------------------------------------------------------

    @precondition(lambda self: self.runner is not None and len(self.requests) < MAX_REQUESTS)
    @rule(request=requests())
    def add(self, request: Request) -> None:
        request = dataclasses.replace(request, ident=len(self.requests))
        self.requests.append(request)
        wire = request.wire()
        self.outbox += wire
        note(f"request {request.ident}: {request}\n  {len(wire)} bytes: {wire[:300]!r}")

    # The preconditions below read only what the steps drew, never what the
    # router did (bytes accepted, a close seen): Hypothesis replays a prefix of
    # steps and must find the same steps enabled.  A step with nothing to do
    # (all sent, the connection closed) only lets the router run.
    @precondition(lambda self: self.runner is not None)
    @rule(n=st.one_of(st.integers(1, 2048), st.integers(2048, 1 << 16)))
    def send(self, n: int) -> None:
        assert self.sock is not None
        while n > 0 and self.outbox and not self.write_closed:
            try:
                sent = self.sock.send(self.outbox[:n])
            except BlockingIOError:
                break
            except (BrokenPipeError, ConnectionResetError):
                self.write_closed = True
                break
            del self.outbox[:sent]
            n -= sent
        self._run(self._settle())

    @precondition(lambda self: self.runner is not None)
    @rule(n=st.integers(1, 1 << 18))
    def read(self, n: int) -> None:
        self._run(self._settle())
        self._recv(n)

    @precondition(lambda self: self.runner is not None)
    @rule(piece=st.integers(1, 512), count=st.integers(1, 64))
    def read_slowly(self, piece: int, count: int) -> None:
        self._run(self._read_slowly(piece, count))

    @precondition(lambda self: self.runner is not None)
    @rule()
    def stall(self) -> None:
        self._run(self._settle())

    async def _read_slowly(self, piece: int, count: int) -> None:
        for _ in range(count):
            self._recv(piece)
            for _ in range(3):
                await asyncio.sleep(0)  # let the router move on: a slow reader, not a stopped one
            self._sample()

    def _recv(self, n: int) -> None:
        """Read what is there, up to ``n`` bytes, without waiting."""
        assert self.sock is not None
        while n > 0 and not self.eof:
            try:
                data = self.sock.recv(min(n, 1 << 18))
            except BlockingIOError:
                return
            except ConnectionResetError:
                self.eof = self.reset = True
                return
            if not data:
                self.eof = True
                return
            self.received += data
            n -= len(data)

    # -- letting the router run ------------------------------------------------------

    def _sample(self) -> None:
        assert self.router is not None
        for conn in self.router.connections:
            with contextlib.suppress(Exception):  # a transport being torn down
                self.max_buffer = max(self.max_buffer, conn.transport.get_write_buffer_size())

    def _fingerprint(self) -> tuple[object, ...]:
        router, sock = self.router, self.sock
        assert router is not None
        assert sock is not None
        sizes = []
        for conn in router.connections:
            with contextlib.suppress(Exception):
                sizes.append(conn.transport.get_write_buffer_size())
        return (
            sorted(sizes),
            len(router.connections),
            router.active,
            router.fleet.loads.total,
            self.script.bytes_out,
            len(self.script.seen),
            sum(len(b.heads) for b in self.backends),
            _queued(sock, termios.FIONREAD),
            _queued(sock, termios.TIOCOUTQ),
        )

    async def _settle(self) -> None:
        """Run the loop until nothing changes for QUIET_ROUNDS rounds (bounded)."""
        last, quiet = None, 0
        for _ in range(SETTLE_ROUNDS):
            self._sample()
            state = self._fingerprint()
            if state == last:
                quiet += 1
                if quiet >= QUIET_ROUNDS:
                    return
            else:
                last, quiet = state, 0
            await asyncio.sleep(0)

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def answers_are_a_prefix_of_the_model(self) -> None:
        self._check(lambda: check_stream(bytes(self.received), self.eof, self.model))

    @invariant()
    def backends_received_a_prefix_of_the_model(self) -> None:
        self._check(lambda: self._check_forwarded(final=False))

    @invariant()
    def buffers_are_bounded(self) -> None:
        self._check(self._check_buffer)

    def _check(self, check: object) -> None:
        if self.runner is None:
            return
        try:
            check()  # type: ignore[operator]
        except BaseException:
            self.failed = True
            raise

    def _check_buffer(self) -> None:
        assert self.max_buffer <= BUFFER_BOUND, (
            f"the router buffered {self.max_buffer} bytes for a client that does not read "
            f"(bound {BUFFER_BOUND}: high-water mark + one read)"
        )

    def _check_forwarded(self, *, final: bool) -> None:
        want = [(r.method, r.target, r.request_body()) for r in self.model.forwarded]
        got = [(s.method, s.target, s.body) for s in self.script.seen]
        for i, (g, w) in enumerate(zip(got, want, strict=False)):
            assert g == w, (
                f"backend request {i}: {g[0]!r} {g[1]!r} ({len(g[2])} body bytes), "
                f"expected {w[0]!r} {w[1]!r} ({len(w[2])})"
            )
        assert len(got) <= len(want), (
            f"the backends received {len(got)} requests, the model forwards {len(want)}: "
            f"extra {[(s.method, s.target) for s in self.script.seen[len(want) :]]}"
        )
        heads = [(s.method, s.target) for b in self.backends for s in b.heads]
        assert len(heads) <= len(want), f"request heads reached the backends: {heads}"
        if final:
            assert len(got) == len(want), (
                f"the backends received {len(got)} of {len(want)} requests"
            )
            assert len(heads) == len(want), f"{len(heads)} heads reached the backends: {heads}"

    # -- the end: send the rest, read everything at once -------------------------------

    def teardown(self) -> None:
        if self.runner is None:
            return
        try:
            if not self.failed:
                self.runner.run(self._finish())
        finally:
            with contextlib.suppress(Exception):
                self.runner.run(self._stop())
            self.runner.close()

    async def _finish(self) -> None:
        model, router, sock = self.model, self.router, self.sock
        assert router is not None
        assert sock is not None
        loop = asyncio.get_running_loop()
        writer = asyncio.ensure_future(self._send_rest())
        parsed, at = 0, 0
        try:
            async with asyncio.timeout(WAIT):
                while not self.eof:
                    if not model.ends:
                        methods = [r.method for r in model.answered[parsed:]]
                        done, rest = parse_stream(bytes(self.received[at:]), methods)
                        parsed, at = parsed + len(done), at + rest
                        if parsed >= len(model.answered):
                            break
                    try:
                        data = await loop.sock_recv(sock, 1 << 18)
                    except ConnectionResetError:
                        self.eof = self.reset = True
                        break
                    self.received += data
                    self.eof = not data
                    self._sample()
                if not self.eof:
                    await writer
        except TimeoutError:
            check_stream(bytes(self.received), self.eof, model, final=True)
            raise AssertionError(f"the router stopped ({WAIT} s) with all answers read") from None
        finally:
            writer.cancel()
        note(f"read {len(self.received)} bytes; eof {self.eof}, reset {self.reset}")
        check_stream(bytes(self.received), self.eof, model, final=True)
        if not model.ends:
            await self._settle()
            assert _queued(sock, termios.FIONREAD) == 0, "stray bytes after the last answer"
        self._check_buffer()
        self._check_forwarded(final=True)
        assert router.active == 0, f"{router.active} exchanges still running after their answers"
        assert router.fleet.loads.total == 0, dict(router.fleet.loads.counts)
        sock.close()
        async with asyncio.timeout(WAIT):
            await until(lambda: not router.connections)
            await router.wait_quiet()
        assert router.fleet.loads.total == 0, dict(router.fleet.loads.counts)

    async def _send_rest(self) -> None:
        loop = asyncio.get_running_loop()
        assert self.sock is not None
        try:
            while self.outbox and not self.write_closed:
                piece = bytes(self.outbox[:65536])
                await loop.sock_sendall(self.sock, piece)
                del self.outbox[: len(piece)]
        except (BrokenPipeError, ConnectionResetError):
            self.write_closed = True

    async def _stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.router is not None:
            with contextlib.suppress(Exception):
                await self.router.shutdown(grace=0.01)
        for backend in self.backends:
            with contextlib.suppress(Exception):
                await backend.close()


def test_a_client_connection_keeps_the_models_contract() -> None:
    check_the_model(MODEL_EXAMPLES or 40)


def test_the_contract_holds_however_the_reads_are_sliced(monkeypatch: pytest.MonkeyPatch) -> None:
    # The reads here (the client's and the backends') are a few KiB: under
    # FEED_SLICE, under FEED_EVENTS. Cut to 37 bytes and 3 parser events, every
    # read leaves a rest that waits (behind the queue or for the loop's next
    # turn) and is parsed later.
    monkeypatch.setattr(client, "FEED_SLICE", 37)
    monkeypatch.setattr(client, "FEED_EVENTS", 3)
    monkeypatch.setattr(upstream, "FEED_SLICE", 37)
    monkeypatch.setattr(upstream, "FEED_EVENTS", 3)
    check_the_model(MODEL_EXAMPLES or 20)


def check_the_model(examples: int) -> None:
    phases = [Phase.explicit, Phase.reuse, Phase.generate]
    if os.environ.get("MODEL_SHRINK"):  # minutes when a step stalls: on demand only
        phases.append(Phase.shrink)
    run_state_machine_as_test(
        ConnectionModel,
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            phases=phases,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.data_too_large,
                HealthCheck.large_base_example,
                HealthCheck.filter_too_much,
            ],
        ),
    )


# -- new defects the model found, as plain tests ---------------------------------------


async def test_requests_pipelined_after_connection_close_are_dropped_not_refused(
    backends: StartBackend, start_router: StartRouter
) -> None:
    """After a request with ``Connection: close`` the server stops reading (RFC 9112
    9.6): what the client pipelined after it is dropped unanswered, not a malformed
    request (llhttp's "Data after `Connection: close`" is not the client's error)."""
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(
            req(b"GET", b"/a")
            + req(b"GET", b"/b", headers=b"Connection: close\r\n")
            + req(b"GET", b"/c")
        )
        data = await client.rest()
    answers, rest = parse_stream(data, [b"GET", b"GET"])
    assert [json.loads(a.body)["target"] for a in answers] == ["/a", "/b"], data[:400]
    assert rest == len(data), f"stray bytes after the answers: {data[rest : rest + 200]!r}"
    assert answers[1].value(b"connection") == b"close"
    assert [s.target for s in backend.heads] == [b"/a", b"/b"]
    assert router.recorder.refused == {}, "a well-formed pipeline was counted as refused"


async def test_a_closing_connection_lingers_so_a_slow_reader_gets_the_whole_answer(
    backends: StartBackend, start_router: StartRouter
) -> None:
    """The router closes after ``Connection: close`` while its answer still waits in
    its buffers; bytes the client sends meanwhile stay unread.  Closing the socket
    with unread bytes makes the kernel send a reset and drop what the client has not
    read yet: the contract's lingering close (half-close, drain) must cover it."""
    size = 48_000  # under the high-water mark: the exchange ends before the client reads

    async def answer(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(response(200, pattern(b"r", size)))
        return True

    backend = await backends(answer)
    router = await start_router([backend.spec])
    loop = asyncio.get_running_loop()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, KERNEL_BUFFER)
        sock.setblocking(False)
        async with asyncio.timeout(WAIT):
            await loop.sock_connect(sock, ("127.0.0.1", router.port))
            await until(lambda: bool(router.connections))
            (conn,) = router.connections
            conn.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_BUFFER
            )
            await loop.sock_sendall(sock, req(b"GET", b"/a", headers=b"Connection: close\r\n"))
            await backend.wait_for(lambda: len(backend.requests) == 1)
            await router.wait_quiet()  # answered: the router is closing this connection
            assert conn.transport.get_write_buffer_size() > 0  # but its answer still waits
            await loop.sock_sendall(sock, req(b"GET", b"/b"))  # unread from now on
            data, reset = bytearray(), False
            while True:  # a slow reader: small reads
                try:
                    piece = await loop.sock_recv(sock, 1024)
                except ConnectionResetError:
                    reset = True
                    break
                if not piece:
                    break
                data += piece
    answers, rest = parse_stream(bytes(data), [b"GET"])
    cut = f"{len(data)} bytes read, reset {reset}: the answer was cut"
    assert len(answers) == 1, cut
    assert answers[0].body == pattern(b"r", size), cut
    assert not reset, "all of the answer came, then a reset instead of a FIN"
    assert rest == len(data)


async def test_a_refused_pipeline_reads_nothing_more_and_logs_no_internal_error(
    backends: StartBackend, start_router: StartRouter, capsys: pytest.CaptureFixture[str]
) -> None:
    """A request refused inside a parser callback (here 431, too many headers) behind
    a good one: the connection must read nothing more ("nothing more is read from
    this client").  Reading again feeds llhttp's failed state, which repeats its
    callback error without an exception: logged as an internal error."""
    release = asyncio.Event()

    async def held(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        await release.wait()
        writer.write(response(200, b"a"))
        return True

    backend = await backends(held)
    router = await start_router([backend.spec])
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(101))
    async with connect(router) as client:
        await client.send(req(b"GET", b"/a") + req(b"GET", b"/b", headers=many))
        await backend.wait_for(lambda: len(backend.heads) == 1)
        await client.send(req(b"GET", b"/c"))
        for _ in range(10):  # loop rounds: bytes already in its socket reach a reading router
            await asyncio.sleep(0)
        release.set()
        data = await client.rest()
    answers, _ = parse_stream(data, [b"GET"])
    assert [a.body for a in answers][:1] == [b"a"]
    assert [s.target for s in backend.heads] == [b"/a"]
    assert router.recorder.refused == {431: 1}
    captured = capsys.readouterr()
    assert "request handling failed" not in captured.out + captured.err
