"""The client side (``router/client.py``): one client connection's requests, read,
limited, timed and answered in order, over real loopback sockets.

What its contract promises: requests are parsed from any split of the bytes;
pipelined requests are answered in order, those before a refused one first;
heads, trailers and chunk framing are counted against the limits as they
arrive; malformed framing (smuggling) gets a 400 and never reaches a backend;
the ``client_header`` / ``client_body`` / ``client_request`` / ``keepalive`` / ``client_send``
deadlines; a client that reads nothing holds a bounded buffer.

Raw-socket clients and recording backends (``tests/harness/``): exact bytes both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess

import pytest

from router.app import Router
from router.client import FEED_SLICE, WRITE_HIGH_WATER, ClientConnection
from router.keyworker import KeyWorker
from tests.harness.backends import Backend, Seen, StartBackend, echo, hold
from tests.harness.http import (
    COMPLETION,
    NATIVE_BODY,
    SMUGGLED,
    WAIT,
    Client,
    assert_error,
    chunked,
    connect,
    quiet,
    req,
    still_serves,
    until,
)
from tests.harness.routers import StartRouter

# uvloop reads at most 256 KiB at a time: one backend read on top of the high-water mark.
ONE_READ = 256 * 1024


def only_the_connection(router: Router) -> ClientConnection:
    (conn,) = router.connections
    return conn


async def read_answers(client: Client, count: int) -> None:
    for _ in range(count):
        assert (await client.response()).status == 200


# -- reading requests ---------------------------------------------------------------


async def test_requests_written_one_byte_at_a_time(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    native = b"short native body"
    requests = [
        req(b"POST", b"/v1/completions", chunks=[COMPLETION[:40], COMPLETION[40:]]),
        req(b"POST", b"/invocations", body=native),
        req(b"POST", b"/invocations", chunks=[native[:5], native[5:]]),
        req(b"GET", b"/v1/models"),
    ]
    async with connect(router) as client:
        for data in requests:
            await client.send_bytewise(data)
            assert (await client.response()).status == 200
    assert [s.body for s in backend.requests] == [COMPLETION, native, native, b""]
    assert backend.connections == 1


async def test_a_request_split_at_every_byte_offset(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    openai = b'{"prompt": "split me", "max_tokens": 1}'
    cases = [
        req(b"POST", b"/invocations", chunks=[b"hello ", b"world"], headers=b"X-Tag: t\r\n"),
        req(b"POST", b"/v1/completions", body=openai),
    ]
    async with connect(router) as client:
        for data in cases:
            for cut in range(1, len(data)):
                # Two writes, drained in turn on a TCP_NODELAY socket: two segments,
                # which the router nearly always reads apart.
                await client.send(data[:cut], data[cut:])
                resp = await client.response()
                assert resp.status == 200, (cut, resp.body)
    first, second = (len(c) - 1 for c in cases)
    assert len(backend.requests) == first + second
    assert {s.body for s in backend.requests[:first]} == {b"hello world"}
    assert {s.body for s in backend.requests[first:]} == {openai}
    assert {s.value("x-tag") for s in backend.requests[:first]} == {b"t"}
    assert backend.connections == 1


async def test_trailers_of_a_pipelined_request_are_not_forwarded_as_headers(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    trailed = req(b"POST", b"/invocations", headers=b"Transfer-Encoding: chunked\r\n")
    trailed += chunked(b"data", trailers=b"X-Injected: from-trailer\r\n")
    async with connect(router) as client:
        await client.send(req(b"GET", b"/first") + trailed)
        assert (await client.response()).status == 200
        assert (await client.response()).status == 200
    assert backend.requests[1].body == b"data"
    assert backend.requests[1].values("x-injected") == []


async def test_an_h2c_upgrade_offer_is_ignored_not_refused(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    offer = (
        b"Connection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n"
    )
    async with connect(router) as client:
        await client.send(req(b"GET", b"/v1/models", headers=offer))
        resp = await client.response()
    assert resp.status == 200, resp.body
    for name in ("upgrade", "http2-settings", "connection"):
        assert backend.requests[0].values(name) == []


# -- pipelining ---------------------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    batch = [
        req(b"GET", b"/first"),
        req(b"POST", b"/v1/completions", body=COMPLETION),
        req(b"POST", b"/invocations", chunks=[b"abc", b"def"]),
        req(b"GET", b"/v1/models"),
        req(b"GET", b"/last", headers=b"Connection: close\r\n"),
    ]
    async with connect(router) as client:
        await client.send(b"".join(batch))
        targets = []
        for _ in batch:
            resp = await client.response()
            assert resp.status == 200
            targets.append(resp.json()["target"])
        assert resp.value("connection") == b"close"
        await client.closed()
    expected = ["/first", "/v1/completions", "/invocations", "/v1/models", "/last"]
    assert targets == expected
    assert [s.target.decode() for s in backend.requests] == expected
    assert backend.requests[2].body == b"abcdef"
    assert backend.connections == 1


async def test_a_malformed_request_pipelined_behind_a_good_one_ends_the_connection_after_it(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(
            req(b"GET", b"/first") + b"GET /bad HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n"
        )
        resp = await client.response()
        assert (resp.status, resp.json()["target"]) == (200, "/first")
        rest = await client.rest()
        assert rest == b"" or rest.startswith(b"HTTP/1.1 400 ")
    assert [s.target for s in backend.heads] == [b"/first"]
    await still_serves(router, backend)


async def test_a_refused_pipelined_request_is_counted_once_while_the_one_before_runs(
    backends: StartBackend, start_router: StartRouter
) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def held(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        started.set()
        await release.wait()
        return await echo(backend, seen, writer)

    backend = await backends(held)
    router = await start_router([backend.spec], timeouts={"client_header": 0.2})
    async with connect(router) as client:
        await client.send(
            req(b"GET", b"/first") + b"GET /bad HTTP/1.1\r\nHost: x\r\nBad Header: 1\r\n\r\n"
        )
        async with asyncio.timeout(WAIT):
            await started.wait()
        # Let the header deadline of the refused request pass while /first is held:
        # it must not refuse the same request again (as a 408).
        await asyncio.sleep(0.4)
        release.set()
        resp = await client.response()
        assert (resp.status, resp.json()["target"]) == (200, "/first")
        await client.rest()
    assert router.recorder.refused == {400: 1}
    await quiet(router)


# RELIABILITY.md hardening defect 6: this test failed before its fix.
async def test_a_read_of_many_pipelined_requests_ending_inside_a_head_is_not_a_431(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    count = 1000  # ~36 kB in one write: more than max_header_bytes (32 KiB) ...
    batch = b"".join(req(b"GET", b"/v1/models") for _ in range(count))
    assert len(batch) > 32 * 1024
    last = req(b"GET", b"/v1/models")
    async with connect(router) as client:
        await client.send(batch + last[:40])  # ... that ends inside a head
        await backend.wait_for(lambda: len(backend.requests) > 0)  # that read is parsed
        await client.send(last[40:])
        for _ in range(count + 1):
            resp = await client.response()
            assert resp.status == 200, resp.body
    assert len(backend.requests) == count + 1


# RELIABILITY.md hardening defect 6: this test failed before its fix.
async def test_requests_pipelined_before_a_refused_one_are_answered_then_the_refusal(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    bad = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"
    async with connect(router) as client:
        await client.send(req(b"GET", b"/a") + req(b"GET", b"/b") + req(b"GET", b"/c") + bad)
        answered = []
        for _ in range(3):
            resp = await client.response()
            answered.append((resp.status, resp.json()["target"]))
        assert answered == [(200, "/a"), (200, "/b"), (200, "/c")]
        refusal = await client.response()
        assert_error(refusal, 400)
        assert refusal.value("connection") == b"close"
        await client.closed()
    assert [s.target for s in backend.requests] == [b"/a", b"/b", b"/c"]
    assert router.recorder.refused == {400: 1}


async def test_a_read_of_thousands_of_pipelined_requests_is_parsed_a_slice_at_a_time(
    backends: StartBackend, start_router: StartRouter
) -> None:
    # Parsing one 256 KiB read of tiny requests held the loop for 50-80 ms
    # and queued them all; the rest of the read now waits behind the queue.
    backend = await backends(hold)
    router = await start_router([backend.spec])
    count = 3000  # ~110 kB in one write
    one = req(b"GET", b"/x")
    async with connect(router) as client:
        await client.send(one * count)
        await backend.wait_for(lambda: len(backend.heads) == 1)  # the first is held
        conn = only_the_connection(router)
        assert 0 < len(conn._queue) <= FEED_SLICE // len(one) + 1
        backend.release.set()
        await read_answers(client, count)
    # (Counted by target: on a loaded machine the run outlasts the default 5 s
    # health interval, and the check's GET /health is a request too.)
    assert len([seen for seen in backend.requests if seen.target == b"/x"]) == count
    assert router.active == 0


# -- bodies -------------------------------------------------------------------------


async def test_a_body_in_tiny_chunks_goes_upstream_a_read_at_a_time(
    backends: StartBackend, start_router: StartRouter
) -> None:
    # One upstream write per 2-byte chunk held the loop for seconds on a few MB.
    backend = await backends()
    router = await start_router([backend.spec])
    body = NATIVE_BODY * 3  # 45 kB, past the PrefixLength: most of it streams through
    pieces = [body[i : i + 2] for i in range(0, len(body), 2)]
    async with connect(router) as client:
        await client.send(req(b"POST", b"/invocations", chunks=pieces))
        assert (await client.response()).status == 200
    (seen,) = backend.requests
    assert seen.body == body
    # one chunk per router read (a read holds kilobytes), not per client chunk
    assert seen.body_pieces < len(pieces) // 20


async def test_a_body_held_for_its_key_keeps_tiny_reads_in_one_buffer(
    backends: StartBackend, start_router: StartRouter
) -> None:
    # An OpenAI body is held until its end; a piece per read made a body in
    # tiny reads a million objects (1.5 GB for 33 MB) and a writelines the key
    # worker's pipe refused.
    backend = await backends()
    router = await start_router([backend.spec])
    body = COMPLETION
    async with connect(router) as client:
        await client.send(
            b"POST /v1/completions HTTP/1.1\r\nHost: router.test\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        await until(lambda: only_the_connection(router).current is not None)
        exchange = only_the_connection(router).current
        assert exchange is not None
        for i in range(0, len(body), 2):  # ~210 reads: each awaited at 1 ms, not 10 ms
            await client.send(chunked(body[i : i + 2])[:-5])  # the chunk, not the end
            await until(lambda: exchange.bytes_in == min(i + 2, len(body)), every=0.001)  # noqa: B023
        assert len(exchange._body) == 1
        await client.send(b"0\r\n\r\n")
        assert (await client.response()).status == 200
    assert backend.requests[0].body == body


async def test_a_failure_at_a_requests_end_answers_500_and_frees_its_place(
    backends: StartBackend, start_router: StartRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fault of ours where the request ends (here: the key worker raising as
    # uvloop does on a closed pipe) left the client waiting forever and the
    # request counted in flight.
    def broken(*args: object) -> None:
        raise RuntimeError("unable to perform operation: the handler is closed")

    monkeypatch.setattr(KeyWorker, "key", broken)
    backend = await backends()
    router = await start_router([backend.spec], limits={"key_offload_bytes": 64})
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
        assert_error(await client.response(), 500)
        await client.closed()
    await quiet(router)
    await still_serves(router, backend)


# -- limits -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "status"), [("many-headers", 431), ("large-head", 431), ("long-url", 414)]
)
async def test_oversized_request_heads_are_refused(
    case: str, status: int, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])  # 100 headers, 32 KiB
    if case == "many-headers":
        data = req(b"GET", b"/v1/models", headers=b"".join(b"X-H%d: v\r\n" % i for i in range(101)))
    elif case == "large-head":
        data = req(b"GET", b"/v1/models", headers=b"X-Big: %s\r\n" % (b"a" * 40_000))
    else:
        data = req(b"GET", b"/v1/models?q=" + b"a" * 40_000)
    async with connect(router) as client:
        await client.send(data)
        resp = await client.response()
        assert_error(resp, status, "invalid_request_error")
        assert resp.value("connection") == b"close"
        await client.closed()
    assert backend.heads == []
    assert router.recorder.refused == {status: 1}  # operators see refusals
    assert f'prefix_router_refused_requests_total{{status="{status}"}} 1.0' in (
        router.collector.render().decode()
    )
    await still_serves(router, backend)
    await quiet(router)


async def test_an_endless_header_line_is_refused_without_waiting_for_its_end(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], timeouts={"client_header": 2.0})
    async with connect(router) as client:
        await client.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Endless: " + b"a" * 256 * 1024)
        async with asyncio.timeout(1.0):  # well before client_header
            resp = await client.response()
    assert_error(resp, 431)


# RELIABILITY.md hardening defect 4: this test failed before its fix.
async def test_an_endless_request_trailer_line_is_refused(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], timeouts={"client_body": 30})
    head = b"POST /invocations HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with connect(router) as client:
        await client.send(head + b"3\r\nabc\r\n0\r\nX-Trailer: ")
        # Past max_header_bytes (32 KiB) plus the one read (up to 256 KiB) that
        # also carried the last body bytes, whose trailer part is not counted.
        with contextlib.suppress(ConnectionError):
            for _ in range(40):
                await client.send(b"t" * 16384)
        resp = await client.response()
        assert resp.status in (200, 431)
        if resp.status == 200:  # the backend answered early; the refusal cuts the connection
            await client.rest()
        else:
            assert_error(resp, 431)
    await quiet(router)
    await still_serves(router, backend)


# -- malformed framing and smuggling ------------------------------------------------


BAD_FRAMING = {
    "cl-then-te": b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te-then-cl": b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n0\r\n\r\n",
    "duplicate-cl": b"Content-Length: 2\r\nContent-Length: 48\r\n\r\n{}",
    "cl-list": b"Content-Length: 2, 2\r\n\r\n{}",
    "bad-chunk-size": b"Transfer-Encoding: chunked\r\n\r\n2x\r\n{}\r\n0\r\n\r\n",
    "chunk-size-bare-lf": b"Transfer-Encoding: chunked\r\n\r\n2\n{}\r\n0\r\n\r\n",
    "te-not-chunked": b"Transfer-Encoding: identity\r\n\r\n{}",
    "te-chunked-not-last": b"Transfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "obs-fold": b"Content-Length: 2\r\nX-Folded: a\r\n b\r\n\r\n{}",
    "space-before-colon": b"Content-Length : 2\r\n\r\n{}",
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMING))
async def test_smuggling_attempts_get_400_and_never_reach_the_backend(
    case: str, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    data = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + BAD_FRAMING[case] + SMUGGLED
    async with connect(router) as client:
        await client.send(data)
        resp = await client.response()
        assert_error(resp, 400, "invalid_request_error")
        assert resp.value("connection") == b"close"
        await client.closed()
    await still_serves(router, backend)
    # Had the router opened a connection for the bad request, the good one would be
    # the second; had it sent anything, the backend would have seen a head.
    assert backend.connections == 1
    assert [s.target for s in backend.heads] == [b"/health"]
    await quiet(router)


async def test_a_bare_lf_request_gets_400(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(
            b"POST /v1/completions HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}" + SMUGGLED
        )
        resp = await client.response()
        assert_error(resp, 400)
        await client.closed()
    await still_serves(router, backend)
    assert [s.target for s in backend.heads] == [b"/health"]


@pytest.mark.parametrize(
    "case",
    [
        "cl-then-te",
        "duplicate-cl",
        "obs-fold",
        "te-not-chunked",
    ],
)
async def test_a_bad_passthrough_request_never_reaches_a_pooled_backend_connection(
    case: str, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/warm"))
        assert (await client.response()).status == 200  # the pool holds one connection now
    data = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + BAD_FRAMING[case]
    async with connect(router) as client:
        await client.send(data)
        assert_error(await client.response(), 400)
        await client.closed()
    await still_serves(router, backend)
    assert [s.target for s in backend.heads] == [b"/warm", b"/health"]
    assert backend.connections == 1


# -- deadlines ----------------------------------------------------------------------


async def test_slow_request_heads_get_408(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], timeouts={"client_header": 0.3})
    async with connect(router) as client:
        await client.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # ... and no more
        resp = await client.response()
        assert_error(resp, 408)
        assert resp.value("connection") == b"close"
        await client.closed()
    async with connect(router) as client:  # says nothing at all: closed, nothing to answer
        await client.closed()
    await still_serves(router, backend)


async def test_a_stalled_request_body_gets_408_and_frees_the_lease(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], timeouts={"client_body": 1.0})
    async with connect(router) as client:
        # Past PrefixLength: routed, leased, streaming; then the client stalls.
        head = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
        await client.send(head % len(NATIVE_BODY), NATIVE_BODY[:5000])
        await backend.wait_for(lambda: len(backend.heads) == 1)
        assert router.fleet.loads.total == 1
        assert_error(await client.response(), 408)
        await client.closed()
    await quiet(router)
    assert backend.requests == []  # never completed upstream
    await still_serves(router, backend)


@pytest.mark.parametrize("whole", [None, 0.4])
async def test_a_body_trickled_under_the_stall_timeout_is_bounded_by_client_request(
    backends: StartBackend, start_router: StartRouter, whole: float | None
) -> None:
    # A slow POST: a byte every 50 ms never stalls for client_body (1 s), so it
    # held its lease and backend connection for as long as the client liked.
    # With client_request set, the body has that long in all: a 408.
    backend = await backends()
    timeouts = {"client_body": 1.0} | ({} if whole is None else {"client_request": whole})
    router = await start_router([backend.spec], timeouts=timeouts)
    body = NATIVE_BODY[:4200] + b"x" * 20  # past PrefixLength: routed, then 20 more bytes
    head = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    async with connect(router) as client:
        await client.send(head % len(body), body[:4200])
        answer = asyncio.ensure_future(client.response())
        for i in range(4200, len(body)):  # ~1 s of trickling, unless answered first
            done, _ = await asyncio.wait([answer], timeout=0.05)
            if done:
                break
            with contextlib.suppress(ConnectionError):
                await client.send(body[i : i + 1])
        resp = await answer
    if whole is None:
        assert resp.status == 200
        assert [len(seen.body) for seen in backend.requests] == [len(body)]
    else:
        error = assert_error(resp, 408)
        assert error["message"] == "request body not received within 0.4 s"
        assert backend.requests == []  # never completed upstream
    await quiet(router)


async def test_time_a_backend_does_not_take_a_body_is_not_counted_against_client_request(
    backends: StartBackend, start_router: StartRouter
) -> None:
    # A native body whose backend takes its head, then reads nothing for longer
    # than client_request while the client keeps sending: the router's reading
    # is paused (backpressure), its time, not the client's; the request is
    # served.  The control, a body the router waits for over that same stretch
    # with reading on, gets the 408.
    limit = 1.0
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()  # the backend has stopped reading the held body
    full = asyncio.Event()  # since then, the client's send buffer filled: nobody takes its bytes
    stop = asyncio.Event()

    async def hold_the_first_body(seen: Seen) -> None:
        if seen.connection == 1:  # the held request's; the control's is read on
            stopped.set()
            await backend.release.wait()

    backend = await backends()
    backend.body_read = hold_the_first_body
    router = await start_router(
        [backend.spec], timeouts={"client_body": 30.0, "client_request": limit}
    )
    head = b"POST /invocations HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = b"x" * 65536
    frame = b"%x\r\n%s\r\n" % (len(piece), piece)

    async def keep_sending(sock: socket.socket) -> int:
        """Chunks until ``stop``; the body's length once ended (or cut off)."""
        sent = len(NATIVE_BODY)
        try:
            while not stop.is_set():
                try:
                    taken = sock.send(frame)
                except BlockingIOError:
                    taken = 0
                if taken < len(frame):  # the kernel's buffer is full
                    full.set()
                    await loop.sock_sendall(sock, memoryview(frame)[taken:])
                sent += len(piece)
                await asyncio.sleep(0)  # the router's turn: it keeps up unless paused
            await loop.sock_sendall(sock, b"0\r\n\r\n")
        except ConnectionError:  # refused: the answer says why
            pass
        return sent

    first = b"%x\r\n%s\r\n" % (len(NATIVE_BODY), NATIVE_BODY)  # past PrefixLength: routed
    async with connect(router) as client:
        # Sent through a second descriptor of the client's socket, by hand: a send
        # the kernel does not take in full says its buffer is full.
        with socket.fromfd(
            client.writer.get_extra_info("socket").fileno(), socket.AF_INET, socket.SOCK_STREAM
        ) as sock:
            sock.setblocking(False)
            await client.send(head, first)
            async with asyncio.timeout(WAIT):
                await stopped.wait()
            # The held body's head has reached the backend, so the router's body
            # watch began before this (the loop's clock is the router's).
            began = loop.time()
            sender = asyncio.create_task(keep_sending(sock))
            try:
                async with asyncio.timeout(WAIT):
                    await full.wait()
                async with connect(router) as control:  # the same, then nothing more
                    await control.send(head, first)
                    error = assert_error(await control.response(), 408)
                assert error["message"] == "request body not received within 1 s"
                held = loop.time() - began
                assert held > limit  # the held body has been under way longer than that
                stop.set()
                backend.release.set()
                async with asyncio.timeout(WAIT):
                    sent = await sender
            finally:
                sender.cancel()
        resp = await client.response()
    print(f"\nheld {held:.2f} s against client_request {limit:g} s; body {sent:,} B")
    assert resp.status == 200, resp.body
    assert resp.json()["length"] == sent
    assert [len(seen.body) for seen in backend.requests] == [sent]
    await quiet(router)


