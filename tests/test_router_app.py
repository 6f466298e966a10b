"""The ``Router`` itself (``router/app.py``): its lifecycle, over real loopback sockets.

Graceful shutdown: the listener closes at once, idle keep-alive connections go,
a stream in flight finishes, then nothing is left.

Raw-socket clients and recording backends (``tests/harness/``): exact bytes both ways.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.harness.backends import StartBackend, hold
from tests.harness.http import (
    WAIT,
    connect,
    req,
)
from tests.harness.routers import SimFleet, StartRouter


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


async def test_an_answer_that_starts_while_stopping_says_connection_close(
    backends: StartBackend, start_router: StartRouter
) -> None:
    """As nginx does while it exits: the client learns from the answer that the
    connection ends, and does not send its next request on it (a POST sent into a
    closing connection fails, and a client may not retry it)."""
    backend = await backends(hold)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/slow"))
        await backend.wait_for(lambda: len(backend.heads) == 1)  # held: its answer not begun
        stopping = asyncio.create_task(router.shutdown(grace=5))
        await asyncio.sleep(0)  # one loop turn: the task runs up to its first await
        assert router.stopping
        backend.release.set()
        resp = await client.response()
        assert resp.status == 200
        assert resp.value("connection") == b"close"
        await client.closed()
        async with asyncio.timeout(WAIT):
            await stopping


async def test_a_client_fin_while_its_request_runs_is_taken_as_the_client_leaving(
    backends: StartBackend, start_router: StartRouter
) -> None:
    """As nginx's default (``proxy_ignore_client_abort off``): a FIN cannot be told
    from a client gone for good until something is written, and a generation
    nobody will read holds a GPU for minutes, so the backend request is cancelled
    and its lease freed at once.  A client that half-closes to say it is done
    sending (``nc -N``) therefore gets no answer (README, HTTP behaviour)."""
    backend = await backends(hold)
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"GET", b"/long-generation"))
        await backend.wait_for(lambda: len(backend.heads) == 1)
        assert router.fleet.loads.total == 1
        client.writer.write_eof()  # a half-close
        assert await client.rest() == b""
        async with asyncio.timeout(WAIT):
            await router.wait_quiet()
    assert router.fleet.loads.total == 0
