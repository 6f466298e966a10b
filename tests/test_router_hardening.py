"""Regression tests for the defects found by trying to break the data plane (issue 10).

Each test names the defect it pins (its number in RELIABILITY.md's "Hardening"
table) and failed before its fix.  Clients are raw sockets, backends hand-written
asyncio servers (``tests/harness/``): exact bytes both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

import pytest

from router.app import Router
from router.client import WRITE_HIGH_WATER, ClientConnection
from router.config import BackendSpec
from tests.harness.backends import Backend, Seen, StartBackend, echo, reset
from tests.harness.http import (
    WAIT,
    Client,
    assert_error,
    chunked,
    connect,
    quiet,
    req,
    still_serves,
)
from tests.harness.routers import StartRouter

# uvloop reads at most 256 KiB at a time: one backend read on top of the high-water mark.
ONE_READ = 256 * 1024


def only_the_connection(router: Router) -> ClientConnection:
    (conn,) = router.connections
    return conn


async def until(predicate: Callable[[], bool]) -> None:
    """Wait for a condition the router offers no event for (bounded by WAIT)."""
    async with asyncio.timeout(WAIT):
        while not predicate():  # noqa: ASYNC110 - connection_lost has no event to wait on
            await asyncio.sleep(0.01)


async def read_answers(client: Client, count: int) -> None:
    for _ in range(count):
        assert (await client.response()).status == 200


async def read_to_the_end(client: Client) -> None:
    async with asyncio.timeout(WAIT):
        while await client.reader.read(65536):
            pass


# -- 1, 2: a client that reads nothing -------------------------------------------------


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


# -- 4: unbounded trailers and response heads --------------------------------------------


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


# -- 6: pipelining ----------------------------------------------------------------------


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


# -- 7: a HEAD or 204 answered without a body ---------------------------------------------


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


# -- 8: HTTP/1.0 truncation ---------------------------------------------------------------


async def test_an_http10_response_cut_by_the_backend_ends_with_a_reset(
    backends: StartBackend, start_router: StartRouter
) -> None:
    async def cut(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await backend.release.wait()
        reset(writer)
        return False

    backend = await backends(cut)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/stream", version=b"1.0"))
        resp = await client.head()
        assert resp.value("content-length") is None  # read until the close
        assert await client.reader.readexactly(5) == b"first"
        backend.release.set()
        with pytest.raises(ConnectionResetError):  # a FIN would look like the whole answer
            await read_to_the_end(client)
    await quiet(router)


# -- 9: transfer codings ------------------------------------------------------------------


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


# -- 10: OpenAI paths written differently ----------------------------------------------------


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


async def test_a_request_target_with_a_fragment_is_a_400(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions#x", body=b"{}"))
        assert_error(await client.response(), 400)
    assert backend.heads == []


# -- 11: repeated and essential headers -----------------------------------------------------


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


async def test_connection_naming_host_does_not_strip_it(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(b"GET /a HTTP/1.1\r\nHost: keep.me\r\nConnection: host\r\n\r\n")
        assert (await client.response()).status == 200
    assert backend.requests[0].value("host") == b"keep.me"


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


# -- 12: a backend that is the router itself ------------------------------------------------


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
