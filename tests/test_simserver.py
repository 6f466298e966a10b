"""The simulated vLLM server over real loopback sockets: OpenAI client, raw HTTP, the CLI.

Timing is checked through the model's own numbers (``x-sim-ttft-ms``, usage), never
through wall-clock speed; waits on server state go through ``SimInstance.wait_for``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from loadtests.simserver import Limits, SimServer, Timing
from loadtests.simserver.model import filler_pieces, tokenize
from loadtests.simserver.wire import parse_completion, render_chat

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = Timing()  # model timing of the FAST fixture timing: 10k tok/s, 20 ms overhead
SYSTEM = "You are the support agent of a bank. Answer briefly and politely. " * 40


def ttft_ms(uncached_tokens: int) -> float:
    return (DEFAULT.request_overhead_s + uncached_tokens / DEFAULT.prefill_tokens_per_s) * 1000


def expected_cached(shared_tokens: int, prompt_tokens: int, block: int = 16) -> int:
    """Full blocks of the shared prefix, within the first prompt_tokens - 1 tokens."""
    return min(shared_tokens // block, (prompt_tokens - 1) // block) * block


@pytest.fixture
async def sim(sim_fleet: Any) -> SimServer:
    (server,) = await sim_fleet(1)
    return server


@pytest.fixture
async def client(sim: SimServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{sim.url}/v1", api_key="x", max_retries=0) as c:
        yield c


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, str], Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, dict(resp.headers), await resp.json()


def sse_data(text: str) -> list[str]:
    blocks = [block for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks), blocks
    return [block.removeprefix("data: ") for block in blocks]


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """Samples of /metrics by (sample name, finished_reason label or "")."""
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["x-sim-instance"]
        text = await resp.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "model_name" in sample.labels:
                assert sample.labels["model_name"] == "sim-llama-3.1-70b"
            key = (sample.name, sample.labels.get("finished_reason", sample.labels.get("le", "")))
            samples[key] = sample.value
    return samples


# ---------------------------------------------------------------- prompt text (pure)


def test_chat_template_is_the_documented_one() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    same_tools_reordered = [
        {"function": {"parameters": {"a": 2, "b": 1}, "name": "f"}, "type": "function"}
    ]
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    messages = [
        {"role": "system", "content": "S"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "a"}, image, {"type": "text", "text": "b"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
    ]
    expected = (
        "<|begin_of_text|>"
        '<|start_header_id|>tools<|end_header_id|>\n\n[{"function":{"name":"f",'
        '"parameters":{"a":2,"b":1}},"type":"function"}]<|eot_id|>'
        "<|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\na\nb<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert render_chat(messages, tools) == expected
    assert render_chat(messages, same_tools_reordered) == expected


def test_a_one_item_prompt_list_is_that_prompt() -> None:
    limits = Limits()
    assert parse_completion({"prompt": ["abcdefgh"]}, limits).tokens == tokenize("abcdefgh")
    assert list(parse_completion({"prompt": [[7, 8, 9]]}, limits).tokens) == [7, 8, 9]


# ---------------------------------------------------------------- OpenAI client


async def test_shared_prefix_is_cached_and_prefills_faster(
    sim: SimServer, client: AsyncOpenAI
) -> None:
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My balance?"}]
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Reset PIN"}]
    one = await client.chat.completions.with_raw_response.create(
        model="m", messages=first, max_tokens=8
    )
    two = await client.chat.completions.with_raw_response.create(
        model="m", messages=second, max_tokens=8
    )
    a, b = one.parse(), two.parse()
    tokens_a, tokens_b = tokenize(render_chat(first)), tokenize(render_chat(second))
    shared = next(i for i, (x, y) in enumerate(zip(tokens_a, tokens_b, strict=False)) if x != y)
    cached = expected_cached(shared, len(tokens_b))
    assert cached > 500  # the system prompt is ~680 tokens

    assert a.usage is not None
    assert b.usage is not None
    assert a.usage.prompt_tokens_details is not None
    assert b.usage.prompt_tokens_details is not None
    assert (a.usage.prompt_tokens, a.usage.prompt_tokens_details.cached_tokens) == (
        len(tokens_a),
        0,
    )
    assert (b.usage.prompt_tokens, b.usage.prompt_tokens_details.cached_tokens) == (
        len(tokens_b),
        cached,
    )
    assert a.usage.completion_tokens == b.usage.completion_tokens == 8
    assert a.choices[0].message.content == "".join(filler_pieces(8))
    assert a.choices[0].finish_reason == "length"
    assert float(one.headers["x-sim-ttft-ms"]) == pytest.approx(ttft_ms(len(tokens_a)))
    assert float(two.headers["x-sim-ttft-ms"]) == pytest.approx(ttft_ms(len(tokens_b) - cached))
    assert one.headers["x-sim-instance"] == two.headers["x-sim-instance"] == sim.name


@pytest.mark.parametrize("api", ["chat", "completions", "responses"])
async def test_cache_salt_separates_cache_entries_as_vllm(client: AsyncOpenAI, api: str) -> None:
    """One prompt under two salts: no hit across them; the same salt hits (vLLM's field)."""

    async def cached(salt: str | None) -> int:
        extra = {} if salt is None else {"extra_body": {"cache_salt": salt}}
        if api == "chat":
            messages: Any = [{"role": "user", "content": SYSTEM}]
            chat = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=2, **extra
            )
            assert chat.usage is not None
            assert chat.usage.prompt_tokens_details is not None
            return chat.usage.prompt_tokens_details.cached_tokens or 0
        if api == "completions":
            text = await client.completions.create(model="m", prompt=SYSTEM, max_tokens=2, **extra)
            assert text.usage is not None
            assert text.usage.prompt_tokens_details is not None
            return text.usage.prompt_tokens_details.cached_tokens or 0
        response = await client.responses.create(
            model="m", input=SYSTEM, max_output_tokens=2, **extra
        )
        assert response.usage is not None
        return response.usage.input_tokens_details.cached_tokens

    assert await cached("tenant-a") == 0
    assert await cached("tenant-b") == 0  # same prompt, another salt: a miss
    assert await cached(None) == 0  # no salt is a salt of its own
    assert await cached("tenant-a") > 500  # same salt: the prompt's blocks hit


