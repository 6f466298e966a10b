"""Streaming both ways: SSE events pass one by one, big bodies flow through."""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from tests.harness.routers import StartRouter

EVENTS = 4
GAP_S = 0.2  # the backend's decode time between two events


async def start_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def test_each_sse_event_reaches_the_client_before_the_next_is_emitted(
    start_router: StartRouter,
) -> None:
    """The backend emits an event only after the client has acknowledged the one
    before: if the router held events back, the backend would wait in vain."""
    acks = [asyncio.Event() for _ in range(EVENTS)]
    missed: list[int] = []

    async def sse(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(EVENTS):
            await response.write(b'data: {"n": %d}\n\n' % i)
            try:
                async with asyncio.timeout(5):
                    await acks[i].wait()
            except TimeoutError:
                missed.append(i)
            await asyncio.sleep(GAP_S)  # decode time, not synchronisation
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", sse)
    runner, url = await start_app(app)
    try:
        router = await start_router([("sse", url)])
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            # A second request on the same keep-alive connection must stream just as well.
            for _ in range(2):
                for ack in acks:
                    ack.clear()
                async with http.post(
                    f"http://127.0.0.1:{router.port}/v1/chat/completions", json=body
                ) as resp:
                    assert resp.status == 200
                    assert resp.headers["content-type"] == "text/event-stream"
                    received = []
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            received.append(line)
                            acks[len(received) - 1].set()
                        elif line.startswith(b"data: [DONE]"):
                            break
                assert len(received) == EVENTS
        assert missed == []
    finally:
        await runner.cleanup()


CHUNK = 64 * 1024
TOTAL = 20 * 1024 * 1024


async def test_a_20_mib_native_body_streams_through_without_being_buffered(
    start_router: StartRouter,
) -> None:
    arrived = asyncio.Event()  # the backend has bytes while the client still sends
    received = 0

    async def invocations(request: web.Request) -> web.Response:
        nonlocal received
        async for chunk in request.content.iter_any():
            received += len(chunk)
            if received >= 2 * CHUNK:
                arrived.set()
        return web.json_response({"received": received})

    app = web.Application(client_max_size=TOTAL * 2)
    app.router.add_post("/invocations", invocations)
    runner, url = await start_app(app)
    try:
        router = await start_router([("big", url)])

        async def body() -> AsyncIterator[bytes]:
            sent = 0
            while sent < TOTAL:
                yield b"x" * CHUNK
                sent += CHUNK
                if sent == 8 * CHUNK:
                    # Hold the rest back until the backend has seen the start:
                    # a buffering router would never forward it, and we time out.
                    async with asyncio.timeout(10):
                        await arrived.wait()

        tracemalloc.start()
        try:
            baseline = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"http://127.0.0.1:{router.port}/invocations", data=body()) as resp,
            ):
                assert resp.status == 200
                assert (await resp.json()) == {"received": TOTAL}
            peak = tracemalloc.get_traced_memory()[1] - baseline
        finally:
            tracemalloc.stop()
        # Client, router and backend share this process: all of them together held
        # a few MiB at most while 20 MiB went through.
        assert peak < 6 * 1024 * 1024, f"peak {peak / 2**20:.1f} MiB"
        assert router.fleet.loads.total == 0
    finally:
        await runner.cleanup()
