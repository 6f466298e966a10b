"""The prefix-cache check inside the real ``Router`` (in the test's loop): SGLang's
counters, a backend without counters, and an engine restarted with its cache on,
then off again.  Rounds are awaited through ``router.health.wait`` (re-checked after
every scrape round), never slept for.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
from structlog.testing import capture_logs

from loadtests.simserver import SimServer
from router.app import Router
from tests.harness.backends import Backend, Seen, StartBackend
from tests.harness.http import WAIT, response
from tests.harness.routers import FAST_HEALTH, SimFleet, StartRouter

SCRAPING = {**FAST_HEALTH, "scrape_metrics": True, "scrape_interval": 0.05}
IN_FLIGHT = {"PrefixAwareRoutingConfig": {"BalanceMode": "IN_FLIGHT"}}  # the ring's walk only
BATCH = 8


class SGLang:
    """SGLang's /metrics without its radix cache: prompt tokens rise, cached ones do not."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.exposed = True  # False: a /metrics without the counters

    async def __call__(self, backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.target == b"/metrics" and not self.exposed:
            body = b"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs 0.0\n"
        elif seen.target == b"/metrics":
            body = (
                "# TYPE sglang:prompt_tokens_total counter\n"
                f'sglang:prompt_tokens_total{{model_name="m"}} {self.prompt_tokens}.0\n'
                "# TYPE sglang:cached_tokens_total counter\n"
                'sglang:cached_tokens_total{model_name="m",cache_source="device"} 0.0\n'
                'sglang:cached_tokens_total{model_name="m",cache_source="host"} 0.0\n'
            ).encode()
        else:
            self.prompt_tokens += len(seen.body) // 4
            body = b'{"text": "ok"}'
        writer.write(response(200, body, [(b"Content-Type", b"text/plain")]))
        return True


def text(i: int) -> str:
    return f"Document {i}. " + "the clause applies to every delivery. " * 120


async def send(http: aiohttp.ClientSession, router: Router, path: str, body: Any) -> str:
    """One request; the backend (or simulated instance) that answered it."""
    async with http.post(f"http://127.0.0.1:{router.port}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers.get("x-sim-instance", "")


async def until_judged(router: Router, name: str, status: str, batch: Any) -> None:
    """Send ``batch()`` and let two scrape rounds pass, until ``name`` is ``status``."""
    health = router.health
    async with asyncio.timeout(WAIT * 4):
        while health.cache.status(name) != status:
            await batch()
            await health.wait(lambda seen=health.rounds: health.rounds >= seen + 2)


async def test_sglang_without_radix_cache_is_suspect_and_a_backend_without_counters_unknown(
    backends: StartBackend, start_router: StartRouter
) -> None:
    engine = SGLang()
    sglang = await backends(engine, name="sglang")
    plain = await backends(name="plain")  # echo: no Prometheus text at /metrics
    router = await start_router(
        [(sglang.name, sglang.url), (plain.name, plain.url)],
        health=SCRAPING,
        routing=IN_FLIGHT,
    )
    async with aiohttp.ClientSession() as http:
        keys = {}
        i = 0
        while len(keys) < 2:  # one native key the ring gives to each backend
            before = {b.name: sum(s.method == b"POST" for s in b.requests) for b in (sglang, plain)}
            body = {"text": text(i), "sampling_params": {"max_new_tokens": 2}}
            await send(http, router, "/generate", body)
            for b in (sglang, plain):
                if sum(s.method == b"POST" for s in b.requests) > before[b.name]:
                    keys.setdefault(b.name, body)
            i += 1

        async def batch() -> None:
            for body in keys.values():
                for _ in range(BATCH):
                    await send(http, router, "/generate", body)

        await until_judged(router, sglang.name, "suspect_off", batch)
    stats = {b.name: b for b in await router_stats(router)}
    check = stats[sglang.name].prefix_cache_check
    assert check is not None
    assert check.evidence >= 20
    assert check.hit_tokens == 0
    assert check.query_tokens > 0  # SGLang counts prompt tokens whatever its cache does
    assert stats[plain.name].prefix_cache == "unknown"
    plain_check = stats[plain.name].prefix_cache_check
    assert plain_check is not None
    assert plain_check.reason == "its /metrics could not be read"
    assert plain_check.repeats_answered > 20  # counted, but nothing to judge them against

    # Counters gone from a /metrics that still answers: unknown, not a flat figure.
    engine.exposed = False
    health = router.health
    async with asyncio.timeout(WAIT):
        await health.wait(lambda: health.cache.status(sglang.name) == "unknown")
    assert health.scraped[sglang.name].hits is None


async def router_stats(router: Router) -> list[Any]:
    from router.control.live import RouterControl

    return (await RouterControl(router).stats()).backends


async def test_recovered_then_regressed_engine_is_warned_again(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    (cached,) = await sim_fleet(1, name="on")
    (uncached,) = await sim_fleet(1, name="off", prefix_caching=False)
    router = await start_router([cached, uncached], health=SCRAPING, routing=IN_FLIGHT)
    name, port = uncached.name, uncached.port
    restarted: list[SimServer] = []
    async with aiohttp.ClientSession() as http:
        keys: dict[str, dict[str, Any]] = {}
        i = 0
        while len(keys) < 2:
            body = {"model": "m", "prompt": text(i), "max_tokens": 2}
            keys.setdefault(await send(http, router, "/v1/completions", body), body)
            i += 1

        async def batch() -> None:
            for served_by, body in keys.items():
                for _ in range(BATCH):
                    assert await send(http, router, "/v1/completions", body) == served_by

        async def restart(prefix_caching: bool) -> None:
            # The engine restarts on its port (its counters from 0) with or without
            # its cache; health checks see it go and come back.
            await (restarted[-1] if restarted else uncached).close()
            backend = router.fleet.backends[name]
            async with asyncio.timeout(WAIT):
                await router.health.wait(lambda: not backend.healthy)
            config = dataclasses.replace(uncached.instance.config, prefix_caching=prefix_caching)
            server = SimServer(config, port=port)
            restarted.append(server)
            await server.start()
            async with asyncio.timeout(WAIT):
                await router.health.wait(lambda: backend.healthy)

        try:
            with capture_logs() as logs:
                await until_judged(router, name, "suspect_off", batch)
                await restart(prefix_caching=True)
                await until_judged(router, name, "ok", batch)
                await restart(prefix_caching=False)
                await until_judged(router, name, "suspect_off", batch)
            assert router.health.cache.status(cached.name) == "ok"
        finally:
            for server in restarted:
                await server.close()
    changes = [(e["backend"], e["status"]) for e in logs if e.get("status")]
    assert changes.count((name, "suspect_off")) == 2  # warned again after the recovery
    assert [e["log_level"] for e in logs if e.get("status") == "suspect_off"] == ["warning"] * 2
    assert (cached.name, "suspect_off") not in changes
