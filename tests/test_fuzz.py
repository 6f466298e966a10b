"""Fuzzing: request heads through a real ``ClientConnection``, and prefix extraction.

CI-sized by default (a few seconds each); run longer with, e.g.,

    FUZZ_EXAMPLES=200000 pytest tests/test_fuzz.py -o timeout=0 -p no:cacheprovider

``FUZZ_EXAMPLES`` sets ``max_examples`` for every target here.  Findings
become ``@example`` regressions below (and a row in RELIABILITY.md).

Request heads: mutations of valid requests (random header names and values
with CR, LF and NUL, duplicate framing headers, huge values, odd methods,
targets and versions, byte-level insertions and deletions, pipelining) are fed
to the ``ClientConnection`` of a real ``Router`` (started on port 0, with a
real loopback backend) through a fake transport (bytes in, bytes out: faking
at the socket, as uvicorn's tests do), split at random offsets.  Invariants:

- nothing raises out of ``data_received`` or out of a loop callback;
- the router answers only well-formed HTTP/1.1 responses (parsed by
  ``httptools.HttpResponseParser``), never a 500, never a 504;
- the backend only ever sees requests whose heads llhttp accepted (the same
  bytes fed in the same pieces to a reference parser), with their bodies
  unchanged, and never bytes its own llhttp rejects;
- once the client is gone, no lease is held and no exchange is running.

Extraction: ``decode_openai`` + ``prompt_key`` on arbitrary JSON, structured
chat bodies and mangled bytes: only ``BadRequest`` escapes, the same body
gives the same key, the key is at most ``PrefixLength`` characters (token ids:
bytes), and JSON whitespace and key order do not change it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httptools
import pytest
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

from hashring import TenantKeyError, tenant_seed
from router.app import Router
from router.client import ClientConnection
from router.extract import BadRequest, decode_openai, prompt_key, prompt_text
from tests.harness.backends import Backend, Seen, echo
from tests.harness.routers import StartRouter

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "0")) or None
WAIT = 5.0


def fuzz_settings(default: int) -> settings:
    return settings(
        max_examples=FUZZ_EXAMPLES or default,
        deadline=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,  # one router for all examples, on purpose
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
        ],
    )


# =============================================================================
# Request heads
# =============================================================================


class FakeTransport:
    """The socket end of a ``ClientConnection``: records what the router writes.

    Behaves as asyncio's and uvloop's transports do where the router can tell:
    ``close`` calls ``connection_lost`` soon after, writing after ``write_eof``
    raises, writes after ``close`` are dropped."""

    def __init__(self, protocol: ClientConnection, loop: asyncio.AbstractEventLoop):
        self.protocol = protocol
        self.loop = loop
        self.out = bytearray()
        self.closed = False
        self.eof = False
        self.reading = True
        self.lost = asyncio.Event()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def write(self, data: bytes) -> None:
        if self.eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not self.closed:
            self.out += data

    def writelines(self, pieces: Any) -> None:
        for piece in pieces:
            self.write(piece)

    def is_closing(self) -> bool:
        return self.closed

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.call_soon(self._lost)

    abort = close

    def client_gone(self) -> None:
        """The client closes its end (what the kernel would report)."""
        if not self.closed:
            self.closed = True
            self._lost()

    def _lost(self) -> None:
        if not self.lost.is_set():
            self.lost.set()
            self.protocol.connection_lost(None)


@dataclass
class Message:
    method: bytes
    url: bytes
    body: list[bytes] = field(default_factory=list)
    complete: bool = False


def reference(pieces: list[bytes]) -> list[Message]:
    """llhttp's verdict on the same pieces: the messages the router may forward.

    The router starts a request only once the ``feed_data`` that completed its
    head returned without error; when a piece fails, the messages it completed
    are still served, and the one in progress is refused unless an earlier
    piece had already completed its head (then it was streaming)."""
    accepted: list[Message] = []
    in_piece: list[Message] = []
    current: list[Message] = []
    url = bytearray()

    class Callbacks:
        def on_message_begin(self) -> None:
            url.clear()

        def on_url(self, piece: bytes) -> None:
            url.extend(piece)

        def on_headers_complete(self) -> None:
            message = Message(parser.get_method(), bytes(url))
            in_piece.append(message)
            current[:] = [message]

        def on_body(self, body: bytes) -> None:
            current[0].body.append(body)

        def on_message_complete(self) -> None:
            current[0].complete = True

    callbacks = Callbacks()
    parser = httptools.HttpRequestParser(callbacks)
    for piece in pieces:
        data, failed = piece, False
        while True:
            try:
                parser.feed_data(data)
            except httptools.HttpParserUpgrade as exc:  # ignored, as the router does
                parser = httptools.HttpRequestParser(callbacks)
                data = data[exc.args[0] :]
                if data:
                    continue
            except httptools.HttpParserError:
                failed = True
            break
        accepted += [m for m in in_piece if not (failed and m is current[0] and not m.complete)]
        in_piece.clear()
        if failed:
            break
    return accepted


@dataclass
class Parsed:
    statuses: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    complete: int = 0


def parse_responses(out: bytes) -> Parsed:
    parsed = Parsed()

    class Callbacks:
        def on_headers_complete(self) -> None:
            parsed.statuses.append(parser.get_status_code())
            parsed.versions.append(parser.get_http_version())

        def on_message_complete(self) -> None:
            parsed.complete += 1

    parser = httptools.HttpResponseParser(Callbacks())
    parser.feed_data(out)  # raises on anything malformed
    return parsed


# -- generators ----------------------------------------------------------------------

FRAMING_NAMES = [b"Content-Length", b"Transfer-Encoding", b"content-length", b"TRANSFER-ENCODING"]
COMMON_NAMES = [b"Accept", b"User-Agent", b"X-Request-Id", b"X-Forwarded-For", b"Authorization"]
HEADER_NAMES = [
    b"Host", b"Connection", b"Expect", b"Upgrade", b"Keep-Alive", b"TE", b"Trailer",
    b"Proxy-Connection", b"Proxy-Authorization", b"X-Request-Id", b"X-Forwarded-For",
    b"X-Forwarded-Proto", b"X-Amzn-SageMaker-Prefix-Aware-Id", b"Authorization",
    b"Content-Type", b"Accept", *FRAMING_NAMES,
]  # fmt: skip
HEADER_VALUES = [
    b"chunked", b"identity", b"gzip, chunked", b"chunked, gzip", b"close", b"keep-alive",
    b"upgrade", b"Upgrade, close", b"100-continue", b"100-Continue", b"200-ok", b"h2c",
    b"websocket", b"0", b"1", b"5", b"17", b"-1", b"+5", b" 5 ", b"1, 1", b"5, 6",
    b"18446744073709551616", b"0x10", b"tenant-1", b"k" * 65, b"caf\xc3\xa9", b"",
    b"router.test", b"x\r\nX-Injected: 1", b"a\x00b", b"a\rb", b"a\nb", b"\t", b"\x7f",
]  # fmt: skip
METHODS = [b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"CONNECT", b"TRACE",
           b"PRI", b"get", b"G\x00T", b"", b"POST POST"]  # fmt: skip
TARGETS = [b"/v1/models", b"/v1/chat/completions", b"/v1/completions", b"/v1/responses",
           b"/invocations", b"/health", b"/v1/chat/completions?x=1", b"*", b"http://x/y",
           b"/%00", b"/a b", b"", b"/\xff"]  # fmt: skip
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9", b"http/1.1",
            b"HTTP/1.1 ", b"", b"HTTP/11"]  # fmt: skip
BODIES = [b"", b"{}", b'{"prompt": "hello"}',
          b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}',
          b'{"prompt": "x", "prompt_cache_key": "tenant"}', b'{"inputs": "native"}',
          b"[1,", b"\xff\xfe"]  # fmt: skip


def weighted(
    common: list[bytes], rare: st.SearchStrategy[bytes], odds: int = 8
) -> st.SearchStrategy[bytes]:
    """Mostly one of ``common``; one time in ``odds``, something from ``rare``."""
    return st.integers(1, odds).flatmap(lambda n: rare if n == 1 else st.sampled_from(common))


header_names = weighted(
    COMMON_NAMES, weighted(HEADER_NAMES, st.binary(max_size=12), odds=4), odds=2
)
header_values = weighted(
    HEADER_VALUES,
    st.one_of(st.binary(max_size=24), st.just(b"v" * 40000), st.just(b"v" * 33000)),
    odds=4,
)


@st.composite
def one_request(draw: st.DrawFn) -> bytes:
    method = draw(weighted([b"GET", b"POST", b"POST"], st.sampled_from(METHODS), odds=12))
    target = draw(weighted(TARGETS[:7], st.one_of(st.sampled_from(TARGETS), st.binary(max_size=8))))
    version = draw(weighted([b"HTTP/1.1"], st.sampled_from(VERSIONS), odds=12))
    eol = draw(weighted([b"\r\n"], st.sampled_from([b"\n", b"\r", b"\r\r\n"]), odds=16))
    body = draw(weighted(BODIES, st.binary(max_size=64)))
    framing = draw(weighted(["length", "chunked", "none"], st.just("wrong-length")))
    if framing == "none" and draw(st.integers(0, 7)):
        body = b""  # mostly: no framing, no body (else its bytes start the next request)
    headers = [(b"Host", b"router.test")] if draw(st.integers(0, 9)) else []
    headers += draw(st.lists(st.tuples(header_names, header_values), max_size=3))
    if framing == "length":
        headers.append((b"Content-Length", b"%d" % len(body)))
    elif framing == "wrong-length":
        headers.append((b"Content-Length", b"%d" % max(0, len(body) + draw(st.integers(-3, 3)))))
    elif framing == "chunked":
        headers.append((b"Transfer-Encoding", b"chunked"))
        cut = draw(st.integers(0, len(body)))
        pieces = [p for p in (body[:cut], body[cut:]) if p]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    draw(st.randoms(use_true_random=False)).shuffle(headers)
    lines = [method + b" " + target + b" " + version]
    lines += [name + b": " + value for name, value in headers]
    return eol.join(lines) + eol + eol + body


@st.composite
def mutated(draw: st.DrawFn, data: bytes) -> bytes:
    """A few byte-level mutations: insert CR/LF/NUL/colon/space, delete, duplicate, flip."""
    out = bytearray(data)
    for _ in range(draw(st.integers(0, 3))):
        if not out:
            break
        at = draw(st.integers(0, len(out) - 1))
        op = draw(st.sampled_from(["insert", "delete", "duplicate", "flip"]))
        if op == "insert":
            out[at:at] = draw(st.sampled_from([b"\r", b"\n", b"\0", b":", b" ", b"\t", b"\r\n",
                                               b"\x80", b"0", b","]))  # fmt: skip
        elif op == "delete":
            del out[at : at + draw(st.integers(1, 4))]
        elif op == "duplicate":
            end = at + draw(st.integers(1, 40))
            out[at:at] = out[at:end]
        else:
            out[at] ^= 1 << draw(st.integers(0, 7))
    return bytes(out)


@st.composite
def cases(draw: st.DrawFn) -> tuple[bytes, list[int]]:
    requests = draw(st.lists(one_request(), min_size=1, max_size=3))
    data = b"".join(requests)
    if draw(st.integers(0, 3)) == 0:
        data = draw(mutated(data))
    cuts = draw(st.lists(st.integers(0, max(0, len(data))), max_size=6))
    return data, sorted(set(cuts))


# -- the router under test ------------------------------------------------------------------


@dataclass
class Harness:
    router: Router
    backend: Backend
    loop_errors: list[dict[str, Any]]


@pytest.fixture
async def harness(start_router: StartRouter) -> AsyncIterator[Harness]:
    backend = Backend(echo, "fuzz")
    await backend.start()
    router = await start_router(
        # Long enough that a loaded machine cannot turn a slow echo into a 504.
        [backend.spec],
        timeouts={"first_byte": 10.0, "idle": 10.0},
        health={"active": False},
    )
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    try:
        yield Harness(router, backend, errors)
    finally:
        loop.set_exception_handler(previous)
        await backend.close()


ALLOWED_STATUSES = {100, 200, 400, 405, 413, 414, 417, 431, 501}


async def run_case(h: Harness, data: bytes, cuts: list[int]) -> None:
    router, backend = h.router, h.backend
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    pieces = [p for p in pieces if p]
    heads_before, requests_before = len(backend.heads), len(backend.requests)
    conn = ClientConnection(router)
    transport = FakeTransport(conn, router.loop)
    conn.connection_made(transport)  # type: ignore[arg-type]
    try:
        for piece in pieces:
            if transport.closed or transport.eof:
                break
            conn.data_received(piece)  # must never raise
            await asyncio.sleep(0)  # one loop turn between reads, as from a socket
        # Until nothing more happens without the client: closed, idle, or waiting for it.
        async with asyncio.timeout(WAIT):
            while not (transport.closed or transport.eof):
                current = conn.current
                if current is None and router.active == 0:
                    break
                if current is not None and not current.request_complete:
                    break
                await router.wait_quiet()
                await asyncio.sleep(0)  # let the next queued request start, if any
        transport.client_gone()
        async with asyncio.timeout(WAIT):
            await transport.lost.wait()
            await router.wait_quiet()
        assert router.fleet.loads.total == 0, dict(router.fleet.loads.counts)
        assert conn not in router.connections
    finally:
        transport.client_gone()
    assert h.loop_errors == [], h.loop_errors

    parsed = parse_responses(bytes(transport.out))
    assert set(parsed.versions) <= {"1.1"}, parsed.versions
    assert set(parsed.statuses) <= ALLOWED_STATUSES, (parsed.statuses, bytes(transport.out))
    assert parsed.complete == len(parsed.statuses)  # nothing cut short

    # --hypothesis-show-statistics shows what the run exercised.
    event(f"answered {sorted(set(parsed.statuses))}")
    for line in bytes(transport.out).split(b"\r\n"):
        if line.startswith(b'{"error":'):
            event(line[21:60].decode(errors="replace"))
    event(f"forwarded {min(len(backend.heads) - heads_before, 2)}+")
    assert backend.errors == [], backend.errors  # nothing the backend's llhttp rejects
    accepted = reference(pieces)
    complete = {id(s) for s in backend.requests[requests_before:]}
    position = 0
    for head in backend.heads[heads_before:]:  # an ordered subsequence of what llhttp accepted
        while position < len(accepted) and not same(accepted[position], head, id(head) in complete):
            position += 1
        assert position < len(accepted), (head, accepted)
        position += 1


def same(message: Message, seen: Seen, complete: bool) -> bool:
    """``seen`` by the backend is ``message``: head, and body unchanged if complete."""
    if (message.method, message.url) != (seen.method, seen.target):
        return False
    return not complete or (message.complete and b"".join(message.body) == seen.body)


@fuzz_settings(default=150)
@given(case=cases())
@example(case=(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", []))
@example(case=(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\n\r\n{}", []))
@example(
    case=(
        b"GET / HTTP/1.1\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\nGET /b HTTP/1.1\r\n\r\n",
        [5],
    )
)
@example(
    case=(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2x\r\n{}\r\n0\r\n\r\n", [50])
)
async def test_fuzzed_request_heads_keep_the_router_sound(
    case: tuple[bytes, list[int]], harness: Harness
) -> None:
    note(f"case = {case!r}")  # pytest-asyncio hides the arguments in the report
    await run_case(harness, *case)


class ResetTransport(FakeTransport):
    """A client that reset its end before the router's half-close: the stdlib
    loop's ``write_eof`` shuts the socket down at once and raises ENOTCONN."""

    def write_eof(self) -> None:
        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")