async def test_an_idle_keep_alive_client_is_closed(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], timeouts={"keepalive": 0.3})
    async with connect(router) as client:
        await client.send(req(b"GET", b"/v1/models"))
        assert (await client.response()).status == 200
        await client.closed()


async def test_a_partial_head_pipelined_after_a_request_still_gets_408(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], timeouts={"client_header": 0.3, "keepalive": 1.5})
    async with connect(router) as client:
        await client.send(req(b"GET", b"/first") + b"GET /second HTTP/1.1\r\nHost: x\r\n")
        assert (await client.response()).status == 200
        async with asyncio.timeout(1.2):  # before keepalive
            resp = await client.response()
    assert_error(resp, 408)


# -- a client that does not read ----------------------------------------------------


# RELIABILITY.md hardening defects 1, 2: this test failed before their fix.
async def test_a_client_that_reads_nothing_holds_a_bounded_buffer_and_is_reset_at_client_send(
    backends: StartBackend, start_router: StartRouter
) -> None:
    answer = b"x" * 48_000

    async def big(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer)
        return True

    backend = await backends(big)
    # client_send far shorter than idle: it must fire on its own (defect 2).
    router = await start_router(
        [backend.spec], timeouts={"client_send": 0.5, "idle": 60, "first_byte": 60}
    )
    count = 1000
    async with connect(router, rcvbuf=4096) as client:
        await client.send(b"".join(req(b"GET", b"/big/%d" % i) for i in range(count)))
        conn = only_the_connection(router)
        # Ended by client_send, not by the backend's idle timer, and aborted: a
        # close would wait for the client to read, and keep the descriptor.
        await until(lambda: conn not in router.connections)
        await quiet(router)
        # The router stopped starting requests once the client stopped reading:
        # what the kernel's socket buffers hold plus our bounded buffer, not 1000.
        # (Before the fix every one of the 1000 answers was read from the backend.)
        print(f"\n{len(backend.requests)} of {count} requests reached the backend")
        assert len(backend.requests) < 200, len(backend.requests)
        with pytest.raises((ConnectionResetError, asyncio.IncompleteReadError)):
            await read_answers(client, count)
    assert router.recorder.requests  # the requests that ran were recorded


