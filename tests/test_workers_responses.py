"""Responses API follow-ups under ``serve --workers 2``: an id learnt by one worker is
followed by the other.

The real daemon runs in front of simulated instances that keep Responses API
state per instance (a follow-up elsewhere is a 404).  Every request uses a
connection of its own, so SO_REUSEPORT spreads them over the workers; which
worker answered is read from the ``X-Request-Id`` the router put on the answer
(each process has its own prefix).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from typing import Any

import aiohttp
import openai
import pytest

from router.channel import IDS_PER_PART, Channel, Records, send_ids
from router.responses import ResponseIds
from tests.harness.processes import admin_call, spawn_router, stop
from tests.harness.routers import SimFleet

pytestmark = pytest.mark.timeout(120)

MODEL = "sim-llama-3.1-70b"
# Conversations tried until enough follow-ups crossed workers: with two workers each
# follow-up lands on the other one with probability 1/2, so 64 tries miss 3 by 2^-50.
TRIES = 64


async def responses_stats(http: aiohttp.ClientSession, proc: Any) -> dict[str, int]:
    status, body = await admin_call(http, proc, "GET", "/admin/stats")
    assert status == 200, body
    stats: dict[str, int] = body["responses"]
    return stats


async def propagated(http: aiohttp.ClientSession, proc: Any, learnt: int) -> None:
    """Return once every worker holds the ``learnt`` ids learnt so far.

    The supervisor relays a worker's ids to the others as it receives them and
    keeps them itself (``held``); once it holds them, the next ``Query`` it sends a
    worker comes after the relay on the same channel, and the worker answers in
    order: after that stats call every worker has them.
    """
    async with asyncio.timeout(10):
        while True:
            if (await responses_stats(http, proc))["held"] >= learnt:
                break
            await asyncio.sleep(0.01)  # a poll of a real read, bounded by the timeout
    await responses_stats(http, proc)


def worker_of(headers: Any) -> str:
    request_id: str = headers["x-request-id"]
    return request_id.partition("-")[0]


async def test_a_follow_up_on_the_other_worker_lands_where_the_response_was_made(
    sim_fleet: SimFleet,
) -> None:
    sims = await sim_fleet(4)
    flags = ["--workers", "2", "--strategy", "prefix", "--no-health-checks"]
    for sim in sims:
        flags += ["--backend", f"{sim.name}={sim.url}"]
    proc, port = await spawn_router(*flags)
    crossed = learnt = 0
    try:
        async with (
            aiohttp.ClientSession() as http,
            openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{port}/v1",
                api_key="unused",
                max_retries=0,
                default_headers={"Connection": "close"},  # a connection per request
            ) as via,
        ):
            for i in range(TRIES):
                stream = i % 2 == 1
                raw = await via.responses.with_raw_response.create(
                    model=MODEL, input=f"Conversation {i}", max_output_tokens=2, stream=stream
                )
                parsed = raw.parse()
                if stream:
                    events = [event async for event in parsed]  # type: ignore[union-attr]
                    first = events[0].response.id
                else:
                    first = parsed.id  # type: ignore[union-attr]
                learnt += 1
                await propagated(http, proc, learnt)
                follow = await via.responses.with_raw_response.create(
                    model=MODEL, input="and then?", max_output_tokens=2, previous_response_id=first
                )
                learnt += 1
                assert follow.headers["x-sim-instance"] == raw.headers["x-sim-instance"]
                got = await via.responses.with_raw_response.retrieve(first)
                assert got.headers["x-sim-instance"] == raw.headers["x-sim-instance"]
                crossed += worker_of(follow.headers) != worker_of(raw.headers)
                crossed += worker_of(got.headers) != worker_of(raw.headers)
                if crossed >= 3:
                    break
            assert crossed >= 3
            counts = await responses_stats(http, proc)
            assert counts["misses"] == counts["fallbacks"] == counts["unread"] == 0
            assert counts["hits"] == 2 * (i + 1)
            assert counts["learnt"] == counts["held"] == learnt
    finally:
        await stop(proc)


async def test_restarted_workers_know_the_ids_learnt_before(sim_fleet: SimFleet) -> None:
    """The supervisor keeps every id it relays and hands them to a worker that starts
    anew (after its ``Init``): both workers killed, every follow-up still lands right."""
    sims = await sim_fleet(4)
    flags = ["--workers", "2", "--strategy", "prefix", "--no-health-checks"]
    for sim in sims:
        flags += ["--backend", f"{sim.name}={sim.url}"]
    proc, port = await spawn_router(*flags)
    try:
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}/v1/responses"
            made = {}
            for i in range(8):
                body = {"model": MODEL, "input": f"Conversation {i}", "max_output_tokens": 2}
                async with http.post(url, json=body, headers={"Connection": "close"}) as r:
                    assert r.status == 200
                    made[(await r.json())["id"]] = r.headers["x-sim-instance"]
            await propagated(http, proc, len(made))
            _, stats = await admin_call(http, proc, "GET", "/admin/stats")
            pids = [worker["pid"] for worker in stats["workers"]]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            async with asyncio.timeout(20):
                while True:
                    _, stats = await admin_call(http, proc, "GET", "/admin/stats")
                    workers = stats["workers"]
                    if all(w["up"] and w["pid"] not in pids for w in workers):
                        break
                    await asyncio.sleep(0.05)  # a restart has no event to await from outside
            for first, where in made.items():
                body = {"model": MODEL, "input": "and?", "previous_response_id": first}
                async with http.post(url, json=body, headers={"Connection": "close"}) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["x-sim-instance"] == where
            assert (await responses_stats(http, proc))["hits"] == len(made)
    finally:
        await stop(proc)


async def test_a_starting_worker_gets_the_ids_in_parts_each_within_the_frame_bound() -> None:
    """``send_ids``: Records of IDS_PER_PART, newest first, the next sent once the last
    is on its way; the table moves again at the end.  (10 million ids in one Init,
    ~500 MB, passed the channel's 64 MB bound: a worker could never start.)"""
    table = ResponseIds(3 * IDS_PER_PART)
    learnt = [(f"resp_{i:032x}", f"backend-{i % 3}") for i in range(2 * IDS_PER_PART + 5)]
    table.apply(learnt)
    ours, theirs = socket.socketpair()
    sender, receiver = await Channel.open(ours), await Channel.open(theirs)
    try:
        frozen = table.frozen(IDS_PER_PART, newest_first=True)
        sending = asyncio.create_task(send_ids(sender, frozen))
        got: list[tuple[str, str]] = []
        while len(got) < len(learnt):
            message = await receiver.receive()
            assert isinstance(message, Records)
            assert (message.records, message.seed) == ([], True)
            assert len(message.responses) <= IDS_PER_PART
            got += [tuple(pair) for pair in message.responses]
        await sending
        assert got == learnt[::-1]  # newest first: a worker full already keeps the newest
        table.learn("resp_new", "backend-0")  # thawed: the table moves again
        assert table.snapshot()[-1] == ("resp_new", "backend-0")
    finally:
        sender.close()
        receiver.close()
