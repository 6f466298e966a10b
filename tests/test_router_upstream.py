"""Connections to backends (``router/upstream.py``): the keep-alive pool and the
parsing of responses, over real loopback sockets.

What its contract promises: a ``Pool`` hands out its most recent open idle
connection, closes what is over ``max_idle`` or idle past ``keepalive`` (when met
and when swept) and takes nothing back once closed; one backend connection serves request after
request, from client after client; an idle connection the backend closed is
replaced; trailers never leak into the next response on a pooled connection;
a HEAD or 204 answer ends at its head, and the next pipelined request is
answered; a response head or trailer section without end is cut at 64 KiB
(a 502, or a visibly cut response); a new connection the backend resets before
the exchange that opened it takes it sends the request on to the next backend.

Raw-socket clients and recording backends (``tests/harness/``): exact bytes both ways.
"""

from __future__ import annotations

import asyncio
import json

import httptools
import pytest
from structlog.testing import capture_logs

from router import upstream
from router.upstream import Pool, UpstreamConnection
from tests.harness.backends import Backend, Seen, StartBackend, echo, reset
from tests.harness.http import (
    COMPLETION,
    NATIVE_BODY,
    WAIT,
    assert_error,
    chunked,
    connect,
    quiet,
    req,
    response,
)
from tests.harness.routers import StartRouter

# -- the pool -----------------------------------------------------------------------


async def pool_to(backend: Backend, *, max_idle: int = 8, keepalive: float = 60) -> Pool:
    loop = asyncio.get_running_loop()
    return Pool(loop, "127.0.0.1", int(backend.url.rpartition(":")[2]), max_idle=max_idle,
                keepalive=keepalive)  # fmt: skip


async def open_connections(pool: Pool, count: int) -> list[UpstreamConnection]:
    return [await pool.connect(WAIT) for _ in range(count)]


async def test_a_pool_hands_out_its_most_recent_idle_connection_and_keeps_at_most_max_idle(
    backends: StartBackend,
) -> None:
    backend = await backends()
    pool = await pool_to(backend, max_idle=2)
    first, second, third = await open_connections(pool, 3)
    assert pool.take() is None  # nothing idle yet
    assert not any(conn.reused for conn in (first, second, third))
    for conn in (first, second, third):
        pool.give_back(conn)
    assert not third.open  # over max_idle: closed, not kept
    await backend.wait_for(lambda: backend.closed == 1)
    assert pool.take() is second  # most recently used first
    assert second.reused  # a failure before any response byte may be the stale race
    assert pool.take() is first
    assert pool.take() is None
    for conn in (first, second):
        conn.close()
    await backend.wait_for(lambda: backend.closed == 3)


async def test_a_pool_closes_connections_idle_past_keepalive_when_met_and_when_swept(
    backends: StartBackend,
) -> None:
    backend = await backends()
    pool = await pool_to(backend, keepalive=0)  # every idle connection is too old at once
    met, swept = await open_connections(pool, 2)
    pool.give_back(met)
    assert pool.take() is None  # met: closed instead of handed out
    assert not met.open
    pool.give_back(swept)
    pool.sweep()
    assert not swept.open
    await backend.wait_for(lambda: backend.closed == 2)
    fresh = await pool_to(backend, keepalive=60)
    (kept,) = await open_connections(fresh, 1)
    fresh.give_back(kept)
    fresh.sweep()
    assert fresh.take() is kept
    kept.close()


async def test_a_closed_pool_closes_its_idle_connections_and_takes_nothing_back(
    backends: StartBackend,
) -> None:
    backend = await backends()
    pool = await pool_to(backend)
    idle, busy = await open_connections(pool, 2)
    pool.give_back(idle)
    pool.close()  # the backend was removed
    assert not idle.open
    pool.give_back(busy)  # its exchange ends after the removal: nothing comes back in
    assert not busy.open
    assert pool.take() is None
    await backend.wait_for(lambda: backend.closed == 2)