async def test_token_id_prompts_give_exact_block_arithmetic(client: AsyncOpenAI) -> None:
    base = list(range(1000, 2000))  # 1,000 tokens
    longer = [*base, *range(5000, 5050)]  # same 1,000 then 50 more
    expected = [
        # (prompt, cached tokens, TTFT ms): 1,000 // 16 = 62 full shared blocks = 992 tokens;
        # resending `base` alone can reuse only blocks within its first 999 tokens: 992.
        (base, 0, 20 + 100.0),
        (longer, 992, 20 + 5.8),
        (base, 992, 20 + 0.8),
    ]
    for prompt, cached, ttft in expected:
        raw = await client.completions.with_raw_response.create(
            model="m", prompt=prompt, max_tokens=3
        )
        body = raw.parse()
        assert body.usage is not None
        assert body.usage.prompt_tokens == len(prompt)
        assert body.usage.prompt_tokens_details is not None
        assert body.usage.prompt_tokens_details.cached_tokens == cached
        assert raw.headers["x-sim-cached-tokens"] == str(cached)
        assert float(raw.headers["x-sim-ttft-ms"]) == pytest.approx(ttft)
        assert body.choices[0].text == "".join(filler_pieces(3))


async def test_chat_stream_with_usage(client: AsyncOpenAI) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "hello " * 50}]}]
    stream = await client.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    async with stream:
        chunks = [chunk async for chunk in stream]
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [chunk.choices[0].delta.content for chunk in chunks[1:-1]]
    assert content == filler_pieces(5)
    assert [chunk.choices[0].finish_reason for chunk in chunks[1:-1]] == [None] * 4 + ["length"]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 5
    assert last.usage.prompt_tokens == len(tokenize(render_chat(messages)))


