"""``--workers``: at most ``router.supervisor.SLOTS`` backends, one column each in the
shared in-flight table.

The admin API and start-up are run at the real limit, as an operator meets it:
the real daemon, from a state file of 8,192 backends (the batch path: one at a
time through the API would take far longer).  Its start builds the ring three
times over (supervisor and each worker), so these tests give it ``START``
seconds, and run it with one virtual node per backend (``SMALL_RING``): the
limit counts backends, one column each, not ring points; at the default 1,024
(capped at 2**21 points) each build took ~3 s on a quiet 2-core VM and the full
fleet's test 30-47 s beside the rest of the suite.  etcd's membership, which no admin call
checks, is driven through a real etcd to a real ``ReplicatedControl`` with real
worker processes, the limit lowered as other tests lower module constants:
8,193 keys through the watch would add one backend at a time, a ring rebuild
each.  ``prefix-router check-config`` is run at the real limit: it reads the
file and the state file, nothing starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from structlog.testing import capture_logs

from admin import AdminServer
from router import supervisor
from router.app import Router
from router.config import BackendSpec, build_config
from router.control import Conflict
from router.control.etcd import EtcdStore
from router.control.replicated import ReplicatedControl
from router.etcd import EtcdClient
from router.sockets import listen
from router.state import SavedBackend
from router.supervisor import SLOTS, Workers
from tests.harness.backends import Backend, StartBackend, echo
from tests.harness.etcd import EtcdServer
from tests.harness.processes import ROOT, admin_call, serve_exit, spawn_router, stop
from tests.harness.routers import router_config

pytestmark = pytest.mark.timeout(600)

START = 240.0  # the daemon's start with SLOTS backends beside other work on 2 cores
# The ring's size is vnodes x backends (hashring.ring.MAX_POINTS at most); the
# limit and the table are per backend whatever it is.
SMALL_RING = "vnodes = 1\n"
FULL = (
    f"the fleet is full: at most {SLOTS} backends with --workers (one column each in the"
    " shared in-flight table); remove one first"
)


def fleet(count: int) -> list[dict[str, str]]:
    return [{"name": f"b{i}", "url": f"http://127.0.0.1:{10_000 + i}"} for i in range(count)]


def write_state(path: Path, count: int) -> None:
    routing = {"PrefixAwareRoutingConfig": {"PrefixLength": 4096}}
    path.write_text(json.dumps({"version": 1, "backends": fleet(count), "RoutingConfig": routing}))


def toml(value: object) -> str:
    """``value`` (strings, numbers, lists and tables of them) as TOML."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {toml(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(toml(item) for item in value) + "]"
    return json.dumps(value)  # a JSON string or number is a TOML one


def past_the_slots(size: int) -> str:
    """serve's refusal of a fleet of ``size`` backends under --workers."""
    return (
        f"invalid configuration: {size} backends, but --workers holds at most {SLOTS} (one"
        f" column each in the shared in-flight table): remove {size - SLOTS} from the state"
        " file (or the config, without one)"
    )