async def test_a_half_close_on_a_reset_client_closes_quietly(harness: Harness) -> None:
    """A refused request closes lingering (half-close, then drain); a client
    already gone makes ``write_eof`` raise on the stdlib loop.  The connection is
    closed, nothing escapes ``data_received`` and the loop logs no error."""
    conn = ClientConnection(harness.router)
    transport = ResetTransport(conn, harness.router.loop)
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n")  # a 400
    async with asyncio.timeout(WAIT):
        await transport.lost.wait()
    assert parse_responses(bytes(transport.out)).statuses == [400]
    assert conn not in harness.router.connections
    assert harness.loop_errors == []


# =============================================================================
# Prefix extraction
# =============================================================================

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(st.characters(exclude_categories=["Cs"]), max_size=30),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=200)


def mostly(good: st.SearchStrategy[Any], odds: int = 6) -> st.SearchStrategy[Any]:
    """``good``; one time in ``odds``, any JSON value instead (a wrong type, mostly)."""
    return st.integers(1, odds).flatmap(lambda n: json_values if n == 1 else good)


content_parts = st.fixed_dictionaries(
    {"type": mostly(st.sampled_from(["text", "input_text", "output_text", "image_url", "x"]))},
    optional={"text": mostly(texts), "image_url": json_values},
)
messages = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "role": mostly(st.sampled_from(["system", "user", "assistant", "tool"]) | texts),
            "content": mostly(st.none() | texts | st.lists(content_parts, max_size=4)),
            "name": texts,
        },
    ),
    max_size=6,
)
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": texts,
        "messages": mostly(messages),
        "prompt": mostly(
            texts
            | st.lists(texts, max_size=3)
            | st.lists(st.integers(-5, 2**33), max_size=20)
            | st.lists(st.lists(st.integers(0, 2**32), max_size=10), max_size=3)
        ),
        "input": mostly(texts | messages),
        "instructions": mostly(texts),
        "tools": mostly(st.lists(json_values, max_size=3)),
        "prompt_cache_key": mostly(st.text(max_size=70)),
        "stream": mostly(st.booleans()),
        "max_tokens": json_values,
    },
)
limits = st.integers(1, 4096)


