"""OpenAI traffic through the real router in front of simulated instances."""

from __future__ import annotations

import json
from collections import Counter

import aiohttp
import openai
import pytest

from tests.harness.routers import SimFleet, StartRouter, sagemaker

SYSTEM = "You are the support assistant of ACME Rockets. " * 120  # ~5.8 KB, shared


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat(question: str, system: str = SYSTEM, **extra: object) -> dict[str, object]:
    return {
        "model": "sim-llama-3.1-70b",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        **extra,
    }


async def test_openai_client_gets_the_same_answers_through_the_router_as_direct(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(3)
    router = await start_router(sims)
    via = client(f"http://127.0.0.1:{router.port}")
    async with via:
        routed = await via.chat.completions.create(**chat("What is a rocket?"))  # type: ignore[call-overload]
        instance = next(s for s in sims if routed.id.startswith(f"chatcmpl-{s.name}"))
        async with client(instance.url) as direct:
            straight = await direct.chat.completions.create(**chat("What is a rocket?"))  # type: ignore[call-overload]
        assert routed.choices[0].message.content == straight.choices[0].message.content
        assert routed.usage is not None
        assert straight.usage is not None
        assert routed.usage.prompt_tokens == straight.usage.prompt_tokens
        assert routed.usage.completion_tokens == straight.usage.completion_tokens == 8

        # Streaming: the same text, chunk by chunk, ending cleanly.
        stream = await via.chat.completions.create(**chat("What is a rocket?", stream=True))  # type: ignore[call-overload]
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        assert "".join(pieces) == routed.choices[0].message.content
        assert len(pieces) >= 8

        # Completions, string prompt.
        done = await via.completions.create(
            model="sim-llama-3.1-70b", prompt=SYSTEM + "Q: hi", max_tokens=4
        )
        assert done.usage is not None
        assert done.usage.completion_tokens == 4


async def instance_of(http: aiohttp.ClientSession, url: str, body: object) -> str:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(url, data=data, headers={"content-type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-sim-instance"]


async def test_a_shared_system_prompt_sticks_to_one_instance_and_documents_spread(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(4)
    router = await start_router(sims, routing=sagemaker())
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        same_prompt = {await instance_of(http, url, chat(f"Question {i}?")) for i in range(30)}
        assert len(same_prompt) == 1
        documents = Counter(
            [
                await instance_of(http, url, chat("Summarise.", system=f"Document {i}: " * 400))
                for i in range(40)
            ]
        )
    assert set(documents) == {s.name for s in sims}, documents
    # The ring spreads 40 keys over 4 instances; none should get most of them.
    assert max(documents.values()) <= 20, documents
    # And the instance that got the shared prompt now has it cached.
    hot = next(s for s in sims if s.name in same_prompt)
    assert hot.instance.cache.hits > 0


async def test_json_key_order_and_whitespace_do_not_move_openai_requests(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(4)
    router = await start_router(sims)
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        for i in range(12):
            body = chat(f"q{i}", system=f"Policy {i}. " * 300)
            compact = json.dumps(body, separators=(",", ":")).encode()
            reordered = {k: body[k] for k in reversed(list(body))}
            reordered["messages"] = [dict(reversed(list(m.items()))) for m in body["messages"]]  # type: ignore[attr-defined]
            spaced = json.dumps(reordered, indent=4).encode()
            assert compact != spaced
            assert await instance_of(http, url, compact) == await instance_of(http, url, spaced)


async def test_native_keys_are_the_raw_prefix_bytes(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    """Native requests hash the first PrefixLength bytes exactly as sent.

    The same bytes always land together whatever follows them past the
    prefix; the same JSON written differently is a different key (documented).
    """
    sims = await sim_fleet(4)
    router = await start_router(sims, routing={"PrefixAwareRoutingConfig": {"PrefixLength": 1024}})
    url = f"http://127.0.0.1:{router.port}/invocations"
    async with aiohttp.ClientSession() as http:
        for i in range(10):
            head = json.dumps({"inputs": f"Manual {i}: " + "torque spec " * 200})[:-2]
            first = await instance_of(http, url, (head + ' first question"}').encode())
            second = await instance_of(http, url, (head + ' another one"}').encode())
            assert first == second
        spread = Counter(
            [
                await instance_of(http, url, json.dumps({"inputs": f"doc {i} " * 300}).encode())
                for i in range(40)
            ]
        )
        assert len(spread) == 4, spread


@pytest.mark.parametrize("strategy", ["RANDOM", "LEAST_OUTSTANDING_REQUESTS"])
async def test_other_strategies_spread_a_shared_prompt(
    sim_fleet: SimFleet, start_router: StartRouter, strategy: str
) -> None:
    sims = await sim_fleet(3)
    router = await start_router(sims, routing={"RoutingStrategy": strategy}, seed=1)
    url = f"http://127.0.0.1:{router.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as http:
        seen = Counter([await instance_of(http, url, chat(f"q{i}")) for i in range(30)])
    assert len(seen) == 3, seen  # no affinity: every instance recomputes the prefix