# RELIABILITY.md hardening defect 1: this test failed before its fix.
async def test_a_paused_client_connection_never_buffers_past_one_read_over_the_high_water_mark(
    backends: StartBackend, start_router: StartRouter
) -> None:
    answer = b"y" * 48_000
    sizes: list[int] = []

    async def big(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        # The router's buffer towards the client, as each request reaches us.
        sizes.extend(conn.transport.get_write_buffer_size() for conn in router.connections)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer)
        return True

    backend = await backends(big)
    router = await start_router([backend.spec], timeouts={"client_send": 0.5})
    async with connect(router, rcvbuf=4096) as client:
        await client.send(b"".join(req(b"GET", b"/big/%d" % i) for i in range(300)))
        conn = only_the_connection(router)
        await until(lambda: conn not in router.connections)
        await quiet(router)
    assert sizes
    print(f"\nrequests reaching the backend: {len(sizes)} of 300; largest buffer {max(sizes):,} B")
    assert max(sizes) <= WRITE_HIGH_WATER + ONE_READ, max(sizes)


@pytest.mark.parametrize("backlog", [None, 100])
async def test_the_listener_queues_as_many_connections_as_listen_backlog_says(
    backends: StartBackend, start_router: StartRouter, backlog: int | None
) -> None:
    # 1,024 before: a flood of new connections (~1,500 a second) overflowed it,
    # and a client whose SYN was dropped waited a second for its retry.
    ss = shutil.which("ss")
    if ss is None:
        pytest.skip("no ss (iproute2) to read a listening socket's backlog")
    backend = await backends()
    limits = {} if backlog is None else {"limits": {"listen_backlog": backlog}}
    router = await start_router([backend.spec], **limits)
    shown, cap = listener_backlog(ss, router.port)
    assert shown == min(cap, backlog or 4096)


def listener_backlog(ss: str, port: int) -> tuple[int, int]:
    """The backlog of the listener on ``port`` (a listener's Send-Q in ``ss``), and
    the kernel's cap on any backlog (net.core.somaxconn)."""
    fields = subprocess.run(
        [ss, "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    with open("/proc/sys/net/core/somaxconn") as somaxconn:
        return int(fields[2]), int(somaxconn.read())
