"""Responses API follow-ups through the real router, with the official ``openai`` client.

The simulated instances keep Responses API state per instance, as vLLM does
(``loadtests/simserver/responses.py``): a follow-up, GET, DELETE or cancel of a
response that lands on another instance is a 404.  So a follow-up that
succeeds is one the router sent where its state is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import openai
import pytest

from tests.harness.routers import SimFleet, StartRouter, sagemaker

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-llama-3.1-70b"
CONVERSATIONS = 8


def client(router: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0
    )


async def create(via: openai.AsyncOpenAI, **fields: Any) -> tuple[str, str]:
    """A non-streaming create: (response id, the instance that answered)."""
    raw = await via.responses.with_raw_response.create(model=MODEL, max_output_tokens=4, **fields)
    return raw.parse().id, raw.headers["x-sim-instance"]


async def create_streaming(via: openai.AsyncOpenAI, **fields: Any) -> tuple[str, str]:
    async with via.responses.with_streaming_response.create(
        model=MODEL, max_output_tokens=4, stream=True, **fields
    ) as raw:
        instance = raw.headers["x-sim-instance"]
        events = [event async for event in await raw.parse()]
    assert events[0].type == "response.created"
    assert events[-1].type == "response.completed"
    return events[0].response.id, instance


async def waiting(router: Any, response_id: str, count: int) -> None:
    """Return once ``count`` requests wait for ``response_id`` (the client's requests
    reach the router in this same loop: each turn of it moves them on)."""
    async with asyncio.timeout(10):
        while True:
            if router.responses.waiting(response_id) >= count:
                return
            await asyncio.sleep(0)


STRATEGIES = [
    pytest.param({"RoutingStrategy": "PREFIX_AWARE", **sagemaker()}, id="prefix"),
    pytest.param({"RoutingStrategy": "RANDOM"}, id="random"),
    pytest.param({"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}, id="least"),
]


@pytest.mark.parametrize("routing", STRATEGIES)
async def test_follow_ups_and_calls_by_id_land_where_the_response_was_made(
    sim_fleet: SimFleet, start_router: StartRouter, routing: dict[str, Any]
) -> None:
    sims = await sim_fleet(4)
    router = await start_router(sims, routing=routing, seed=7)
    async with client(router) as via:
        for i in range(CONVERSATIONS):
            make = create_streaming if i % 2 else create
            first, where = await make(via, input=f"Conversation {i}: what is a rocket?")
            # Another input, so the prefix rule alone would send it elsewhere.
            second, there = await create(
                via, input=f"{i}: and a comet?", previous_response_id=first
            )
            third, again = await create_streaming(
                via, input="and a star?", previous_response_id=second
            )
            assert where == there == again
            raw = await via.responses.with_raw_response.retrieve(first)
            assert raw.headers["x-sim-instance"] == where
            assert raw.parse().id == first
            with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous"):
                await via.responses.cancel(second)  # the instance knows it: not a 404
            await via.responses.delete(third)
        with pytest.raises(openai.NotFoundError):  # deleted there, asked there
            await via.responses.retrieve(third)
    counts = router.responses.counts()
    # Two follow-ups, a GET, a cancel and a DELETE per conversation, and the last GET.
    assert counts["hits"] == 5 * CONVERSATIONS + 1
    assert counts["learnt"] == 3 * CONVERSATIONS
    assert (counts["misses"], counts["fallbacks"], counts["unread"]) == (0, 0, 0)


async def test_without_the_feature_follow_ups_fail_on_other_instances(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    """The same conversations as above with ``limits.response_ids = 0``: the prefix rule
    alone sends some follow-ups to instances that do not hold the state."""
    sims = await sim_fleet(4)
    router = await start_router(
        sims, routing={"RoutingStrategy": "PREFIX_AWARE", **sagemaker()}, limits={"response_ids": 0}
    )
    failed = []
    async with client(router) as via:
        for i in range(CONVERSATIONS):
            first, _ = await create(via, input=f"Conversation {i}: what is a rocket?")
            try:
                await create(via, input=f"{i}: and a comet?", previous_response_id=first)
            except openai.NotFoundError as exc:
                failed.append((first, exc.message))
    assert failed
    assert all(f"Response with id '{first}' not found." in message for first, message in failed)
    assert router.responses.counts()["learnt"] == 0


async def test_unknown_ids_and_lost_backends_fall_back_to_the_prefix_rule(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(3)
    router = await start_router(sims, routing={"RoutingStrategy": "PREFIX_AWARE", **sagemaker()})
    async with client(router) as via:
        # An id no backend produced: routed by its prompt, and the engine's 404 comes back.
        with pytest.raises(openai.NotFoundError):
            await create(via, input="hello", previous_response_id="resp_nobody")
        with pytest.raises(openai.NotFoundError):
            await via.responses.retrieve("resp_nobody")
        assert router.responses.counts()["misses"] == 2

        # The backend that holds a response goes down: the follow-up is routed by its
        # prompt instead (the state went with the backend; here the instance is only
        # marked down, so whichever instance gets it answers 404 unless it is the same).
        first, where = await create(via, input="What is a rocket?")
        router.fleet.set_healthy(where, False)
        await router.fleet.settled()
        with pytest.raises(openai.NotFoundError):
            await create(via, input="and a comet?", previous_response_id=first)
        assert router.responses.counts()["fallbacks"] == 1
        router.fleet.set_healthy(where, True)
        await router.fleet.settled()
        _, there = await create(via, input="and a comet?", previous_response_id=first)
        assert there == where
    assert router.responses.counts()["hits"] == 1
    metrics = router.collector.render().decode()
    for line in (
        'prefix_router_response_follow_ups_total{result="hit"} 1.0',
        'prefix_router_response_follow_ups_total{result="miss"} 2.0',
        'prefix_router_response_follow_ups_total{result="fallback"} 1.0',
        "prefix_router_response_ids_learnt_total 2.0",
        "prefix_router_response_ids 2.0",
    ):
        assert line in metrics.splitlines(), line


async def test_an_unknown_id_waits_for_another_process_to_share_it(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    """With shared ids (several workers), a follow-up can beat its id to this process:
    it waits for the id (``apply``), bounded by ``wait_s``, then takes the prefix rule."""
    sims = await sim_fleet(3)
    maker = await start_router(sims, routing={"RoutingStrategy": "PREFIX_AWARE", **sagemaker()})
    router = await start_router(sims, routing={"RoutingStrategy": "PREFIX_AWARE", **sagemaker()})
    router.responses.share(wait_s=60.0)  # as a worker does; no timer fires in this test
    async with client(maker) as made, client(router) as via:
        first, where = await create(made, input="What is a rocket?")
        follow = asyncio.ensure_future(
            create(via, input="and a comet?", previous_response_id=first)
        )
        fetch = asyncio.ensure_future(via.responses.retrieve(first))
        await waiting(router, first, 2)  # both: nothing in flight, nothing counted yet
        assert router.fleet.loads.total == 0
        router.responses.apply([(first, where)])  # as a worker applies the others' ids
        assert (await follow)[1] == where
        assert (await fetch).id == first
        assert router.responses.counts()["hits"] == 2

        # A client that leaves while waiting leaves nothing behind.
        gone = asyncio.ensure_future(via.responses.retrieve("resp_later"))
        await waiting(router, "resp_later", 1)
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        await router.wait_quiet()
        assert router.responses.waiting("resp_later") == 0

        # An id that never comes: a miss once the wait is over, then the prefix rule.
        router.responses.wait_s = 0.001
        with pytest.raises(openai.NotFoundError):
            await via.responses.retrieve("resp_never")
    assert router.responses.counts()["misses"] == 1


async def test_many_requests_waiting_for_one_unknown_id_leave_in_linear_time(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    """Any unknown id makes a request wait (shared ids): clients that send many for
    one id and leave newest first.  Before, each leave scanned a list of the id's
    waiters: quadratic, 5,000 of them held the loop 0.71 s, 20,000 13.4 s."""
    sims = await sim_fleet(1)
    router = await start_router(sims)
    router.responses.share(wait_s=60.0)  # as a worker does; no timer fires in this test
    # Real clients: 300 connections, each a GET for the same unknown id, then gone.
    writers = []
    for _ in range(300):
        _, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(b"GET /v1/responses/resp_bogus HTTP/1.1\r\nHost: r\r\n\r\n")
        writers.append(writer)
    await waiting(router, "resp_bogus", 300)
    for writer in reversed(writers):
        writer.transport.abort()
    async with asyncio.timeout(10):
        while True:  # each turn of the loop moves the router on
            if not router.responses.waiting("resp_bogus"):
                break
            await asyncio.sleep(0)
    await router.wait_quiet()
    # At scale, the same leaves as those clients' exchanges make them: 100,000.
    callbacks = [_Waiter().routed for _ in range(100_000)]
    for callback in callbacks:
        router.responses.wait("resp_bogus", callback)
    # Linear: well under a second.  Quadratic took minutes: the test's timeout ends it
    # (no assertion on time: a paused VM must not fail it).
    started = time.perf_counter()
    for callback in reversed(callbacks):
        router.responses.unwait("resp_bogus", callback)
    print(f"\n100,000 waiters of one id left in {(time.perf_counter() - started) * 1000:.0f} ms")
    assert router.responses.waiting("resp_bogus") == 0
    assert router.responses.counts()["misses"] == 0  # nobody waited it out


class _Waiter:
    def routed(self) -> None:
        raise AssertionError("the id never comes")
