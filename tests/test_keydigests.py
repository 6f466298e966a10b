"""Key digests (router.keydigests): each digest is the routing hash the request's
prefix key would have at that PrefixLength, whatever the body's shape or pieces."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from hashring import hash_key, tenant_seed
from loadtests.advise import key_body
from router.config import parse_routing
from router.extract import decode_openai, prompt_key
from router.keydigests import KeyDigester, NativeDigests, digest_of, openai_digests
from tests.harness.backends import StartBackend, echo
from tests.harness.http import connect, req
from tests.harness.routers import StartRouter

LENGTHS = (1024, 1500, 2048, 4096, 8192)

# Text of one to four UTF-8 bytes a character, so that characters and bytes differ.
TEXT = st.text(alphabet=st.sampled_from("abc é€\U0001f600"), max_size=3000)


def expected(body: bytes, lengths: tuple[int, ...], seed: int) -> list[str]:
    """The digests by definition: the key at each length, as the router keys it."""
    request = decode_openai(body, 4096)
    out = []
    previous = None
    for g in lengths:
        key = prompt_key(request, g)
        if key == previous:  # the whole key at the length before: the list stopped
            break
        out.append(digest_of(hash_key(key, seed)))
        previous = key
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["system", "user"]), TEXT), min_size=1, max_size=6),
    st.sampled_from([1024, 2048, 4096]),
    st.sampled_from([None, "tenant-a"]),
    st.booleans(),
)
def test_openai_digests_are_the_keys_at_each_length(
    messages: list[tuple[str, str]], limit: int, tenant: str | None, session: bool
) -> None:
    body = msgspec.json.encode(
        {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages]}
    )
    request = decode_openai(body, limit)
    seed = tenant_seed(tenant)
    lengths = KeyDigester(LENGTHS).lengths(limit)
    key = b"" if session else prompt_key(request, limit)  # a session keyed it: no prompt key
    got = openai_digests(request, key, limit, seed, lengths)
    want = expected(body, lengths, seed)
    assert got.digests == want[: len(got.digests)]
    whole = prompt_key(request, 100_000).decode("utf-8", "surrogatepass")
    if len(whole) <= lengths[-1]:
        assert got.length == len(whole)
        assert got.digests == want  # stops at the first length holding the whole key
    else:
        assert got.length is None
        assert len(got.digests) == len(lengths)
    if not session and len(whole) > limit:
        at = lengths.index(limit)
        assert got.digests[at] == digest_of(hash_key(prompt_key(request, limit), seed))


def test_token_id_prompts_are_digested_by_their_ids() -> None:
    for count, length, digests in ((3000, None, 5), (1500, 6000, 5), (300, 1200, 2)):
        body = msgspec.json.encode({"model": "m", "prompt": list(range(count))})
        request = decode_openai(body, 4096)
        got = openai_digests(request, prompt_key(request, 4096), 4096, 0, LENGTHS)
        assert got.digests == expected(body, LENGTHS, 0)[:digests]
        assert (got.length, len(got.digests)) == (length, digests)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=10_000), st.data(), st.integers(0, 2**32 - 1))
def test_native_digests_are_the_body_prefixes_however_it_is_split(
    body: bytes, data: st.DataObject, seed: int
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=6)))
    pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    digests = NativeDigests(LENGTHS, seed)
    for piece in pieces:
        digests.feed(memoryview(piece) if len(piece) % 2 else piece)
    assert digests.field().length is None  # not ended: its size is not known yet
    digests.ended()
    field = digests.field()
    want = []
    for g in LENGTHS:
        want.append(digest_of(hash_key(body[:g], seed)))
        if len(body) <= g:
            break
    assert field.digests == want
    assert field.length == len(body)


# -- the access line, through the real Router ------------------------------------


async def test_access_lines_carry_the_digests_and_no_text(
    backends: StartBackend, start_router: StartRouter, tmp_path: Path
) -> None:
    """OpenAI (prompt, session header, tenant), native (in pieces): each line's digests
    are its key's at each length, the one at PrefixLength the line's prefix_hash."""
    backend = await backends(echo)
    log = tmp_path / "access.log"
    router = await start_router(
        [backend.spec],
        access_log=str(log),
        advisor={"key_digests": True, "lengths": [1024, 8192]},
        routing={"PrefixAwareRoutingConfig": {"PrefixLength": 2048}},
    )
    document = "Clause %d applies. " * 500 % tuple(range(500))  # ~10,000 characters
    chat = json.dumps(
        {"model": "m", "messages": [{"role": "system", "content": document}]}
    ).encode()
    short = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    native = document.encode()[:5000]
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions", body=chat))
        await client.send(req(b"POST", b"/v1/chat/completions", body=short))
        session = b"X-Session-Id: s-1\r\nX-Amzn-SageMaker-Prefix-Aware-Id: t\r\n"
        await client.send(req(b"POST", b"/v1/chat/completions", body=chat, headers=session))
        await client.send(req(b"POST", b"/invocations", chunks=[native[:1500], native[1500:]]))
        await client.send(req(b"GET", b"/v1/models"))
        for _ in range(5):
            assert (await client.response()).status == 200
    router.access.sync()
    text = log.read_text()
    assert "Clause" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    prompt, hi, sessioned, body, passthrough = lines
    lengths = [1024, 2048, 8192]
    request = decode_openai(chat, 2048)
    want = [digest_of(hash_key(prompt_key(request, g))) for g in lengths]
    assert prompt["key_digests"] == {"lengths": lengths, "digests": want, "length": None}
    assert prompt["prefix_hash"].startswith(want[1])  # routed at 2,048
    key = prompt_key(decode_openai(short, 2048), 2048)
    assert hi["key_digests"] == {
        "lengths": lengths,
        "digests": [digest_of(hash_key(key))],
        "length": len(key),
    }
    assert sessioned["key_source"] == "header"  # routed by the session, digests of its prompt
    seed = tenant_seed("t")
    assert sessioned["key_digests"]["digests"] == [
        digest_of(hash_key(prompt_key(request, g), seed)) for g in lengths
    ]
    assert body["key_digests"] == {
        "lengths": lengths,
        "digests": [digest_of(hash_key(native[:g])) for g in lengths[:2]]
        + [digest_of(hash_key(native))],
        "length": 5000,
    }
    assert "key_digests" not in passthrough  # no key, no digests
    # A captured body sample (prefix-router advise --bodies) is keyed as the log keys it.
    routing = parse_routing({"PrefixAwareRoutingConfig": {"PrefixLength": 2048}})
    headers = {"X-Session-Id": "s-1", "X-Amzn-SageMaker-Prefix-Aware-Id": "t"}
    for line, path, sent, body_bytes in (
        (prompt, "/v1/chat/completions", {}, chat),
        (hi, "/v1/chat/completions", {}, short),
        (sessioned, "/v1/chat/completions", headers, chat),
        (body, "/invocations", {}, native),
    ):
        source, digest, digests = key_body(path, sent, body_bytes, routing, (1024, 8192))
        assert (source, digest) == (line["key_source"], line["prefix_hash"])
        assert json.loads(msgspec.json.encode(digests)) == line["key_digests"]


async def test_off_by_default_the_line_is_unchanged(
    backends: StartBackend, start_router: StartRouter, tmp_path: Path
) -> None:
    backend = await backends(echo)
    log = tmp_path / "access.log"
    router = await start_router([backend.spec], access_log=str(log))
    assert router.key_digests is None
    async with connect(router) as client:
        await client.send(req(b"POST", b"/invocations", body=b"x" * 3000))
        assert (await client.response()).status == 200
    router.access.sync()
    [line] = log.read_text().splitlines()
    assert "key_digests" not in json.loads(line)