def key_of(body: bytes, limit: int) -> bytes | None:
    """The routing key, or None for a BadRequest; anything else propagates."""
    try:
        request = decode_openai(body)
        with contextlib.suppress(TenantKeyError):  # the router's 400; not this target's
            tenant_seed(request.prompt_cache_key)
        key = prompt_key(request, limit)
    except BadRequest as exc:
        event(f"BadRequest: {str(exc)[:30]}")
        return None
    event("routed" + (" (cut at the limit)" if len(key) >= limit else ""))
    text = prompt_text(request, limit)
    assert len(text) <= limit
    if key != text.encode("utf-8", "surrogatepass"):
        assert len(key) <= limit  # token ids, 4 bytes each
        assert len(key) % 4 == 0
    return key


@fuzz_settings(default=150)
@given(body=bodies, limit=limits, seed=st.integers(0, 2**32))
def test_extraction_of_structured_bodies(body: dict[str, Any], limit: int, seed: int) -> None:
    compact = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    key = key_of(compact, limit)
    assert key_of(compact, limit) == key  # the same body, the same key
    # JSON whitespace and key order do not change an OpenAI key.
    items = list(body.items())
    random.Random(seed).shuffle(items)
    spaced = json.dumps(dict(items), indent=2).encode()  # and \u escapes for non-ASCII
    assert key_of(spaced, limit) == key


@fuzz_settings(default=150)
@given(value=json_values, limit=limits)
def test_extraction_of_arbitrary_json(value: Any, limit: int) -> None:
    body = json.dumps(value).encode()
    assert key_of(body, limit) == key_of(body, limit)


@fuzz_settings(default=150)
@given(body=bodies, limit=limits, data=st.data())
def test_extraction_of_mangled_bytes(body: dict[str, Any], limit: int, data: st.DataObject) -> None:
    raw = data.draw(mutated(json.dumps(body).encode()))
    assert key_of(raw, limit) == key_of(raw, limit)
    garbage = data.draw(st.binary(max_size=200))
    key_of(garbage, limit)
