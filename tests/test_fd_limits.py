"""``prefix-router serve`` at its file-descriptor limit, for real.

The router runs as a process with a low ``RLIMIT_NOFILE`` (soft 128, hard 256,
set before the interpreter starts).  It must raise the soft limit to the hard
one, cap its client connections below it, answer clients past the cap with a
503 JSON error (not an EOF), keep its admin API up, and take clients again
once some leave.  Every request is held at the backend while the cap fills,
so each client also holds its upstream connection: the worst case.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from router.admission import BUSY_MESSAGE, MAX_REFUSING, client_cap
from tests.harness.backends import Backend, Seen, echo
from tests.harness.processes import ROOT

WAIT = 10.0
SOFT, HARD = 128, 256
CAP = client_cap(HARD, backends=1, max_idle=64)  # the limited router's, one backend

# Sets the limit in the child itself, then runs the router: no preexec_fn,
# which is unsafe in a process with threads.
LIMITED = (
    "import resource, runpy, sys;"
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, {HARD}));"
    "sys.argv[0] = 'prefix-router';"
    "runpy.run_module('admin', run_name='__main__', alter_sys=True)"
)

REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n\r\n{}"


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response: (status, body); (0, b"") for an EOF instead."""
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return 0, b""
    lines = head.decode().split("\r\n")
    length = next(
        int(line.partition(":")[2]) for line in lines if line.lower().startswith("content-length")
    )
    return int(lines[0].split()[1]), await reader.readexactly(length)


class Router:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: dict[str, dict[str, object]] = {}

    async def until(self, event: str) -> dict[str, object]:
        assert self.proc.stderr is not None
        async with asyncio.timeout(WAIT * 2):
            while event not in self.events:
                line = await self.proc.stderr.readline()
                assert line, f"router exited before {event!r}"
                record = json.loads(line)
                self.events[record["event"]] = record
        return self.events[event]


@pytest.fixture
async def limited_router() -> AsyncIterator[Callable[..., Awaitable[Router]]]:
    procs: list[asyncio.subprocess.Process] = []

    async def start(backend_url: str, *flags: str) -> Router:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", LIMITED, "serve", "--listen", "127.0.0.1:0",
            "--admin-listen", "127.0.0.1:0", "--access-log", "off", "--no-health-checks",
            "--backend", f"b={backend_url}", *flags,
            cwd=ROOT, stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        procs.append(proc)
        return Router(proc)

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def port_of(event: dict[str, object]) -> int:
    return int(str(event["address"]).rpartition(":")[2])


