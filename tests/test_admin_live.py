"""The control plane end to end: admin HTTP calls change a router that carries load."""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from admin import AdminServer
from router.app import Router
from router.control.live import RouterControl
from tests.harness.routers import SimFleet, StartRouter, sagemaker

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Admin:
    url: str
    http: aiohttp.ClientSession

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with self.http.request(method, self.url + path, json=body, headers=AUTH) as resp:
            return resp.status, await resp.json()


StartAdmin = Callable[[Router], Awaitable[Admin]]


@pytest.fixture
async def start_admin() -> AsyncIterator[StartAdmin]:
    servers: list[tuple[AdminServer, RouterControl]] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(router: Router) -> Admin:
        control = RouterControl(router)
        server = AdminServer(control, token=TOKEN)
        servers.append((server, control))
        await server.start("127.0.0.1", 0)
        session = aiohttp.ClientSession()
        sessions.append(session)
        return Admin(f"http://127.0.0.1:{server.port}", session)

    yield start
    for session in sessions:
        await session.close()
    for server, control in servers:
        await server.close()
        await control.close()


@dataclass
class Load:
    """A bounded open generator: ``workers`` loops send chat requests until told to stop."""

    url: str
    statuses: Counter[int] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)

    def answered(self, status: int) -> None:
        self.statuses[status] += 1
        done = sum(self.statuses.values())
        for target, future in self.waiters:
            if done >= target and not future.done():
                future.set_result(None)

    async def run(self, workers: int = 8, limit: int = 6000) -> None:
        counter = itertools.count()
        async with aiohttp.ClientSession() as http:

            async def worker() -> None:
                while not self.stop.is_set():
                    i = next(counter)
                    if i >= limit:
                        return
                    body = {
                        "model": "m",
                        "messages": [
                            {"role": "system", "content": f"Knowledge base {i % 40}. " * 60},
                            {"role": "user", "content": f"question {i}"},
                        ],
                        "max_tokens": 2,
                        "stream": i % 2 == 0,
                    }
                    try:
                        async with http.post(self.url, json=body) as resp:
                            payload = await resp.read()
                            self.answered(resp.status)
                            if resp.status != 200:
                                self.failures.append(payload.decode(errors="replace")[:200])
                            else:
                                self.served[resp.headers["x-sim-instance"]] += 1
                    except aiohttp.ClientError as exc:
                        self.failures.append(repr(exc))

            await asyncio.gather(*(worker() for _ in range(workers)))

    async def until(self, requests: int) -> None:
        """Wait until at least ``requests`` more answers have come back."""
        future = asyncio.get_running_loop().create_future()
        self.waiters.append((sum(self.statuses.values()) + requests, future))
        async with asyncio.timeout(30):
            await future


