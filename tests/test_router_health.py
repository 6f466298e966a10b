"""Health: active checks, passive failures with half-open probes, metric scraping."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
from aiohttp import web

from loadtests.simserver import SimServer
from router.app import Router
from router.config import BackendSpec
from router.control.live import RouterControl
from router.fleet import AdminState, Fleet, ModelPool
from tests.harness.routers import FAST_HEALTH, SimFleet, StartRouter

# Detection must happen within the configured time: thresholds x interval plus
# a probe timeout, with room for a loaded machine.  Failing this means broken.
DETECTION_BOUND_S = 5.0


def chat(system: str, question: str = "q") -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 2,
    }


async def served_by(http: aiohttp.ClientSession, router: Router, body: dict[str, Any]) -> str:
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-sim-instance"]


async def healthy_is(router: Router, name: str, healthy: bool) -> None:
    backend = router.fleet.backends[name]
    async with asyncio.timeout(DETECTION_BOUND_S):
        await router.health.wait(lambda: backend.healthy == healthy)


async def test_a_stopped_instance_is_marked_down_then_back_and_traffic_follows(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(3)
    router = await start_router(sims, health=FAST_HEALTH)
    prompts = [f"Tenant handbook {i}. " * 80 for i in range(30)]
    async with aiohttp.ClientSession() as http:
        before = {p: await served_by(http, router, chat(p)) for p in prompts}
        victim = sims[0]
        port = victim.port
        await victim.close()
        await healthy_is(router, victim.name, False)
        assert router.health.transitions[victim.name, "down"] == 1
        during = {p: await served_by(http, router, chat(p)) for p in prompts}
        assert victim.name not in during.values()
        # Only the victim's keys moved.
        assert all(during[p] == before[p] for p in prompts if before[p] != victim.name)

        revived = SimServer(dataclasses.replace(victim.instance.config), port=port)
        await revived.start()
        try:
            await healthy_is(router, victim.name, True)
            after = {p: await served_by(http, router, chat(p)) for p in prompts}
            assert after == before  # its keys came back
        finally:
            await revived.close()


async def test_passive_failures_mark_down_at_once_and_a_half_open_probe_brings_it_back(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(2)
    router = await start_router(sims, health={**FAST_HEALTH, "active": False})
    victim = sims[0]
    port = victim.port
    await victim.close()
    prompts = [f"Contract {i}. " * 80 for i in range(40)]
    async with aiohttp.ClientSession() as http:
        # Every request still succeeds: connect failures are retried elsewhere.
        for p in prompts[:10]:
            assert await served_by(http, router, chat(p)) == sims[1].name
        await healthy_is(router, victim.name, False)
        assert router.fleet.backends[victim.name].errors == 3  # then no more attempts
        for p in prompts[10:]:
            assert await served_by(http, router, chat(p)) == sims[1].name
        assert router.fleet.backends[victim.name].errors == 3
        revived = SimServer(dataclasses.replace(victim.instance.config), port=port)
        await revived.start()
        try:
            await healthy_is(router, victim.name, True)  # no active checks: the probe did it
            served = {await served_by(http, router, chat(p)) for p in prompts}
            assert served == {victim.name, sims[1].name}
        finally:
            await revived.close()


async def test_5xx_answers_count_as_failures(start_router: StartRouter) -> None:
    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": "boom"}, status=500)

    app = web.Application()
    app.router.add_post("/v1/completions", broken)
    app.router.add_get("/health", broken)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        # Without panic (below): the one backend down, nothing is tried.
        health = {**FAST_HEALTH, "active": False, "panic": False}
        router = await start_router([("broken", url)], health=health)
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(
                    f"http://127.0.0.1:{router.port}/v1/completions", json={"prompt": "x"}
                ) as resp:
                    assert resp.status == 500  # the backend's answer, relayed
            await healthy_is(router, "broken", False)
            async with http.post(
                f"http://127.0.0.1:{router.port}/v1/completions", json={"prompt": "x"}
            ) as resp:
                assert resp.status == 503  # nothing healthy left
    finally:
        await runner.cleanup()


# -- panic: every backend a request could go to is down -----------------------------


def test_panic_routes_to_down_backends_only_where_their_pools_have_none_up() -> None:
    def fleet(*backends: tuple[str, list[str]], panic: bool = True) -> Fleet:
        specs = [BackendSpec(name=n, url="http://127.0.0.1:9", models=m) for n, m in backends]
        return Fleet(specs, panic=panic)

    def names(members: Fleet | ModelPool | None) -> set[str]:
        assert members is not None
        return {b.name for b in members.available}

    one = fleet(("a", []), ("b", []), ("c", []))
    one.set_healthy("a", False)
    assert (one.rescued, one.unavailable) == (frozenset(), {"a"})
    one.set_healthy("b", False)
    one.set_healthy("c", False)
    assert one.rescued == {"a", "b", "c"}
    assert not one.unavailable
    assert names(one) == {"a", "b", "c"}
    one.set_state("c", AdminState.DRAINING)  # draining is the operator's word: kept out
    assert (one.rescued, one.unavailable) == ({"a", "b"}, {"c"})
    one.set_healthy("b", True)  # one up again: the panic is over
    assert (one.rescued, one.unavailable) == (frozenset(), {"a", "c"})

    # x serves m1, y m1 and m2, z m2, w any model (it is in every pool).
    pools = fleet(("x", ["m1"]), ("y", ["m1", "m2"]), ("z", ["m2"]), ("w", []))
    for name in ("x", "y"):
        pools.set_healthy(name, False)
    assert not pools.rescued  # w serves m1
    pools.set_healthy("w", False)
    # m1 has none up: x, which serves only m1, takes it; y and w serve m2 too, up on z.
    assert pools.rescued == {"x"}
    assert names(pools.members_for("m1")) == {"x"}
    assert names(pools.members_for("m2")) == {"z"}
    assert pools.unavailable == {"y", "w"}
    # A request of no model goes to w alone, down: not rescued, since m2's traffic
    # would then go to it too (the contract).
    assert names(pools.members_for(None)) == set()

    off = fleet(("a", []), panic=False)
    off.set_healthy("a", False)
    assert (off.rescued, off.unavailable, names(off)) == (frozenset(), {"a"}, set())


async def test_when_every_health_check_fails_requests_are_still_served(
    start_router: StartRouter,
) -> None:
    """A health path that fails while the engines serve (mistyped, or too slow under
    load): every backend goes down, and with panic (the default) traffic goes on;
    once one is up, only it is routed to.  Without panic: 503."""
    up: set[str] = set()

    async def start(name: str) -> tuple[web.AppRunner, str]:
        async def health(request: web.Request) -> web.Response:
            return web.Response(status=200 if name in up else 404)

        async def completion(request: web.Request) -> web.Response:
            return web.json_response({"choices": []}, headers={"x-served-by": name})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completion)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"

    started = [await start(name) for name in ("a", "b")]
    try:
        specs = [(name, url) for name, (_, url) in zip("ab", started, strict=True)]
        router = await start_router(specs, health=FAST_HEALTH)
        strict = await start_router(specs, health={**FAST_HEALTH, "panic": False})
        for name in "ab":
            await healthy_is(router, name, False)
            await healthy_is(strict, name, False)

        async def post(target: Router, i: int) -> tuple[int, str]:
            url = f"http://127.0.0.1:{target.port}/v1/completions"
            async with http.post(url, json={"prompt": f"document {i} " * 50}) as resp:
                await resp.read()
                return resp.status, resp.headers.get("x-served-by", "")

        async with aiohttp.ClientSession() as http:
            answers = [await post(router, i) for i in range(20)]
            assert {status for status, _ in answers} == {200}
            assert {status for status, _ in [await post(strict, i) for i in range(5)]} == {503}
            stats = await RouterControl(router).stats()
            assert stats.panic == ["a", "b"]
            metrics = (await router.collector.render_async()).decode()
            assert "prefix_router_panic_backends 2.0" in metrics

            up.add("b")
            await healthy_is(router, "b", True)
            assert not router.fleet.rescued
            assert {await post(router, i) for i in range(20)} == {(200, "b")}
    finally:
        for runner, _ in started:
            await runner.cleanup()


async def test_backend_metrics_are_scraped_for_stats(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(1)
    router = await start_router(
        sims, health={**FAST_HEALTH, "scrape_metrics": True, "scrape_interval": 0.05}
    )
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            await served_by(http, router, chat("Shared system prompt. " * 100, f"q{i}"))
    scraped = router.health.scraped[sims[0].name]
    engine = sims[0].instance.cache
    async with asyncio.timeout(DETECTION_BOUND_S):
        # A scrape may land after the last request was counted but before the
        # engine let it go (running 1): wait for one that sees the engine idle.
        await router.health.wait(
            lambda: (
                (scraped.queries, scraped.hits, scraped.running) == (engine.queries, engine.hits, 0)
            )
        )
    assert engine.hits > 0
    assert scraped.hit_rate == engine.hits / engine.queries
