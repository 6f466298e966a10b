"""A handover counts the old process's requests in flight in the new one until they end.

The old process drains its requests on the backends after a handover
(``router.handover``); until now the new one routed as if they were not
there, so a backend at its bound took a full bound more.  The old process
now reports its counts (``Loads``) and the new one counts them as its own:
``LoadTracker.set_outside`` in one process, the predecessor row of the
shared table with ``--workers`` (``Workers.predecessor``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from hashring import LoadTracker
from tests.harness.backends import Backend, StartBackend, hold
from tests.harness.http import post_generate, until
from tests.harness.processes import admin_call, serving, spawn_router, stop

pytestmark = pytest.mark.timeout(60)

HELD = 3  # requests of one key held on its primary: its whole bound
DRY = {"method": "POST", "path": "/generate", "body": "prompt 0"}


def flags(pair: list[Backend], tmp_path: Path, workers: int) -> list[str]:
    """Two backends, a handover socket, ``--workers``: the old process's and the new one's."""
    backends = [f"--backend={b.name}={b.url}" for b in pair]
    path = str(tmp_path / "handover.sock")
    return [*backends, "--handover-socket", path, "--workers", str(workers)]


def fresh_connections() -> aiohttp.ClientSession:
    """A connection per request: the admin port is the same before and after the
    handover, and a connection pooled to the old process is closed as it retires
    (a request sent on it as it closes would fail: a client's keep-alive race)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def test_outside_counts_add_to_the_own_and_a_member_is_idle_once_both_are_gone() -> None:
    tracker = LoadTracker()
    idle: list[str] = []
    tracker.on_idle = idle.append
    lease = tracker.acquire("a")
    assert not tracker.set_outside({"a": 2, "b": 1})
    assert (dict(tracker.counts), tracker.total) == ({"a": 3, "b": 1}, 4)
    lease.release()  # the own count is gone, the outside one stays: not idle
    assert (dict(tracker.counts), tracker.total, idle) == ({"a": 2, "b": 1}, 3, [])
    assert tracker.set_outside({"a": 1})  # b's ended: it is idle, and a place freed
    assert (dict(tracker.counts), tracker.total, idle) == ({"a": 1}, 1, ["b"])
    lease = tracker.acquire("a")
    assert tracker.set_outside({})  # the other process is gone
    assert (dict(tracker.counts), tracker.total, idle) == ({"a": 1}, 1, ["b"])
    lease.release()
    assert (dict(tracker.counts), tracker.total, idle) == ({}, 0, ["b", "a"])


async def in_flight(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> Any:
    status, views = await admin_call(http, proc, "GET", "/admin/backends")
    assert status == 200, views
    return {view["name"]: view["in_flight"] for view in views}


async def decision(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> Any:
    status, answer = await admin_call(http, proc, "POST", "/admin/route", DRY)
    assert status == 200, answer
    return answer["decision"]


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_new_process_counts_the_old_ones_requests_until_they_end(
    backends: StartBackend, tmp_path: Path, workers: int
) -> None:
    pair = [await backends(hold), await backends(hold)]
    config = flags(pair, tmp_path, workers)
    config += ["--balance-mode", "IN_FLIGHT", "--concurrency-scope", "IN_FLIGHT"]
    config += ["--concurrency-threshold", str(HELD)]
    async with serving(*config) as (old, port), fresh_connections() as http:
        held = [asyncio.create_task(post_generate(http, port, "prompt 0")) for _ in range(HELD)]
        await until(lambda: sum(len(b.requests) for b in pair) == HELD)
        (primary,) = [b for b in pair if b.requests]  # the key's, at its bound now
        (other,) = [b for b in pair if b is not primary]
        assert await decision(http, old) == "overflow 1"
        new, _ = await spawn_router(f"--listen=127.0.0.1:{port}", *config)
        try:
            # The old process has retired and drains; the new one counts its requests.
            counts = {primary.name: HELD, other.name: 0}
            await until(lambda: _equal(in_flight(http, new), counts))
            assert await decision(http, new) == "overflow 1"
            # A request of the key through the new process goes past the full primary.
            late = asyncio.create_task(post_generate(http, port, "prompt 0"))
            await until(lambda: len(other.requests) == 1)
            assert len(primary.requests) == HELD
            for backend in pair:
                backend.release.set()
            assert await asyncio.gather(*held, late) == [200] * (HELD + 1)
            assert await old.wait() == 0  # drained, and gone
            await until(lambda: _equal(in_flight(http, new), {primary.name: 0, other.name: 0}))
            assert await decision(http, new) == "primary"
        finally:
            await stop(new)


async def _equal(read: Awaitable[Any], expected: Any) -> bool:
    return bool(await read == expected)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_drain_in_the_new_process_waits_for_the_old_ones_requests(
    backends: StartBackend, tmp_path: Path, workers: int
) -> None:
    pair = [await backends(hold), await backends(hold)]
    config = flags(pair, tmp_path, workers)
    async with serving(*config) as (old, port), fresh_connections() as http:
        held = asyncio.create_task(post_generate(http, port, "prompt 0"))
        await until(lambda: sum(len(b.requests) for b in pair) == 1)
        (busy,) = [b for b in pair if b.requests]
        new, _ = await spawn_router(f"--listen=127.0.0.1:{port}", *config)
        try:
            await until(
                lambda: _equal(in_flight(http, new), {b.name: int(b is busy) for b in pair})
            )
            url = f"/admin/backends/{busy.name}?wait=true&timeout=30"
            drain = asyncio.create_task(admin_call(http, new, "DELETE", url))
            await until(lambda: _equal(states(http, new), {b.name: b is busy for b in pair}))
            assert not drain.done()  # the old process's request holds it
            busy.release.set()
            assert await held == 200
            status, view = await drain
            assert (status, view["state"], view["forced"]) == (200, "removed", False)
            assert await old.wait() == 0
        finally:
            await stop(new)


async def states(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> Any:
    """Which backends are draining."""
    status, views = await admin_call(http, proc, "GET", "/admin/backends")
    assert status == 200, views
    return {view["name"]: view["state"] == "draining" for view in views}
