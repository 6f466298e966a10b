"""One request crossing the router (``router/exchange.py``): its body forwarded, the
stale keep-alive race retried, backend failures and deadlines turned into errors
or visibly cut responses, over real loopback sockets.

What its contract promises: bodies reach the backend intact in any framing
(OpenAI bodies held whole and bounded, native bodies streamed past
``PrefixLength``); ``Expect: 100-continue`` is answered by the router; a
request lost on a reused connection is resent only when the router holds it
whole; errors before the first response byte are JSON 502/503/504, after it
the response is cut so that it cannot look complete; ``first_byte`` and
``idle`` deadlines, and time the client spends not reading is not the
backend's.  The head rules it applies are in ``test_router_heads.py``.

Raw-socket clients and recording backends (``tests/harness/``): exact bytes both ways.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import resource
import tracemalloc

import pytest

from tests.harness.backends import Backend, Handler, Seen, StartBackend, echo, reset
from tests.harness.http import (
    COMPLETION,
    NATIVE_BODY,
    WAIT,
    Client,
    assert_error,
    connect,
    quiet,
    req,
    still_serves,
)
from tests.harness.routers import StartRouter


async def read_to_the_end(client: Client) -> None:
    async with asyncio.timeout(WAIT):
        while await client.reader.read(65536):
            pass


# -- request bodies -----------------------------------------------------------------


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


# -- OpenAI bodies ------------------------------------------------------------------


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


async def test_a_body_refused_part_way_is_let_go_at_once_not_at_a_collection(
    backends: StartBackend, start_router: StartRouter
) -> None:
    # A chunked OpenAI body refused with 413 once past the limit stayed reachable
    # from its finished exchange through a reference cycle: ~32 MiB each until a
    # garbage collection, which an idle router (gc.freeze(), few allocations)
    # may not run for minutes (20 in a row: RSS 54 -> 692 MiB).
    backend = await backends()
    limit = 4 << 20
    router = await start_router([backend.spec], limits={"max_body_bytes": limit})
    piece = b"x" * (256 << 10)
    wire = req(b"POST", b"/v1/chat/completions", chunks=[b'{"prompt": "', *[piece] * 20])
    gc.collect()
    gc.disable()  # what an idle router amounts to: nothing collects the cycle
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        async with connect(router) as client:
            await client.send(wire)
            assert_error(await client.response(), 413, "invalid_request_error")
            await client.closed()
        await quiet(router)
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        gc.enable()
    assert held < limit // 4, f"{held:,} bytes still held after the 413"
    assert backend.connections == 0


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


# -- retries: the stale keep-alive race ---------------------------------------------


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


# -- broken backends ----------------------------------------------------------------


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


# RELIABILITY.md hardening defect 8: this test failed before its fix.
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


# -- deadlines ----------------------------------------------------------------------


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
