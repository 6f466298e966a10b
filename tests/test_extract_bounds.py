"""The bounded reading of large OpenAI bodies (``router.extract``, contract "Cost").

Two readers exist: a body up to ``FAST_BODY_BYTES`` is decoded whole; a larger
one is read in one pass that keeps only the elements a key can use.  These
tests pin that both give the same key and the same errors, that a key of a
huge body allocates memory in proportion to ``PrefixLength`` and not to the
body (the measure of work that does not depend on the machine's speed), and
the two rules that make that possible.
"""

from __future__ import annotations

import json
import tracemalloc
from array import array
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from router import extract
from router.extract import (
    FAST_BODY_BYTES,
    TOOL_CANONICAL_BYTES,
    BadRequest,
    BoundedRequest,
    OpenAIRequest,
    decode_openai,
    prompt_key,
)

RS, US, GS = "\x1e", "\x1f", "\x1d"


def outcome(request: Any, limit: int) -> bytes | tuple[str, str | None]:
    try:
        return prompt_key(request, limit)
    except BadRequest as exc:
        return (str(exc), exc.param)


def both(body: bytes, limit: int) -> tuple[Any, Any]:
    """The outcome of the whole decode (fast when small) and of the bounded reading."""
    try:
        whole = outcome(decode_openai(body, limit), limit)
    except BadRequest as exc:
        whole = (str(exc), exc.param)
    try:
        bounded = outcome(extract._reader(max(limit, 1024)).read(body), limit)
    except BadRequest as exc:
        bounded = (str(exc), exc.param)
    return whole, bounded


# -- both readers agree --------------------------------------------------------

texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
small_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | texts,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=8,
)
part_types = st.sampled_from(["text", "input_text", "output_text", "image_url", ""])
parts = st.fixed_dictionaries(
    {"type": part_types},
    optional={"text": st.none() | texts | st.just("") | st.integers(0, 3)},
)
# Runs of one part: enough empty text parts to reach the parts bound (1,024).
part_runs = st.tuples(parts, st.integers(1, 700)).map(lambda run: [run[0]] * run[1])
contents = st.one_of(
    st.none(),
    texts,
    st.integers(0, 3),
    st.lists(part_runs, max_size=3).map(lambda runs: [p for run in runs for p in run]),
)
roles = st.sampled_from(["user", "system", "", "assistant"]) | st.integers(0, 2)
message_runs = st.tuples(
    st.fixed_dictionaries({}, optional={"role": roles, "content": contents}),
    st.integers(1, 400),
).map(lambda run: [run[0]] * run[1])
messages = st.lists(message_runs, max_size=3).map(lambda runs: [m for run in runs for m in run])
id_runs = st.tuples(st.integers(0, 9) | texts | st.just([1, 2]), st.integers(1, 600))
prompts = st.one_of(
    texts,
    st.lists(id_runs, max_size=3).map(lambda runs: [x for run in runs for x in [run[0]] * run[1]]),
    st.lists(st.lists(st.integers(0, 2**32), max_size=300), max_size=3),
    st.lists(texts, max_size=3),
    st.integers(0, 3),
)
tools = st.lists(small_json, max_size=3) | st.tuples(small_json, st.integers(1, 900)).map(
    lambda run: [run[0]] * run[1]
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "messages": messages | texts,
        "input": messages | texts,
        "prompt": prompts,
        "instructions": texts | st.integers(0, 2),
        "tools": tools,
        "prompt_cache_key": texts,
        "model": small_json,
    },
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(body=bodies, limit=st.integers(1024, 3000), spaced=st.booleans())
@example(
    body={"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
    limit=1024,
    spaced=False,
)
def test_the_bounded_reading_gives_the_whole_decodes_key_and_errors(
    body: dict[str, Any], limit: int, spaced: bool
) -> None:
    raw = json.dumps(body, indent=1 if spaced else None).encode()
    whole, bounded = both(raw, limit)
    assert whole == bounded


long_texts = st.tuples(
    st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=30),
    st.integers(0, 11),
).map(lambda t: "x" * t[1] + t[0] * (14_000 // len(t[0]) + 1))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=long_texts, ascii_only=st.booleans(), limit=st.integers(1024, 1100))
def test_a_long_string_is_decoded_only_as_far_as_the_key_needs(
    content: str, ascii_only: bool, limit: int
) -> None:
    # Past 12 characters of JSON per character needed, only a prefix is
    # decoded: wherever its cut falls (escapes, surrogate pairs, UTF-8), the
    # key is the whole string's.
    body = {"messages": [{"role": "user", "content": content}]}
    raw = json.dumps(body, ensure_ascii=ascii_only).encode()
    request = extract._reader(limit).read(raw)
    assert prompt_key(request, limit) == (f"{RS}user{US}" + content)[:limit].encode()


# -- a key's work is bounded by PrefixLength ------------------------------------

MiB = 1024 * 1024


def filled(head: bytes, unit: bytes, tail: bytes, size: int = 8 * MiB) -> bytes:
    """``head``, ``unit`` repeated comma-separated to ``size`` bytes, ``tail``
    (by repetition: a join over a list of millions of units took 0.2 s each)."""
    count = (size - len(head) - len(tail)) // (len(unit) + 1)
    return head + unit + (b"," + unit) * (count - 1) + tail


# Each is built by its own test (8 MiB each, 1.6 s at import before, in every
# pytest process that collects this file, and held all session).
HUGE: list[tuple[str, Callable[[], bytes]]] = [
    ("a tool of empty lists", lambda: filled(b'{"tools":[{"a":[', b"[]", b']}],"messages":[]}')),
    ("empty tools", lambda: filled(b'{"tools":[', b"[]", b'],"messages":[]}')),
    (
        "empty content parts",
        lambda: filled(
            b'{"messages":[{"role":"user","content":[', b'{"type":"text","text":""}', b"]}]}"
        ),
    ),
    ("empty messages", lambda: filled(b'{"messages":[', b"{}", b"]}")),
    ("token ids", lambda: filled(b'{"prompt":[', b"7", b"]}")),
    ("a batch of one token list", lambda: filled(b'{"prompt":[[', b"7", b"]]}")),
    ("prompt strings", lambda: filled(b'{"prompt":[', b'"a"', b"]}")),
    (
        "a long content string",
        lambda: b'{"messages":[{"role":"user","content":"' + b"\\n" * (4 * MiB) + b'"}]}',
    ),
]


@pytest.mark.parametrize(("name", "build"), HUGE, ids=[name for name, _ in HUGE])
def test_the_key_of_a_huge_body_allocates_in_proportion_to_the_prefix(
    name: str, build: Callable[[], bytes]
) -> None:
    # Before the bounded reading, every element became an object: 8 MiB of
    # empty lists or parts allocated 60-500 MB (and took seconds of the loop).
    body = build()
    prompt_key(decode_openai(b"{}" + b" " * FAST_BODY_BYTES, 4096), 4096)  # types built once
    tracemalloc.start()
    try:
        key = prompt_key(decode_openai(body, 4096), 4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 0 < len(key) <= 3 * 4096
    assert peak < 2 * MiB, f"{name}: {peak / MiB:.1f} MiB for 8 MiB"


# -- the two rules that bound it, and what is no longer type-checked ------------


def key(body: object, limit: int = 1024) -> bytes:
    return prompt_key(decode_openai(json.dumps(body).encode(), limit), limit)


@pytest.mark.parametrize("padding", [0, FAST_BODY_BYTES])  # both readers
def test_the_text_ends_after_prefix_length_content_parts(padding: int) -> None:
    empty = {"type": "text", "text": ""}
    last = {"role": "user", "content": [empty] * 1022 + [{"type": "text", "text": "last"}]}
    past = {"role": "user", "content": [empty] * 1024 + [{"type": "text", "text": "past"}]}
    after = {"role": "user", "content": "after"}
    pad = "p" * padding
    assert (
        key({"messages": [last, after], "pad": pad})
        == f"{RS}user{US}last{RS}user{US}after".encode()
    )
    assert key({"messages": [past, after], "pad": pad}) == f"{RS}user{US}".encode()


def test_a_tool_longer_than_the_canonical_budget_is_keyed_by_its_text() -> None:
    small = {"b": [2, 1], "a": "y" * 100}
    big = {"b": [2, 1], "a": "y" * TOOL_CANONICAL_BYTES}
    message = {"role": "user", "content": "hi"}
    canonical = key({"tools": [small], "messages": [message]}, 4096).decode()
    assert canonical.startswith(f'{RS}tools{US}[{{"a":"yyy')  # keys sorted
    as_sent = key({"tools": [big], "messages": [message]}, 4096).decode()
    assert as_sent.startswith(f'{RS}tools{US}[{{"b": [2, 1], "a": "yyy')  # json.dumps spacing
    assert len(as_sent) == 4096


def test_what_the_key_does_not_read_is_not_type_checked() -> None:
    long_first = {"role": "system", "content": "x" * 2000}
    bad_late = {"role": 5, "content": {"not": "text"}}
    for padding in (0, FAST_BODY_BYTES):  # both readers
        body = {"messages": [long_first, *[{"role": "user"}] * 600, bad_late], "pad": "p" * padding}
        assert key(body) == f"{RS}system{US}".encode() + b"x" * (1024 - 8)
        body["messages"] = [bad_late]
        with pytest.raises(BadRequest) as info:
            key(body)
        assert info.value.param == "messages[0].role"


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (
            b'{"messages": [{"content": [{"type": "text", "text": 5}]}]}',
            "got `int`",
            "messages[0].content[0].text",
        ),
        (b'{"input": [{"content": 7}]}', "Expected `str | array | null`", "input[0].content"),
        (b'{"messages": [5]}', "Expected `object`, got `int`", "messages[0]"),
        (b'{"prompt": [1, 2.5]}', "Expected `int | str | array`, got `float`", "prompt[1]"),
        (b'{"prompt": [[1, "a"]]}', "Expected `int`, got `str`", "prompt[0][1]"),
        (b'{"prompt": [1, "a"]}', "non-negative integers", "prompt"),
        (b'{"messages": [{"content": "caf\xe9"}]}', "not valid JSON", None),
        (b'{"tools": [1e400]}', "invalid tools[0]", "tools"),
    ],
)
@pytest.mark.parametrize("padding", [0, FAST_BODY_BYTES])
def test_errors_name_the_field_whichever_reader_finds_them(
    body: bytes, message: str, param: str | None, padding: int
) -> None:
    body = body[:-1] + b', "pad": "' + b"p" * padding + b'"}'
    with pytest.raises(BadRequest) as info:
        prompt_key(decode_openai(body, 1024), 1024)
    assert message in str(info.value)
    assert info.value.param == param


def test_a_body_read_for_a_shorter_prefix_is_read_again_when_that_was_not_enough() -> None:
    body = json.dumps({"messages": [{"role": ""}] * 3000, "pad": "p" * FAST_BODY_BYTES}).encode()
    request = decode_openai(body, 1024)  # sized for the least PrefixLength
    assert isinstance(request, BoundedRequest)
    assert prompt_key(request, 4096) == f"{RS}{US}".encode() * 2048
    assert prompt_key(decode_openai(body), 4096) == f"{RS}{US}".encode() * 2048
    ids = json.dumps({"prompt": list(range(2000)), "pad": "p" * FAST_BODY_BYTES}).encode()
    assert prompt_key(decode_openai(ids), 8000) == array("I", range(2000)).tobytes()
    assert prompt_key(decode_openai(ids, 1024), 8000) == array("I", range(2000)).tobytes()
    assert isinstance(decode_openai(ids[:100] + b"]}"), OpenAIRequest)