async def test_one_client_connection_serves_many_requests_over_one_backend_connection(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        for i in range(3):
            await client.send(req(b"GET", b"/v1/models?n=%d" % i))
            resp = await client.response()
            assert (resp.status, resp.json()["target"]) == (200, f"/v1/models?n={i}")
            assert resp.value("connection") is None  # HTTP/1.1: keep-alive is the default
        await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
        assert (await client.response()).json()["length"] == len(COMPLETION)
        await client.send(req(b"POST", b"/invocations", body=NATIVE_BODY))
        assert (await client.response()).json()["length"] == len(NATIVE_BODY)
    # Another client, later: the same backend connection, taken from the pool.
    async with connect(router) as client:
        await client.send(req(b"GET", b"/health", headers=b"Connection: close\r\n"))
        resp = await client.response()
        assert resp.status == 200
        assert resp.value("connection") == b"close"
        await client.closed()
    assert [(s.connection, s.number) for s in backend.requests] == [(1, n) for n in range(1, 7)]
    # The client's "Connection: close" is hop-by-hop: the upstream stays pooled.
    assert router.pools[backend.name].idle == 1
    metrics = router.collector.render().decode()
    assert f'prefix_router_upstream_idle_connections{{backend="{backend.name}"}} 1.0' in metrics
    async with connect(router) as client:
        await client.send(req(b"GET", b"/health"))
        assert (await client.response()).status == 200
    assert backend.connections == 1
    assert (backend.requests[-1].connection, backend.requests[-1].number) == (1, 7)


async def test_a_pooled_connection_the_backend_closed_while_idle_is_replaced(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def answer_then_close(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(response(200, b"ok"))  # keep-alive by default, then its idle timer fires
        return False

    backend = await backends(answer_then_close)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        for _ in range(3):
            await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
            resp = await client.response()
            assert (resp.status, resp.body) == (200, b"ok")
    assert backend.connections == 3
    assert router.fleet.backends[backend.name].errors == 0


# -- responses ----------------------------------------------------------------------


async def test_response_trailers_do_not_leak_into_the_next_response(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def handler(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.number == 1:
            head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: X-Usage\r\n\r\n"
            writer.write(head + chunked(b"first", trailers=b"X-Usage: tenant-a-secret\r\n"))
        else:
            writer.write(response(200, b"second"))
        return True

    backend = await backends(handler)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/a"))
        assert (await client.response()).body == b"first"
    async with connect(router) as client:  # another client, the same pooled connection
        await client.send(req(b"GET", b"/b"))
        resp = await client.response()
    assert resp.body == b"second"
    assert backend.connections == 1
    assert resp.values("x-usage") == []


# RELIABILITY.md hardening defect 7: this test failed before its fix.
@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n",
    ],
    ids=["cl-0", "204", "cl-1234"],
)
async def test_the_request_pipelined_after_a_bodiless_head_answer_is_answered(
    answer: bytes, backends: StartBackend, start_router: StartRouter
) -> None:
    async def head_aware(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.method == b"HEAD":
            writer.write(answer)
            return True
        return await echo(backend, seen, writer)

    backend = await backends(head_aware)
    router = await start_router([backend.spec], timeouts={"keepalive": 30})
    async with connect(router) as client:
        await client.send(req(b"HEAD", b"/health") + req(b"GET", b"/after"))
        first = await client.response(no_body=True)
        assert first.status in (200, 204)
        second = await client.response()
        assert (second.status, second.json()["target"]) == (200, "/after")
        # And the same connection goes on serving.
        await client.send(req(b"HEAD", b"/health"))
        await client.response(no_body=True)
        await client.send(req(b"GET", b"/again"))
        assert (await client.response()).json()["target"] == "/again"
    assert router.recorder.requests


# RELIABILITY.md hardening defect 4: this test failed before its fix.
async def test_an_endless_response_header_line_is_a_502_without_waiting_for_its_end(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def endless(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.target != b"/endless":
            return await echo(backend, seen, writer)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: " + b"e" * 256 * 1024)
        await writer.drain()
        await backend.release.wait()
        return False

    backend = await backends(endless)
    router = await start_router([backend.spec], timeouts={"first_byte": 60, "idle": 60})
    async with connect(router) as client:
        await client.send(req(b"GET", b"/endless"))
        resp = await client.response()
    backend.release.set()
    error = assert_error(resp, 502)
    assert "head over" in error["message"]
    await quiet(router)


# RELIABILITY.md hardening defect 4: this test failed before its fix.
async def test_endless_response_trailers_cut_the_response(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def trailers(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nbody\r\n0\r\nX: ")
        for _ in range(40):  # past 64 KiB plus the read that carried the body
            writer.write(b"t" * 16384)
            await writer.drain()
        await backend.release.wait()
        return False

    backend = await backends(trailers)
    router = await start_router([backend.spec], timeouts={"idle": 60})
    async with connect(router) as client:
        await client.send(req(b"GET", b"/trailers"))
        resp = await client.response()
    backend.release.set()
    assert resp.status == 200
    assert not resp.complete  # no last chunk: visibly cut
    await quiet(router)


# -- connecting -----------------------------------------------------------------------


async def test_a_connection_reset_before_its_exchange_takes_it_fails_over_at_once(
    backends: StartBackend, start_router: StartRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend dying as it accepts resets the connection just made.  On a busy loop
    that reset can be read before the connect's callback runs, a few loop turns
    later (tests/test_churn.py killed instances under load): the request must go to
    the next backend then, not wait out ``first_byte`` on a connection already gone."""
    accepted: list[int] = []

    def accept_and_reset(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        reset(writer)

    dying = await asyncio.start_server(accept_and_reset, "127.0.0.1", 0)
    dying_port = dying.sockets[0].getsockname()[1]
    lost = asyncio.Event()
    connection_lost = UpstreamConnection.connection_lost
    pool_connect = Pool.connect

    def lost_and_told(conn: UpstreamConnection, exc: Exception | None) -> None:
        connection_lost(conn, exc)
        lost.set()

    async def after_the_reset(future: asyncio.Future[UpstreamConnection]) -> UpstreamConnection:
        conn = await future
        async with asyncio.timeout(WAIT):
            while conn.open:
                lost.clear()
                await lost.wait()
        return conn  # the busy loop's order: connected, reset, and only then the callback

    def connect_late(pool: Pool, timeout: float) -> asyncio.Future[UpstreamConnection]:
        future = pool_connect(pool, timeout)
        return asyncio.ensure_future(after_the_reset(future)) if pool.port == dying_port else future

    monkeypatch.setattr(UpstreamConnection, "connection_lost", lost_and_told)
    monkeypatch.setattr(Pool, "connect", connect_late)
    alive = await backends(echo, name="alive")
    try:
        router = await start_router(
            [("dying", f"http://127.0.0.1:{dying_port}"), alive.spec],
            health={"active": False, "passive_failures": 1000},  # dying stays in the walk
        )
        async with connect(router) as client:
            for i in range(8):
                body = json.dumps({"model": "m", "prompt": f"request {i} " * 20}).encode()
                await client.send(req(b"POST", b"/v1/completions", body=body))
                resp = await client.response()  # bounded by WAIT: not first_byte's 300 s
                assert resp.status == 200, resp
        assert accepted  # some requests went to dying first, and on from there
        assert len(alive.requests) == 8
        assert router.fleet.backends["dying"].errors == len(accepted)
    finally:
        dying.close()
        await dying.wait_closed()
    await quiet(router)


async def test_a_response_in_tiny_chunks_reaches_the_client_a_read_at_a_time(
    backends: StartBackend, start_router: StartRouter
) -> None:
    # A backend's 2-byte chunks were relayed one chunk each: three buffers per
    # chunk in one writelines, ~20 ms of the loop per 256 KiB read.
    text = bytes(range(48, 122)) * 600  # 44 kB
    pieces = [text[i : i + 2] for i in range(0, len(text), 2)]

    async def tiny(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        writer.write(head + b"".join(b"2\r\n%s\r\n" % p for p in pieces) + b"0\r\n\r\n")
        return True

    class Count:
        def __init__(self) -> None:
            self.chunks: list[bytes] = []

        def on_body(self, body: bytes) -> None:
            self.chunks.append(body)

    backend = await backends(tiny)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/x"))
        assert (await client.response()).body == text
        # The backend connection went back to the pool reading, though the read
        # that ended the response had it wait a turn: the next request uses it.
        await client.send(req(b"GET", b"/x", headers=b"Connection: close\r\n"))
        raw = await client.rest()
    count = Count()
    httptools.HttpResponseParser(count).feed_data(raw)
    assert b"".join(count.chunks) == text
    assert len(count.chunks) < len(pieces) // 20  # one per backend read (kilobytes each)
    assert backend.connections == 1


@pytest.mark.parametrize("framing", ["chunked", "length", "close"])
async def test_a_response_whose_reads_wait_a_turn_arrives_whole_in_every_framing(
    backends: StartBackend,
    start_router: StartRouter,
    monkeypatch: pytest.MonkeyPatch,
    framing: str,
) -> None:
    # Cut to 37-byte slices and 3 parser events, every read of the answer
    # leaves a rest that waits for the loop's next turn, reading paused.
    monkeypatch.setattr(upstream, "FEED_SLICE", 37)
    monkeypatch.setattr(upstream, "FEED_EVENTS", 3)
    text = bytes(range(48, 122)) * 60  # 4.4 kB: ~120 slices, ~40 waits
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]

    async def answer(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         + b"".join(b"5\r\n%s\r\n" % p for p in pieces) + b"0\r\n\r\n")  # fmt: skip
        elif framing == "length":
            writer.write(response(200, text))
        else:  # the body ends when the backend closes, right behind its last byte
            writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + text)
        return framing != "close"

    backend = await backends(answer)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        for _ in range(3):
            await client.send(req(b"GET", b"/x"))
            got = await client.response()
            assert got.status == 200
            assert got.body == text
            if framing == "close":
                break  # the router closes a client whose answer ended with its backend
    # Kept-alive answers come over one backend connection: each went back to the
    # pool reading, though its reads waited turns.
    assert backend.connections == 1
    await quiet(router)


async def test_bytes_after_a_complete_response_retire_the_connection_quietly(
    backends: StartBackend, start_router: StartRouter
) -> None:
    # A backend that answers and then sends a response nobody asked for, in the
    # same write: the stray bytes must never reach the next request, and they
    # are a backend's fault, not a router error with a traceback.
    async def extra(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(response(200, b"mine") + response(200, b"EVIL"))
        return True

    backend = await backends(extra)
    router = await start_router([backend.spec])
    with capture_logs() as logs:
        async with connect(router) as client:
            for _ in range(2):
                await client.send(req(b"GET", b"/x"))
                got = await client.response()
                assert (got.status, got.body) == (200, b"mine")
    assert backend.connections == 2  # the first one was closed, never reused
    assert not [e for e in logs if e["log_level"] == "error"], logs
    await quiet(router)
