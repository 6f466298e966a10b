"""The fair admission queue (router.queue) through the real router, in process.

A gated backend holds every request until the test lets it go, one at a
time, so the order in which queued requests reach it is exactly the order the
router admitted them: that is the fairness the tests read.  Overload runs
against simulated instances.  Clients are the official ``openai`` client (no
retries: a 429 is what the test wants to see) and raw sockets where a client
must vanish.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from loadtests.simserver import Timing
from router.app import Router
from tests.harness.backends import Backend, Seen, StartBackend, hold
from tests.harness.http import response
from tests.harness.processes import ADMIN_PORTS, spawn_router, stop
from tests.harness.routers import SimFleet, StartRouter

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-llama-3.1-70b"
# One request in flight per backend, counted until its answer ends.
ONE_AT_A_TIME = {
    "RoutingStrategy": "PREFIX_AWARE",
    "PrefixAwareRoutingConfig": {
        "ConcurrencyThreshold": 1,
        "BalanceMode": "IN_FLIGHT",
        "ConcurrencyScope": "IN_FLIGHT",
    },
}


def completion(seen: Seen) -> bytes:
    body = json.loads(seen.body)
    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": body["model"],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": body["prompt_cache_key"]},
                "finish_reason": "stop",
            }
        ],
    }
    return json.dumps(answer).encode()


class Gate:
    """A backend handler that answers each request only when ``open_one`` lets it."""

    def __init__(self) -> None:
        self.arrived: list[str] = []  # tenants, in the order their requests reached it
        self.waiting: list[asyncio.Event] = []
        self.changed = asyncio.Event()

    async def __call__(self, backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.method != b"POST":  # health checks
            writer.write(response(200, b"{}", [(b"Content-Type", b"application/json")]))
            return True
        gate = asyncio.Event()
        self.arrived.append(json.loads(seen.body)["prompt_cache_key"])
        self.waiting.append(gate)
        self.changed.set()
        await gate.wait()
        writer.write(response(200, completion(seen), [(b"Content-Type", b"application/json")]))
        return True

    def open_one(self) -> None:
        self.waiting.pop(0).set()

    def open_all(self) -> None:
        while self.waiting:
            self.open_one()

    async def until(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(10):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


async def until(predicate: Callable[[], bool]) -> None:
    """Return once ``predicate`` holds: the router runs in this loop, each turn moves it on."""
    async with asyncio.timeout(10):
        while True:
            if predicate():
                return
            await asyncio.sleep(0)


def client(router: Router) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0
    )


async def ask(via: openai.AsyncOpenAI, tenant: str, text: str = "same prompt") -> str:
    done = await via.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        extra_body={"prompt_cache_key": tenant},
    )
    content = done.choices[0].message.content
    assert content is not None
    return content


def queue_of(router: Router) -> Any:
    assert router.queue is not None
    return router.queue


async def test_saturated_requests_are_admitted_round_robin_by_tenant(
    backends: StartBackend, start_router: StartRouter
) -> None:
    gate = Gate()
    backend = await backends(gate)
    router = await start_router([backend.spec], routing=ONE_AT_A_TIME, admission={"queue": True})
    queue = queue_of(router)
    async with client(router) as via:
        tasks = [asyncio.create_task(ask(via, "heavy", f"h{i}")) for i in range(6)]
        await gate.until(lambda: len(gate.arrived) == 1)
        await until(lambda: queue.depth == 5)
        tasks += [asyncio.create_task(ask(via, "light", f"l{i}")) for i in range(2)]
        await until(lambda: queue.depth == 7)
        for n in range(2, 9):
            gate.open_one()
            await gate.until(lambda n=n: len(gate.arrived) == n)  # type: ignore[misc]
        gate.open_all()
        answers = await asyncio.gather(*tasks)
    # FIFO would be heavy x6 then light x2; round robin serves light between heavies.
    assert gate.arrived == ["heavy", "heavy", "light", "heavy", "light", "heavy", "heavy", "heavy"]
    assert sorted(answers) == ["heavy"] * 6 + ["light"] * 2
    assert queue.depth == 0
    await router.wait_quiet()
    assert router.fleet.loads.total == 0


async def test_weights_give_a_tenant_its_share_of_the_places(
    backends: StartBackend, start_router: StartRouter
) -> None:
    gate = Gate()
    backend = await backends(gate)
    router = await start_router(
        [backend.spec],
        routing=ONE_AT_A_TIME,
        admission={"queue": True, "weights": {"gold": 2.0}},
    )
    queue = queue_of(router)
    async with client(router) as via:
        tasks = [asyncio.create_task(ask(via, "first", "x"))]
        await gate.until(lambda: len(gate.arrived) == 1)
        tasks += [asyncio.create_task(ask(via, "basic", f"b{i}")) for i in range(3)]
        await until(lambda: queue.depth == 3)
        tasks += [asyncio.create_task(ask(via, "gold", f"g{i}")) for i in range(6)]
        await until(lambda: queue.depth == 9)
        for n in range(2, 11):
            gate.open_one()
            await gate.until(lambda n=n: len(gate.arrived) == n)  # type: ignore[misc]
        gate.open_all()
        await asyncio.gather(*tasks)
    assert gate.arrived[1:] == ["basic", "gold", "gold"] * 3


async def test_a_full_tenant_queue_is_answered_429_with_retry_after(
    backends: StartBackend, start_router: StartRouter
) -> None:
    gate = Gate()
    backend = await backends(gate)
    router = await start_router(
        [backend.spec],
        routing=ONE_AT_A_TIME,
        admission={"queue": True, "max_queued_per_tenant": 2},
    )
    queue = queue_of(router)
    async with client(router) as via:
        tasks = [asyncio.create_task(ask(via, "a", f"{i}")) for i in range(3)]
        await until(lambda: queue.depth == 2)
        with pytest.raises(openai.RateLimitError) as caught:
            await ask(via, "a", "one too many")
        # Another tenant still has its own places.
        other = asyncio.create_task(ask(via, "b", "mine"))
        await until(lambda: queue.depth == 3)
        for n in range(2, 5):
            gate.open_one()
            await gate.until(lambda n=n: len(gate.arrived) == n)  # type: ignore[misc]
        gate.open_all()
        await asyncio.gather(*tasks, other)
    error = caught.value
    assert error.status_code == 429
    retry_after = error.response.headers["retry-after"]
    assert retry_after.isdigit()
    assert 1 <= int(retry_after) <= 30
    body = error.response.json()
    assert body["error"]["code"] == "queue_full"
    assert body["error"]["type"] == "rate_limit_error"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    rejected = dict(router.tenants.items())
    assert sum(series.rejected[0] for series in rejected.values()) == 1


async def test_the_wait_bound_answers_429(
    backends: StartBackend, start_router: StartRouter
) -> None:
    gate = Gate()
    backend = await backends(gate)
    router = await start_router(
        [backend.spec],
        routing=ONE_AT_A_TIME,
        admission={"queue": True, "max_wait": 0.05},
    )
    async with client(router) as via:
        first = asyncio.create_task(ask(via, "a", "held"))
        await gate.until(lambda: len(gate.arrived) == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            await ask(via, "b", "waits too long")
        gate.open_all()
        await first
    assert caught.value.response.json()["error"]["code"] == "queue_timeout"
    assert caught.value.response.headers["retry-after"] == "1"
    assert queue_of(router).depth == 0


async def test_a_client_that_leaves_while_queued_frees_its_place_at_once(
    backends: StartBackend, start_router: StartRouter
) -> None:
    gate = Gate()
    backend = await backends(gate)
    router = await start_router(
        [backend.spec],
        routing=ONE_AT_A_TIME,
        admission={"queue": True, "max_queued_per_tenant": 1},
    )
    queue = queue_of(router)
    async with client(router) as via:
        held = asyncio.create_task(ask(via, "a", "held"))
        await gate.until(lambda: len(gate.arrived) == 1)
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x"}],
                "prompt_cache_key": "a",
            }
        ).encode()
        _, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await until(lambda: queue.depth == 1)
        writer.close()
        await until(lambda: queue.depth == 0)
        # Its place is free: the tenant's next request queues instead of a 429.
        again = asyncio.create_task(ask(via, "a", "again"))
        await until(lambda: queue.depth == 1)
        gate.open_all()
        await gate.until(lambda: len(gate.arrived) == 2)
        gate.open_all()
        assert await again == "a"
        await held
    assert gate.arrived == ["a", "a"]  # the one that left never reached the backend


async def test_off_keeps_the_least_loaded_fallback(
    backends: StartBackend, start_router: StartRouter
) -> None:
    gate = Gate()
    backend = await backends(gate)
    router = await start_router([backend.spec], routing=ONE_AT_A_TIME)
    assert router.queue is None
    async with client(router) as via:
        tasks = [asyncio.create_task(ask(via, "a", f"{i}")) for i in range(3)]
        await gate.until(lambda: len(gate.arrived) == 3)  # all three at once: fallback
        gate.open_all()
        await asyncio.gather(*tasks)
    assert router.recorder.decisions["fallback"] == 2


async def test_overload_loses_no_request_and_memory_stays_bounded(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(
        2, timing=Timing(time_scale=0.01, request_overhead_s=0.5, decode_s_per_token=0.1)
    )
    router = await start_router(
        sims,
        routing={"PrefixAwareRoutingConfig": {"ConcurrencyThreshold": 2}},
        admission={"queue": True, "max_queued_per_tenant": 8, "max_queued": 20},
    )
    queue = queue_of(router)
    peak = 0

    def watch() -> None:
        nonlocal peak
        peak = max(peak, queue.depth)

    statuses: list[int] = []

    async def one(via: openai.AsyncOpenAI, tenant: str, i: int) -> None:
        try:
            await ask(via, tenant, f"{tenant} {i} " + "doc " * 50)
            statuses.append(200)
        except openai.RateLimitError as exc:
            statuses.append(429 if int(exc.response.headers["retry-after"]) >= 1 else 0)
        watch()

    async with client(router) as via:
        tenants = ["t0", "t1", "t2", "t3"]
        await asyncio.gather(*(one(via, tenants[i % 4], i) for i in range(240)))
    assert len(statuses) == 240  # every request answered: 200 or 429, nothing else
    assert set(statuses) <= {200, 429}
    assert statuses.count(200) >= 4  # the fleet worked through its share
    assert 429 in statuses
    assert peak <= 20
    await router.wait_quiet()
    assert queue.depth == 0
    assert queue.tenants == 0
    assert not queue._pools
    assert router.fleet.loads.total == 0
    assert router.fleet.waiting.total == 0


REQUESTS = 48
QUEUE_DEPTH = re.compile(r"^prefix_router_queue_depth (\S+)$", re.M)


async def test_two_workers_keep_the_bounds_and_admit_across_workers(
    backends: StartBackend, tmp_path: Path
) -> None:
    """Each worker queues its own clients against the fleet-wide count: with one
    place in the fleet and 2 places per tenant per worker, at most 2 + 2 x 2 of
    REQUESTS requests of one tenant are admitted or queued, the rest are 429 at
    once; once the backend answers, every queued request is admitted, also those
    whose worker learns of the free place only from the other worker's row (a
    fold: without that wake they would wait for max_wait, past the test's
    timeout).  SO_REUSEPORT gives each worker at least 3 of the 48 connections
    but with a chance below 10^-11: both queue."""
    backend = await backends(hold)
    config = tmp_path / "router.toml"
    config.write_text("[admission]\nqueue = true\nmax_queued_per_tenant = 2\nmax_wait = 60.0\n")
    proc, port = await spawn_router(
        "--config",
        str(config),
        "--workers",
        "2",
        "--strategy",
        "prefix",
        "--concurrency-threshold",
        "1",
        "--concurrency-scope",
        "IN_FLIGHT",
        "--balance-mode",
        "IN_FLIGHT",
        "--no-health-checks",
        "--backend",
        "{}={}".format(*backend.spec),
    )
    answers: list[tuple[int, dict[str, Any], str | None]] = []
    try:
        async with aiohttp.ClientSession() as http:

            async def post(i: int) -> None:
                async with http.post(
                    f"http://127.0.0.1:{port}/generate",
                    data=f"prompt {i}",
                    headers={"X-Amzn-SageMaker-Prefix-Aware-Id": "one", "Connection": "close"},
                ) as resp:
                    body = await resp.json(content_type=None)
                    answers.append((resp.status, body, resp.headers.get("Retry-After")))

            tasks = [asyncio.create_task(post(i)) for i in range(REQUESTS)]

            async def depth() -> int:
                url = f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics"
                async with http.get(url) as resp:
                    found = QUEUE_DEPTH.search(await resp.text())
                assert found is not None
                return int(float(found.group(1)))

            # Every request is answered 429, held by the backend or queued (read
            # through /metrics, which asks both workers: a real read each time).
            async with asyncio.timeout(30):
                while True:
                    if len(answers) + len(backend.heads) + await depth() >= REQUESTS:
                        break
                    await asyncio.sleep(0.05)
            held, queued = len(backend.heads), await depth()
            backend.release.set()
            await asyncio.gather(*tasks)
    finally:
        await stop(proc)
    statuses = [status for status, _, _ in answers]
    assert len(statuses) == REQUESTS
    assert set(statuses) <= {200, 429}
    # The fleet-wide bound: 1 in flight (2 if both workers decided within one fold
    # period), at most 2 queued per worker.
    assert held <= 2
    assert queued == 4  # both workers queued their 2
    assert statuses.count(200) == held + queued
    assert statuses.count(429) >= REQUESTS - 2 - 4
    for status, body, retry_after in answers:
        if status == 429:
            assert body["error"]["code"] == "queue_full"  # no wait bound passed
            assert retry_after is not None
            assert int(retry_after) >= 1


@pytest.mark.parametrize(
    ("section", "value", "path"),
    [
        ("admission", {"max_wait": 0}, "$.admission.max_wait"),
        ("admission", {"max_queued_per_tenant": 0}, "$.admission.max_queued_per_tenant"),
        ("admission", {"weights": {"gold": 0.0}}, "$.admission.weights"),
        ("tenants", {"metrics_top": -1}, "$.tenants.metrics_top"),
        ("tenants", {"header": "bad header"}, "$.tenants.header"),
        ("tenants", {"label_key": "short"}, "$.tenants.label_key"),
    ],
)
def test_bad_admission_and_tenant_settings_name_their_field(
    section: str, value: dict[str, Any], path: str
) -> None:
    from router.config import ConfigError, build_config

    with pytest.raises(ConfigError, match=re.escape(path)):
        build_config({section: value})
