"""Is prefix caching on?  The real router process in front of a simulated fleet with
one instance started without a prefix cache, driven as an operator would: the
official ``openai`` client for traffic, the log, ``/admin/stats`` and ``/metrics``.

With ``--workers 2`` every request comes on a connection of its own, so SO_REUSEPORT
spreads them over both workers: the repeated-key counts the check judges on are the
workers' added up by the supervisor.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from loadtests.simserver import SimServer
from tests.harness.http import WAIT
from tests.harness.processes import ADMIN_PORTS, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet

pytestmark = pytest.mark.timeout(120)

BATCH = 10  # requests per instance between two reads of /admin/stats


def document(i: int) -> str:
    """A system prompt of ~6,000 bytes: the whole routing key (PrefixLength 4,096)."""
    return f"Handbook {i}.\n" + " ".join(f"clause {i}.{n} applies" for n in range(300))


class Fleet:
    def __init__(self, port: int, workers: int) -> None:
        # Several workers: the router closes each connection after its answer, so the
        # client opens one per request and SO_REUSEPORT spreads them over the workers.
        headers = {"Connection": "close"} if workers > 1 else None
        self.client = AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key="unused",
            max_retries=0,
            default_headers=headers,
        )

    async def ask(self, system: str, n: int) -> str:
        """One chat request; the name of the instance that answered it."""
        raw = await self.client.chat.completions.with_raw_response.create(
            model="sim-llama-3.1-70b",
            messages=[
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {n}"},
            ],
            max_tokens=2,
        )
        raw.parse()
        return raw.headers["x-sim-instance"]


async def stats(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> dict[str, Any]:
    status, body = await admin_call(http, proc, "GET", "/admin/stats")
    assert status == 200, body
    return {b["name"]: b for b in body["backends"]}  # type: ignore[attr-defined]


async def judged_twice(
    http: aiohttp.ClientSession,
    proc: asyncio.subprocess.Process,
    fleet: Fleet,
    docs: dict[str, str],
    sent: dict[str, int],
) -> dict[str, Any]:
    """Repeat each instance's document in batches until the router has judged both
    twice (its verdicts come on its own scrape period: /admin/stats is read after
    each batch, every read a real one); ``sent`` counts the requests."""
    async with asyncio.timeout(WAIT * 4):
        while True:
            for name, doc in docs.items():
                for n in range(BATCH):
                    assert await fleet.ask(doc, n) == name
                sent[name] += BATCH
            backends = await stats(http, proc)
            if all(b["prefix_cache_check"]["verdicts"] >= 2 for b in backends.values()):
                return backends


@pytest.mark.parametrize("workers", [1, 2])
async def test_an_instance_without_prefix_cache_is_flagged_once_and_a_caching_one_is_not(
    sim_fleet: SimFleet, workers: int
) -> None:
    (cached,) = await sim_fleet(1, name="cached")
    (uncached,) = await sim_fleet(1, name="nocache", prefix_caching=False)
    sims: dict[str, SimServer] = {s.name: s for s in (cached, uncached)}
    proc, port = await spawn_router(
        *("--scrape-metrics", "--scrape-interval", "0.1", "--workers", str(workers)),
        # The ring's walk alone (no traffic balancing): a key stays on its instance.
        *("--balance-mode", "IN_FLIGHT"),
        *(arg for s in sims.values() for arg in ("--backend", f"{s.name}={s.url}")),
    )
    fleet = Fleet(port, workers)
    try:
        # One document whose key the ring gives to each instance.
        docs: dict[str, str] = {}
        i = 0
        while len(docs) < len(sims):
            doc = document(i)
            docs.setdefault(await fleet.ask(doc, 0), doc)
            i += 1
        sent = dict.fromkeys(sims, 1)
        async with aiohttp.ClientSession() as http:
            backends = await judged_twice(http, proc, fleet, docs, sent)

            on, off = backends["cached-0"], backends["nocache-0"]
            assert off["prefix_cache"] == "suspect_off", off
            assert on["prefix_cache"] == "ok", on
            check = off["prefix_cache_check"]
            assert check["evidence"] >= 20
            assert check["hit_tokens"] == check["query_tokens"] == 0  # vLLM off counts nothing
            assert on["prefix_cache_check"]["hit_tokens"] > 0
            for name, backend in backends.items():
                # Every request after a key's first one on a process is a repeat there,
                # and the sum is over every worker: with two, each saw the key first
                # once (that one worker got all of a key's 40+ connections: < 2^-39).
                answered = backend["prefix_cache_check"]["repeats_answered"]
                assert answered == sent[name] - workers, (name, answered)
                assert backend["prefix_cache_check"]["repeats_sent"] == answered

            async with http.get(f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics") as resp:
                text = await resp.text()
            assert 'prefix_router_backend_prefix_cache_suspect{backend="nocache-0"} 1.0' in text
            assert 'prefix_router_backend_prefix_cache_suspect{backend="cached-0"} 0.0' in text
    finally:
        await fleet.client.close()
        rest = await stop(proc)
    events = [json.loads(line) for line in rest.decode().splitlines() if line.startswith("{")]
    warned = [e for e in events if e["event"] == "prefix cache suspect off"]
    assert [e["backend"] for e in warned] == ["nocache-0"]  # once, over two verdicts
    assert "--enable-prefix-caching" in warned[0]["reason"]
    assert not any(e["event"] == "prefix cache suspect off" for e in events if e is not warned[0])
