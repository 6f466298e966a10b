"""``prefix-router serve --workers N``: one port, N processes, one router's behaviour.

Each test runs the real daemon (a supervisor and its worker processes) in front of
hand-written backends, and talks to it over real sockets as clients and operators
do.  Each client request uses a connection of its own, so that SO_REUSEPORT spreads
them over the workers; which worker took a request is read from the ``Via`` name it
put on the forwarded request (every process has its own).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter

import aiohttp
import pytest

from hashring import Ring, hash_key
from tests.harness.backends import Backend, StartBackend, echo, hold
from tests.harness.http import WAIT
from tests.harness.http import post_generate as post
from tests.harness.processes import RESTART_WAIT, admin_call, spawn_router, stop

pytestmark = pytest.mark.timeout(120)

# 2^-39 is the chance that 40 connections all hash to one of two workers' sockets.
CONNECTIONS = 40


def via(backend: Backend) -> Counter[bytes]:
    """How many requests each router process forwarded to ``backend``."""
    return Counter(seen.value("via") or b"" for seen in backend.requests)


async def stats(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> dict:
    status, body = await admin_call(http, proc, "GET", "/admin/stats")
    assert status == 200, body
    return body


async def wait_stats(http, proc, predicate, bound: float = WAIT) -> dict:  # type: ignore[no-untyped-def]
    """Poll /admin/stats until ``predicate`` holds (a worker restart has no event to
    await from outside the daemon; every poll is a real read, bounded by ``bound``)."""
    async with asyncio.timeout(bound):
        while True:
            body = await stats(http, proc)
            if predicate(body):
                return body
            await asyncio.sleep(0.05)


def prefix(*backends: Backend, threshold: int = 10) -> list[str]:
    flags = ["--workers", "2", "--strategy", "prefix", "--concurrency-threshold", str(threshold)]
    flags += ["--no-health-checks"]
    for backend in backends:
        flags += ["--backend", "{}={}".format(*backend.spec)]
    return flags


async def test_workers_share_the_port_agree_on_keys_and_add_up_their_stats(
    backends: StartBackend,
) -> None:
    a, b = await backends(echo), await backends(echo)
    proc, port = await spawn_router(*prefix(a, b))
    try:
        async with aiohttp.ClientSession() as http:
            keys = [f"prompt {i}" for i in range(8)]
            for turn in range(CONNECTIONS // len(keys)):
                for key in keys:
                    assert await post(http, port, key) == 200
                if turn == 0:
                    # Each key placed once, by the worker that took it; answering
                    # /admin/stats, every worker has sent its placements and has the
                    # other's (without it, a worker can see a key again before the
                    # other's record, 10 ms apart, and place it too: seen at load 9).
                    await stats(http, proc)
            body = await stats(http, proc)
        homes: dict[bytes, set[str]] = {}
        for backend in (a, b):
            for seen in backend.requests:
                homes.setdefault(seen.body, set()).add(backend.name)
        assert all(len(names) == 1 for names in homes.values()), homes  # one home per key
        assert len(via(a) + via(b)) == 2  # both workers served
        assert body["totals"]["requests"] == CONNECTIONS
        assert sum(view["requests"] for view in body["backends"]) == CONNECTIONS
        assert [w["up"] for w in body["workers"]] == [True, True]
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{_admin(proc)}/metrics") as resp,
        ):
            text = await resp.text()
        served = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("prefix_router_requests_total{")
        )
        assert served == CONNECTIONS
    finally:
        await stop(proc)


def _admin(proc: asyncio.subprocess.Process) -> int:
    from tests.harness.processes import ADMIN_PORTS

    return ADMIN_PORTS[proc.pid]


async def test_an_admin_change_is_live_in_every_worker_when_it_is_answered(
    backends: StartBackend,
) -> None:
    a, b = await backends(echo), await backends(echo)
    proc, port = await spawn_router(*prefix(a))
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": b.name, "url": b.url}
            )
            assert status == 201, body
            status, body = await admin_call(
                http, proc, "PATCH", f"/admin/backends/{a.name}", {"state": "draining"}
            )
            assert status == 200, body
            for i in range(CONNECTIONS):
                assert await post(http, port, f"prompt {i}") == 200
        assert not a.requests  # draining in every worker from the first request on
        assert len(via(b)) == 2  # and both workers route to the newcomer
    finally:
        await stop(proc)


async def test_a_traffic_placement_made_in_one_worker_is_followed_by_every_worker(
    backends: StartBackend,
) -> None:
    # BalanceMode TRAFFIC gives a new key a home and keeps it there.  The ring's
    # first choice for the key drains while its first request is routed, so the
    # key is placed on the second; a worker that did not learn of that placement
    # would place the key afresh, on the first.
    fleet = {backend.name: backend for backend in [await backends(echo) for _ in range(3)]}
    body = "the first turn of a conversation"
    first, second, _ = Ring(dict.fromkeys(fleet, 1)).walk(hash_key(body.encode()))
    traffic = ["--balance-mode", "TRAFFIC", "--concurrency-scope", "PREFILL"]
    proc, port = await spawn_router(*prefix(*fleet.values()), *traffic)
    try:
        async with aiohttp.ClientSession() as http:
            path = f"/admin/backends/{first}"
            assert (await admin_call(http, proc, "PATCH", path, {"state": "draining"}))[0] == 200
            assert await post(http, port, body) == 200
            assert (await admin_call(http, proc, "PATCH", path, {"state": "active"}))[0] == 200
            # Every worker sent its placements before it answered that change, and the
            # supervisor passed them on at once: answering this read, every worker has
            # every other worker's placements.
            await stats(http, proc)
            for i in range(CONNECTIONS):
                assert await post(http, port, body) == 200
                # Other keys between: the key stays below a hot key's share.
                for j in range(3):
                    assert await post(http, port, f"another conversation {i} {j}") == 200
        served = [seen.body for seen in fleet[second].requests].count(body.encode())
        assert served == CONNECTIONS + 1
        assert len(via(fleet[second])) == 2  # both workers routed there
        assert body.encode() not in [seen.body for seen in fleet[first].requests]
    finally:
        await stop(proc)


async def test_in_flight_counts_are_fleet_wide_across_workers(backends: StartBackend) -> None:
    # Threshold 1: a key's second request overflows when its home is busy, whichever
    # worker routes it, because every worker counts every worker's requests.
    a, b = await backends(hold), await backends(hold)
    proc, port = await spawn_router(*prefix(a, b, threshold=1))
    try:
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(post(http, port, "one prompt"))
            await wait_stats(http, proc, lambda s: s["totals"]["in_flight"] == 1)
            # Answering /admin/stats made every worker fold the table: all see it now.
            second = asyncio.create_task(post(http, port, "one prompt"))
            await wait_stats(http, proc, lambda s: s["totals"]["in_flight"] == 2)
            body = await stats(http, proc)
            assert sorted(v["in_flight"] for v in body["backends"]) == [1, 1]
            assert body["decisions"]["overflow"] == 0  # counted when they finish
            a.release.set()
            b.release.set()
            assert await first == await second == 200
            body = await stats(http, proc)
            assert body["decisions"] == {
                "primary": 1,
                "overflow": 1,
                "fallback": 0,
                "other": 0,
                "claim_spread": 1,  # one replica: nothing races
            }
            assert body["totals"]["in_flight"] == 0
    finally:
        await stop(proc)


async def test_a_killed_worker_is_restarted_and_its_in_flight_rows_are_cleared(
    backends: StartBackend,
) -> None:
    held, spare = await backends(hold), await backends(echo)
    proc, port = await spawn_router(*prefix(held))
    try:
        async with aiohttp.ClientSession() as http:
            stuck = [asyncio.create_task(post(http, port, f"stuck {i}")) for i in range(6)]
            body = await wait_stats(http, proc, lambda s: s["totals"]["in_flight"] == 6)
            pids = [w["pid"] for w in body["workers"]]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            for task in stuck:  # their clients see the connection go
                with pytest.raises(aiohttp.ClientError):
                    await task
            body = await wait_stats(
                http,
                proc,
                lambda s: all(w["up"] and w["pid"] not in pids for w in s["workers"]),
                bound=RESTART_WAIT,
            )
            assert [w["restarts"] for w in body["workers"]] == [1, 1]
            assert body["totals"]["in_flight"] == 0  # the dead rows were zeroed
            status, _ = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": spare.name, "url": spare.url}
            )
            assert status == 201  # membership still changes, in the new workers too
            status, _ = await admin_call(
                http, proc, "PATCH", f"/admin/backends/{held.name}", {"state": "draining"}
            )
            assert status == 200
            for i in range(CONNECTIONS):
                assert await post(http, port, f"after {i}") == 200
            assert len(via(spare)) == 2
    finally:
        await stop(proc)


async def test_sigterm_drains_every_worker_and_exits_zero(backends: StartBackend) -> None:
    slow = await backends(hold)
    proc, port = await spawn_router(*prefix(slow))
    async with aiohttp.ClientSession() as http:
        pending = [asyncio.create_task(post(http, port, f"slow {i}")) for i in range(6)]
        await wait_stats(http, proc, lambda s: s["totals"]["in_flight"] == 6)
        proc.send_signal(signal.SIGTERM)
        await slow.wait_for(lambda: len(slow.requests) == 6)
        slow.release.set()  # answered after the signal: every request completes
        assert [await task for task in pending] == [200] * 6
    assert proc.stderr is not None
    async with asyncio.timeout(WAIT):
        await proc.stderr.read()
        assert await proc.wait() == 0


async def test_a_draining_backends_last_release_outlives_a_closed_channel() -> None:
    """A worker tells its supervisor when a draining backend goes idle, from inside
    the lease's release at an exchange's end; with the supervisor gone (the channel
    closed) that end still runs to the end (``_receive`` is what stops the worker)."""
    import socket
    from types import SimpleNamespace

    from router.channel import Channel
    from router.fleet import AdminState
    from router.worker import _Worker

    ours, theirs = socket.socketpair()
    channel = await Channel.open(ours)
    theirs.close()
    channel._writer.close()  # what the channel is once the supervisor is gone
    draining = SimpleNamespace(state=AdminState.DRAINING)
    worker = SimpleNamespace(
        channel=channel, router=SimpleNamespace(fleet=SimpleNamespace(backends={"a": draining}))
    )
    _Worker._idle(worker, "a")  # type: ignore[arg-type]
