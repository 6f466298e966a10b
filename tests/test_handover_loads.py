"""A handover counts the old process's requests in flight in the new one until they end.

The old process drains its requests on the backends after a handover
(``router.handover``); until now the new one routed as if they were not
there, so a backend at its bound took a full bound more.  The old process
now reports its counts (``Loads``) and the new one counts them as its own:
``LoadTracker.outside`` in one process, the predecessor row of the
shared table with ``--workers`` (``Workers.predecessor``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from hashring import LoadTracker
from router import handover as handover_module
from router.handover import Handover, HandoverError, Snapshot, take_over
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
    assert not tracker.outside({"a": 2, "b": 1})
    assert (dict(tracker.counts), tracker.total) == ({"a": 3, "b": 1}, 4)
    lease.release()  # the own count is gone, the outside one stays: not idle
    assert (dict(tracker.counts), tracker.total, idle) == ({"a": 2, "b": 1}, 3, [])
    assert tracker.outside({"b": 0, "a": 1})  # b's ended: it is idle, and a place freed
    assert (dict(tracker.counts), tracker.total, idle) == ({"a": 1}, 1, ["b"])
    assert not tracker.outside({"c": 0})  # nothing there, nothing changes
    lease = tracker.acquire("a")
    assert tracker.outside({"a": 0})  # the other process is gone
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


async def hold_one(
    http: aiohttp.ClientSession, port: int, pair: list[Backend]
) -> tuple[asyncio.Task[int], Backend]:
    """A request sent and held at its backend: its task, and that backend."""
    held = asyncio.create_task(post_generate(http, port, "prompt 0"))
    await until(lambda: sum(len(b.requests) for b in pair) == 1)
    (busy,) = [b for b in pair if b.requests]
    return held, busy


@dataclass
class HandedOver:
    """A request held on ``busy`` by the old process, which has handed over to ``new``."""

    old: asyncio.subprocess.Process
    new: asyncio.subprocess.Process
    http: aiohttp.ClientSession
    held: asyncio.Task[int]
    busy: Backend


@asynccontextmanager
async def handed_over(
    pair: list[Backend], tmp_path: Path, workers: int
) -> AsyncIterator[HandedOver]:
    """The old process holding one request, then a new one that took over and counts it."""
    config = flags(pair, tmp_path, workers)
    async with serving(*config) as (old, port), fresh_connections() as http:
        held, busy = await hold_one(http, port, pair)
        new, _ = await spawn_router(f"--listen=127.0.0.1:{port}", *config)
        try:
            counts = {b.name: int(b is busy) for b in pair}
            await until(lambda: _equal(in_flight(http, new), counts))
            yield HandedOver(old, new, http, held, busy)
        finally:
            await stop(new)


async def _equal(read: Awaitable[Any], expected: Any) -> bool:
    return bool(await read == expected)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_drain_in_the_new_process_waits_for_the_old_ones_requests(
    backends: StartBackend, tmp_path: Path, workers: int
) -> None:
    pair = [await backends(hold), await backends(hold)]
    async with handed_over(pair, tmp_path, workers) as run:
        url = f"/admin/backends/{run.busy.name}?wait=true&timeout=30"
        drain = asyncio.create_task(admin_call(run.http, run.new, "DELETE", url))
        draining = {b.name: b is run.busy for b in pair}
        await until(lambda: _equal(states(run.http, run.new), draining))
        assert not drain.done()  # the old process's request holds it
        run.busy.release.set()
        assert await run.held == 200
        status, view = await drain
        assert (status, view["state"], view["forced"]) == (200, "removed", False)
        assert await run.old.wait() == 0


async def states(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> Any:
    """Which backends are draining."""
    status, views = await admin_call(http, proc, "GET", "/admin/backends")
    assert status == 200, views
    return {view["name"]: view["state"] == "draining" for view in views}


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_second_handover_passes_the_first_old_processs_requests_on(
    backends: StartBackend, tmp_path: Path, workers: int
) -> None:
    """A -> B -> C: B has nothing of its own in flight, A still drains.  B reports
    A's requests to C until A is gone, and only then exits."""
    pair = [await backends(hold), await backends(hold)]
    config = flags(pair, tmp_path, workers)
    async with serving(*config) as (first, port), fresh_connections() as http:
        held, busy = await hold_one(http, port, pair)
        counts = {b.name: int(b is busy) for b in pair}
        later: list[asyncio.subprocess.Process] = []
        try:
            second, _ = await spawn_router(f"--listen=127.0.0.1:{port}", *config)
            later.append(second)
            await until(lambda: _equal(in_flight(http, second), counts))
            third, _ = await spawn_router(f"--listen=127.0.0.1:{port}", *config)
            later.append(third)
            await until(lambda: _equal(in_flight(http, third), counts))
            assert second.returncode is None  # waits for the first, whose request it reports
            busy.release.set()
            assert await held == 200
            assert (await first.wait(), await second.wait()) == (0, 0)
            await until(lambda: _equal(in_flight(http, third), {b.name: 0 for b in pair}))
            await stop(third)
        finally:
            for proc in later:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()


