"""The head rules (``router/heads.py``) on the wire, through a running router: what
a backend receives, which heads are refused, how responses are framed to each
client.  ``tests/test_heads.py`` tests the same pure functions byte by byte.

What its contract promises: hop-by-hop fields (and those named in
``Connection``) stay on their hop both ways, ``X-Forwarded-For`` lines are
gathered and ours appended, ``X-Request-Id`` is kept or made, our ``Via`` entry
goes on every forwarded request; a loop (508), a missing or repeated ``Host``,
a repeated tenant header, a fragment (400) and a transfer coding other than
``chunked`` (501) are refused; the kind follows the path the backend routes on;
responses keep their framing to HTTP/1.1 clients (no length on 204/304) and
are read until the close by HTTP/1.0 ones.

Raw-socket clients and recording backends (``tests/harness/``): exact bytes both ways.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from router.config import BackendSpec
from tests.harness.backends import Backend, Seen, StartBackend, echo
from tests.harness.http import (
    COMPLETION,
    assert_error,
    chunked,
    connect,
    quiet,
    req,
    response,
)
from tests.harness.routers import StartRouter

# -- forwarded request heads --------------------------------------------------------


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


async def test_an_http10_request_without_host_gets_a_host_upstream(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(b"GET /v1/models HTTP/1.0\r\n\r\n")
        assert (await client.response()).status == 200
    assert backend.requests[0].values("host") != []


# RELIABILITY.md hardening defect 11: this test failed before its fix.
async def test_connection_naming_host_does_not_strip_it(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(b"GET /a HTTP/1.1\r\nHost: keep.me\r\nConnection: host\r\n\r\n")
        assert (await client.response()).status == 200
    assert backend.requests[0].value("host") == b"keep.me"


# RELIABILITY.md hardening defect 12: this test failed before its fix.
async def test_forwarded_requests_carry_our_via_entry(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/a", headers=b"Via: 1.1 upstream-proxy\r\n"))
        assert (await client.response()).status == 200
    vias = backend.requests[0].values("via")
    assert vias == [b"1.1 upstream-proxy", b"1.1 " + router.via_name]


# -- refused request heads ----------------------------------------------------------


# RELIABILITY.md hardening defect 12: this test failed before its fix.
async def test_a_request_that_comes_back_to_the_router_is_a_508_after_one_hop(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    assert backend.requests == []
    router.remove_backend(backend.name)
    router.add_backend(BackendSpec("self", f"http://127.0.0.1:{router.port}"))
    async with connect(router) as client:
        await client.send(req(b"GET", b"/loop"))
        resp = await client.response()
    assert resp.status == 508
    assert "loop" in resp.json()["error"]["message"]
    assert router.recorder.requests  # two exchanges: ours, and the one that came back
    assert sum(router.recorder.requests.values()) == 2


# RELIABILITY.md hardening defect 11: this test failed before its fix.
@pytest.mark.parametrize(
    "head",
    [
        b"GET /a HTTP/1.1\r\nHost: x\r\nX-Amzn-SageMaker-Prefix-Aware-Id: "
        + b"k" * 65
        + b"\r\nX-Amzn-SageMaker-Prefix-Aware-Id: ok\r\n\r\n",
        b"GET /a HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
        b"GET /a HTTP/1.1\r\n\r\n",
    ],
    ids=["repeated-tenant-header", "repeated-host", "no-host-on-1.1"],
)
async def test_heads_a_backend_could_read_two_ways_are_a_400(
    head: bytes, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(head)
        assert_error(await client.response(), 400)
    assert backend.heads == []


# RELIABILITY.md hardening defect 10: this test failed before its fix.
async def test_a_request_target_with_a_fragment_is_a_400(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions#x", body=b"{}"))
        assert_error(await client.response(), 400)
    assert backend.heads == []


# RELIABILITY.md hardening defect 9: this test failed before its fix.
async def test_a_request_transfer_coding_other_than_chunked_is_a_501(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(
            b"POST /invocations HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            + chunked(b"\x1f\x8b not really gzip")
        )
        assert_error(await client.response(), 501)
    assert backend.heads == []


# RELIABILITY.md hardening defect 10: this test failed before its fix.
@pytest.mark.parametrize(
    "target",
    [
        b"http://router.test/v1/chat/completions",
        b"/v1/chat/%63ompletions",
        b"/v1/./chat/../chat/completions",
        b"//v1/chat/completions?x=1",
    ],
)
async def test_every_spelling_of_an_openai_path_is_an_openai_request(
    target: bytes, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], limits={"max_body_bytes": 1024})
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 2000}]})
    async with connect(router) as client:
        await client.send(req(b"POST", target, body=body.encode()))
        assert_error(await client.response(), 413)  # the OpenAI limit applied
    assert backend.heads == []


# -- response framing ---------------------------------------------------------------


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


# RELIABILITY.md hardening defect 9: this test failed before its fix.
async def test_a_response_transfer_coding_is_relayed_with_the_chunking(
    backends: StartBackend, start_router: StartRouter
) -> None:
    payload = b"\x1f\x8bgzipped bytes"

    async def gzipped(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n" + chunked(payload)
        )
        return True

    backend = await backends(gzipped)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/gz"))
        resp = await client.head()
        assert resp.value("transfer-encoding") == b"gzip, chunked"
        await client._chunks(resp)
    assert resp.complete
    assert resp.body == payload


# RELIABILITY.md hardening defect 11: this test failed before its fix.
@pytest.mark.parametrize("status", [204, 304])
async def test_no_content_length_is_relayed_on_204_and_304(
    status: int, backends: StartBackend, start_router: StartRouter
) -> None:
    async def empty(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 %d X\r\nContent-Length: 0\r\n\r\n" % status)
        return True

    backend = await backends(empty)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/a"))
        resp = await client.response()
        assert resp.status == status
        assert resp.value("content-length") is None
        await client.send(req(b"GET", b"/b"))  # and the connection goes on
        assert (await client.response()).status == status
