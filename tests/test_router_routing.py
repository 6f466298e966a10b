"""Routing decisions end to end: tenants, bounded loads, failover, leases."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import aiohttp
import pytest

from hashring import Placement, hash_key, tenant_seed
from router.app import Router
from router.balancer import Balancer
from router.explain import DryRequest, explain
from router.extract import decode_openai, prompt_key
from tests.harness.routers import SimFleet, StartRouter, sagemaker

SYSTEM = "Warehouse robot safety manual, section 4: lifting limits. " * 100


def chat(question: str, system: str = SYSTEM, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        **extra,
    }


def key_of(router: Router, body: dict[str, Any]) -> int:
    """The routing key hash the router will use for this body (computed independently)."""
    request = decode_openai(json.dumps(body).encode())
    limit = router.balancer.config.prefix_aware.prefix_length
    return hash_key(prompt_key(request, limit), tenant_seed(request.prompt_cache_key))


def walk_of(router: Router, body: dict[str, Any]) -> list[str]:
    """The preference walk the router will use for this body."""
    return list(router.fleet.ring.walk(key_of(router, body)))


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, str, dict[str, Any]]:
    async with http.post(url, json=body, headers=headers) as resp:
        payload = await resp.json()
        return resp.status, resp.headers.get("x-sim-instance", ""), payload


async def test_tenant_keys_separate_the_same_prompt_deterministically(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(4)
    router = await start_router(sims, routing=sagemaker())
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        placement = {}
        for tenant in range(50):
            body = chat("Can I lift 40 kg?", prompt_cache_key=f"tenant-{tenant}")
            _, first, _ = await post(http, url, body)
            _, again, _ = await post(
                http, url, chat("Other question", prompt_cache_key=f"tenant-{tenant}")
            )
            assert first == again  # deterministic per tenant, whatever the question
            assert first == walk_of(router, body)[0]
            placement[tenant] = first
        assert len(set(placement.values())) >= 3, Counter(placement.values())

        # Native requests take the tenant from the SageMaker header.
        native = f"http://127.0.0.1:{router.port}/invocations"
        doc = {"inputs": "Shared contract text. " * 300}
        spots = Counter()
        for tenant in range(50):
            header = {"X-Amzn-SageMaker-Prefix-Aware-Id": f"customer-{tenant}"}
            _, first, _ = await post(http, native, doc, header)
            _, again, _ = await post(http, native, doc, header)
            assert first == again
            spots[first] += 1
        assert len(spots) >= 3, spots


async def test_bad_tenant_keys_are_rejected_with_400(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(1)
    router = await start_router(sims)
    base = f"http://127.0.0.1:{router.port}"
    async with aiohttp.ClientSession() as http:
        status, _, body = await post(
            http, base + "/v1/chat/completions", chat("q", prompt_cache_key="k" * 65)
        )
        assert status == 400
        assert body["error"]["param"] == "prompt_cache_key"
        assert "at most 64" in body["error"]["message"]
        status, _, body = await post(
            http,
            base + "/invocations",
            {"inputs": "x"},
            {"X-Amzn-SageMaker-Prefix-Aware-Id": "t" * 70},
        )
        assert status == 400
        assert "x-amzn-sagemaker-prefix-aware-id" in body["error"]["message"]
        assert "t" * 70 not in body["error"]["message"]  # never echo the key
        # Other traffic is unaffected.
        status, instance, _ = await post(http, base + "/v1/chat/completions", chat("q"))
        assert (status, instance) == (200, "sim-0")


async def wait_running(router: Router, sims: list[Any], expected: dict[str, int]) -> None:
    by_name = {s.name: s for s in sims}
    async with asyncio.timeout(10):
        for name, count in expected.items():
            await by_name[name].instance.wait_for(lambda e, c=count: e.running + e.waiting == c)


class Held:
    """Requests of one key held in flight on instances that answer late: ``send``
    posts one and waits until it runs on ``target``; ``release`` sends the clients
    away and waits for every lease to come back."""

    def __init__(
        self, http: aiohttp.ClientSession, router: Router, sims: list[Any], walk: list[str]
    ):
        self.http, self.router, self.sims = http, router, sims
        self.url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
        self.expected = dict.fromkeys(walk, 0)
        self.tasks: list[asyncio.Task[Any]] = []

    async def send(self, target: str, question: str) -> None:
        # Different questions, same prefix: the same key.
        self.tasks.append(asyncio.create_task(post(self.http, self.url, chat(question))))
        self.expected[target] += 1
        await wait_running(self.router, self.sims, self.expected)

    async def release(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        async with asyncio.timeout(10):
            await self.router.wait_quiet()


async def test_concurrency_threshold_overflows_along_the_walk_then_falls_back(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    # Every instance holds its requests for a long time, so they stay in flight.
    sims = await sim_fleet(4, extra_ttft_s=30)
    router = await start_router(sims, routing=sagemaker(ConcurrencyThreshold=2))
    walk = walk_of(router, chat("q"))
    async with aiohttp.ClientSession() as http:
        held = Held(http, router, sims, walk)
        try:
            for i, target in enumerate([walk[0], walk[0], walk[1], walk[1], walk[2], walk[2]]):
                await held.send(target, f"question {i}")
            backends = router.fleet.backends
            assert backends[walk[1]].overflow == 2  # always the next one of the walk
            assert backends[walk[2]].overflow == 2
            assert dict(router.fleet.loads.counts) == {walk[0]: 2, walk[1]: 2, walk[2]: 2}
            for i in range(2):
                await held.send(walk[3], f"more {i}")
            # Everyone is at the threshold: fallback to the least loaded, first in the walk.
            await held.send(walk[0], "one too many")
            assert backends[walk[0]].fallback == 1
            assert router.fleet.loads.total == 9
        finally:
            await held.release()  # the clients went away: every lease comes back
    assert router.fleet.loads.total == 0
    assert dict(router.fleet.loads.counts) == {}


async def test_deep_past_the_threshold_a_saturated_key_keeps_its_walk_within_the_tolerance(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    # One key, threshold 1, three instances that hold every request.  Just past the
    # threshold the fallback takes the fewest in flight, earliest on ties; from a
    # queue of 2 past it, a member within half that queue of the least loaded
    # counts as least loaded too (hashring.bounded.FALLBACK_TOLERANCE), so the key
    # stays on the first member of its walk where exact ties would move it on.
    sims = await sim_fleet(3, extra_ttft_s=30)
    router = await start_router(sims, routing=sagemaker(ConcurrencyThreshold=1))
    walk = walk_of(router, chat("q"))
    w0, w1, w2 = walk
    async with aiohttp.ClientSession() as http:
        held = Held(http, router, sims, walk)
        try:
            # Primary, two overflows, then fallback round by round: all at 3 in flight.
            # Then at 3 each (a queue of 2): up to 4 count as least loaded, twice w0.
            for i, target in enumerate([w0, w1, w2] * 3 + [w0, w0, w1]):
                await held.send(target, f"question {i}")
            assert dict(router.fleet.loads.counts) == {w0: 5, w1: 4, w2: 3}
            backends = router.fleet.backends
            assert [backends[m].fallback for m in walk] == [4, 3, 2]
            # The dry run (POST /admin/route) of the next one: w2 is the least loaded
            # (3, a queue of 2), so up to 4 count and w1 is the earliest of those.
            dry = DryRequest("POST", "/v1/chat/completions", body=json.dumps(chat("q")))
            answer = explain(router, dry)
            assert (answer.backend, answer.decision) == (w1, "fallback"), answer
            assert "the earliest of the walk among the least loaded" in answer.reason
        finally:
            await held.release()
    assert router.fleet.loads.total == 0


@pytest.mark.parametrize(("scope", "spread"), [("IN_FLIGHT", [0, 1, 2]), ("PREFILL", [0, 0, 0])])
async def test_concurrency_scope_prefill_counts_only_requests_not_yet_answered(
    sim_fleet: SimFleet, start_router: StartRouter, scope: str, spread: list[int]
) -> None:
    # Streams that decode for a long time after their first token.
    sims = await sim_fleet(3, extra_token_s=30)
    routing = {"ConcurrencyThreshold": 1, "ConcurrencyScope": scope}
    router = await start_router(sims, routing={"PrefixAwareRoutingConfig": routing})
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    walk = walk_of(router, chat("q"))
    streams: list[aiohttp.ClientResponse] = []
    async with aiohttp.ClientSession() as http:
        try:
            for i in range(3):
                resp = await http.post(url, json=chat(f"question {i}", stream=True))
                streams.append(resp)
                assert resp.status == 200
                assert (await resp.content.readline()).startswith(b"data: ")  # first token
            # IN_FLIGHT: a decoding stream holds its slot, the next request overflows.
            # PREFILL: it stopped counting at its first token, the key stays on walk[0].
            assert [r.headers["x-sim-instance"] for r in streams] == [walk[i] for i in spread]
            assert router.fleet.loads.total == 3
            assert router.fleet.waiting.total == 0
        finally:
            for resp in streams:
                resp.close()
    async with asyncio.timeout(10):
        await router.wait_quiet()
    assert router.fleet.loads.total == 0


async def test_balance_mode_traffic_serves_one_hot_prefix_from_every_instance(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    # Every request shares one system prompt (the hot-spot case). The key is placed
    # on one home; as soon as the evidence says it carries more than 1.5
    # instances' shares (a Chernoff bound, see hashring.placement), it is served
    # by replicas along its walk.
    sims = await sim_fleet(3)
    routing = {"BalanceMode": "TRAFFIC", "ConcurrencyScope": "PREFILL"}
    router = await start_router(sims, routing={"PrefixAwareRoutingConfig": routing})
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    gate = asyncio.Semaphore(6)

    async def one(i: int) -> tuple[int, str, dict[str, Any]]:
        async with gate:
            return await post(http, url, chat(f"question {i}"))

    async with aiohttp.ClientSession() as http:
        # One at a time: every decision sees no request in flight, so the live
        # router's choices must be exactly those of the placement on its own.
        first = [await one(i) for i in range(1120)]
        # And under concurrency, nothing fails and the replicas share the load.
        concurrent = await asyncio.gather(*(one(i) for i in range(1120, 1420)))
    assert all(status == 200 for status, _, _ in first + concurrent)
    home = first[0][1]
    assert {instance for _, instance, _ in first[:7]} == {home}  # hot at the 8th
    replay = Placement(Balancer.DEFAULT_TRAFFIC_FACTOR)
    key = key_of(router, chat("any question"))
    expected = [replay.route(router.fleet.ring, key, {}, 10).member for _ in range(1120)]
    assert [instance for _, instance, _ in first] == expected
    # Ties go to the replica with the fewest recent requests, so the home rests
    # until the others have caught up; from then on all three share it evenly.
    assert set(expected[7:14]) == {s.name for s in sims} - {home}
    shares = Counter(expected[120:]).values()
    assert len(shares) == 3
    assert max(shares) - min(shares) <= 2
    assert len({instance for _, instance, _ in concurrent}) >= 2
    placement = router.balancer._placement
    assert placement is not None
    assert placement.home(key_of(router, chat("any question"))) == home  # it kept its home


async def test_a_stopped_instance_is_routed_around_without_client_errors(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(3)
    router = await start_router(sims, routing=sagemaker())
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    body = chat("where do I go?")
    walk = walk_of(router, body)
    async with aiohttp.ClientSession() as http:
        status, instance, _ = await post(http, url, body)
        assert (status, instance) == (200, walk[0])
        primary = next(s for s in sims if s.name == walk[0])
        await primary.close()
        for i in range(5):
            status, instance, _ = await post(http, url, chat(f"still there {i}?"))
            assert (status, instance) == (200, walk[1])
    assert router.fleet.backends[walk[0]].errors >= 1


async def test_every_backend_down_is_a_502_and_no_backend_a_503(
    start_router: StartRouter,
) -> None:
    # Ports that refuse connections: bind, note the port, close.
    refused = []
    for _ in range(2):
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        refused.append(server.sockets[0].getsockname()[1])
        server.close()
        await server.wait_closed()
    router = await start_router([(f"dead-{p}", f"http://127.0.0.1:{p}") for p in refused])
    empty = await start_router([])
    async with aiohttp.ClientSession() as http:
        status, _, body = await post(
            http, f"http://127.0.0.1:{router.port}/v1/completions", {"prompt": "x"}
        )
        assert status == 502
        assert body["error"]["type"] == "bad_gateway"
        status, _, body = await post(
            http, f"http://127.0.0.1:{empty.port}/v1/completions", {"prompt": "x"}
        )
        assert status == 503
        assert "no backend" in body["error"]["message"]


async def test_a_client_leaving_mid_stream_frees_its_lease_and_the_backend_slot(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(2, extra_token_s=0.05)
    router = await start_router(sims)
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        resp = await http.post(url, json=chat("stream please", stream=True, max_tokens=500))
        assert resp.status == 200
        first = await resp.content.readline()
        assert first.startswith(b"data: ")
        assert router.fleet.loads.total == 1
        resp.close()  # the client goes away mid-stream
    async with asyncio.timeout(10):
        await router.wait_quiet()
        for sim in sims:
            await sim.instance.wait_idle()  # the router aborted its upstream request
    assert router.fleet.loads.total == 0