async def test_a_backend_removed_and_added_back_meanwhile_keeps_the_old_ones_count(
    backends: StartBackend, tmp_path: Path
) -> None:
    """With --workers: the supervisor writes the row a column at a time and gives a
    removed backend's column away (one process counts every name it is told of)."""
    workers = 2
    pair = [await backends(hold), await backends(hold)]
    async with handed_over(pair, tmp_path, workers) as run:
        http, new, busy = run.http, run.new, run.busy
        # Removed (its drain forced: the old process's request outlives it), added back.
        url = f"/admin/backends/{busy.name}?wait=true&timeout=0.1"
        status, view = await admin_call(http, new, "DELETE", url)
        assert (status, view["state"], view["forced"]) == (200, "removed", True)
        spec = {"name": busy.name, "url": busy.url}
        status, view = await admin_call(http, new, "POST", "/admin/backends", spec)
        assert status == 201, view
        await until(lambda: _equal(in_flight(http, new), {b.name: int(b is busy) for b in pair}))
        busy.release.set()
        assert await run.held == 200
        assert await run.old.wait() == 0
        await until(lambda: _equal(in_flight(http, new), {b.name: 0 for b in pair}))


@pytest.mark.parametrize("reads", [False, True])
async def test_loads_go_only_to_a_new_process_that_reads_them(tmp_path: Path, reads: bool) -> None:
    """An older new process (a rollback) ends its reading at a frame it does not
    know, and with it the response ids: it is sent none.  One that reads them gets
    them all at once after Released."""

    async def freeze() -> Snapshot:
        return Snapshot([], [], None)

    old = Handover(freeze, lambda: None, lambda pid: None)
    old.loads = lambda: [("a", 1, 1)]
    path = str(tmp_path / "h.sock")
    await old.listen(path)
    try:
        taken = await take_over(path)
        assert taken is not None
        conn = taken._conn
        await handover_module._send(conn, handover_module.Ready(os.getpid(), loads=reads))
        assert isinstance(await handover_module._receive(conn), handover_module.Released)
        if reads:
            expected = handover_module.Loads([("a", 1, 1)], full=True)
            assert await handover_module._receive(conn) == expected
        old.learnt([("resp_1", "a")])
        assert await handover_module._receive(conn) == handover_module.Ids([("resp_1", "a")])
        await old.close()
        with pytest.raises(HandoverError):  # and nothing more before it closed
            await handover_module._receive(conn)
        taken.abandon()
    finally:
        await old.close()


def test_a_count_out_of_range_is_not_a_handover_message() -> None:
    """A negative count would break the table's sums (cells are never negative); one
    past 2**31 would not fit a cell's writes: the frame is refused, not applied."""
    for count in (-1, 1 << 31):
        frame = handover_module._encoder.encode(handover_module.Loads([("a", count, 0)]))
        with pytest.raises(msgspec.ValidationError):
            handover_module._decoder.decode(frame)
