"""Membership churn under load, driven through the admin API.

For ``CHURN_SECONDS`` (10), once a second, an instance is added and another
drained and removed (``DELETE ?wait=true``), a weight changes or a drain is
cancelled; every fifth second an instance is killed without draining (its
``FaultProxy`` resets every connection and refuses new ones) and revived the
next second on the same port, for the health checks to bring back.  Meanwhile
an open generator sends ``CHURN_RATE`` (250) requests a second, streaming and
not.  The only failures allowed are the documented ones: requests in flight on
an instance at the moment it was killed.  Everything else must complete and be
correct, every drain must finish without being forced, and no lease may leak.

    CHURN_SECONDS=300 CHURN_RATE=300 pytest tests/test_churn.py -o timeout=900 -s
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from admin import AdminServer
from loadtests.faultproxy import FaultProxy
from loadtests.simserver.model import filler_pieces
from router.app import Router
from router.control.live import RouterControl
from tests.harness.backends import Backend, Seen, echo
from tests.harness.http import connect, quiet, req
from tests.harness.routers import FAST, SimFleet, StartRouter

CHURN_SECONDS = float(os.environ.get("CHURN_SECONDS", "10"))
CHURN_RATE = int(os.environ.get("CHURN_RATE", "250"))
WAIT = 5.0
TOKEN = "churn-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEALTH = {
    "interval": 0.1,
    # A killed instance refuses connections at once; the timeout only has to
    # outlast a busy loop (the load keeps one core near full).
    "timeout": 2.0,
    "healthy_threshold": 2,
    "unhealthy_threshold": 2,
    "passive_failures": 3,
    "backoff_initial": 0.1,
    "backoff_max": 0.4,
}


@dataclass
class Admin:
    url: str
    http: aiohttp.ClientSession
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with asyncio.timeout(30):
            async with self.http.request(method, self.url + path, json=body, headers=AUTH) as resp:
                self.statuses[method, resp.status] += 1
                return resp.status, await resp.json()


StartAdmin = Callable[[Router], Awaitable[Admin]]


@pytest.fixture
async def start_admin() -> AsyncIterator[StartAdmin]:
    """The admin API in-process: ``AdminServer`` over ``RouterControl``, token required."""
    running: list[tuple[AdminServer, RouterControl, aiohttp.ClientSession]] = []

    async def start(router: Router) -> Admin:
        control = RouterControl(router)
        server = AdminServer(control, token=TOKEN)
        session = aiohttp.ClientSession()
        running.append((server, control, session))
        await server.start("127.0.0.1", 0)
        return Admin(f"http://127.0.0.1:{server.port}", session)

    yield start
    for server, control, session in running:
        await session.close()
        await server.close()
        await control.close()


# -- the load ------------------------------------------------------------------------------


@dataclass
class Load:
    """An open generator: ``rate`` requests a second, each checked and classified."""

    url: str
    rate: int
    sent: int = 0
    ok: int = 0
    served: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)  # by the backend that failed it
    failures: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    async def run(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        connector = aiohttp.TCPConnector(limit=256)
        async with aiohttp.ClientSession(connector=connector) as http:
            start = loop.time()
            total = int(seconds * self.rate)
            for i in range(total):
                due = start + i / self.rate
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())  # the generator's rate, not a sync
                task = asyncio.create_task(self.one(http, i))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            async with asyncio.timeout(60):
                await asyncio.gather(*tasks)

    async def one(self, http: aiohttp.ClientSession, i: int) -> None:
        self.sent += 1
        stream = i % 2 == 0
        # One stream in 20 lasts ~2 s, so that drains take a while and can be cancelled.
        max_tokens = 400 if i % 20 == 0 else 2 + i % 5
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": f"Knowledge base {i % 40}. " * 40},
                {"role": "user", "content": f"question {i}"},
            ],
            "max_tokens": max_tokens,
            "stream": stream,
        }
        backend = ""
        try:
            async with asyncio.timeout(30), http.post(self.url, json=body) as resp:
                backend = resp.headers.get("x-sim-instance", "")
                payload = await resp.read()
                if resp.status != 200:
                    message = json.loads(payload)["error"]["message"]
                    named = re.search(r"backend (\S+) ", message)
                    self.fail(named[1] if named else "", f"{resp.status}: {message}")
                    return
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
            self.fail(backend, f"truncated: {exc!r}")
            return
        except TimeoutError:
            self.violations.append(f"request {i}: no answer within 30 s")
            return
        expected = "".join(filler_pieces(max_tokens))
        if stream:
            events = [line[6:] for line in payload.split(b"\n") if line.startswith(b"data: ")]
            if events[-1:] != [b"[DONE]"]:
                self.violations.append(f"request {i}: complete HTTP, unfinished stream")
                return
            chunks = [json.loads(e)["choices"] for e in events[:-1]]
            text = "".join(c[0]["delta"].get("content") or "" for c in chunks if c)
        else:
            text = json.loads(payload)["choices"][0]["message"]["content"]
        if text != expected:
            self.violations.append(f"request {i}: wrong text {text!r}")
            return
        self.ok += 1
        self.served[backend] += 1

    def fail(self, backend: str, what: str) -> None:
        self.failed[backend] += 1
        self.failures.append(f"{backend}: {what}")


# -- churn -----------------------------------------------------------------------------------


@pytest.mark.serial  # 250 requests/s for 10 s: ~0.8 of a core
@pytest.mark.timeout(CHURN_SECONDS * 4 + 60)  # the session-wide 60 s would end the whole run
async def test_membership_churn_under_load_fails_only_requests_on_killed_instances(
    sim_fleet: SimFleet, start_router: StartRouter, start_admin: StartAdmin
) -> None:
    sims = await sim_fleet(6, timing=FAST, extra_token_s=0.005)  # 5 ms a streamed token
    proxies = {s.name: FaultProxy(("127.0.0.1", s.port)) for s in sims}
    rng = random.Random(20261129)
    try:
        for proxy in proxies.values():
            await proxy.start()
        names = sorted(proxies)
        members = set(names[:4])
        router = await start_router([(n, proxies[n].url) for n in sorted(members)], health=HEALTH)
        admin = await start_admin(router)
        load = Load(f"http://127.0.0.1:{router.port}/v1/chat/completions", CHURN_RATE)
        traffic = asyncio.create_task(load.run(CHURN_SECONDS))

        spares = set(names) - members
        draining: dict[str, int] = {}  # name -> the second its drain began
        drains: list[asyncio.Task[tuple[int, Any]]] = []
        killed: set[str] = set()
        allowed: Counter[str] = Counter()  # requests in flight on an instance when killed
        operations: Counter[str] = Counter()

        async def drain(name: str) -> tuple[int, Any]:
            result = await admin.call("DELETE", f"/admin/backends/{name}?wait=true&timeout=20")
            draining.pop(name, None)
            if result[0] == 200:
                members.discard(name)
                spares.add(name)
            return result

        loop = asyncio.get_running_loop()
        start = loop.time()
        second = 0
        while not traffic.done() and second < CHURN_SECONDS:
            second += 1
            await asyncio.sleep(max(0.0, start + second - loop.time()))  # the churn's period
            for name in list(killed):  # revived a second after the kill, same port
                await proxies[name].start()
                killed.discard(name)
                operations["revive"] += 1
            active = sorted(members - set(draining) - killed)
            if spares:
                name = rng.choice(sorted(spares))
                status, body = await admin.call(
                    "POST", "/admin/backends", {"name": name, "url": proxies[name].url}
                )
                assert status == 201, body
                spares.discard(name)
                members.add(name)
                operations["add"] += 1
            kill_due = second % 5 == 0
            # A drain's length depends on the machine's speed: on a kill's second none
            # starts, so that the kill does not depend on how many drains have ended.
            if len(active) > 2 and not kill_due:
                name = rng.choice(active)
                draining[name] = second
                drains.append(asyncio.create_task(drain(name)))
                operations["drain and remove"] += 1
                active.remove(name)
            if kill_due and len(active) >= 2:
                name = rng.choice(active)
                allowed[name] += router.fleet.loads.get(name)
                proxies[name].kill()  # no drain: its requests in flight fail
                killed.add(name)
                operations["kill"] += 1
            elif second % 3 == 0 and active:
                name = rng.choice(active)
                status, _ = await admin.call("PATCH", f"/admin/backends/{name}", {"weight": 2})
                assert status == 200
                operations["weight"] += 1
            elif second % 4 == 0 and (old := sorted(n for n, s in draining.items() if s < second)):
                # Cancel a drain that began a second ago or more (one cancelled before its
                # task ever ran is test_a_drain_cancelled_at_once_still_answers_its_delete):
                # back to active, and its DELETE answers 409.
                name = rng.choice(old)
                status, _ = await admin.call(
                    "PATCH", f"/admin/backends/{name}", {"state": "active"}
                )
                if status == 200:
                    operations["drain cancelled"] += 1
        await traffic
        for name in killed:
            await proxies[name].start()
        async with asyncio.timeout(30):
            results = await asyncio.gather(*drains)
        await quiet(router)

        print(
            f"\nchurn {CHURN_SECONDS:g} s at {CHURN_RATE}/s: sent {load.sent}, ok {load.ok},"
            f" failed {sum(load.failed.values())} {dict(load.failed)},"
            f" allowed {dict(allowed)}; operations {dict(operations)};"
            f" admin {dict(admin.statuses)}"
        )
        assert load.violations == []
        assert load.sent == int(CHURN_SECONDS * CHURN_RATE)
        assert load.ok + sum(load.failed.values()) == load.sent  # every request accounted for
        for name, count in load.failed.items():
            assert count <= allowed[name], (name, load.failures)
        for status, body in results:
            if status == 200:
                assert body["forced"] is False, body  # every drain finished on its own
            else:
                assert status == 409  # cancelled by a PATCH back to active
        assert operations["add"] >= CHURN_SECONDS // 2
        assert operations["drain and remove"] >= CHURN_SECONDS // 2
        assert operations["kill"] >= CHURN_SECONDS // 10
        assert len(load.served) == len(names)  # every instance took traffic at some point

        status, stats = await admin.call("GET", "/admin/stats")
        assert (status, stats["totals"]["in_flight"]) == (200, 0)
        async with admin.http.get(admin.url + "/metrics", headers=AUTH) as resp:
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        assert all(s.value == 0 for s in families["prefix_router_in_flight"].samples)
        assert router.fleet.loads.total == 0
    finally:
        for proxy in proxies.values():
            await proxy.close()


# -- races of the control plane, one at a time ---------------------------------------------------


async def test_a_drain_cancelled_at_once_still_answers_its_delete(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    from router.control import BackendPatch, Conflict

    sims = await sim_fleet(2)
    router = await start_router(sims)
    control = RouterControl(router)
    try:
        deleting = asyncio.create_task(control.remove_backend("sim-0", timeout=5, wait=True))
        await asyncio.sleep(0)  # one loop turn: the DELETE has started its drain task
        await control.update_backend("sim-0", BackendPatch(state="active"))
        with pytest.raises(Conflict):
            async with asyncio.timeout(2):  # correct code answers at once
                await deleting
    finally:
        await control.close()
        deleting.cancel()
    assert "sim-0" in router.fleet.backends


async def test_a_request_left_on_a_force_removed_backend_still_gets_an_answer(
    start_router: StartRouter,
) -> None:
    release = asyncio.Event()

    async def hold_then_close(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        if seen.target == b"/warm":
            return await echo(backend, seen, writer)
        await release.wait()  # the backend goes away without answering
        return False

    backend = Backend(hold_then_close, "leaving")
    await backend.start()
    # A short first_byte: the stuck exchange ends with its timer, as a 504, within the test.
    router = await start_router([backend.spec], timeouts={"first_byte": 2.0})
    control = RouterControl(router)
    try:
        async with connect(router) as client:
            await client.send(req(b"GET", b"/warm"))
            assert (await client.response()).status == 200  # a pooled connection now
            await client.send(req(b"POST", b"/v1/completions", body=b'{"prompt": "x"}'))
            await backend.wait_for(lambda: len(backend.requests) == 2)
            view = await control.remove_backend("leaving", timeout=0.05, wait=True)
            assert view.forced  # the request was still in flight
            release.set()
            resp = await client.response()  # bounded by WAIT
            assert resp.status in (502, 503), resp  # not the 504 of a request left hanging
    finally:
        release.set()
        await control.close()
        await backend.close()
    await quiet(router)
