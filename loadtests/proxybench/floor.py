"""The naive-Python floor: the ``aiohttp`` target, 30 lines of aiohttp proxy.

``python -m loadtests.proxybench floor --listen HOST:PORT --backend URL ...``
runs it on its own; SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import asyncio
import signal
import zlib
from collections.abc import Callable
from typing import Any

from ..supervisor import say
from .workloads import PREFIX


def floor(listen: str, backends: list[str]) -> None:
    """The naive-Python floor: what 30 lines of aiohttp give (uvloop, no access log)."""
    from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

    hop = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
           "proxy-connection", "host", "content-length"}  # fmt: skip

    async def main() -> None:
        session = ClientSession(
            connector=TCPConnector(limit=0),
            timeout=ClientTimeout(total=None, sock_read=300),
            auto_decompress=False,
        )

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            base = backends[zlib.crc32(body[:PREFIX]) % len(backends)]
            headers = {k: v for k, v in request.headers.items() if k.lower() not in hop}
            url = base + request.path_qs
            async with session.request(request.method, url, data=body, headers=headers) as up:
                out = {k: v for k, v in up.headers.items() if k.lower() not in hop}
                response = web.StreamResponse(status=up.status, headers=out)
                if up.content_length is not None:
                    response.content_length = up.content_length
                await response.prepare(request)
                async for chunk in up.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        host, _, port = listen.rpartition(":")
        await web.TCPSite(runner, host, int(port), backlog=4096).start()
        say(f"floor listening {listen}")
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()
        await session.close()

    runner()(main())


def runner() -> Callable[[Any], Any]:
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run
