"""``[limits] keepalive_requests``: the requests one client connection may carry
(``router/client.py``), over real loopback sockets.

The last one is answered with ``Connection: close`` and the connection closes;
requests pipelined after it are not served (the client sends them again on a
new connection); the official OpenAI client reconnects without an error, and
each worker of ``serve --workers 2`` counts its own connections.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest

from tests.harness.backends import StartBackend
from tests.harness.http import WAIT, connect, req
from tests.harness.processes import spawn_router, stop
from tests.harness.routers import SimFleet, StartRouter

pytestmark = pytest.mark.timeout(60)

REQUEST = req(b"GET", b"/health")


async def test_the_last_request_of_a_connection_is_answered_with_connection_close(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], limits={"keepalive_requests": 3})
    async with connect(router) as client:
        for _ in range(2):
            await client.send(REQUEST)
            resp = await client.response()
            assert resp.status == 200
            assert resp.value("connection") is None  # HTTP/1.1: kept open
        await client.send(REQUEST)
        resp = await client.response()
        assert resp.status == 200
        assert resp.value("connection") == b"close"
        async with asyncio.timeout(WAIT):
            assert await client.reader.read() == b""
    async with connect(router) as client:  # pipelined: the rest is not served
        await client.send(REQUEST * 5)
        statuses = [(await client.response()).status for _ in range(3)]
        assert statuses == [200, 200, 200]
        assert await client.rest() == b""
    assert len(backend.requests) == 6


async def test_without_a_limit_a_connection_carries_any_number(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(REQUEST * 50)
        for _ in range(50):
            resp = await client.response()
            assert resp.status == 200
            assert resp.value("connection") is None


class _Counting(set):  # type: ignore[type-arg]
    """The router's set of client connections, counting the connections made."""

    added = 0

    def add(self, item: object) -> None:
        self.added += 1
        super().add(item)


async def test_the_openai_client_reconnects_when_a_connection_reaches_its_limit(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(2)
    router = await start_router(sims, limits={"keepalive_requests": 2})
    router.connections = made = _Counting()
    async with openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0
    ) as client:
        for i in range(7):
            messages = [{"role": "user", "content": f"question {i}"}]
            if i % 2:
                stream = await client.chat.completions.create(
                    model="sim-llama-3.1-70b", messages=messages, max_tokens=3, stream=True
                )  # type: ignore[call-overload]
                pieces = [c.choices[0].delta.content async for c in stream if c.choices]
                assert pieces
            else:
                done = await client.chat.completions.create(
                    model="sim-llama-3.1-70b", messages=messages, max_tokens=3
                )  # type: ignore[call-overload]
                assert done.choices[0].message.content
    assert sum(router.recorder.requests.values()) == 7
    assert made.added == 4  # two requests a connection: the client opened four, one at a time


async def test_with_two_workers_each_connection_is_counted_where_it_is_served(
    backends: StartBackend, tmp_path: Path
) -> None:
    backend = await backends()
    config = tmp_path / "router.toml"
    config.write_text("[limits]\nkeepalive_requests = 2\n")
    proc, port = await spawn_router(
        "--config", str(config), "--backend", f"b0={backend.url}", "--workers", "2"
    )
    try:
        for _ in range(6):  # connections land on either worker: each closes at its second
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(REQUEST * 3)
            async with asyncio.timeout(WAIT):
                answers = await reader.read()
            writer.close()
            assert answers.count(b"HTTP/1.1 200") == 2, answers
            assert answers.lower().count(b"\r\nconnection: close\r\n") == 1
        assert len(backend.requests) == 12
    finally:
        await stop(proc)
