"""A client that half-closes (``shutdown(SHUT_WR)``: ``nc -N``, a TCP proxy
passing its client's half-close on) after sending its requests is still answered
(``ClientConnection.eof_received``), over real loopback sockets.

Before, asyncio closed the connection at the client's FIN: a whole request got
no answer at all.  Requests cut short by the FIN can never end: the connection
closes, and nothing reaches a backend.
"""

from __future__ import annotations

import pytest

from tests.harness.backends import StartBackend, hold
from tests.harness.http import connect, req, until
from tests.harness.routers import StartRouter

pytestmark = pytest.mark.timeout(60)

REQUEST = req(b"GET", b"/health")


async def test_requests_sent_whole_before_a_half_close_are_answered_then_closed(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(REQUEST)
        client.writer.write_eof()
        assert (await client.response()).status == 200
        assert await client.rest() == b""
    async with connect(router) as client:  # pipelined: all three, in order
        await client.send(
            req(b"GET", b"/1") + req(b"POST", b"/2", body=b"two") + req(b"GET", b"/3")
        )
        client.writer.write_eof()
        for _ in range(3):
            assert (await client.response()).status == 200
        assert await client.rest() == b""
    assert [seen.target for seen in backend.requests] == [b"/health", b"/1", b"/2", b"/3"]
    await until(lambda: not router.connections and router.admission.clients == 0)


async def test_an_answer_still_on_its_way_at_the_half_close_arrives_whole(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(hold)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"POST", b"/slow", body=b"x" * 1000))
        await backend.wait_for(lambda: len(backend.requests) == 1)
        client.writer.write_eof()
        backend.release.set()
        resp = await client.response()
        assert resp.status == 200
        assert b'"length": 1000' in resp.body
        assert await client.rest() == b""


async def test_a_request_cut_short_by_the_half_close_is_dropped(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:  # half a head
        await client.send(b"GET /never HTTP/1.1\r\nHost: x\r\n")
        client.writer.write_eof()
        assert await client.rest() == b""
    async with connect(router) as client:  # a whole one, then half a body
        await client.send(
            REQUEST + b"POST /cut HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12"
        )
        client.writer.write_eof()
        assert (await client.response()).status == 200  # the whole one is answered
        assert await client.rest() == b""  # the cut one never started
    assert b"/cut" not in [seen.target for seen in backend.requests]
    assert b"/never" not in [seen.target for seen in backend.requests]
    await until(lambda: router.admission.clients == 0)


async def test_behind_a_proxy_protocol_header_too(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], proxy_protocol=True)
    async with connect(router) as client:
        await client.send(b"PROXY TCP4 203.0.113.7 127.0.0.1 1 2\r\n" + REQUEST)
        client.writer.write_eof()
        assert (await client.response()).status == 200
        assert await client.rest() == b""
    assert backend.requests[0].value("x-forwarded-for") == b"203.0.113.7"
