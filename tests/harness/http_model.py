"""The reference model of one client connection through the router: pure, bytes in, verdicts out.

A ``Request`` is one pipelined request as the client writes it (``wire``) and
carries its own script for the backend (the ``X-Model`` header: which framing
to answer with and how many body bytes), so the model knows, without running
anything, what the client must read back and what the backends must receive:

- ``model_of(requests)``: every request before the first refused one (a
  malformed request) or up to and including the first ``Connection: close``
  one is forwarded once and answered, in order; nothing after it is.
- ``check_stream(data, eof, model)`` parses what the client read so far
  (strictly: status line, header syntax, framing) and raises
  ``AssertionError`` at the first departure from the model; with
  ``final=True`` it also requires every answer to be there and the
  connection to be closed exactly when the model says.

Bodies are patterns that name their request (``r3.r3.r3``), so a response or
a body delivered to the wrong request is caught, not just a wrong length.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "FRAMINGS",
    "KINDS",
    "MALFORMED",
    "Model",
    "Request",
    "Response",
    "check_stream",
    "model_of",
    "parse_stream",
    "pattern",
]

# Request kinds, simplest first (hypothesis shrinks towards the first).
KINDS = ("get", "head", "openai", "native", "chunked", "expect", "malformed")
# How the backend frames its answer: Content-Length, chunked, until it closes, 204.
FRAMINGS = ("cl", "chunked", "close", "204")

HOST = b"Host: model.test\r\n"

# Requests the router must refuse, each with the status of its refusal.  Every
# one is caught by the head or by the first body byte, before any routing: none
# of its bytes may reach a backend.  ``%d`` is the request's ident.
MALFORMED: tuple[tuple[bytes, int], ...] = (
    # a space in a header name
    (b"GET /bad?id=%d HTTP/1.1\r\n" + HOST + b"Bad Header: 1\r\n\r\n", 400),
    # two different Content-Lengths
    (
        b"POST /invocations?id=%d HTTP/1.1\r\n" + HOST + b"Content-Length: 3\r\n"
        b"Content-Length: 5\r\n\r\nabcde",
        400,
    ),
    # Content-Length with Transfer-Encoding (the classic smuggling pair)
    (
        b"POST /invocations?id=%d HTTP/1.1\r\n" + HOST + b"Content-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    # bare LF line ends
    (b"GET /bad?id=%d HTTP/1.1\nHost: model.test\n\n", 400),
    # a Transfer-Encoding that does not end in chunked (llhttp says so after the head)
    (
        b"POST /invocations?id=%d HTTP/1.1\r\n"
        + HOST
        + b"Transfer-Encoding: chunked, gzip\r\n\r\n",
        400,
    ),
    # a chunk size that is not hex, first byte of the body
    (
        b"POST /invocations?id=%d HTTP/1.1\r\n"
        + HOST
        + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
        400,
    ),
    # a head over max_header_bytes (32 KiB)
    (b"GET /bad?id=%d HTTP/1.1\r\n" + HOST + b"X-Big: " + b"b" * 33_000 + b"\r\n\r\n", 431),
)


@functools.lru_cache(maxsize=256)
def pattern(tag: bytes, size: int) -> bytes:
    """``size`` bytes of ``tag.tag.tag``: a body that names its request."""
    unit = tag + b"."
    return (unit * (size // len(unit) + 1))[:size]


@dataclass(frozen=True)
class Request:
    """One pipelined request and the backend's scripted answer to it."""

    ident: int = 0
    kind: str = "get"
    framing: str = "cl"  # the backend's answer: FRAMINGS
    size: int = 0  # response body bytes
    body: int = 0  # request body bytes (prompt characters for openai)
    pieces: tuple[int, ...] = ()  # chunk sizes of a chunked body (the rest in one more)
    pad: int = 0  # bytes of an X-Pad header, to make heads large
    close: bool = False  # Connection: close
    variant: int = 0  # which MALFORMED entry, for kind "malformed"

    @property
    def refused(self) -> bool:
        return self.kind == "malformed"

    @property
    def refusal_status(self) -> int:
        return MALFORMED[self.variant % len(MALFORMED)][1]

    @property
    def method(self) -> bytes:
        return {"get": b"GET", "head": b"HEAD"}.get(self.kind, b"POST")

    @property
    def target(self) -> bytes:
        if self.kind == "openai":
            return b"/v1/completions?id=%d" % self.ident
        if self.method == b"POST":
            return b"/invocations?id=%d" % self.ident
        return b"/%s?id=%d" % (self.kind.encode(), self.ident)

    def request_body(self) -> bytes:
        """The body the backend must receive (de-chunked)."""
        if self.kind == "openai":
            prompt = pattern(b"q%d" % self.ident, self.body).decode()
            return json.dumps({"model": "m", "prompt": prompt}).encode()
        if self.kind in ("native", "chunked", "expect"):
            return pattern(b"q%d" % self.ident, self.body)
        return b""

    def wire(self) -> bytes:
        """The bytes the client writes."""
        if self.refused:
            return MALFORMED[self.variant % len(MALFORMED)][0].replace(b"%d", b"%d" % self.ident)
        head = [b"%s %s HTTP/1.1\r\n" % (self.method, self.target), HOST]
        head.append(b"X-Model: %d %s %d\r\n" % (self.ident, self.framing.encode(), self.size))
        if self.pad:
            head.append(b"X-Pad: %s\r\n" % (b"p" * self.pad))
        if self.close:
            head.append(b"Connection: close\r\n")
        body = self.request_body()
        if self.kind == "chunked":
            head.append(b"Transfer-Encoding: chunked\r\n\r\n")
            return b"".join(head) + _chunked(body, self.pieces)
        if self.kind == "expect":
            head.append(b"Expect: 100-continue\r\n")
        if self.method == b"POST":
            head.append(b"Content-Length: %d\r\n" % len(body))
        return b"".join(head) + b"\r\n" + body

    # -- what the client must read back ------------------------------------------

    @property
    def status(self) -> int:
        return 204 if self.framing == "204" else 200

    def response_body(self) -> bytes:
        if self.method == b"HEAD" or self.framing == "204":
            return b""
        return pattern(b"r%d" % self.ident, self.size)