async def test_membership_weights_drain_and_routing_change_live_without_failures(
    sim_fleet: SimFleet, start_router: StartRouter, start_admin: StartAdmin
) -> None:
    sims = await sim_fleet(4)
    router = await start_router(sims[:3])
    admin = await start_admin(router)
    load = Load(f"http://127.0.0.1:{router.port}/v1/chat/completions")
    traffic = asyncio.create_task(load.run())
    try:
        await load.until(150)
        status, body = await admin.call(
            "POST", "/admin/backends", {"name": sims[3].name, "url": sims[3].url, "weight": 1}
        )
        assert status == 201, body
        await load.until(150)
        status, body = await admin.call("PATCH", f"/admin/backends/{sims[0].name}", {"weight": 3})
        assert (status, body["weight"]) == (200, 3)
        await load.until(150)
        routing = {
            "RoutingConfig": {
                "RoutingStrategy": "PREFIX_AWARE",
                "PrefixAwareRoutingConfig": {"PrefixLength": 2048, "ConcurrencyThreshold": 3},
            }
        }
        status, body = await admin.call("PUT", "/admin/routing", routing)
        assert status == 200, body
        await load.until(150)
        served_before = load.served[sims[1].name]
        status, body = await admin.call("DELETE", f"/admin/backends/{sims[1].name}?wait=true")
        assert (status, body["state"]) == (200, "removed"), body
        assert body["forced"] is False  # its requests finished within the drain
        served_after_removal = load.served[sims[1].name]
        await load.until(300)
    finally:
        load.stop.set()
        await traffic
    status, body = await admin.call("GET", "/admin/stats")
    assert status == 200
    assert load.failures == []
    assert set(load.statuses) == {200}
    assert sum(load.statuses.values()) >= 900
    assert load.served[sims[3].name] > 0  # the added instance took traffic
    assert load.served[sims[1].name] == served_after_removal >= served_before
    names = sorted(b["name"] for b in body["backends"])
    assert names == sorted([sims[0].name, sims[2].name, sims[3].name])
    assert body["totals"]["requests"] == sum(load.statuses.values())
    assert router.balancer.config.prefix_aware.concurrency_threshold == 3
    by_name = {b["name"]: b for b in body["backends"]}
    assert by_name[sims[3].name]["requests"] == load.served[sims[3].name]
    assert by_name[sims[0].name]["ttft_p50_ms"] is not None
    assert body["decisions"]["primary"] + body["decisions"]["overflow"] >= 900

    # Prometheus agrees with what the clients saw.
    async with admin.http.get(admin.url + "/metrics", headers=AUTH) as resp:
        assert resp.status == 200
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    requests = families["prefix_router_requests"].samples
    assert sum(s.value for s in requests if s.name.endswith("_total")) == sum(
        load.statuses.values()
    )
    assert {s.labels["status"] for s in requests} == {"200"}
    assert all(s.value == 0 for s in families["prefix_router_in_flight"].samples)
    assert families["prefix_router_ring_members"].samples[0].value == 3
    ttft_count = [
        s for s in families["prefix_router_ttft_seconds"].samples if s.name.endswith("_count")
    ]
    assert sum(s.value for s in ttft_count) == sum(load.statuses.values())
    for name in (
        "prefix_router_overflow",
        "prefix_router_fallback",
        "prefix_router_backend_healthy",
    ):
        assert families[name].samples


async def placements(url: str, prompts: list[str]) -> dict[str, str]:
    """Where each prompt goes: native requests, 8 at a time, below the default
    ConcurrencyThreshold of 10, so no request overflows and placement is the ring's."""
    placed: dict[str, str] = {}
    gate = asyncio.Semaphore(8)
    async with aiohttp.ClientSession() as http:

        async def one(prompt: str) -> None:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 1}}
            async with gate, http.post(url, json=body) as resp:
                assert resp.status == 200
                await resp.read()
                placed[prompt] = resp.headers["x-sim-instance"]

        await asyncio.gather(*(one(p) for p in prompts))
    return placed


async def test_growing_4_to_5_moves_only_the_newcomers_share_and_removing_moves_it_back(
    sim_fleet: SimFleet, start_router: StartRouter, start_admin: StartAdmin
) -> None:
    sims = await sim_fleet(5)
    router = await start_router(sims[:4], routing=sagemaker())
    admin = await start_admin(router)
    url = f"http://127.0.0.1:{router.port}/invocations"
    prompts = [f"distinct document {i}: " + "lorem ipsum " * 10 for i in range(1000)]
    before = await placements(url, prompts)
    assert set(before.values()) == {s.name for s in sims[:4]}

    status, _ = await admin.call("POST", "/admin/backends", {"name": "sim-4", "url": sims[4].url})
    assert status == 201
    grown = await placements(url, prompts)
    moved = [p for p in prompts if grown[p] != before[p]]
    assert 0.10 <= len(moved) / len(prompts) <= 0.30, len(moved)
    assert {grown[p] for p in moved} == {"sim-4"}  # every moved key went to the newcomer

    status, body = await admin.call("DELETE", "/admin/backends/sim-4?wait=true")
    assert (status, body["state"]) == (200, "removed")
    assert await placements(url, prompts) == before
