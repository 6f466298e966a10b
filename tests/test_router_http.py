"""The router as an HTTP/1.1 proxy, byte for byte, over real loopback sockets.

What an nginx/Envoy-grade proxy must get right: keep-alive on both sides, the
stale keep-alive race, request and response framings, hop-by-hop headers,
``Expect: 100-continue``, pipelining, limits, request smuggling, timeouts,
broken backends and graceful shutdown.

Clients here are raw sockets that write exact bytes and check the exact
framing they read back (``Client``); backends are hand-written ``asyncio``
servers (``Backend``) that record every request head and body they receive
and answer with exact bytes.  Every wait is bounded (``WAIT``); nothing waits
on a sleep, except where a test plays a slow peer on purpose and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource

import pytest

from tests.harness.backends import Backend, Handler, Seen, StartBackend, echo, reset
from tests.harness.http import (
    COMPLETION,
    NATIVE_BODY,
    SMUGGLED,
    WAIT,
    assert_error,
    chunked,
    connect,
    quiet,
    req,
    response,
    still_serves,
)
from tests.harness.routers import SimFleet, StartRouter

# -- keep-alive -----------------------------------------------------------------------


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


def drop_second_request(how: str) -> Handler:
    """Answer the first request of each connection; drop the connection on the second,
    unanswered: what a router sees when it writes into a connection the backend has
    just closed (the stale keep-alive race), made deterministic."""

    async def handler(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.number == 1:
            return await echo(backend, seen, writer)
        if how == "reset":
            reset(writer)
        return False

    return handler


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_a_held_openai_request_lost_on_a_reused_connection_is_resent_on_a_fresh_one(
    how: str, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(drop_second_request(how))
    router = await start_router([backend.spec])
    second = COMPLETION.replace(b"quick", b"quiet")
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
        assert (await client.response()).status == 200
        await client.send(req(b"POST", b"/v1/completions", body=second))
        resp = await client.response()
        assert resp.status == 200, resp.body
        assert resp.json()["length"] == len(second)
        # The client connection is unaffected (and the race met again is handled again).
        await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
        assert (await client.response()).status == 200
    placed = [(s.connection, s.number) for s in backend.requests]
    assert placed == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1)]
    assert backend.requests[1].body == backend.requests[2].body == second
    assert router.fleet.backends[backend.name].errors == 0  # the race is not the backend's fault
    await quiet(router)


async def test_a_get_lost_on_a_reused_connection_is_resent_on_a_fresh_one(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(drop_second_request("close"))
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/v1/models"))
        assert (await client.response()).status == 200
        await client.send(req(b"GET", b"/v1/models"))
        resp = await client.response()
    assert resp.status == 200, resp.body


async def test_a_streamed_native_body_lost_on_a_reused_connection_is_not_replayed(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(drop_second_request("close"))
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/health"))
        assert (await client.response()).status == 200
        # Past PrefixLength: routed and streamed, so the router no longer holds it all.
        await client.send(req(b"POST", b"/invocations", body=NATIVE_BODY))
        resp = await client.response()
        assert_error(resp, 502, "bad_gateway")
        await client.closed()
    assert [(s.connection, s.number, s.target) for s in backend.requests] == [
        (1, 1, b"/health"),
        (1, 2, b"/invocations"),
    ]
    assert backend.connections == 1
    await quiet(router)


# -- request bodies -------------------------------------------------------------------


def pieces_of(body: bytes) -> list[bytes]:
    """Uneven chunks: one byte, a small one, one across PrefixLength, the rest."""
    return [body[:1], body[1:100], body[100:5000], body[5000:]]


@pytest.mark.parametrize("framing", ["length", "chunked", "chunked-with-extensions"])
@pytest.mark.parametrize("path", [b"/invocations", b"/v1/completions"])
async def test_request_bodies_reach_the_backend_intact(
    path: bytes, framing: str, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    if path == b"/invocations":
        body = NATIVE_BODY
    else:
        body = json.dumps({"model": "m", "prompt": NATIVE_BODY.decode(), "max_tokens": 1}).encode()
    if framing == "length":
        data = req(b"POST", path, body=body)
    elif framing == "chunked":
        data = req(b"POST", path, chunks=pieces_of(body))
    else:
        head = req(b"POST", path, headers=b"Transfer-Encoding: chunked\r\n")
        data = head + b"".join(
            b"%x;n=%d\r\n%s\r\n" % (len(p), i, p) for i, p in enumerate(pieces_of(body))
        )
        data += b"0;done\r\n\r\n"
    split = len(data) - 8000  # some 10 KB of body first: past PrefixLength
    async with connect(router) as client:
        await client.send(data[:split])
        if path == b"/invocations":
            # Routed on its prefix and connected: the rest streams through as it comes.
            await backend.wait_for(lambda: len(backend.heads) == 1)
        await client.send(data[split:])
        resp = await client.response()
    assert resp.status == 200
    assert resp.json()["length"] == len(body)
    (seen,) = backend.requests
    assert seen.body == body
    if path == b"/invocations" and framing != "length":
        # Streamed: the router cannot know the length, so it forwards chunks.
        assert seen.value("transfer-encoding") == b"chunked"
        assert seen.value("content-length") is None
    else:
        # OpenAI bodies are held whole (bounded), so they go with a length.
        assert seen.value("content-length") == b"%d" % len(body)
        assert seen.value("transfer-encoding") is None


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


# -- response framings ----------------------------------------------------------------


async def framings(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
    plain = (b"Content-Type", b"text/plain")
    if seen.method == b"HEAD" and seen.target == b"/chunked":
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
    elif seen.method == b"HEAD":
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 11\r\n\r\n")
    elif seen.target == b"/length":
        writer.write(response(200, b"hello world", [plain]))
    elif seen.target == b"/chunked":
        head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
        writer.write(head + chunked(b"hello", b" ", b"world"))
    elif seen.target == b"/close":
        # An HTTP/1.0 server: no length, the end of the body is the end of the connection.
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nhello world")
        return False
    elif seen.target == b"/204":
        writer.write(b"HTTP/1.1 204 No Content\r\nX-Kind: none\r\n\r\n")
    elif seen.target == b"/304":
        writer.write(b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\n\r\n')
    else:
        return await echo(backend, seen, writer)
    return True


@pytest.mark.parametrize(
    ("method", "target", "status", "framing", "body"),
    [
        (b"GET", b"/length", 200, "length", b"hello world"),
        (b"GET", b"/chunked", 200, "chunked", b"hello world"),
        (b"GET", b"/204", 204, "none", b""),
        (b"GET", b"/304", 304, "none", b""),
        (b"HEAD", b"/length", 200, "none", b""),
        (b"HEAD", b"/chunked", 200, "none", b""),
    ],
)
async def test_response_framings_are_relayed_to_an_http11_client(
    method: bytes,
    target: bytes,
    status: int,
    framing: str,
    body: bytes,
    backends: StartBackend,
    start_router: StartRouter,
) -> None:
    backend = await backends(framings)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(method, target))
        resp = await client.response(no_body=method == b"HEAD")
        assert (resp.status, resp.framing, resp.body, resp.complete) == (
            status,
            framing,
            body,
            True,
        )
        if method == b"HEAD" and target == b"/length":
            assert resp.value("content-length") == b"11"  # what a GET would have had
            assert resp.value("transfer-encoding") is None
        if status in (204, 304):
            assert resp.value("content-length") is None
            assert resp.value("transfer-encoding") is None
        # The same connection goes on, with no stray byte in between.
        await client.send(req(b"GET", b"/length"))
        after = await client.response()
        assert (after.status, after.body) == (200, b"hello world")
    await quiet(router)


async def test_a_close_delimited_response_reaches_an_http11_client_complete(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(framings)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/close"))
        resp = await client.response()
    assert (resp.status, resp.body) == (200, b"hello world")
    assert resp.complete
    assert router.fleet.backends[backend.name].errors == 0


async def test_http10_clients_get_unchunked_responses(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(framings)
    router = await start_router([backend.spec])
    for target in (b"/chunked", b"/close"):
        async with connect(router) as client:
            await client.send(req(b"GET", target, version=b"1.0"))
            resp = await client.response()
            assert (resp.status, resp.framing, resp.body) == (200, "close", b"hello world")
            assert resp.value("transfer-encoding") is None
            assert resp.value("connection") == b"close"
    # HTTP/1.0 with keep-alive: a length, and the connection stays open.
    async with connect(router) as client:
        for _ in range(2):
            await client.send(
                req(b"GET", b"/length", version=b"1.0", headers=b"Connection: keep-alive\r\n")
            )
            resp = await client.response()
            assert (resp.status, resp.framing, resp.body) == (200, "length", b"hello world")
            assert resp.value("connection") == b"keep-alive"
        await client.send(req(b"GET", b"/length", version=b"1.0"))
        resp = await client.response()
        assert resp.value("connection") == b"close"
        await client.closed()
    await quiet(router)


# -- headers ------------------------------------------------------------------------

HOP_REQUEST_HEADERS = (
    b"Connection: keep-alive, X-Hop-Secret\r\n"
    b"X-Hop-Secret: for the router only\r\n"
    b"Keep-Alive: timeout=30\r\n"
    b"TE: trailers\r\n"
    b"Trailer: X-Checksum\r\n"
    b"Upgrade: websocket\r\n"
    b"Proxy-Authorization: Basic dXNlcjpwYXNz\r\n"
    b"Proxy-Connection: keep-alive\r\n"
    b"Authorization: Bearer end-to-end\r\n"
    b"X-Forwarded-For: 203.0.113.7\r\n"
    b"X-Forwarded-Proto: https\r\n"
    b"X-Request-Id: client-chosen-id\r\n"
    b"X-End: kept\r\n"
)
HOP_BY_HOP = [
    "connection",
    "keep-alive",
    "te",
    "trailer",
    "upgrade",
    "proxy-authorization",
    "proxy-connection",
    "proxy-authenticate",
    "x-hop-secret",
    "expect",
]


async def hop_headers(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
    headers = [
        (b"Connection", b"keep-alive"),
        (b"Keep-Alive", b"timeout=5, max=100"),
        (b"Proxy-Authenticate", b'Basic realm="backend"'),
        (b"Proxy-Connection", b"keep-alive"),
        (b"Trailer", b"X-Checksum"),
        (b"Upgrade", b"h2c"),
        (b"X-End", b"kept"),
    ]
    writer.write(response(200, b"{}", headers))
    return True


async def test_hop_by_hop_headers_stay_on_their_hop_and_forwarding_headers_are_set(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends(hop_headers)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/v1/models", headers=HOP_REQUEST_HEADERS))
        first = await client.response()
        for _ in range(2):
            # No id, no X-Forwarded-For of the client's own: the router makes them.
            await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
            await client.response()
    seen, second, third = backend.requests
    for name in HOP_BY_HOP:
        assert seen.values(name) == [], name
        assert first.values(name) == [], name
    assert seen.value("host") == b"router.test"
    assert seen.value("authorization") == b"Bearer end-to-end"
    assert seen.value("x-end") == first.value("x-end") == b"kept"
    assert seen.value("x-forwarded-for") == b"203.0.113.7, 127.0.0.1"
    assert seen.value("x-forwarded-proto") == b"http"
    assert seen.value("x-request-id") == first.value("x-request-id") == b"client-chosen-id"
    assert second.value("x-forwarded-for") == b"127.0.0.1"
    assert second.value("x-forwarded-proto") == b"http"
    made = {second.value("x-request-id"), third.value("x-request-id")}
    assert None not in made
    assert len(made) == 2  # one per request


async def test_headers_named_in_the_backends_connection_header_are_not_relayed(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def handler(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        headers = [(b"Connection", b"keep-alive, X-Backend-Hop"), (b"X-Backend-Hop", b"1")]
        writer.write(response(200, b"{}", headers))
        return True

    backend = await backends(handler)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/v1/models"))
        resp = await client.response()
    assert resp.values("x-backend-hop") == []


async def test_several_x_forwarded_for_lines_are_all_kept(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    xff = b"X-Forwarded-For: 198.51.100.1\r\nX-Forwarded-For: 203.0.113.7\r\n"
    async with connect(router) as client:
        await client.send(req(b"GET", b"/v1/models", headers=xff))
        await client.response()
    assert backend.requests[0].value("x-forwarded-for") == b"198.51.100.1, 203.0.113.7, 127.0.0.1"


async def test_a_backend_echoing_x_request_id_does_not_duplicate_it(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def handler(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        rid = seen.value("x-request-id") or b""
        writer.write(response(200, b"{}", [(b"X-Request-Id", rid)]))
        return True

    backend = await backends(handler)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/v1/models", headers=b"X-Request-Id: abc\r\n"))
        resp = await client.response()
    assert resp.values("x-request-id") == [b"abc"]


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


async def test_an_http10_request_without_host_gets_a_host_upstream(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(b"GET /v1/models HTTP/1.0\r\n\r\n")
        assert (await client.response()).status == 200
    assert backend.requests[0].values("host") != []


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


# -- Expect: 100-continue, pipelining -------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"), [(b"/v1/chat/completions", COMPLETION), (b"/invocations", NATIVE_BODY)]
)
async def test_expect_100_continue_is_answered_by_the_router(
    path: bytes, body: bytes, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(
            b"POST %s HTTP/1.1\r\nHost: router.test\r\nContent-Length: %d\r\n"
            b"Expect: 100-continue\r\n\r\n" % (path, len(body))
        )
        interim = await client.head()  # the client sends nothing more until it has this
        assert (interim.status, interim.headers) == (100, [])
        await client.send(body)
        resp = await client.response()
        assert (resp.status, resp.json()["length"]) == (200, len(body))
    (seen,) = backend.requests
    assert seen.body == body
    assert seen.values("expect") == []


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


# -- limits ---------------------------------------------------------------------------


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


@pytest.mark.parametrize("framing", ["length", "chunked", "length-with-expect"])
async def test_openai_bodies_over_max_body_bytes_get_413(
    framing: str, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], limits={"max_body_bytes": 2048})
    big = json.dumps({"model": "m", "prompt": "x" * 3000}).encode()
    async with connect(router) as client:
        if framing == "length":
            await client.send(req(b"POST", b"/v1/chat/completions", body=big))
        elif framing == "chunked":
            await client.send(req(b"POST", b"/v1/chat/completions", chunks=pieces_of(big)))
        else:
            await client.send(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
                b"Expect: 100-continue\r\n\r\n" % len(big)
            )
        resp = await client.response()  # not "100 Continue"
        error = assert_error(resp, 413, "invalid_request_error")
        assert "2048" in error["message"]
        assert resp.value("connection") == b"close"
        await client.closed()
    assert backend.connections == 0
    # Exactly at the limit is fine.
    padded = json.dumps({"model": "m", "prompt": ""}).encode()
    at_limit = padded.replace(b'""', b'"' + b"y" * (2048 - len(padded)) + b'"')
    assert len(at_limit) == 2048
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions", chunks=pieces_of(at_limit)))
        assert (await client.response()).status == 200
    assert [s.body for s in backend.requests] == [at_limit]
    await quiet(router)


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


@pytest.mark.parametrize(
    ("path", "body", "needle", "param"),
    [
        (b"/v1/chat/completions", b'{"messages": [', "not valid JSON", None),
        (b"/v1/chat/completions", b"\xff\xfe{}", "not valid JSON", None),
        (b"/v1/chat/completions", b"", "not valid JSON", None),
        (b"/v1/chat/completions", b'{"messages": "hi"}', "got `str`", "messages"),
        (
            b"/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": 7}]}',
            "got `int`",
            "messages[0].content",
        ),
        (b"/v1/completions", b'{"prompt": [1, -2]}', "non-negative integers", "prompt"),
        (b"/v1/responses", b'{"prompt_cache_key": 5}', "Expected `str | null`", "prompt_cache_key"),
        (b"/v1/completions", b"[1, 2]", "Expected `object`, got `array`", None),
    ],
)
async def test_unreadable_openai_bodies_get_400_naming_the_problem(
    path: bytes,
    body: bytes,
    needle: str,
    param: str | None,
    backends: StartBackend,
    start_router: StartRouter,
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"POST", path, body=body))
        resp = await client.response()
        error = assert_error(resp, 400, "invalid_request_error")
        assert needle in error["message"]
        assert error["param"] == param
        assert resp.value("x-request-id")
        # The request was read whole: the connection goes on.
        await client.send(req(b"POST", path, body=COMPLETION))
        assert (await client.response()).status == 200
    assert [s.body for s in backend.requests] == [COMPLETION]
    await still_serves(router, backend)
    await quiet(router)


async def test_an_unroutable_tool_definition_gets_400(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    body = b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1e400}]}'
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions", body=body))
        resp = await client.response()
    assert_error(resp, 400)


# -- timeouts -----------------------------------------------------------------------


async def test_running_out_of_file_descriptors_is_a_503_and_no_backend_is_blamed(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], health={"active": False})
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers: list[int] = []
    async with connect(router) as client:
        # The process (router and test share it) gets to its descriptor limit.
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 32, hard))
        try:
            with contextlib.suppress(OSError):
                while True:
                    fillers.append(os.open(os.devnull, os.O_RDONLY))
            await client.send(req(b"GET", b"/v1/models"))
            resp = await client.response()
        finally:
            for fd in fillers:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert_error(resp, 503)
    assert fillers  # the limit was reached
    state = router.fleet.backends[backend.name]
    assert (state.errors, state.healthy) == (0, True)  # EMFILE is ours, not the backend's
    await still_serves(router, backend)
    await quiet(router)


async def test_a_backend_that_never_answers_is_a_504(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def silent(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        return True  # reads, never answers

    backend = await backends(silent)
    router = await start_router([backend.spec], timeouts={"first_byte": 0.3})
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
        resp = await client.response()  # strict: the 504 is the very first thing sent
        error = assert_error(resp, 504, "gateway_timeout")
        assert "did not answer" in error["message"]
        assert resp.value("connection") == b"close"
        await client.closed()
    assert backend.requests[0].body == COMPLETION
    await backend.wait_for(lambda: backend.closed == 1)  # the router let go of it
    await quiet(router)


async def test_a_backend_stalling_mid_body_gives_a_truncated_response(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def stall(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        return True  # and nothing more

    backend = await backends(stall)
    router = await start_router([backend.spec], timeouts={"first_byte": 0.3, "idle": 0.3})
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
        resp = await client.response()
    assert (resp.status, resp.framing, resp.body) == (200, "chunked", b"first")
    assert not resp.complete  # closed with no terminating chunk
    await quiet(router)


async def test_an_idle_timeout_shorter_than_first_byte_is_honoured(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def stall(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        return True

    backend = await backends(stall)
    router = await start_router([backend.spec], timeouts={"first_byte": 5.0, "idle": 0.2})
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
        async with asyncio.timeout(1.0):  # well past idle, well before first_byte
            resp = await client.response()
    assert not resp.complete


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


async def test_a_slow_reading_client_is_not_cut_off_by_the_upstream_idle_timeout(
    backends: StartBackend, start_router: StartRouter
) -> None:
    size = 16 * 1024 * 1024  # far more than the socket buffers between router and client
    block = b"z" * 65536

    async def bulk(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // len(block)):
            writer.write(block)
            await writer.drain()
        return True

    backend = await backends(bulk)
    router = await start_router([backend.spec], timeouts={"first_byte": 0.5, "idle": 0.5})
    async with connect(router, rcvbuf=65536) as client:
        await client.send(req(b"GET", b"/bulk"))
        resp = await client.head()
        await asyncio.sleep(1.5)  # the client is slow on purpose: it reads nothing for a while
        resp = await client.body(resp)
    assert resp.complete
    assert len(resp.body) == size
    assert router.fleet.backends[backend.name].errors == 0


# -- broken backends ------------------------------------------------------------------


async def test_a_backend_sending_garbage_is_a_502(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def garbage(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.target == b"/v1/completions":
            writer.write(b"HELLO THERE\r\n\r\n")
            return False
        return await echo(backend, seen, writer)

    backend = await backends(garbage)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
        resp = await client.response()
        assert_error(resp, 502, "bad_gateway")
        await client.closed()
    assert router.fleet.backends[backend.name].errors == 1
    await quiet(router)
    await still_serves(router, backend)


async def test_a_backend_reset_mid_response_truncates_it_and_frees_the_lease(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def reset_later(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.target != b"/stream":
            return await echo(backend, seen, writer)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await backend.release.wait()  # the client has the first chunk
        reset(writer)
        return False

    backend = await backends(reset_later)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/stream"))
        resp = await client.head()
        assert resp.status == 200
        assert await client.chunk() == b"first"
        assert router.fleet.loads.total == 1
        backend.release.set()
        rest = await client.rest()
        assert not rest.endswith(b"0\r\n\r\n")  # no terminating chunk: visibly truncated
    await quiet(router)
    assert router.fleet.backends[backend.name].errors == 1
    await still_serves(router, backend)


# -- graceful shutdown ----------------------------------------------------------------


async def test_shutdown_lets_a_stream_finish_and_refuses_new_connections(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    (sim,) = await sim_fleet(1, extra_token_s=0.02)
    router = await start_router([sim])
    port = router.port
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 25,
            "stream": True,
        }
    ).encode()
    async with connect(router) as idle, connect(router) as streaming:
        await idle.send(req(b"GET", b"/health"))
        assert (await idle.response()).status == 200
        await streaming.send(req(b"POST", b"/v1/chat/completions", body=body))
        head = await streaming.head()
        assert (head.status, head.value("transfer-encoding")) == (200, b"chunked")
        assert (await streaming.chunk()).startswith(b"data: ")

        stopping = asyncio.create_task(router.shutdown(grace=5))
        await asyncio.sleep(0)  # one loop turn: the task runs up to its first await
        assert router.stopping
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        await idle.closed()  # idle keep-alive connections go at once

        rest = await streaming.body(head)
        assert rest.complete
        assert rest.body.rstrip().endswith(b"data: [DONE]")
        await streaming.closed()  # no next request on a stopping router
        async with asyncio.timeout(WAIT):
            await stopping
    assert router.active == 0
    assert router.fleet.loads.total == 0