def _chunked(body: bytes, pieces: Sequence[int]) -> bytes:
    out, at = [], 0
    for size in [*pieces, len(body)]:
        piece = body[at : at + size]
        at += len(piece)
        if piece:
            out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
    return b"".join(out) + b"0\r\n\r\n"


@dataclass(frozen=True)
class Model:
    """What the router must do with a sequence of pipelined requests."""

    answered: tuple[Request, ...]  # answered in this order, and forwarded once each
    refused: Request | None  # the first refused request, if any
    ends: bool  # the router closes the connection after the answers

    @property
    def forwarded(self) -> tuple[Request, ...]:
        return self.answered


def model_of(requests: Iterable[Request]) -> Model:
    answered = []
    for request in requests:
        if request.refused:
            return Model(tuple(answered), request, ends=True)
        answered.append(request)
        if request.close:
            return Model(tuple(answered), None, ends=True)
    return Model(tuple(answered), None, ends=False)


# -- the client's side: parsing what it read ----------------------------------------

_STATUS_LINE = re.compile(rb"HTTP/1\.1 (\d{3}) [^\r\n]*")
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEX = re.compile(rb"[0-9a-fA-F]{1,16}")


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    interim: int  # 100 Continue heads before it

    def value(self, name: bytes) -> bytes | None:
        values = [v for n, v in self.headers if n.lower() == name]
        assert len(values) <= 1, f"{name!r} appears {len(values)} times in {self.headers}"
        return values[0] if values else None


def _head(data: bytes, at: int) -> tuple[int, list[tuple[bytes, bytes]], int] | None:
    end = data.find(b"\r\n\r\n", at)
    if end < 0:
        assert len(data) - at < 65536, f"no end of response head in {data[at : at + 200]!r}"
        return None
    lines = data[at:end].split(b"\r\n")
    match = _STATUS_LINE.fullmatch(lines[0])
    assert match, f"bad status line {lines[0][:200]!r} at offset {at}"
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        assert colon, f"bad header line {line[:200]!r}"
        assert _TOKEN.fullmatch(name), f"bad header name in {line[:200]!r}"
        headers.append((name, value.strip(b" \t")))
    return int(match[1]), headers, end + 4


