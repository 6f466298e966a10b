"""What peer routers ask of the simulated server, beyond generation.

vllm-router (cache_aware) asks every worker to render or tokenize each request and keys
its prefix tree on the ids: these tests pin vLLM's shapes, that the ids are exactly the
ones the generation endpoints compute, and that asking costs the engine nothing.
sglang-router probes every worker for gRPC when it registers it: one log line, not a
traceback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtests.simserver import Limits, SimServer
from loadtests.simserver.model import tokenize
from loadtests.simserver.wire import BadRequest, detokenize, parse_tokenize, render_chat

SYSTEM = "You are the support agent of a bank. Answer briefly and politely. " * 20
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My balance?"}]
LONG = {"role": "user", "content": "x" * 4 * 4096}


@pytest.fixture
async def sim(sim_fleet: Any) -> SimServer:
    (server,) = await sim_fleet(1, limits=Limits(max_model_len=4096))
    return server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        assert resp.headers["x-sim-instance"]
        return resp.status, await resp.json()


# ---------------------------------------------------------------- pure


def test_template_switches_of_vllm() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "The ans"}]
    closed = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\na<|eot_id|>"
    last = "<|start_header_id|>assistant<|end_header_id|>\n\nThe ans"
    assert render_chat(messages, add_generation_prompt=False) == closed + last + "<|eot_id|>"
    assert render_chat(messages, add_generation_prompt=False, continue_final_message=True) == (
        closed + last
    )
    opened = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    assert render_chat(messages) == closed + last + "<|eot_id|>" + opened
    with pytest.raises(BadRequest, match="continue_final_message"):
        render_chat(messages, continue_final_message=True)


@pytest.mark.parametrize("text", ["", "a", "ab", "abc", "abcd", "abcde", "héllo wörld", "🙂x"])
def test_detokenize_inverts_tokenize_at_every_padding(text: str) -> None:
    assert detokenize(tokenize(text)) == text


@given(st.text().filter(lambda t: not t.endswith("\0")))
def test_detokenize_inverts_tokenize(text: str) -> None:
    assert detokenize(tokenize(text)) == text


def test_tokenize_request_forms() -> None:
    assert parse_tokenize({"prompt": "hello"}) == (tokenize("hello"), False)
    chat = tokenize(render_chat(MESSAGES))
    assert parse_tokenize({"messages": MESSAGES, "add_special_tokens": False}) == (chat, False)
    no_prompt = tokenize(render_chat(MESSAGES, add_generation_prompt=False))
    body = {"messages": MESSAGES, "add_generation_prompt": False, "return_token_strs": True}
    assert parse_tokenize(body) == (no_prompt, True)


# ---------------------------------------------------------------- HTTP


async def test_tokenize_gives_the_ids_generation_counts(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    status, body = await post(http, f"{sim.url}/tokenize", {"model": "m", "messages": MESSAGES})
    assert status == 200
    assert body["tokens"] == tokenize(render_chat(MESSAGES)).tolist()
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 4096
    assert body["token_strs"] is None

    chat = {"model": "m", "messages": MESSAGES, "max_tokens": 2}
    status, reply = await post(http, f"{sim.url}/v1/chat/completions", chat)
    assert status == 200
    assert reply["usage"]["prompt_tokens"] == body["count"]

    status, body = await post(
        http, f"{sim.url}/tokenize", {"prompt": "héllo", "return_token_strs": True}
    )
    assert (status, body["tokens"]) == (200, tokenize("héllo").tolist())
    assert "".join(body["token_strs"]) == "héllo"


async def test_detokenize_round_trip(sim: SimServer, http: aiohttp.ClientSession) -> None:
    text = render_chat(MESSAGES)
    status, body = await post(http, f"{sim.url}/detokenize", {"tokens": tokenize(text).tolist()})
    assert (status, body) == (200, {"prompt": text})


async def test_chat_render_is_vllms_generate_request(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    request = {"model": "m", "messages": MESSAGES, "max_tokens": 7, "stream": True}
    status, body = await post(http, f"{sim.url}/v1/chat/completions/render", request)
    assert status == 200
    assert body["token_ids"] == tokenize(render_chat(MESSAGES)).tolist()
    assert body["sampling_params"] == {"max_tokens": 7}
    assert (body["model"], body["stream"], body["features"]) == ("m", True, None)
    assert body["request_id"].startswith(f"chatcmpl-{sim.name}-render-")
    for key in ("stream_options", "cache_salt", "kv_transfer_params"):
        assert key in body
    assert body["priority"] == 0


async def test_completion_render_is_a_list_of_one(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    status, body = await post(
        http, f"{sim.url}/v1/completions/render", {"model": "m", "prompt": [5, 6, 7]}
    )
    assert status == 200
    assert isinstance(body, list)
    assert [entry["token_ids"] for entry in body] == [[5, 6, 7]]
    assert body[0]["sampling_params"] == {"max_tokens": Limits().default_max_tokens}


async def test_asking_costs_the_engine_nothing(sim: SimServer, http: aiohttp.ClientSession) -> None:
    chat = {"model": "m", "messages": MESSAGES, "max_tokens": 2}
    for path in ("/tokenize", "/v1/chat/completions/render"):
        status, _ = await post(http, f"{sim.url}{path}", chat)
        assert status == 200
    engine = sim.instance.engine
    assert (engine.stats.prompt_tokens, engine.cache.queries, engine.cache.resident_blocks) == (
        0,
        0,
        0,
    )
    # Nothing was cached by asking: the first generation still prefills everything.
    status, reply = await post(http, f"{sim.url}/v1/chat/completions", chat)
    assert (status, reply["usage"]["prompt_tokens_details"]["cached_tokens"]) == (200, 0)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"model": "m"}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, None),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/v1/chat/completions/render", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions/render", {"messages": [LONG]}, "messages"),  # > max_model_len
        ("/v1/completions/render", {"prompt": ""}, "prompt"),
    ],
)
async def test_bad_requests_are_400s_with_openai_errors(
    sim: SimServer, http: aiohttp.ClientSession, path: str, body: Any, param: str | None
) -> None:
    status, reply = await post(http, f"{sim.url}{path}", body)
    assert status == 400
    assert reply["error"]["type"] == "invalid_request_error"
    if param is not None:
        assert reply["error"]["param"] == param
    else:
        assert "continue_final_message" in reply["error"]["message"]


async def test_tokenize_is_post_only(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{sim.url}/tokenize") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"


async def test_a_grpc_probe_is_refused_in_one_log_line(
    sim: SimServer, caplog: pytest.LogCaptureFixture
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    try:
        # HTTP/2 with prior knowledge: the connection preface, then an empty SETTINGS frame.
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        await writer.drain()
        assert (await reader.readline()).endswith(b" 400 Bad Request\r\n")
    finally:
        writer.close()
        await writer.wait_closed()
    records = [r for r in caplog.records if r.name == "loadtests.simserver.http"]
    assert [(r.levelno, r.getMessage(), r.exc_info) for r in records] == [
        (logging.WARNING, "400 for an HTTP/2 preface (a gRPC probe?) from 127.0.0.1", None)
    ]
