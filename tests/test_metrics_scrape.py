"""/metrics and /admin/stats of a large fleet: complete, exact, read several at once,
and built in slices that give the loop back (the figure of the stall:
loadtests/bench_scrape.py).

The real ``Router`` with 600 backends (all at one recording server on 127.0.0.1,
so that every request is answered wherever the ring sends it), the admin API on
127.0.0.1, scraped over HTTP and read with prometheus-client's own parser.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from admin import AdminServer
from router.app import Router
from router.control.live import VIEW_SLICE, RouterControl
from router.metrics import LINES
from tests.harness.backends import StartBackend, echo
from tests.harness.discovery import post
from tests.harness.routers import StartRouter

T = TypeVar("T")
BACKENDS = 600
REQUESTS = 240
PER_BACKEND = (  # families with one series per backend
    "prefix_router_in_flight",
    "prefix_router_backend_healthy",
    "prefix_router_backend_draining",
    "prefix_router_backend_weight",
    "prefix_router_overflow",
    "prefix_router_fallback",
    "prefix_router_backend_errors",
    "prefix_router_backend_prefix_cache_suspect",
)


@pytest.fixture
async def fleet(
    backends: StartBackend, start_router: StartRouter
) -> AsyncIterator[tuple[Router, RouterControl, str]]:
    server = await backends(echo)
    specs = [{"name": f"b{i:04d}", "url": server.url, "weight": 1 + i % 3} for i in range(BACKENDS)]
    # 16 virtual nodes a backend, not 1,024: what is read here is per backend, and
    # a ring of 1.2 M points took ~2 s to build per test alone, 10-14 s in the suite.
    router = await start_router(specs, health={"active": False}, vnodes=16)
    control = RouterControl(router)
    admin = AdminServer(control, token=None)
    await admin.start("127.0.0.1", 0)
    try:
        yield router, control, f"http://127.0.0.1:{admin.port}"
    finally:
        await admin.close()
        await control.close()


async def send_requests(router: Router) -> None:
    """``REQUESTS`` requests of distinct keys, all answered."""
    statuses = Counter(
        await asyncio.gather(*(post(router, b"key %d" % i) for i in range(REQUESTS)))
    )
    assert statuses == {200: REQUESTS}


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return await resp.text()


def families(text: str) -> dict[str, list[Sample]]:
    found: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        assert family.name not in found, f"{family.name} written twice"
        found[family.name] = family.samples
    return found


def assert_histograms_whole(samples: list[Sample]) -> dict[str, float]:
    """Each backend's +Inf bucket is its count (read in one step); the counts."""
    counts = {s.labels["backend"]: s.value for s in samples if s.name.endswith("_count")}
    top = {
        s.labels["backend"]: s.value
        for s in samples
        if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"
    }
    assert top == counts
    return counts


async def test_every_backend_is_in_every_family_and_concurrent_scrapes_agree(
    fleet: tuple[Router, RouterControl, str],
) -> None:
    router, _, url = fleet
    await send_requests(router)

    async with aiohttp.ClientSession() as http:
        texts = await asyncio.gather(*(scrape(http, url) for _ in range(4)))
    assert len(set(texts)) == 1  # nothing changed between them: the same text
    assert texts[0].encode() == router.collector.render()  # and the one-step render's
    found = families(texts[0])

    names = {f"b{i:04d}" for i in range(BACKENDS)}
    for family in PER_BACKEND:
        assert {s.labels["backend"] for s in found[family]} == names, family
    weights = {s.labels["backend"]: s.value for s in found["prefix_router_backend_weight"]}
    assert weights == {name: b.weight for name, b in router.fleet.backends.items()}

    served = {
        s.labels["backend"]: s.value
        for s in found["prefix_router_requests"]
        if s.name.endswith("_total")
    }
    assert sum(served.values()) == REQUESTS
    assert served == {name: b.requests for name, b in router.fleet.backends.items() if b.requests}
    assert assert_histograms_whole(found["prefix_router_ttft_seconds"]) == served
    assert found["prefix_router_ring_members"][0].value == BACKENDS


async def test_scrapes_during_traffic_each_read_a_whole_fleet(
    fleet: tuple[Router, RouterControl, str],
) -> None:
    router, _, url = fleet
    async with aiohttp.ClientSession() as http:
        results = await asyncio.gather(
            *(post(router, b"during %d" % i) for i in range(REQUESTS)),
            *(scrape(http, url) for _ in range(3)),
        )
    assert all(status == 200 for status in results[:REQUESTS])
    for text in results[REQUESTS:]:
        assert isinstance(text, str)
        found = families(text)
        for family in PER_BACKEND:
            assert len(found[family]) == BACKENDS, family
        total = sum(s.value for s in found["prefix_router_requests"] if s.name.endswith("_total"))
        ttft = sum(
            s.value for s in found["prefix_router_ttft_seconds"] if s.name.endswith("_count")
        )
        # Each a value the router had (families are read a slice of the loop apart,
        # so the two need not agree with each other while requests end).
        assert 0 <= total <= REQUESTS
        assert 0 <= ttft <= REQUESTS
        assert_histograms_whole(found["prefix_router_ttft_seconds"])


async def turns_during(call: Awaitable[T]) -> tuple[T, int]:
    """``call``'s result and how many times another task ran while it did."""
    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    task = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    try:
        before = turns
        result = await call
        return result, turns - before
    finally:
        task.cancel()


async def test_a_scrape_gives_the_loop_back_while_it_writes(
    fleet: tuple[Router, RouterControl, str],
) -> None:
    """Other tasks run during one render, at least once per ``LINES`` lines."""
    _, control, _ = fleet
    text, during = await turns_during(control.metrics())
    lines = text.count(b"\n")
    assert lines > 9 * BACKENDS  # a line a backend in each of 9 families, at least
    assert during >= lines // LINES // 2


async def test_admin_stats_of_a_large_fleet_is_whole_and_gives_the_loop_back(
    fleet: tuple[Router, RouterControl, str],
) -> None:
    router, control, url = fleet
    await send_requests(router)
    async with aiohttp.ClientSession() as http:

        async def get(path: str) -> Any:
            async with http.get(url + path) as resp:
                assert resp.status == 200
                return await resp.json()

        stats, listed = await asyncio.gather(get("/admin/stats"), get("/admin/backends"))
    views = stats["backends"]
    assert [v["name"] for v in views] == sorted(router.fleet.backends)
    assert {v["name"]: v["requests"] for v in views} == {
        name: b.requests for name, b in router.fleet.backends.items()
    }
    assert sum(v["requests"] for v in views) == stats["totals"]["requests"] == REQUESTS
    assert sum(v["share"] for v in views) == pytest.approx(1.0)
    assert [v["name"] for v in listed] == [v["name"] for v in views]

    result, during = await turns_during(control.stats())
    assert len(result.backends) == BACKENDS
    assert during >= BACKENDS // VIEW_SLICE - 1
