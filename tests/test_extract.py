"""The routing-key extraction rule, pinned by vectors (README "Routing key")."""

from __future__ import annotations

import json
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.extract import BadRequest, decode_openai, prompt_key, prompt_text

RS, US, GS = "\x1e", "\x1f", "\x1d"


def text_of(body: object, limit: int = 4096) -> str:
    return prompt_text(decode_openai(json.dumps(body).encode()), limit)


VECTORS = [
    (
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ]
        },
        f"{RS}system{US}Be brief.{RS}user{US}Hi",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Look: "},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        {"type": "text", "text": "what is it?"},
                    ],
                }
            ]
        },
        f"{RS}user{US}Look: {GS}image_urlwhat is it?",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}
            ],
            "messages": [{"role": "user", "content": "go"}],
        },
        f'{RS}tools{US}[{{"function":{{"name":"f","parameters":{{"a":2,"b":1}}}},"type":"function"}}]'
        f"{RS}user{US}go",
    ),
    (
        {"messages": [{"role": "assistant", "content": None}, {"role": "tool", "content": "42"}]},
        f"{RS}assistant{US}{RS}tool{US}42",
    ),
    ({"prompt": "Once upon a time"}, "Once upon a time"),
    ({"prompt": ["first prompt", "second"]}, "first prompt"),
    (
        {"instructions": "Answer in French.", "input": "Bonjour"},
        f"{RS}instructions{US}Answer in French.{RS}user{US}Bonjour",
    ),
    (
        {
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Q1"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "A1"}]},
            ]
        },
        f"{RS}user{US}Q1{RS}assistant{US}A1",
    ),
]


@pytest.mark.parametrize(("body", "expected"), VECTORS)
def test_extraction_vectors(body: object, expected: str) -> None:
    assert text_of(body) == expected


def test_text_is_cut_at_prefix_length_characters() -> None:
    body = {
        "messages": [{"role": "system", "content": "é" * 5000}, {"role": "user", "content": "q"}]
    }
    text = text_of(body, limit=1024)
    assert len(text) == 1024
    assert text == f"{RS}system{US}" + "é" * (1024 - 8)
    key = prompt_key(decode_openai(json.dumps(body).encode()), 1024)
    assert key == text.encode()  # characters counted, then encoded: 2 bytes per é


def test_requests_sharing_a_long_prefix_share_the_key_whatever_follows() -> None:
    system = {"role": "system", "content": "Shared document. " * 400}
    one = {"messages": [system, {"role": "user", "content": "first"}], "temperature": 0}
    two = {"messages": [system, {"role": "user", "content": "second"}], "stream": True}
    assert text_of(one) == text_of(two)
    short = {"messages": [{"role": "system", "content": "short"}, {"role": "user", "content": "a"}]}
    other = {"messages": [{"role": "system", "content": "short"}, {"role": "user", "content": "b"}]}
    assert text_of(short) != text_of(other)


def test_a_tool_catalogue_is_cut_too_and_stops_early() -> None:
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "d": "x" * 100}} for i in range(200)
    ]
    text = text_of({"tools": tools, "messages": [{"role": "user", "content": "hi"}]}, limit=1024)
    assert len(text) == 1024
    assert text.startswith(f"{RS}tools{US}[")


def test_token_id_prompts_are_keyed_by_their_first_ids() -> None:
    request = decode_openai(json.dumps({"prompt": list(range(2000))}).encode())
    assert prompt_key(request, 4096) == array("I", range(1024)).tobytes()
    batch = decode_openai(json.dumps({"prompt": [[5, 6, 7], [8]]}).encode())
    assert prompt_key(batch, 4096) == array("I", [5, 6, 7]).tobytes()
    with pytest.raises(BadRequest, match="non-negative"):
        prompt_key(decode_openai(b'{"prompt": [1, -2]}'), 4096)


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (b"{not json", "not valid JSON", None),
        (b'{"messages": "hi"}', "Expected `array | null`, got `str`", "messages"),
        (b'{"messages": [{"role": 5}]}', "Expected `str`, got `int`", "messages[0].role"),
        (b'{"messages": [{"content": {"a": 1}}]}', "got `object`", "messages[0].content"),
        (b'{"prompt": "\xff"}', "not valid JSON", None),
        (b"[1, 2]", "Expected `object`, got `array`", None),
        (b'{"stream": "yes"}', "Expected `bool | null`", "stream"),
        (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not valid JSON", None),
    ],
)
def test_bad_bodies_raise_bad_request_naming_the_problem(
    body: bytes, message: str, param: str | None
) -> None:
    with pytest.raises(BadRequest, match=message.replace("|", r"\|").replace("[", r"\[")) as info:
        prompt_key(decode_openai(body), 4096)  # a part the key reads may fail in either
    assert info.value.param == param


@given(st.text(max_size=300), st.integers(1024, 4096))
def test_any_text_content_is_rendered_verbatim_up_to_the_limit(content: str, limit: int) -> None:
    body = {"messages": [{"role": "user", "content": content}]}
    assert text_of(body, limit) == (f"{RS}user{US}" + content)[:limit]
