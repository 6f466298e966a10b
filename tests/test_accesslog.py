"""The access log's sink misbehaving: the router serves on, memory stays bounded.

The router is a real process (``spawn_router``): a write that blocks would freeze
its loop, and the test's with it if they were one.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from pathlib import Path

import aiohttp
import pytest

from tests.harness.backends import StartBackend
from tests.harness.http import connect, quiet, req
from tests.harness.processes import admin_call, spawn_router, stop
from tests.harness.routers import StartRouter

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


async def test_a_rotated_access_log_is_followed_without_a_signal(
    backends: StartBackend, start_router: StartRouter, tmp_path: Path
) -> None:
    """logrotate renames the log (then ``create``s a new one, or not): the next
    lines go to a file at the path again, none is lost, no signal needed."""
    backend = await backends()
    path = tmp_path / "access.log"
    router = await start_router([backend.spec], access_log=str(path))

    async def served(tag: str) -> None:
        async with connect(router) as client:
            for i in range(3):
                await client.send(req(b"GET", f"/{tag}/{i}".encode()))
                assert (await client.response()).status == 200
        await quiet(router)  # every line recorded
        assert router.access.sync()  # and written

    def paths(log: Path) -> list[str]:
        return [json.loads(line)["path"] for line in log.read_text().splitlines()]

    await served("before")
    os.rename(path, tmp_path / "access.log.1")
    path.touch()  # logrotate's `create`
    await served("after")
    os.rename(path, tmp_path / "access.log.2")  # no `create` this time
    await served("again")
    assert paths(tmp_path / "access.log.1") == [f"/before/{i}" for i in range(3)]
    assert paths(tmp_path / "access.log.2") == [f"/after/{i}" for i in range(3)]
    assert paths(path) == [f"/again/{i}" for i in range(3)]


async def test_with_two_workers_each_follows_a_rotated_log(
    backends: StartBackend, tmp_path: Path
) -> None:
    backend = await backends()
    path = tmp_path / "access.log"
    proc, port = await spawn_router(
        "--workers", "2", "--no-health-checks", "--backend", f"{backend.name}={backend.url}",
        "--access-log", str(path),
    )  # fmt: skip

    async def on_both_workers(http: aiohttp.ClientSession) -> set[str]:
        """Request ids of requests until both workers served some (a connection each:
        the kernel spreads them; 200 on one worker in a row: 2^-199)."""
        ids: set[str] = set()
        for i in range(200):
            url = f"http://127.0.0.1:{port}/{i}"
            async with http.get(url, headers={"Connection": "close"}) as resp:
                assert resp.status == 200
                ids.add(resp.headers["x-request-id"])
            if len({rid.partition("-")[0] for rid in ids}) == 2:
                return ids
        raise AssertionError("every request went to one worker")

    async def logged(log: Path, ids: set[str]) -> set[str]:
        """The ids in ``log`` once all of ``ids`` are (lines are written each second)."""
        async with asyncio.timeout(10):
            while True:  # a file: no event to wait on
                found = request_ids(log)
                if ids <= found:
                    return found
                await asyncio.sleep(0.1)

    try:
        async with aiohttp.ClientSession() as http:
            before = await on_both_workers(http)
            await logged(path, before)
            os.rename(path, tmp_path / "access.log.1")
            after = await on_both_workers(http)
            assert await logged(path, after) == after
            assert not after & await logged(tmp_path / "access.log.1", before)
    finally:
        await stop(proc)


def request_ids(log: Path) -> set[str]:
    """The request ids of ``log``'s whole lines (a writer may be half-way through one)."""
    text = log.read_text() if log.exists() else ""
    lines = text.splitlines(keepends=True)
    return {json.loads(line)["request_id"] for line in lines if line.endswith("\n")}