def _chunks(data: bytes, at: int) -> tuple[bytes, int] | None:
    pieces = []
    while True:
        eol = data.find(b"\r\n", at)
        if eol < 0:
            return None
        assert _HEX.fullmatch(data[at:eol]), f"bad chunk size line {data[at : eol + 2][:80]!r}"
        size = int(data[at:eol], 16)
        at = eol + 2
        if len(data) < at + size + 2:
            return None
        assert data[at + size : at + size + 2] == b"\r\n", "a chunk not followed by CRLF"
        if size == 0:
            return b"".join(pieces), at + 2
        pieces.append(data[at : at + size])
        at += size + 2


def parse_stream(data: bytes, methods: Iterable[bytes]) -> tuple[list[Response], int]:
    """The complete responses at the start of ``data`` (``methods``: their requests'
    methods, in order; GET after them), and the offset where the incomplete rest starts."""
    responses: list[Response] = []
    at = 0
    for method in itertools.chain(methods, itertools.repeat(b"GET")):
        start, interim = at, 0
        while True:
            head = _head(data, at)
            if head is None:
                return responses, start
            status, headers, at = head
            if status != 100:
                break
            assert not headers, f"a 100 Continue with headers {headers}"
            interim += 1
        assert status >= 200, f"unexpected interim status {status}"
        resp = Response(status, headers, b"", interim)
        te, cl = resp.value(b"transfer-encoding"), resp.value(b"content-length")
        if method == b"HEAD" or status in (204, 304):
            pass
        elif te is not None:
            assert te.lower() == b"chunked", f"Transfer-Encoding {te!r}"
            assert cl is None, f"Transfer-Encoding with Content-Length {cl!r}"
            chunks = _chunks(data, at)
            if chunks is None:
                return responses, start
            resp.body, at = chunks
        else:
            assert cl is not None, f"a {status} response to an HTTP/1.1 client without framing"
            if len(data) < at + int(cl):
                return responses, start
            resp.body = data[at : at + int(cl)]
            at += int(cl)
        responses.append(resp)
    raise AssertionError("unreachable")  # pragma: no cover


def _describe(body: bytes) -> str:
    return f"{len(body)} bytes {body[:40]!r}"


def check_stream(data: bytes, eof: bool, model: Model, *, final: bool = False) -> int:
    """Raise AssertionError where what the client read departs from ``model``.

    ``eof``: the router closed (or reset) the connection after ``data``.  With
    ``final``, the client has read all it will: every answer must be there.
    Returns the number of answers read.
    """
    responses, rest = parse_stream(data, [r.method for r in model.answered])
    answered = model.answered
    for i, resp in enumerate(responses):
        if i >= len(answered):
            refused = model.refused
            extra = (
                f"response {i} ({resp.status} {_describe(resp.body)}) answers no request: "
                f"the model answers {len(answered)} and then "
                + ("refuses one" if refused else "closes" if model.ends else "waits")
            )
            assert refused is not None, extra
            assert i == len(answered), extra
            assert resp.status == refused.refusal_status, (
                f"the refusal of request {refused.ident} is a {resp.status}, "
                f"not a {refused.refusal_status}: {_describe(resp.body)}"
            )
            assert json.loads(resp.body)["error"]["code"] == resp.status
            assert resp.value(b"connection") == b"close", "a refusal without Connection: close"
            continue
        request = answered[i]
        what = f"response {i} (request {request.ident}: {request.kind}, backend {request.framing})"
        assert resp.status == request.status, (
            f"{what}: status {resp.status}, expected {request.status}; {_describe(resp.body)}"
        )
        assert resp.value(b"x-model-id") == b"%d" % request.ident, (
            f"{what}: answered by the backend for request {resp.value(b'x-model-id')!r}"
        )
        expected = request.response_body()
        assert resp.body == expected, (
            f"{what}: body {_describe(resp.body)}, expected {len(expected)}"
        )
        assert resp.interim <= (1 if request.kind == "expect" else 0), (
            f"{what}: {resp.interim} interim 100 Continue heads"
        )
        if request.close:
            assert resp.value(b"connection") == b"close", f"{what}: no Connection: close"
    if eof or final:
        assert len(responses) >= len(answered), (
            f"{len(responses)} of {len(answered)} answers, then "
            + ("the connection closed" if eof else "nothing")
            + (f"; {len(data) - rest} bytes of an incomplete one" if rest < len(data) else "")
        )
        assert rest == len(data), f"stray bytes after the last answer: {data[rest : rest + 80]!r}"
        if model.ends:
            assert eof or not final, "the connection stayed open after its last answer"
        else:
            assert not eof, "the router closed a keep-alive connection with nothing refused"
    return len(responses)
