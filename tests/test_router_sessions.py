"""Session keys (issue 14 §2) in process (uvloop and the stdlib loop): native requests,
the header's rules (the daemon's side: ``tests/test_sessions.py``).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from router.heads import TENANT_HEADER
from tests.harness.http import assert_error, connect, req
from tests.harness.routers import SimFleet, StartRouter, sagemaker

pytestmark = pytest.mark.timeout(120)

MODEL = "sim-llama-3.1-70b"
PROMPTS = [f"Question {i}: what does a rocket of class {i} carry?" for i in range(10)]


def client(port: int, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, **options
    )


async def chat(via: openai.AsyncOpenAI, prompt: str, headers: dict[str, str]) -> Any:
    return await via.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        extra_headers=headers,
    )


# -- in-process: native requests, the header's rules ---------------------------------------


async def test_a_native_request_with_a_session_header_is_routed_at_its_head(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(4)
    router = await start_router(sims, routing=sagemaker())
    url = f"http://127.0.0.1:{router.port}/invocations"
    async with aiohttp.ClientSession() as http:
        seen = set()
        for prompt in PROMPTS:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 2}}
            async with http.post(url, json=body, headers={"X-Session-Id": "native-1"}) as resp:
                assert resp.status == 200, await resp.text()
                seen.add(resp.headers["x-sim-instance"])
        assert len(seen) == 1
        spread = set()
        for prompt in PROMPTS:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 2}}
            async with http.post(url, json=body) as resp:
                spread.add(resp.headers["x-sim-instance"])
        assert len(spread) > 1
    assert router.recorder.sources == {"header": 10, "prefix": 10}


async def test_a_configured_header_name_and_its_tenant_salt(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    """``SessionHeader`` names the header (the tenant header still salts it); another
    name or an empty value is no session."""
    sims = await sim_fleet(2)
    routing = sagemaker(SessionHeader="X-Chat-Thread", SessionKeys=["header", "prefix"])
    router = await start_router(sims, routing=routing)
    async with client(router.port) as via:
        await chat(via, "one", headers={"X-Chat-Thread": "t"})
        await chat(via, "two", headers={"X-Chat-Thread": "t"})
        await chat(via, "one", headers={"X-Chat-Thread": "t", TENANT_HEADER.decode(): "acme"})
        await chat(via, "one", headers={"X-Session-Id": "t"})  # not the configured name
        await chat(via, "one", headers={"X-Chat-Thread": ""})
    assert router.recorder.sources == {"header": 3, "prefix": 2}


async def test_a_repeated_session_header_is_refused(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(1)
    router = await start_router(sims)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
    async with connect(router) as conn:
        await conn.send(
            req(
                b"POST",
                b"/v1/chat/completions",
                body=body.encode(),
                headers=b"X-Session-Id: a\r\nx-session-id: b\r\n",
            )
        )
        error = assert_error(await conn.response(), 400)
    assert "x-session-id header must appear once" in error["message"]
    assert router.recorder.sources == {}
