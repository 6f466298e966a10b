"""What the A/B tests share: the documents and their chat bodies, an ``openai``
client that opens a connection per request (so SO_REUSEPORT spreads them over
the workers), and two ``--etcd`` replicas with a routing config PUT on one and
awaited on the other."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from openai import AsyncOpenAI

from loadtests.simserver import SimServer
from tests.harness.etcd import EtcdServer
from tests.harness.http import WAIT
from tests.harness.processes import admin_call, spawn_router

MODEL = "sim-llama-3.1-70b"


def document(i: int) -> str:
    return f"Manual {i}.\n" + " ".join(f"section {i}.{n} holds" for n in range(200))


def body(doc: str) -> str:
    messages = [{"role": "system", "content": doc}, {"role": "user", "content": "Summarise."}]
    return json.dumps({"model": MODEL, "messages": messages, "max_tokens": 2})


def client(port: int) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"Connection": "close"},  # a connection each: both workers serve
    )


async def ask(openai: AsyncOpenAI, doc: str) -> str:
    """One chat request about ``doc``; the instance that answered it."""
    raw = await openai.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": doc}, {"role": "user", "content": "Summarise."}],
        max_tokens=2,
    )
    raw.parse()
    return raw.headers["x-sim-instance"]


async def two_replicas(
    etcd: EtcdServer, sims: list[SimServer], prefix: str
) -> list[tuple[asyncio.subprocess.Process, int]]:
    """Two ``--etcd`` replicas of ``sims``, started one after the other (the first seeds
    the fleet in etcd)."""
    flags = [arg for s in sims for arg in ("--backend", f"{s.name}={s.url}")]
    return [
        await spawn_router(
            "--etcd", etcd.url, "--etcd-prefix", prefix, "--replica-id", f"r{i}", *flags
        )
        for i in range(2)
    ]


async def put_everywhere(
    http: aiohttp.ClientSession,
    first: asyncio.subprocess.Process,
    second: asyncio.subprocess.Process,
    routing: dict[str, Any],
) -> None:
    """PUT an experiment on ``first``; return once ``second`` has it from etcd."""
    status, answer = await admin_call(http, first, "PUT", "/admin/routing", routing)
    assert status == 200, answer
    async with asyncio.timeout(WAIT):
        while True:
            status, applied = await admin_call(http, second, "GET", "/admin/routing")
            if applied == answer:
                break
            await asyncio.sleep(0.05)  # polled: each a real read of the other replica
