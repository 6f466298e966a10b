"""Large OpenAI bodies keyed in the key worker process (``router/keyworker.py``).

The real router, a real child process, hand-written backends on 127.0.0.1: a
body over ``key_offload_bytes`` must get the key the loop would have given it
(the same backend), the same errors, and survive the worker dying.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import msgspec
import pytest

from router.extract import BadRequest, decode_openai, prompt_key
from router.keyworker import answer
from tests.harness.backends import Backend, Handler, Seen, StartBackend
from tests.harness.http import WAIT, assert_error, connect, req
from tests.harness.routers import StartRouter

MIB = 1024 * 1024


def chat(document: str, question: str, **extra: object) -> bytes:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": document},
            {"role": "user", "content": question},
        ],
        **extra,
    }
    return json.dumps(body).encode()


def named(name: str) -> Handler:
    """A backend that says who it is and how much body it received."""

    async def handler(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        payload = json.dumps({"backend": name, "length": len(seen.body)}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
        return True

    return handler


async def test_a_large_body_gets_the_key_the_loop_would_give_it(
    backends: StartBackend, start_router: StartRouter
) -> None:
    fleet = [await backends(named(f"b{i}"), name=f"b{i}") for i in range(5)]
    specs = [b.spec for b in fleet]
    inline = await start_router(specs, limits={"key_offload_bytes": 0})
    offloaded = await start_router(specs)  # default: over 1 MiB
    documents = [f"document {i} " * 200_000 for i in range(6)]  # ~2.2 MiB each
    for document in documents:
        body = chat(document, "what does it say?")
        assert len(body) > MIB
        chosen = []
        for router in (inline, offloaded):
            async with connect(router) as client:
                await client.send(req(b"POST", b"/v1/chat/completions", body=body))
                resp = await client.response()
            assert resp.status == 200, resp.body[:200]
            assert resp.json()["length"] == len(body)  # forwarded whole
            chosen.append(resp.json()["backend"])
        assert chosen[0] == chosen[1], document[:20]
    assert inline.keyworker.pid is None  # never needed
    assert offloaded.keyworker.pid is not None


async def test_a_large_unreadable_body_gets_the_loops_400(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], limits={"key_offload_bytes": 1024})
    cases = [
        (b'{"messages": [' + b'{"role": "user", "content": "x"},' * 100 + b"", "not valid JSON"),
        (chat("x" * 4000, "q", prompt_cache_key="k" * 65), "prompt_cache_key"),
        (json.dumps({"messages": [{"role": 5}] * 100}).encode(), "messages"),
    ]
    for body, needle in cases:
        async with connect(router) as client:
            await client.send(req(b"POST", b"/v1/chat/completions", body=body))
            error = assert_error(await client.response(), 400)
        assert needle in error["message"] + str(error["param"])
        if needle != "prompt_cache_key":  # the worker answers exactly what the loop would
            with pytest.raises(BadRequest) as raised:
                prompt_key(decode_openai(body, 4096), 4096)
            assert error["message"] == str(raised.value)
    assert backend.requests == []


async def test_the_key_worker_is_restarted_after_it_dies(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], limits={"key_offload_bytes": 1024})
    body = chat("y" * 5000, "q")
    for _ in range(2):
        async with connect(router) as client:
            await client.send(req(b"POST", b"/v1/chat/completions", body=body))
            assert (await client.response()).status == 200
        pid = router.keyworker.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(WAIT):
            await router.keyworker._exited.wait()
        assert router.keyworker.pid is None
    assert len(backend.requests) == 2


def test_the_worker_answers_what_the_loop_computes() -> None:
    body = chat(
        "z" * 10_000,
        "q",
        prompt_cache_key="tenant",
        previous_response_id="resp_1",
        conversation={"id": "conv_1"},
        cache_salt="s",
    )
    decoded = msgspec.msgpack.decode(answer(body, 4096))
    status, key, tenant, previous, model, conversation, salted = decoded
    request = decode_openai(body, 4096)
    assert (status, key, tenant) == ("ok", prompt_key(request, 4096), "tenant")
    assert previous == request.previous_response_id == "resp_1"
    assert model == bytes(request.model) == b'"m"'
    assert (conversation, salted) == ("conv_1", True)
    plain = msgspec.msgpack.decode(answer(chat("z" * 10_000, "q"), 4096))
    assert plain[5:] == [None, False]


async def test_a_key_worker_whose_pipe_failed_is_replaced_and_costs_only_its_requests(
    backends: StartBackend, start_router: StartRouter
) -> None:
    # uvloop refuses a write to a closed pipe (RuntimeError), and a writelines
    # of a million pieces (EINVAL, then the pipe closes): either must fail the
    # requests that wait on that child with a 503, never escape into the
    # client's connection, and the next large body must get a new child.
    backend = await backends()
    router = await start_router([backend.spec], limits={"key_offload_bytes": 1024})
    body = chat("y" * 5000, "q")
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions", body=body))
        assert (await client.response()).status == 200
    first = router.keyworker.pid
    assert first is not None
    router.keyworker._transport.get_pipe_transport(0).close()  # type: ignore[union-attr]
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions", body=body))
        assert_error(await client.response(), 503)
    assert router.keyworker.pid is None  # dropped at once, not when it exits
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions", body=body))
        assert (await client.response()).status == 200
    assert router.keyworker.pid not in (None, first)
    assert len(backend.requests) == 2
    assert router.active == 0
