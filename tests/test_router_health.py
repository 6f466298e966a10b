"""Health: active checks, passive failures with half-open probes, metric scraping."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
from aiohttp import web

from loadtests.simserver import SimServer
from router.app import Router
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
        router = await start_router([("broken", url)], health={**FAST_HEALTH, "active": False})
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
