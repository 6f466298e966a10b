"""Membership and weight changes on a big fleet, through the real router.

The ring is rebuilt in slices between which the loop serves requests on the
old ring; the new ring is swapped in whole and equals one built from scratch
for the same membership.  With ``SLICE_SECONDS = 0`` each slice is a single
step, so a rebuild takes hundreds of loop turns and a request (a few turns,
everything here on one loop over loopback) completes meanwhile: no timing.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from hashring import Ring
from router.app import Router
from router.config import BackendSpec
from router.control import BackendPatch
from router.control.live import RouterControl
from router.fleet import Fleet
from tests.harness.backends import Backend, echo
from tests.harness.http import connect, quiet, req
from tests.harness.routers import StartRouter

# 300 members of weight 1 at the default vnodes: ~307,000 points, ~1,000 steps
# to rebuild (a second or so of work), far more loop turns than a request takes.
BIG = 300
NO_HEALTH = {"active": False}


@pytest.fixture(autouse=True)
def one_step_per_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Fleet, "SLICE_SECONDS", 0.0, raising=False)


def completion(i: int) -> bytes:
    body = json.dumps({"model": "m", "prompt": f"prompt number {i} " * 8}).encode()
    return req(b"POST", b"/v1/completions", body=body)


def fresh_ring(router: Router) -> Ring:
    weights = {name: b.weight for name, b in router.fleet.backends.items()}
    return Ring(weights, vnodes=router.config.vnodes)


async def serve_until(router: Router, change: asyncio.Task[object]) -> int:
    """Send requests one after another until ``change`` is done; each must
    succeed.  Returns how many finished while it was still running, on the
    ring that was published before it."""
    before = router.fleet.ring
    served = 0
    async with connect(router) as client:
        for i in range(100_000):  # bounded; the change ends long before
            await client.send(completion(i))
            resp = await client.response()
            assert resp.status == 200, resp
            if change.done():
                break
            assert router.fleet.ring is before  # nothing half-built is ever published
            served += 1
    await change
    return served


async def big_router(start_router: StartRouter, backend: Backend, count: int = BIG) -> Router:
    specs = [{"name": f"m-{i}", "url": backend.url} for i in range(count)]
    return await start_router(specs, health=NO_HEALTH)


@pytest.mark.parametrize("change", ["weight 1 -> 100", "add"])
async def test_a_change_on_a_big_fleet_keeps_serving_and_publishes_a_fresh_ring(
    start_router: StartRouter, change: str
) -> None:
    backend = Backend(echo, "echo")
    await backend.start()
    try:
        router = await big_router(start_router, backend)
        control = RouterControl(router)
        if change == "add":
            spec = BackendSpec(name="newcomer", url=backend.url, weight=3)
            task = asyncio.create_task(control.add_backend(spec))
        else:
            task = asyncio.create_task(control.update_backend("m-7", BackendPatch(weight=100)))
        served = await serve_until(router, task)
        assert served > 0
        if change == "add":
            assert router.fleet.ring.weight("newcomer") == 3
        else:
            assert router.fleet.ring.weight("m-7") == 100
        assert router.fleet.ring == fresh_ring(router)
        await control.close()
    finally:
        await backend.close()
    await quiet(router)


async def test_a_removed_backend_gets_nothing_while_the_ring_still_holds_it(
    start_router: StartRouter,
) -> None:
    backend = Backend(echo, "echo")
    leaving = Backend(echo, "leaving")
    await backend.start()
    await leaving.start()
    try:
        specs = [{"name": f"m-{i}", "url": backend.url} for i in range(BIG)]
        # Weight 300 of 600: the leaving member owns about half of the keys.
        specs.append({"name": "leaving", "url": leaving.url, "weight": BIG})
        router = await start_router(specs, health=NO_HEALTH)
        control = RouterControl(router)
        view = await control.remove_backend("leaving", timeout=1, wait=True)
        assert view.state == "removed"
        assert "leaving" not in router.fleet.backends
        assert "leaving" in router.fleet.ring  # the rebuild has only begun
        assert "leaving" in router.fleet.unavailable
        async with connect(router) as client:
            for i in range(40):
                await client.send(completion(i))
                assert (await client.response()).status == 200
        assert leaving.requests == []
        await router.fleet.settled()
        assert "leaving" not in router.fleet.ring
        assert "leaving" not in router.fleet.unavailable
        assert router.fleet.ring == fresh_ring(router)
        await control.close()
    finally:
        await backend.close()
        await leaving.close()
    await quiet(router)


async def test_changes_made_during_a_rebuild_are_folded_into_the_next_one(
    start_router: StartRouter,
) -> None:
    backend = Backend(echo, "echo")
    await backend.start()
    try:
        router = await big_router(start_router, backend, count=100)
        fleet = router.fleet
        fleet.set_weight("m-1", 5)
        fleet.add(BackendSpec(name="x", url=backend.url))
        fleet.remove("m-2")
        fleet.set_weight("x", 2)
        await fleet.settled()
        assert fleet.ring == fresh_ring(router)
        assert fleet.ring.weights == {name: b.weight for name, b in fleet.backends.items()}
        assert fleet.unavailable == frozenset()
    finally:
        await backend.close()


def test_without_a_loop_a_change_rebuilds_the_ring_before_returning() -> None:
    fleet = Fleet([BackendSpec(name=f"m-{i}", url="http://127.0.0.1:9") for i in range(5)])
    fleet.add(BackendSpec(name="x", url="http://127.0.0.1:9", weight=2))
    fleet.set_weight("m-0", 3)
    fleet.remove("m-1")
    assert fleet.ring == Ring({"m-0": 3, "m-2": 1, "m-3": 1, "m-4": 1, "x": 2})
    with pytest.raises(ValueError, match="positive integer"):
        fleet.set_weight("m-0", 0)
    assert fleet.backends["m-0"].weight == 3