async def test_at_the_fd_limit_clients_get_a_503_and_the_admin_api_stays_up(
    backends: Callable[..., Awaitable[Backend]],
    limited_router: Callable[..., Awaitable[Router]],
) -> None:
    release = asyncio.Event()

    async def held(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        await release.wait()
        return await echo(backend, seen, writer)

    backend = await backends(held)
    router = await limited_router(backend.url)
    admin = port_of(await router.until("admin listening"))
    port = port_of(router.events["listening"])

    clients: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    refused: tuple[int, bytes] | None = None
    try:
        # Open clients one by one, each with a request held at the backend, until
        # one is not let in (bounded by the hard limit: the router cannot hold more).
        for i in range(HARD):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            clients.append((reader, writer))
            writer.write(REQUEST)
            held_now = asyncio.ensure_future(backend.wait_for(lambda n=i: len(backend.heads) > n))
            answered = asyncio.ensure_future(answer(reader))
            done, _ = await asyncio.wait(
                [held_now, answered], timeout=WAIT, return_when=asyncio.FIRST_COMPLETED
            )
            if answered in done:
                held_now.cancel()
                refused = answered.result()
                break
            answered.cancel()
            assert held_now in done, f"client {i} neither held nor answered"
        assert refused is not None
        status, body = refused
        assert status == 503, (status, body)
        assert json.loads(body)["error"]["message"] == BUSY_MESSAGE
        # The soft limit was raised to the hard one, and exactly the cap let in.
        limit = router.events["file descriptor limit"]
        assert (limit["nofile"], limit["raised_from"]) == (HARD, SOFT)
        cap = client_cap(HARD, backends=1, max_idle=64)
        assert router.events["listening"]["max_clients"] == cap
        assert len(clients) - 1 == cap
        await router.until("connection limit reached: refusing new clients with 503")

        # A burst of clients past the cap, more than may linger at once: each
        # reads a 503, none an EOF.
        burst = [await asyncio.open_connection("127.0.0.1", port) for _ in range(MAX_REFUSING + 8)]
        try:
            async with asyncio.timeout(WAIT):
                answers = await asyncio.gather(*(answer(reader) for reader, _ in burst))
        finally:
            for _, writer in burst:
                writer.close()
        assert {status for status, _ in answers} == {503}
        # At the cap, the admin API answers, and so do further clients (503).
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{admin}/healthz") as resp:
                assert resp.status == 200
            async with http.get(f"http://127.0.0.1:{admin}/admin/backends") as resp:
                assert resp.status == 200
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json={}) as resp:
                assert resp.status == 503
        # The held requests all finish.
        release.set()
        for reader, _ in clients[:-1]:
            async with asyncio.timeout(WAIT):
                assert (await answer(reader))[0] == 200
    finally:
        for _, writer in clients:
            writer.close()
    # Clients gone: new ones are served again.  The router sees the closes in its
    # own time and nothing outside tells when, so ask (each try a round trip)
    # until one is let in, a bounded number of times.
    statuses = []
    async with aiohttp.ClientSession() as http, asyncio.timeout(WAIT):
        while 200 not in statuses[-1:] and len(statuses) < 1000:
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json={}) as resp:
                statuses.append(resp.status)
    assert set(statuses) <= {200, 503}
    assert statuses[-1] == 200


@pytest.mark.parametrize("refused", [1, CAP], ids=["one-refused", "cap-refused"])
async def test_one_address_cannot_take_every_place_with_client_connections_set(
    backends: Callable[..., Awaitable[Backend]],
    limited_router: Callable[..., Awaitable[Router]],
    tmp_path: Path,
    refused: int,
) -> None:
    """Without the limit one address fills the cap above and every other client
    gets a 503 (the test before); with it, that address gets a 429 at its limit
    and another address is still served.  Even when it goes on connecting and
    never closes (``cap-refused``: as many refusals as the cap has places): at
    most ``MAX_REFUSING`` of its 429s linger, the rest are closed at once, so
    they never fill the cap (before, each lingered 2 s, counted against it, and
    the other address got a 503)."""
    release = asyncio.Event()

    async def held(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        await release.wait()
        return await echo(backend, seen, writer)

    limit = 8
    assert limit + MAX_REFUSING < CAP - 1
    config = tmp_path / "router.toml"
    config.write_text(f"[limits]\nclient_connections = {limit}\n")
    backend = await backends(held)
    router = await limited_router(backend.url, "--config", str(config))
    await router.until("admin listening")
    port = port_of(router.events["listening"])
    clients = []
    try:
        for _ in range(limit):  # each with a request held at the backend
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            clients.append((reader, writer))
            writer.write(REQUEST)
        await backend.wait_for(lambda: len(backend.heads) == limit)
        for _ in range(refused):  # each held open
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            clients.append((reader, writer))
            async with asyncio.timeout(WAIT):
                status, body = await answer(reader)
                assert status == 429, body
                assert await reader.read() == b""  # the router is done with it
            assert "client_connections" in json.loads(body)["error"]["message"]
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=("127.0.0.2", 0)
        )
        clients.append((reader, writer))
        writer.write(REQUEST)
        await backend.wait_for(lambda: len(backend.heads) == limit + 1)  # let in and forwarded
        release.set()
        for reader, _ in clients[:limit] + clients[-1:]:
            async with asyncio.timeout(WAIT):
                assert (await answer(reader))[0] == 200
    finally:
        release.set()
        for _, writer in clients:
            writer.close()
