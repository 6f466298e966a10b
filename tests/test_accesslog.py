"""The access log's sink misbehaving: the router serves on, memory stays bounded.

The router is a real process (``spawn_router``): a write that blocks would freeze
its loop, and the test's with it if they were one.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import aiohttp
import pytest

from tests.harness.backends import StartBackend
from tests.harness.processes import admin_call, spawn_router, stop

pytestmark = pytest.mark.timeout(60)

F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, which Python names only from 3.10 on Linux builds


async def test_an_access_log_nobody_reads_does_not_stop_the_router(
    backends: StartBackend, tmp_path: Path
) -> None:
    # The log is a pipe whose reader reads nothing (a stalled log shipper, a
    # `serve | consumer` that stopped): before, the first flush into the full pipe
    # blocked the loop in write(2): every client, the admin API and SIGTERM froze.
    backend = await backends()
    fifo = tmp_path / "access.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # opened, never read
    fcntl.fcntl(reader, F_SETPIPE_SZ, 4096)  # full after ~15 lines
    proc, port = await spawn_router(
        "--no-health-checks", "--backend", f"{backend.name}={backend.url}",
        "--access-log", str(fifo),
    )  # fmt: skip
    try:
        try:
            async with aiohttp.ClientSession() as http, asyncio.timeout(15):
                # A flush is 64 KiB of lines; 1,500 lines of 2 kB paths make 3 MB,
                # past what may wait for the writer (MAX_PENDING, 1 MiB) too.
                for i in range(1500):
                    url = f"http://127.0.0.1:{port}/{i:04}{'p' * 2000}"
                    async with http.get(url) as resp:
                        assert resp.status == 200
                        await resp.read()
                status, _ = await admin_call(http, proc, "GET", "/admin/stats")
                assert status == 200
            assert len(backend.requests) == 1500
        except BaseException:
            proc.kill()  # a router stuck in write(2) does not answer SIGTERM
            await proc.wait()
            raise
        # The pipe still full: the last lines get CLOSE_SECONDS, then exit 0.
        logged = await stop(proc)
        assert b"access log: the sink is not keeping up, dropping lines" in logged
    finally:
        os.close(reader)
