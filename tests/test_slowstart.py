"""Slow start: an added or recovered backend's ring share ramps up over a window.

The pure parts (``router.slowstart``, ``Ring`` fractions) are checked directly;
the behaviour as an operator sees it runs the real daemon (``prefix-router
serve``, one process and ``--workers 2``) in front of simulated vLLM instances,
adds a backend through the admin API and follows its effective weight there.
Which instance served a request is its ``x-sim-instance`` header; where a key
*should* go at step ``k`` is computed from the same ring the router builds (a
native body's key is its bytes), so every request is checked, not a share.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hashring import Ring, hash_key
from loadtests.simserver import SimServer
from router.config import ConfigError, build_config
from router.slowstart import MAX_STEPS, Ramp, fraction, next_change, parse_duration, steps
from tests.harness.etcd import EtcdServer
from tests.harness.http import WAIT
from tests.harness.processes import ROOT, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet

pytestmark = pytest.mark.timeout(120)

WINDOW = 6  # seconds: 6 steps of a second (the first held for two)
LAST = steps(WINDOW)


# -- the pure function ---------------------------------------------------------------


def test_a_ramp_holds_one_step_from_the_start_and_every_point_at_its_end() -> None:
    ramp = Ramp(start=1000.0, seconds=60.0)
    assert steps(60.0) == MAX_STEPS
    assert steps(5.0) == 5
    assert steps(0.5) == 1
    assert fraction(ramp, 999.0) == (1, 20)  # a replica whose clock is behind
    assert fraction(ramp, 1000.0) == (1, 20)
    assert fraction(ramp, 1005.9) == (1, 20)
    assert fraction(ramp, 1006.0) == (2, 20)
    assert fraction(ramp, 1057.0) == (19, 20)
    assert fraction(ramp, 1060.0) is None
    assert next_change(ramp, 1000.0) == pytest.approx(1006.0)
    assert next_change(ramp, 1057.0) == pytest.approx(1060.0)
    assert next_change(ramp, 1060.0) is None


@given(
    seconds=st.floats(min_value=0.01, max_value=86_400),
    a=st.floats(min_value=-10, max_value=90_000),
    b=st.floats(min_value=-10, max_value=90_000),
)
def test_a_ramp_never_goes_back(seconds: float, a: float, b: float) -> None:
    ramp = Ramp(0.0, seconds)
    early, late = sorted((a, b))
    part_early, part_late = fraction(ramp, early), fraction(ramp, late)
    full = steps(seconds)
    k_early = full if part_early is None else part_early[0]
    k_late = full if part_late is None else part_late[0]
    assert 1 <= k_early <= k_late <= full


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(60, 60.0), (1.5, 1.5), ("60s", 60.0), ("2m", 120.0), ("500ms", 0.5), ("off", 0.0), (0, 0.0)],
)
def test_durations(value: Any, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["banana", "-5s", "60x", "", True, -1, 86_401, "25h"])
def test_bad_durations_are_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"\$\.health") as error:
        build_config({"health": {"slow_start": value}})
    assert "slow_start" in str(error.value)


def test_a_fraction_adds_only_the_ramping_members_first_points() -> None:
    old = {"a": 1, "b": 1, "c": 1}
    base = Ring(old)
    keys = [hash_key(f"key {i}".encode()) for i in range(2000)]
    previous: set[int] = set()
    for part in range(1, 5):
        ring = Ring({**old, "new": 1}, fractions={"new": (part, 4)} if part < 4 else None)
        assert ring.points_of("new") == 1024 * part // 4
        assert ring.weights["new"] == 1
        assert ring.total_weight == 4
        owned = {k for k in keys if ring.primary(k) == "new"}
        # Keys move only to the newcomer, and the ones it has it keeps.
        assert previous <= owned
        assert all(ring.primary(k) == base.primary(k) for k in keys if k not in owned)
        previous = owned
    whole = Ring({**old, "new": 1})
    assert previous == {k for k in keys if whole.primary(k) == "new"}


# -- the daemon ----------------------------------------------------------------------


def _body(key: str) -> bytes:
    return json.dumps({"inputs": key, "parameters": {"max_new_tokens": 1}}).encode()


KEYS = [f"document {i}: the shared part of a prompt" for i in range(60)]


def _predicted(names: list[str], new: str, part: int, whole: int) -> dict[str, str]:
    """Where each key goes with ``new`` at ``part/whole`` of its points."""
    fractions = {new: (part, whole)} if part < whole else None
    ring = Ring(dict.fromkeys([*names, new], 1), fractions=fractions)
    return {key: ring.primary(hash_key(_body(key))) or "" for key in KEYS}


async def _send(http: aiohttp.ClientSession, port: int) -> dict[str, str]:
    """Each key once, at once, each on a connection of its own (so workers share
    them): key -> the instance that served it."""

    async def one(key: str) -> str:
        async with http.post(
            f"http://127.0.0.1:{port}/invocations",
            data=_body(key),
            headers={"Content-Type": "application/json", "Connection": "close"},
        ) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return resp.headers["x-sim-instance"]

    instances = await asyncio.gather(*map(one, KEYS))
    return dict(zip(KEYS, instances, strict=True))


async def _step(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process, name: str) -> int:
    """The newcomer's step (k of ``steps(WINDOW)``) as the admin API reports it."""
    status, view = await admin_call(http, proc, "GET", f"/admin/backends/{name}")
    assert status == 200, view
    weight = view["effective_weight"]
    assert isinstance(weight, float | int)
    return round(weight * LAST)


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Poll ``await check()`` until true, bounded by WAIT: state in other processes
    (their health, their watch of etcd) has no event to await from here."""
    async with asyncio.timeout(WAIT):
        while True:
            if await check():
                return
            await asyncio.sleep(0.02)


def _flags(servers: list[SimServer], *extra: str) -> list[str]:
    # IN_FLIGHT with a threshold no test reaches: each request goes to its key's
    # primary, so where it went says which ring the process routed on.
    flags = ["--strategy", "prefix", "--balance-mode", "IN_FLIGHT", "--no-health-checks"]
    flags += ["--concurrency-threshold", "1000", *extra]
    for server in servers:
        flags += ["--backend", f"{server.name}={server.url}"]
    return flags


async def _ramp(workers: int, sim_fleet: SimFleet) -> None:
    *old, new = await sim_fleet(4)
    names = [s.name for s in old]
    predicted = {
        k: {key for key, b in _predicted(names, new.name, k, LAST).items() if b == new.name}
        for k in range(1, LAST + 1)
    }
    base_ring = Ring(dict.fromkeys(names, 1))
    base = {key: base_ring.primary(hash_key(_body(key))) for key in KEYS}
    flags = _flags(old, "--slow-start", f"{WINDOW}s", "--workers", str(workers))
    proc, port = await spawn_router(*flags)
    batches: list[tuple[int, int, set[str]]] = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            status, view = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": new.name, "url": new.url}
            )
            assert status == 201, view
            assert view["weight"] == 1
            assert view["effective_weight"] == pytest.approx(1 / LAST)
            assert isinstance(view["slow_start_ends"], float)
            async with asyncio.timeout(WINDOW + WAIT):
                while True:
                    before = await _step(http, proc, new.name)
                    served = await _send(http, port)
                    after = await _step(http, proc, new.name)
                    on_new = {k for k, instance in served.items() if instance == new.name}
                    # Every request went where the ring of a step in [before, after]
                    # sends it; each process steps on its own timer, a few ms apart:
                    # one step either side.
                    lo, hi = max(1, before - 1), min(LAST, after + 1)
                    assert predicted[lo] <= on_new <= predicted[hi], (before, after)
                    for key, instance in served.items():
                        if instance != new.name:
                            assert instance == base[key], key  # the others' keys stay put
                    batches.append((before, after, on_new))
                    if before == LAST:
                        break
                    if after < LAST:  # one batch a step, not a busy loop over the window

                        async def stepped(after: int = after) -> bool:
                            return await _step(http, proc, new.name) > after

                        await _until(stepped)
            status, view = await admin_call(http, proc, "GET", f"/admin/backends/{new.name}")
            assert view["effective_weight"] == 1
            assert view["slow_start_ends"] is None
    finally:
        await stop(proc)
    # A growing share: a small part at first, its whole share at the end, and
    # several steps reported on the way.
    first_before, first_after, first = batches[0]
    assert first_before == 1
    assert first_after <= LAST // 2
    assert len(first) <= len(predicted[LAST // 2 + 1]) < len(predicted[LAST])
    assert batches[-1][2] == predicted[LAST]
    assert len({before for before, _, _ in batches}) >= 3


async def test_an_added_backend_gets_a_growing_share_over_the_window(
    sim_fleet: SimFleet,
) -> None:
    await _ramp(1, sim_fleet)


async def test_two_workers_apply_the_same_ramp(sim_fleet: SimFleet) -> None:
    await _ramp(2, sim_fleet)


async def test_without_slow_start_an_added_backend_takes_its_share_at_once(
    sim_fleet: SimFleet,
) -> None:
    *old, new = await sim_fleet(4)
    full = _predicted([s.name for s in old], new.name, 1, 1)
    proc, port = await spawn_router(*_flags(old))
    try:
        async with aiohttp.ClientSession() as http:
            status, view = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": new.name, "url": new.url}
            )
            assert status == 201, view
            assert view["effective_weight"] == 1
            assert view["slow_start_ends"] is None
            assert await _send(http, port) == full
    finally:
        await stop(proc)


async def test_a_backend_with_its_own_window_and_bad_values_through_the_admin_api(
    sim_fleet: SimFleet,
) -> None:
    old, new, other = await sim_fleet(3)
    proc, _ = await spawn_router(*_flags([old]))
    try:
        async with aiohttp.ClientSession() as http:
            for bad in ("banana", -1, True, "90000s"):
                body = {"name": new.name, "url": new.url, "health": {"slow_start": bad}}
                status, error = await admin_call(http, proc, "POST", "/admin/backends", body)
                assert status == 422, error
                assert "slow_start" in json.dumps(error["error"]), error
            body = {"name": new.name, "url": new.url, "health": {"slow_start": "1h"}}
            status, view = await admin_call(http, proc, "POST", "/admin/backends", body)
            assert status == 201, view
            assert view["effective_weight"] == pytest.approx(1 / MAX_STEPS)
            assert isinstance(view["slow_start_ends"], float)
            # Off by default: a backend without its own window joins at once.
            body = {"name": other.name, "url": other.url}
            status, view = await admin_call(http, proc, "POST", "/admin/backends", body)
            assert status == 201, view
            assert view["slow_start_ends"] is None, view
    finally:
        await stop(proc)


@pytest.mark.parametrize("value", ["banana", "-1s", "2d"])
async def test_a_bad_slow_start_flag_exits_2_naming_it(value: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "admin",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "off",
        f"--slow-start={value}",
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(WAIT):
        _, stderr = await proc.communicate()
    assert proc.returncode == 2
    assert b"slow_start" in stderr, stderr
    assert b"$.health" in stderr, stderr


async def test_replicas_ramp_an_added_backend_from_the_one_start_etcd_carries(
    sim_fleet: SimFleet, etcd: EtcdServer
) -> None:
    """The add's ramp is written to etcd with the backend: every replica applies it
    from that start, one whose own config has no slow start and one that joins
    mid-ramp included (health recoveries, per replica, ramp from each one's own)."""
    old, new = await sim_fleet(2)
    base = ["--etcd", etcd.url, "--etcd-prefix", "/slow/", *_flags([old])]
    routers = [
        await spawn_router(*base, "--replica-id", "r0", "--slow-start", "1h"),
        await spawn_router(*base, "--replica-id", "r1"),  # no slow start of its own
    ]
    try:
        async with aiohttp.ClientSession() as http:
            status, view = await admin_call(
                http, routers[0][0], "POST", "/admin/backends", {"name": new.name, "url": new.url}
            )
            assert status == 201, view
            ends = view["slow_start_ends"]
            assert isinstance(ends, float)
            routers.append(await spawn_router(*base, "--replica-id", "r2"))  # joins mid-ramp

            async def everywhere() -> bool:
                views = [
                    (await admin_call(http, proc, "GET", f"/admin/backends/{new.name}"))[1]
                    for proc, _ in routers
                ]
                return all(
                    v.get("slow_start_ends") == ends
                    and v.get("effective_weight") == pytest.approx(1 / MAX_STEPS)
                    for v in views
                )

            await _until(everywhere)  # the others apply it through their watch
    finally:
        for proc, _ in routers:
            await stop(proc)


async def test_a_recovered_backend_ramps_in_every_worker_from_when_it_came_back(
    sim_fleet: SimFleet,
) -> None:
    """Down, then up again: with a window of an hour the recovered instance holds
    1/20 of its points for the whole test, in the supervisor's view and in both
    workers' routing (the supervisor passes its up time on with the transition)."""
    servers = await sim_fleet(4)
    victim = servers[0]
    names = [s.name for s in servers]
    others = [n for n in names if n != victim.name]
    at_first_step = _predicted(others, victim.name, 1, MAX_STEPS)
    whole = _predicted(others, victim.name, 1, 1)
    assert at_first_step != whole
    flags = ["--strategy", "prefix", "--balance-mode", "IN_FLIGHT"]
    flags += ["--concurrency-threshold", "1000", "--health-interval", "0.05"]
    flags += ["--slow-start", "1h", "--workers", "2"]
    for server in servers:
        flags += ["--backend", f"{server.name}={server.url}"]
    proc, port = await spawn_router(*flags)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            # Present at start-up: no ramp (HAProxy's rule), its whole share.
            assert await _send(http, port) == whole

            async def view() -> dict[str, Any]:
                path = f"/admin/backends/{victim.name}"
                status, body = await admin_call(http, proc, "GET", path)
                assert status == 200, body
                return body

            port_of_victim = victim.port
            await victim.close()

            async def down() -> bool:
                return (await view())["healthy"] is False

            await _until(down)
            revived = SimServer(dataclasses.replace(victim.instance.config), port=port_of_victim)
            await revived.start()
            try:

                async def up() -> bool:
                    return (await view())["healthy"] is True

                await _until(up)
                body = await view()
                assert body["effective_weight"] == pytest.approx(1 / MAX_STEPS)
                assert isinstance(body["slow_start_ends"], float)

                async def routed_at_first_step() -> bool:
                    return await _send(http, port) == at_first_step

                await _until(routed_at_first_step)  # both workers have the transition
            finally:
                await revived.close()
    finally:
        await stop(proc)
