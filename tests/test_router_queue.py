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
import time
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from loadtests.simserver import Timing
from router.app import Router
from router.explain import DryRequest, explain
from tests.harness.backends import Backend, Seen, StartBackend
from tests.harness.http import response
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
        self.waiting: list[tuple[str, asyncio.Event]] = []  # (tenant, its gate), in order
        self.changed = asyncio.Event()

    async def __call__(self, backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.method != b"POST":  # health checks
            writer.write(response(200, b"{}", [(b"Content-Type", b"application/json")]))
            return True
        gate = asyncio.Event()
        tenant = json.loads(seen.body)["prompt_cache_key"]
        self.arrived.append(tenant)
        self.waiting.append((tenant, gate))
        self.changed.set()
        await gate.wait()
        writer.write(response(200, completion(seen), [(b"Content-Type", b"application/json")]))
        return True

    def open_one(self, tenant: str | None = None) -> None:
        """Answer the request that arrived first (of ``tenant``, if given)."""
        for i, (whose, _) in enumerate(self.waiting):
            if tenant is None or whose == tenant:
                self.waiting.pop(i)[1].set()
                return
        raise AssertionError(f"no request of {tenant!r} is waiting")

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


def chat(tenant: str, text: str) -> str:
    """The body ``ask`` sends, as text."""
    messages = [{"role": "user", "content": text}]
    return json.dumps({"model": MODEL, "messages": messages, "prompt_cache_key": tenant})


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


Gated = Callable[..., Awaitable[tuple[Gate, Router]]]


@pytest.fixture
def gated(backends: StartBackend, start_router: StartRouter) -> Gated:
    """``gate, router = await gated(places, **admission)``: ``places`` gated backends
    (one request in flight each) behind a router with the admission queue on."""

    async def start(places: int = 1, **admission: Any) -> tuple[Gate, Router]:
        gate = Gate()
        specs = [(await backends(gate)).spec for _ in range(places)]
        router = await start_router(
            specs, routing=ONE_AT_A_TIME, admission={"queue": True, **admission}
        )
        return gate, router

    return start


async def answered(gate: Gate, tasks: list[asyncio.Task[str]], tenant: str, done: int) -> None:
    """Answer ``tenant``'s first waiting request and wait until ``done`` of ``tasks``
    are: the release it made has been pumped by the time its client reads the end."""
    gate.open_one(tenant)
    await until(lambda: sum(task.done() for task in tasks) == done)


async def open_in_turn(gate: Gate, upto: int) -> None:
    """Answer the requests one at a time until ``upto`` have reached the backends."""
    for n in range(len(gate.arrived) + 1, upto + 1):
        gate.open_one()
        await gate.until(lambda n=n: len(gate.arrived) == n)  # type: ignore[misc]


async def test_saturated_requests_are_admitted_round_robin_by_tenant(gated: Gated) -> None:
    gate, router = await gated()
    queue = queue_of(router)
    async with client(router) as via:
        tasks = [asyncio.create_task(ask(via, "heavy", f"h{i}")) for i in range(6)]
        await gate.until(lambda: len(gate.arrived) == 1)
        await until(lambda: queue.depth == 5)
        tasks += [asyncio.create_task(ask(via, "light", f"l{i}")) for i in range(2)]
        await until(lambda: queue.depth == 7)
        await open_in_turn(gate, 8)
        gate.open_all()
        answers = await asyncio.gather(*tasks)
    # FIFO would be heavy x6 then light x2; round robin serves light between heavies.
    assert gate.arrived == ["heavy", "heavy", "light", "heavy", "light", "heavy", "heavy", "heavy"]
    assert sorted(answers) == ["heavy"] * 6 + ["light"] * 2
    assert queue.depth == 0
    await router.wait_quiet()
    assert router.fleet.loads.total == 0


async def test_weights_give_a_tenant_its_share_of_the_places(gated: Gated) -> None:
    gate, router = await gated(weights={"gold": 2.0})
    queue = queue_of(router)
    async with client(router) as via:
        tasks = [asyncio.create_task(ask(via, "first", "x"))]
        await gate.until(lambda: len(gate.arrived) == 1)
        tasks += [asyncio.create_task(ask(via, "basic", f"b{i}")) for i in range(3)]
        await until(lambda: queue.depth == 3)
        tasks += [asyncio.create_task(ask(via, "gold", f"g{i}")) for i in range(6)]
        await until(lambda: queue.depth == 9)
        await open_in_turn(gate, 10)
        gate.open_all()
        await asyncio.gather(*tasks)
    assert gate.arrived[1:] == ["basic", "gold", "gold"] * 3


async def test_the_reserve_keeps_a_place_for_a_tenant_under_its_share(gated: Gated) -> None:
    """Three places, ``reserve = 1``.  A tenant alone takes every place; once a
    tenant under its share is active, the one over its share may not take the
    last free place: it stays free for the other, whose request takes it at
    once; the heavy one is admitted when a place past the reserve frees up.
    (The plain queue would have sent h3 where l1 went.)"""
    gate, router = await gated(3, reserve=1)
    queue = queue_of(router)
    async with client(router) as via:
        tasks = [asyncio.create_task(ask(via, "heavy", f"h{i}")) for i in range(3)]
        await gate.until(lambda: len(gate.arrived) == 3)  # alone: nothing held back
        tasks.append(asyncio.create_task(ask(via, "light", "l0")))
        await until(lambda: queue.depth == 1)
        await answered(gate, tasks, "heavy", 1)  # light, the only one waiting, takes its place
        await gate.until(lambda: len(gate.arrived) == 4)
        tasks.append(asyncio.create_task(ask(via, "heavy", "h3")))
        await until(lambda: queue.depth == 1)
        await answered(gate, tasks, "heavy", 2)  # one place free, the reserve: h3 stays
        assert queue.depth == 1
        tasks.append(asyncio.create_task(ask(via, "light", "l1")))
        await gate.until(lambda: len(gate.arrived) == 5)  # straight into the reserve
        assert queue.depth == 1
        await answered(gate, tasks, "heavy", 3)  # one free again: still the reserve
        assert queue.depth == 1
        await answered(gate, tasks, "light", 4)  # two free: h3 takes one
        await gate.until(lambda: len(gate.arrived) == 6)
        gate.open_all()
        await asyncio.gather(*tasks)
    assert gate.arrived == ["heavy"] * 3 + ["light", "light", "heavy"]
    assert queue.depth == 0


async def test_the_reserve_lapses_a_window_after_the_last_tenant_under_its_share(
    gated: Gated,
) -> None:
    """Two places, ``reserve = 1``, a 2 s share window: a request held back for a
    tenant that then sends nothing more is admitted when the window ends, with no
    place freed meanwhile (a timer: without it, it would wait ``max_wait``, past
    the test's timeout).  Fails only if two consecutive steps below are 2 s apart."""
    gate, router = await gated(2, reserve=1, share_window=2.0, max_wait=60.0)
    queue = queue_of(router)
    async with client(router) as via:
        tasks = [asyncio.create_task(ask(via, "heavy", f"h{i}")) for i in range(2)]
        await gate.until(lambda: len(gate.arrived) == 2)
        tasks.append(asyncio.create_task(ask(via, "light", "l0")))
        await until(lambda: queue.depth == 1)
        await answered(gate, tasks, "heavy", 1)  # l0 takes the place: the reserve is wanted
        await gate.until(lambda: len(gate.arrived) == 3)
        await answered(gate, tasks, "light", 2)
        # The dry run says why heavy's next request would wait with a place free.
        dry = explain(
            router, DryRequest("POST", "/v1/chat/completions", body=chat("heavy", "h2")), 3
        )
        assert dry.admission == "wait"
        assert dry.reason.startswith("no more places are free than the reserve (1)")
        tasks.append(asyncio.create_task(ask(via, "heavy", "h2")))
        await until(lambda: queue.depth == 1)  # one place free: the reserve
        await gate.until(lambda: len(gate.arrived) == 4)  # the window ended
        gate.open_all()
        await asyncio.gather(*tasks)
    assert gate.arrived == ["heavy", "heavy", "light", "heavy"]


async def test_a_full_tenant_queue_is_answered_429_with_retry_after(gated: Gated) -> None:
    gate, router = await gated(max_queued_per_tenant=2)
    queue = queue_of(router)
    async with client(router) as via:
        tasks = [asyncio.create_task(ask(via, "a", f"{i}")) for i in range(3)]
        await until(lambda: queue.depth == 2)
        with pytest.raises(openai.RateLimitError) as caught:
            await ask(via, "a", "one too many")
        # Another tenant still has its own places.
        other = asyncio.create_task(ask(via, "b", "mine"))
        await until(lambda: queue.depth == 3)
        await open_in_turn(gate, 4)
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


async def test_the_wait_bound_answers_429(gated: Gated) -> None:
    gate, router = await gated(max_wait=0.05)
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


async def test_a_client_that_leaves_while_queued_frees_its_place_at_once(gated: Gated) -> None:
    gate, router = await gated(max_queued_per_tenant=1)
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


@pytest.mark.parametrize(
    ("section", "value", "path"),
    [
        ("admission", {"max_wait": 0}, "$.admission.max_wait"),
        ("admission", {"max_queued_per_tenant": 0}, "$.admission.max_queued_per_tenant"),
        ("admission", {"weights": {"gold": 0.0}}, "$.admission.weights"),
        ("admission", {"reserve": -1}, "$.admission.reserve"),
        ("admission", {"share_window": 0}, "$.admission.share_window"),
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


class _Waiting:
    """What the queue reads of a waiting request (``Exchange``'s queue side), nothing more."""

    def __init__(self, tenant: str) -> None:
        self.tenant_key = tenant
        self.pool = None
        self.timer: asyncio.TimerHandle | None = None

    def queue_entered(self, now: float, timer: asyncio.TimerHandle) -> None:
        self.timer = timer

    def admit(self, now: float) -> bool:
        return False  # the fleet stays saturated

    def members(self) -> None:
        return None


@pytest.mark.parametrize("tenants", [1, 100_000])
async def test_100000_waiting_requests_leave_in_any_order_in_linear_time(
    gated: Gated, tenants: int
) -> None:
    # 100,000 requests wait (one tenant each, or all of one tenant), then their
    # clients go away newest first, as a mass disconnect can.  Before, each leave
    # scanned the tenant's FIFO and the round-robin list: quadratic, minutes of CPU
    # here (4,000 real clients closing together: 0.27 s of it in one loop pass).
    gate, router = await gated(max_queued=100_000, max_queued_per_tenant=100_000, max_wait=60)
    queue = queue_of(router)
    async with client(router) as via:
        held = asyncio.create_task(ask(via, "held", "held"))  # the only place, taken
        await gate.until(lambda: len(gate.arrived) == 1)
        waiting = [_Waiting(f"t{i % tenants}") for i in range(100_000)]
        for request in waiting:
            assert queue.enter(request)  # type: ignore[arg-type]
        await until(lambda: not queue._scheduled)  # the pump ran: still saturated
        assert queue.depth == 100_000
        # Linear: ~0.1 s here.  Quadratic took minutes: the test's timeout ends it (no
        # assertion on time: a paused VM must not fail it).
        started = time.perf_counter()
        for request in reversed(waiting):
            queue.leave(request)  # type: ignore[arg-type]
            assert request.timer is not None
            request.timer.cancel()
        took = time.perf_counter() - started
        print(f"\n{tenants} tenant(s): 100,000 leaves in {took * 1000:.0f} ms")
        assert queue.depth == 0
        assert queue.tenants == 0
        assert not queue._pools
        gate.open_all()
        assert await held == "held"