async def test_a_full_fleet_refuses_one_more_backend_with_409_and_saves_nothing(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.json"
    write_state(state, SLOTS)
    before = state.read_bytes()
    config = tmp_path / "router.toml"
    config.write_text(SMALL_RING)
    flags = ("--config", str(config), "--workers", "2", "--no-health-checks")
    flags += ("--state-file", str(state))
    proc, _ = await spawn_router(*flags, within=START)
    extra = {"name": "extra", "url": "http://127.0.0.1:9"}
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await admin_call(http, proc, "POST", "/admin/backends", extra)
            assert (status, body) == (409, {"error": {"message": FULL, "type": "conflict"}})
            assert state.read_bytes() == before  # nothing persisted: it still restarts
            status, _ = await admin_call(http, proc, "GET", "/admin/backends/extra")
            assert status == 404
            status, body = await admin_call(http, proc, "GET", "/admin/stats")
            assert [w["restarts"] for w in body["workers"]] == [0, 0]  # type: ignore[index, union-attr]
        # A freed column taken by the next backend: the etcd tests below, at SLOTS
        # patched small (each change rebuilds a ring of 8,192 in every process, ~4 s).
    finally:
        await stop(proc)


async def test_a_state_file_past_the_limit_stops_start_up_with_exit_2_naming_it(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.json"
    write_state(state, SLOTS + 1)
    config = tmp_path / "router.toml"
    config.write_text(SMALL_RING)  # the ring is built before the fleet's size is checked
    code, err = await serve_exit(
        "--config", str(config), "--workers", "2", "--listen", "127.0.0.1:0",
        "--admin-listen", "off", "--state-file", str(state), within=START,
    )  # fmt: skip
    assert code == 2, err
    assert b"Traceback" not in err
    assert err.decode().splitlines()[-1] == f"prefix-router: {past_the_slots(SLOTS + 1)}"


def test_check_config_refuses_a_config_or_state_file_past_the_limit_as_serve_does(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.json"
    write_state(state, SLOTS + 1)
    config = tmp_path / "router.toml"

    def check(**top: object) -> subprocess.CompletedProcess[str]:
        lines = [f"{key} = {toml(value)}" for key, value in top.items()]
        config.write_text("\n".join(lines) + "\n")
        return subprocess.run(
            [sys.executable, "-m", "admin", "check-config", str(config)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def refused(done: subprocess.CompletedProcess[str], size: int) -> None:
        assert done.returncode == 2, done
        assert done.stderr.splitlines()[-1] == f"{config}: {past_the_slots(size)}"

    one = fleet(1)
    refused(check(workers=2, state_file=str(state), backends=one), SLOTS + 1)
    refused(check(workers=2, backends=fleet(SLOTS + 2)), SLOTS + 2)
    # With etcd, the supervisor's table holds the configured fleet (etcd's seed) too.
    refused(check(etcd=["http://127.0.0.1:2379"], backends=fleet(SLOTS + 1)), SLOTS + 1)
    # One process has no table, and so no limit: serve starts with all of them.
    done = check(workers=1, state_file=str(state), backends=one)
    assert (done.returncode, done.stderr) == (0, "")
    assert f"ok: {SLOTS + 1} backends (the state file's)," in done.stdout
    done = check(workers=2, backends=fleet(SLOTS))
    assert (done.returncode, done.stderr) == (0, "")


@dataclasses.dataclass
class Replica:
    """One replica's supervisor as the daemon wires it with ``--etcd``: its router,
    workers (real processes), control and etcd store."""

    router: Router
    workers: Workers
    control: ReplicatedControl
    store: EtcdStore


@contextlib.asynccontextmanager
async def replica(etcd: EtcdServer, prefix: str) -> AsyncIterator[Replica]:
    """A replica of one worker started on what etcd holds under ``prefix`` (as the
    daemon starts one: the store opened, its state applied, then the workers)."""
    router = Router(build_config(router_config([], health={"active": False})))
    held = listen("127.0.0.1", 0, backlog=16, reuse_port=True)
    workers = Workers(router, 1, held)
    await router.start_control(workers.sockets)
    control = ReplicatedControl(router, workers)
    store = EtcdStore(EtcdClient([etcd.url]), prefix, control)
    control.store = store
    try:
        await store.open()
        await control.on_resync(store.state())
        await workers.start()
        yield Replica(router, workers, control, store)
        await workers.refresh()  # every worker answers: none died on an op
        assert [(w.up, w.restarts) for w in workers.views()] == [(True, 0)]
    finally:
        await store.close()
        await store.client.close()
        await workers.stop()
        await router.shutdown(grace=1)
        await control.close()


def saved(i: int, url: str | None = None, **fields: object) -> bytes:
    """Backend ``b<i>``'s value in etcd."""
    url = url or f"http://127.0.0.1:{10_000 + i}"
    return ENCODER.encode(SavedBackend(f"b{i}", url, **fields))  # type: ignore[arg-type]


ENCODER = msgspec.json.Encoder()


def not_added(logs: list[dict[str, object]]) -> list[object]:
    return [e["backend"] for e in logs if e["event"] == "backend not added"]


async def test_etcd_membership_past_the_slots_is_logged_and_skipped_not_raised(
    etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervisor, "SLOTS", 4)  # the table and the limit, workers' too
    prefix = "/slots/"
    longer = {"RoutingConfig": {"PrefixAwareRoutingConfig": {"PrefixLength": 2048}}}
    async with EtcdClient([etcd.url]) as client:
        for i in range(6):  # two past the slots
            await client.put(f"{prefix}backends/b{i}", saved(i))
        await client.put(f"{prefix}routing", json.dumps(longer))
        with capture_logs() as logs:
            async with replica(etcd, prefix) as one:
                router, control, store = one.router, one.control, one.store
                assert sorted(router.fleet.backends) == ["b0", "b1", "b2", "b3"]
                assert not_added(logs) == ["b4", "b5"]
                # the rest of the re-list still applied
                assert control.routing().prefix_aware_routing_config.prefix_length == 2048

                # Through the watch: a removal frees a column, the first skipped member
                # by key takes it; an add past the slots, and its state, are skipped.
                await store.applied(await client.put(f"{prefix}backends/b4", saved(4, weight=2)))
                await store.applied(await client.delete(f"{prefix}backends/b0"))
                draining = saved(6, state="draining")
                await store.applied(await client.put(f"{prefix}backends/b6", draining))
                assert sorted(router.fleet.backends) == ["b1", "b2", "b3", "b4"]
                assert router.fleet.backends["b4"].weight == 2  # its latest value
                # The admin API's add on a full replica: a 409, nothing written to etcd.
                with pytest.raises(Conflict, match="the fleet is full"):
                    await control.add_backend(BackendSpec("b7", "http://127.0.0.1:10007"))
                assert (await client.range(f"{prefix}backends/b7"))[0] == []
        assert not_added(logs) == ["b4", "b5", "b4", "b6"]
        assert not [e for e in logs if e["event"] == "etcd listener failed"]


async def test_a_member_skipped_past_the_slots_is_routed_to_once_a_column_frees(
    etcd: EtcdServer, backends: StartBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It was added only at its own next change in etcd: the fleet stayed short of a
    # column for as long as that member did not change.
    monkeypatch.setattr(supervisor, "SLOTS", 1)
    servers = [await backends(echo) for _ in range(3)]
    prefix = "/freed/"
    async with EtcdClient([etcd.url]) as client:
        for i, server in enumerate(servers):  # limit + 2: b1 and b2 skipped
            await client.put(f"{prefix}backends/b{i}", saved(i, server.url))
        async with replica(etcd, prefix) as one:
            admin = AdminServer(one.control, token=None)
            await admin.start("127.0.0.1", 0)
            try:
                async with aiohttp.ClientSession() as http:

                    async def stats() -> Any:
                        url = f"http://127.0.0.1:{admin.port}/admin/stats"
                        async with http.get(url) as resp:
                            assert resp.status == 200
                            return await resp.json()

                    async def routed_to() -> Backend:
                        url = f"http://127.0.0.1:{one.workers.port}/generate"
                        async with http.post(url, data=b"a prompt") as resp:
                            assert resp.status == 200
                        (server,) = [s for s in servers if s.requests]
                        server.requests.clear()
                        return server

                    body = await stats()
                    assert [b["name"] for b in body["backends"]] == ["b0"]
                    assert body["not_added"] == ["b1", "b2"]
                    assert await routed_to() is servers[0]

                    await one.store.applied(await client.delete(f"{prefix}backends/b0"))
                    body = await stats()
                    assert [b["name"] for b in body["backends"]] == ["b1"]  # by key
                    assert body["not_added"] == ["b2"]
                    assert await routed_to() is servers[1]

                    # A skipped member gone from etcd is no longer waiting for a column.
                    await one.store.applied(await client.delete(f"{prefix}backends/b2"))
                    assert (await stats())["not_added"] == []
            finally:
                await admin.close()