async def test_completion_stream_without_usage(client: AsyncOpenAI) -> None:
    stream = await client.completions.create(
        model="m", prompt="Once upon a time " * 30, max_tokens=4, stream=True
    )
    async with stream:
        chunks = [chunk async for chunk in stream]
    assert [chunk.choices[0].text for chunk in chunks] == filler_pieces(4)
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_openai_client_sees_the_error_object(client: AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as excinfo:
        await client.chat.completions.create(model="m", messages=[], max_tokens=2)
    assert excinfo.value.param == "messages"
    assert excinfo.value.type == "invalid_request_error"


async def test_models_health_ping(
    sim: SimServer, client: AsyncOpenAI, http: aiohttp.ClientSession
) -> None:
    models = await client.models.list()
    assert [model.id for model in models.data] == ["sim-llama-3.1-70b"]
    for path in ("/health", "/ping"):
        async with http.get(sim.url + path) as resp:
            assert resp.status == 200
            assert resp.headers["x-sim-instance"] == sim.name
    sim.instance.healthy = False
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 503


# ---------------------------------------------------------------- native API


async def test_invocations_json_and_stream(sim: SimServer, http: aiohttp.ClientSession) -> None:
    prompt = "Summarise this contract. " * 40
    status, headers, body = await post(
        http, f"{sim.url}/invocations", {"inputs": prompt, "parameters": {"max_new_tokens": 6}}
    )
    assert status == 200
    assert headers["x-sim-instance"] == sim.name
    assert body["generated_text"] == "".join(filler_pieces(6))
    assert body["usage"]["prompt_tokens"] == len(tokenize(prompt))
    assert body["usage"]["completion_tokens"] == 6

    request = {"prompt": prompt, "stream": True, "parameters": {"max_tokens": 3}}
    async with http.post(f"{sim.url}/invocations", json=request) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        events = [json.loads(data) for data in sse_data(await resp.text())]
    assert [event["token"]["text"] for event in events] == filler_pieces(3)
    assert [event["generated_text"] for event in events[:-1]] == [None, None]
    assert events[-1]["generated_text"] == "".join(filler_pieces(3))
    assert events[-1]["usage"]["completion_tokens"] == 3
    # The same prompt again: everything but the last partial block is cached.
    n = len(tokenize(prompt))
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_cached(n, n)


async def test_raw_sse_framing_of_chat(sim: SimServer, http: aiohttp.ClientSession) -> None:
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    async with http.post(f"{sim.url}/v1/chat/completions", json=request) as resp:
        assert resp.status == 200
        assert resp.headers["x-sim-instance"] == sim.name
        assert resp.headers["x-sim-ttft-ms"]
        assert resp.headers["x-sim-in-flight"] == "1"  # alone on the instance
        data = sse_data(await resp.text())
    assert data[-1] == "[DONE]"
    assert len(data) == 1 + 2 + 1  # role chunk, two tokens, [DONE]


# ---------------------------------------------------------------- Responses API


async def test_responses_continue_a_stored_conversation_and_only_here(
    sim_fleet: Any, http: aiohttp.ClientSession
) -> None:
    here, there = await sim_fleet(2, responses_stored=2)
    async with AsyncOpenAI(base_url=f"{here.url}/v1", api_key="x", max_retries=0) as client:
        first = await client.responses.create(
            model="m", input="What is a rocket?", instructions=SYSTEM, max_output_tokens=4
        )
        assert first.id.startswith("resp_")
        assert first.output_text == "".join(filler_pieces(4))
        follow = await client.responses.create(
            model="m", input="And a comet?", previous_response_id=first.id, max_output_tokens=2
        )
        # The follow-up's prompt holds the first turn and its answer (the new request
        # has no instructions: the old ones are dropped, as in vLLM).
        messages = [
            {"role": "user", "content": "What is a rocket?"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And a comet?"},
        ]
        assert follow.usage is not None
        assert follow.usage.input_tokens == len(tokenize(render_chat(messages)))
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text
        with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous"):
            await client.responses.cancel(first.id)
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(first.id)
        assert gone.value.body == {
            "message": f"Response with id '{first.id}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
        # Bounded: two stored at most, the oldest goes.
        for _ in range(2):
            await client.responses.create(model="m", input="x", max_output_tokens=1)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(follow.id)
    # Another instance holds none of them: every call by id is vLLM's 404.
    url = f"{there.url}/v1/responses"
    body = {"model": "m", "input": "more", "previous_response_id": first.id}
    status, _, error = await post(http, url, body)
    assert (status, error["error"]["code"]) == (404, 404)
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel")):
        async with http.request(method, f"{url}/{first.id}{path}") as resp:
            assert resp.status == 404, (method, path)


async def test_responses_stream_opens_with_the_id_in_vllm_event_framing(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    request = {"model": "m", "input": "hi", "max_output_tokens": 3, "stream": True}
    async with http.post(f"{sim.url}/v1/responses", json=request) as resp:
        assert resp.content_type == "text/event-stream"
        text = await resp.text()
    frames = text.split("\n\n")
    assert frames[-1] == ""  # no [DONE] on this API
    names = [frame.split("\n")[0].removeprefix("event: ") for frame in frames[:-1]]
    assert names[0] == "response.created"
    assert names.count("response.output_text.delta") == 3
    assert names[-1] == "response.completed"
    # vLLM's pydantic order: the event's "response" first, the object's "id" first in it.
    created = frames[0].split("\n")[1]
    assert created.startswith('data: {"response":{"id":"resp_')
    response_id = json.loads(created.removeprefix("data: "))["response"]["id"]
    async with http.get(f"{sim.url}/v1/responses/{response_id}") as resp:
        assert resp.status == 200
        assert (await resp.json())["status"] == "completed"


# ---------------------------------------------------------------- cache and metrics


async def test_capacity_forces_eviction(sim_fleet: Any, http: aiohttp.ClientSession) -> None:
    (server,) = await sim_fleet(1, capacity_blocks=8)
    url = f"{server.url}/v1/completions"
    a = list(range(0, 129))  # 8 full blocks, all reusable (within the first 128 tokens)
    b = list(range(10_000, 10_129))

    async def cached(prompt: list[int]) -> int:
        status, headers, body = await post(http, url, {"prompt": prompt, "max_tokens": 1})
        assert status == 200
        assert headers["x-sim-cached-tokens"] == str(
            body["usage"]["prompt_tokens_details"]["cached_tokens"]
        )
        return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached(a) == 0
    assert await cached(a) == 128  # fits: reused
    assert await cached(b) == 0  # needs all 8 blocks: every block of a is evicted
    assert await cached(a) == 0
    assert server.instance.cache.resident_blocks == 8


async def test_metrics_count_what_was_sent(sim: SimServer, http: aiohttp.ClientSession) -> None:
    prompts = [list(range(500)), list(range(500)), list(range(300, 400))]
    sent_prompt, sent_cached, ttfts = 0, 0, []
    for prompt in prompts:
        status, headers, body = await post(
            http, f"{sim.url}/v1/completions", {"prompt": prompt, "max_tokens": 4}
        )
        assert status == 200
        sent_prompt += body["usage"]["prompt_tokens"]
        sent_cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
        ttfts.append(float(headers["x-sim-ttft-ms"]) / 1000)
    assert sent_cached == 496  # only the repeat hits: 31 full blocks within 499 tokens

    m = await metrics(http, sim.url)
    assert m["vllm:prefix_cache_queries_total", ""] == sent_prompt == 1100
    assert m["vllm:prefix_cache_hits_total", ""] == sent_cached
    assert m["vllm:prompt_tokens_total", ""] == sent_prompt
    assert m["vllm:generation_tokens_total", ""] == 12
    assert m["vllm:request_success_total", "length"] == 3
    assert m["vllm:request_success_total", "abort"] == 0
    assert m["vllm:num_requests_running", ""] == 0
    assert m["vllm:num_requests_waiting", ""] == 0
    assert m["vllm:kv_cache_usage_perc", ""] == 0
    assert m["vllm:time_to_first_token_seconds_count", ""] == 3
    assert m["vllm:time_to_first_token_seconds_sum", ""] == pytest.approx(sum(ttfts), abs=1e-5)
    assert m["vllm:time_to_first_token_seconds_bucket", "+Inf"] == 3
    assert m["vllm:cache_config_info", ""] == 1

    async with http.post(f"{sim.url}/reset_prefix_cache") as resp:
        assert resp.status == 200
        assert resp.headers["x-sim-instance"] == sim.name
    m = await metrics(http, sim.url)
    assert m["vllm:prefix_cache_queries_total", ""] == 0
    assert m["vllm:request_success_total", "length"] == 0
    status, _, body = await post(http, f"{sim.url}/v1/completions", {"prompt": prompts[0]})
    assert status == 200
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # cache is cold
    assert body["usage"]["completion_tokens"] == 16  # the default max_tokens


# ---------------------------------------------------------------- bad input

CHAT, TEXT, NATIVE = "/v1/chat/completions", "/v1/completions", "/invocations"
OK_MESSAGES = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    (CHAT, b"{not json", None),
    (CHAT, b"", None),
    (CHAT, b"[1, 2]", None),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": ["hi"]}, "messages[0]"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}, "cache_salt"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "cache_salt": 7}, "cache_salt"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    (CHAT, {"messages": OK_MESSAGES, "max_tokens": "8"}, "max_tokens"),
    (CHAT, {"messages": OK_MESSAGES, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": OK_MESSAGES, "max_completion_tokens": True}, "max_completion_tokens"),
    (CHAT, {"messages": OK_MESSAGES, "stream": "yes"}, "stream"),
    (CHAT, {"messages": OK_MESSAGES, "stream_options": []}, "stream_options"),
    (CHAT, {"messages": OK_MESSAGES, "tools": {"a": 1}}, "tools"),
    (TEXT, {}, "prompt"),
    (TEXT, {"prompt": ""}, "prompt"),
    (TEXT, {"prompt": ["one", "two"]}, "prompt"),
    (TEXT, {"prompt": [1, -2]}, "prompt"),
    (TEXT, {"prompt": [1, 2.5]}, "prompt"),
    (TEXT, {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    (NATIVE, {}, "inputs"),
    (NATIVE, {"inputs": 3}, "inputs"),
    (NATIVE, {"inputs": "x", "parameters": []}, "parameters"),
    (NATIVE, {"inputs": "x", "parameters": {"max_new_tokens": 1.5}}, "max_new_tokens"),
]


async def test_no_prefix_caching_instance_never_hits_and_keeps_its_counters_at_zero(
    sim_fleet: Any, http: aiohttp.ClientSession
) -> None:
    (server,) = await sim_fleet(1, prefix_caching=False)
    prompt = list(range(500))
    for _ in range(3):
        status, headers, body = await post(
            http, f"{server.url}/v1/completions", {"prompt": prompt, "max_tokens": 2}
        )
        assert status == 200
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert headers["x-sim-cached-tokens"] == "0"
    m = await metrics(http, server.url)
    # As vLLM V1 exposes them with caching off: the series are there, at 0.
    assert m["vllm:prefix_cache_queries_total", ""] == 0
    assert m["vllm:prefix_cache_hits_total", ""] == 0
    assert m["vllm:prompt_tokens_total", ""] == 1500


def test_cli_flag_turns_prefix_caching_off() -> None:
    from loadtests.simserver.__main__ import configs_from, parse_args

    assert configs_from(parse_args([]))[0].prefix_caching
    (config,) = configs_from(parse_args(["--no-prefix-caching"]))
    assert not config.prefix_caching


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
async def test_bad_input_is_a_400_with_openai_error(
    sim: SimServer, http: aiohttp.ClientSession, path: str, body: Any, param: str | None
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(sim.url + path, data=data) as resp:
        assert resp.status == 400
        assert resp.headers["x-sim-instance"] == sim.name
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] is None
    assert isinstance(error["message"], str)
    assert error["message"]
    assert sim.instance.engine.stats.prompt_tokens == 0  # nothing reached the engine


async def test_limits_cap_and_context_length(sim_fleet: Any, http: aiohttp.ClientSession) -> None:
    (server,) = await sim_fleet(1, limits=Limits(max_tokens_cap=4, max_model_len=100))
    url = f"{server.url}/v1/completions"
    status, _, body = await post(http, url, {"prompt": list(range(96)), "max_tokens": 50})
    assert status == 200
    assert body["usage"]["completion_tokens"] == 4  # lowered to the cap
    status, _, body = await post(http, url, {"prompt": list(range(97)), "max_tokens": 4})
    assert status == 400
    assert "maximum context length is 100" in body["error"]["message"]


async def test_unknown_path_and_method(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{sim.url}/v2/nothing") as resp:
        assert resp.status == 404
        assert resp.headers["x-sim-instance"] == sim.name
        assert (await resp.json())["error"]["type"] == "not_found_error"
    async with http.get(f"{sim.url}/v1/completions") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"]["message"]


# ---------------------------------------------------------------- queueing and disconnects

SLOW = Timing(time_scale=1.0)  # real time: 25 ms per token, a 1,000-token answer lasts 25 s


async def open_stream(http: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    """A long streaming completion, returned once its first event has arrived."""
    body = {"prompt": list(range(64)), "max_tokens": 1000, "stream": True}
    resp = await http.post(f"{url}/v1/completions", json=body)
    assert resp.status == 200
    assert (await resp.content.readline()).startswith(b"data: ")
    return resp


async def test_disconnect_mid_stream_releases_slot_and_blocks(
    sim_fleet: Any, http: aiohttp.ClientSession
) -> None:
    (server,) = await sim_fleet(1, timing=SLOW)
    instance = server.instance
    resp = await open_stream(http, server.url)
    assert instance.engine.running == 1
    assert instance.cache.pinned_blocks == 4
    async with http.post(f"{server.url}/reset_prefix_cache") as busy:
        assert busy.status == 409  # blocks in use, as vLLM refuses
    resp.close()  # drop the connection mid-stream
    async with asyncio.timeout(5):
        await instance.wait_idle()
    assert instance.cache.pinned_blocks == 0
    assert instance.engine.stats.aborted == 1
    assert instance.engine.stats.finished == 0


async def test_queue_is_fifo_and_a_queued_client_can_leave(
    sim_fleet: Any, http: aiohttp.ClientSession
) -> None:
    slow = Timing(time_scale=1.0, max_num_seqs=1)
    (server,) = await sim_fleet(1, timing=slow)
    instance = server.instance
    holder = await open_stream(http, server.url)

    leaver = asyncio.create_task(post(http, f"{server.url}/v1/completions", {"prompt": "a"}))
    await instance.wait_for(lambda e: e.waiting == 1)
    leaver.cancel()  # the client gives up while queued: its connection closes
    with pytest.raises(asyncio.CancelledError):
        await leaver
    async with asyncio.timeout(5):
        await instance.wait_for(lambda e: e.waiting == 0)
    assert instance.engine.running == 1
    assert instance.engine.stats.aborted == 1

    queued = asyncio.create_task(
        post(http, f"{server.url}/v1/completions", {"prompt": "b", "max_tokens": 1})
    )
    await instance.wait_for(lambda e: e.waiting == 1)
    m = await metrics(http, server.url)
    assert (m["vllm:num_requests_running", ""], m["vllm:num_requests_waiting", ""]) == (1, 1)
    holder.close()  # frees the only slot: the queued request is admitted
    async with asyncio.timeout(5):
        status, headers, body = await queued
    assert status == 200
    assert float(headers["x-sim-queue-ms"]) > 0
    assert float(headers["x-sim-ttft-ms"]) >= float(headers["x-sim-queue-ms"])
    assert body["usage"]["completion_tokens"] == 1


async def test_extra_ttft_hook_delays_one_instance(
    sim_fleet: Any, http: aiohttp.ClientSession
) -> None:
    (fast,) = await sim_fleet(1, name="fast")
    (slow,) = await sim_fleet(1, name="slow", extra_ttft_s=0.2)
    loop = asyncio.get_running_loop()
    results = {}
    for server in (fast, slow):
        started = loop.time()
        status, headers, _ = await post(
            http, f"{server.url}/v1/completions", {"prompt": "x" * 400, "max_tokens": 2}
        )
        results[server.name] = (loop.time() - started, headers["x-sim-ttft-ms"])
        assert status == 200
    # A lower bound only: asyncio.sleep never returns early. The model TTFT is the same.
    assert results["slow-0"][0] >= 0.2
    assert results["slow-0"][1] == results["fast-0"][1]


# ---------------------------------------------------------------- CLI


@pytest.mark.parametrize(
    "stop_signal",
    [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")],
)
async def test_cli_prints_its_urls_serves_and_stops_on_signal(
    http: aiohttp.ClientSession, stop_signal: signal.Signals
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadtests.simserver",
        "--name",
        "cli",
        "--count",
        "2",
        "--time-scale",
        "0.001",
        "--capacity-blocks",
        "64",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(20):
            lines = [json.loads(await proc.stdout.readline()) for _ in range(2)]
        assert [line["name"] for line in lines] == ["cli-0", "cli-1"]
        for line in lines:
            assert line["url"].startswith("http://127.0.0.1:")
            async with http.get(line["url"] + "/health") as resp:
                assert resp.status == 200
                assert resp.headers["x-sim-instance"] == line["name"]
        status, headers, _ = await post(
            http, lines[1]["url"] + "/v1/completions", {"prompt": "hi", "max_tokens": 2}
        )
        assert (status, headers["x-sim-instance"]) == (200, "cli-1")
        async with http.get(lines[0]["url"] + "/metrics") as resp:
            assert 'num_gpu_blocks="64"' in await resp.text()
        proc.send_signal(stop_signal)
        async with asyncio.timeout(20):
            out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        assert out == b""  # nothing after the two JSON lines
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.communicate()


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--time-scale", "0", b"time_scale"),
        ("--block-size", "0", b"block_size"),
        ("--default-max-tokens", "0", b"max_tokens"),
    ],
)
async def test_cli_rejects_bad_values(flag: str, value: str, message: bytes) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "loadtests.simserver",
        flag,
        value,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(20):
        out, err = await proc.communicate()
    assert proc.returncode == 2
    assert out == b""
    assert message in err
