"""Values an older version saved below a floor added since: raised, not refused.

The health checks' ``interval`` and ``timeout`` took any number above 0 before
they got a floor of ``HEALTH_FLOOR_S``; a state file or an etcd value written
then may hold 0.01.  An operator who upgrades must find the router started, the
value raised to the floor and one warning per field naming the field and both
values, while the admin API still refuses a new value below the floor.  Driven
as an operator meets it: ``prefix-router serve`` as a real process, its state
file or a real etcd.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from router.config import HEALTH_FLOOR_S
from router.etcd import EtcdClient
from tests.harness.backends import StartBackend, echo
from tests.harness.etcd import EtcdServer
from tests.harness.processes import admin_call, spawn_router, stop

pytestmark = pytest.mark.timeout(60)

OLD = {"interval": 0.01, "timeout": 0.02}  # what an older version took and saved
RAISED = "saved value below its floor raised to it"


def raised(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(e["source"], e["field"], e["old"], e["new"]) for e in events if e["event"] == RAISED]


async def post(http: aiohttp.ClientSession, port: int) -> int:
    async with http.post(f"http://127.0.0.1:{port}/generate", data=b"a prompt") as resp:
        await resp.read()
        return resp.status


async def test_a_state_file_with_a_health_period_below_the_floor_starts_with_it_raised(
    tmp_path: Path, backends: StartBackend
) -> None:
    a = await backends(echo)
    state = tmp_path / "state.json"
    saved = {"name": a.name, "url": a.url, "health": OLD}
    state.write_text(json.dumps({"version": 1, "backends": [saved], "RoutingConfig": {}}))
    events: list[dict[str, Any]] = []
    proc, port = await spawn_router("--state-file", str(state), "--no-health-checks", events=events)
    try:
        source = f"state file {state}"
        assert raised(events) == [
            (source, "$.backends[0].health.interval", 0.01, HEALTH_FLOOR_S),
            (source, "$.backends[0].health.timeout", 0.02, HEALTH_FLOOR_S),
        ]
        async with aiohttp.ClientSession() as http:
            assert await post(http, port) == 200
            assert len(a.requests) == 1

            # A new value below the floor is still refused, naming the field.
            low = {"name": "b", "url": a.url, "health": {"interval": 0.01}}
            status, body = await admin_call(http, proc, "POST", "/admin/backends", low)
            assert status == 422, body
            error: Any = body["error"]
            assert error["fields"][0]["path"] == "$.health.interval"
            assert f">= {HEALTH_FLOOR_S}" in error["message"]

            # The next change saves the raised value.
            status, body = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": "c", "url": a.url}
            )
            assert status == 201, body
        health = json.loads(state.read_text())["backends"][0]["health"]
        assert (health["interval"], health["timeout"]) == (HEALTH_FLOOR_S, HEALTH_FLOOR_S)
    finally:
        await stop(proc)


async def test_an_etcd_backend_with_a_health_period_below_the_floor_joins_with_it_raised(
    etcd: EtcdServer, backends: StartBackend
) -> None:
    a = await backends(echo)
    value = {"name": a.name, "url": a.url, "health": {"interval": 0.01}}
    async with EtcdClient([etcd.url]) as client:
        await client.put(f"/floors/backends/{a.name}", msgspec.json.encode(value))
        await client.put("/floors/routing", b'{"RoutingConfig": {}}')
    events: list[dict[str, Any]] = []
    flags = ("--etcd", etcd.url, "--etcd-prefix", "/floors/", "--no-health-checks")
    proc, port = await spawn_router(*flags, events=events)
    try:
        assert raised(events) == [
            (f"etcd /floors/backends/{a.name}", "$.health.interval", 0.01, HEALTH_FLOOR_S)
        ]
        assert not [e for e in events if e["event"] == "etcd backend value ignored"]
        async with aiohttp.ClientSession() as http:
            status, body = await admin_call(http, proc, "GET", f"/admin/backends/{a.name}")
            assert status == 200, body
            assert await post(http, port) == 200
        assert len(a.requests) == 1
    finally:
        await stop(proc)
