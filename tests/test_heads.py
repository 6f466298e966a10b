"""The head rules (``router/heads.py``) on byte vectors, each parsed split at every offset.

As h11's tests do: the raw head goes through the parser the data plane uses
(httptools), in two pieces cut at each byte offset, and the rules must give
the same answer every time — the forwarded head byte for byte, or the same
refusal.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httptools
import pytest

from router.heads import (
    CHUNKED,
    LENGTH,
    NO_BODY,
    UNTIL_CLOSE,
    Kind,
    Request,
    read_request,
    read_response,
    upstream_head,
)

VIA = b"prefix-router-0badcafe"
TAIL = b"\r\nx-forwarded-proto: http\r\nvia: 1.1 " + VIA


@dataclass
class Parsed:
    method: bytes = b""
    url: bytes = b""
    status: int = 0
    http10: bool = False
    keep_alive: bool = True
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    done: bool = False


class _Callbacks:
    def __init__(self, parsed: Parsed):
        self.parsed = parsed
        self.parser: httptools.HttpRequestParser | httptools.HttpResponseParser

    def on_url(self, url: bytes) -> None:
        self.parsed.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.parsed.headers.append((name, value))

    def on_headers_complete(self) -> None:
        parsed, parser = self.parsed, self.parser
        parsed.http10 = parser.get_http_version() == "1.0"
        parsed.keep_alive = parser.should_keep_alive()
        if isinstance(parser, httptools.HttpRequestParser):
            parsed.method = parser.get_method()
        else:
            parsed.status = parser.get_status_code()
        parsed.done = True


def parse(raw: bytes, cut: int, *, response: bool = False) -> Parsed:
    parsed = Parsed()
    callbacks = _Callbacks(parsed)
    kind = httptools.HttpResponseParser if response else httptools.HttpRequestParser
    callbacks.parser = kind(callbacks)
    callbacks.parser.feed_data(raw[:cut])
    callbacks.parser.feed_data(raw[cut:])
    assert parsed.done
    return parsed


def every_cut(raw: bytes, *, response: bool = False) -> list[Parsed]:
    return [parse(raw, cut, response=response) for cut in range(len(raw) + 1)]


def forwarded(request: Request) -> bytes:
    return upstream_head(
        request, host=b"10.0.0.1:8000", client_ip=b"192.0.2.7", tail=TAIL, request_id=b"rid"
    )


def read(parsed: Parsed) -> Request:
    return read_request(
        parsed.method, parsed.url, parsed.headers, http10=parsed.http10, via_name=VIA
    )


# -- requests that go on --------------------------------------------------------------

FORWARDED = [
    pytest.param(
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\nAccept: */*\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: r\r\nAccept: */*\r\n"
        b"x-forwarded-for: 192.0.2.7" + TAIL + b"\r\nx-request-id: rid\r\n\r\n",
        id="plain-get",
    ),
    pytest.param(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Length: 2\r\n"
        b"Connection: keep-alive, X-Secret\r\nX-Secret: s\r\nKeep-Alive: 5\r\nTE: trailers\r\n"
        b"Proxy-Authorization: Basic x\r\nProxy: http://evil\r\nX-Forwarded-Proto: https\r\n"
        b"X-Forwarded-For: 1.1.1.1\r\nX-Forwarded-For: 2.2.2.2, 3.3.3.3\r\n"
        b"X-Request-Id: client-id\r\nAuthorization: Bearer k\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nAuthorization: Bearer k\r\n"
        b"content-length: 2\r\nx-forwarded-for: 1.1.1.1, 2.2.2.2, 3.3.3.3, 192.0.2.7"
        + TAIL
        + b"\r\nx-request-id: rid\r\n\r\n",
        id="hop-by-hop-proxy-and-forwarding-fields",
    ),
    pytest.param(
        b"POST /invocations HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /invocations HTTP/1.1\r\nHost: r\r\ntransfer-encoding: chunked\r\n"
        b"x-forwarded-for: 192.0.2.7" + TAIL + b"\r\nx-request-id: rid\r\n\r\n",
        id="chunked",
    ),
    pytest.param(
        b"GET /a HTTP/1.1\r\nHost: keep\r\nConnection: host\r\n\r\n",
        b"GET /a HTTP/1.1\r\nHost: keep\r\nx-forwarded-for: 192.0.2.7"
        + TAIL
        + b"\r\nx-request-id: rid\r\n\r\n",
        id="connection-naming-host",
    ),
    pytest.param(
        b"GET /a HTTP/1.0\r\n\r\n",
        b"GET /a HTTP/1.1\r\nhost: 10.0.0.1:8000\r\nx-forwarded-for: 192.0.2.7"
        + TAIL
        + b"\r\nx-request-id: rid\r\n\r\n",
        id="http10-without-host",
    ),
    pytest.param(
        b"GET /a HTTP/1.1\r\nHost: r\r\nVia: 1.0 other-proxy\r\n\r\n",
        b"GET /a HTTP/1.1\r\nHost: r\r\nVia: 1.0 other-proxy\r\nx-forwarded-for: 192.0.2.7"
        + TAIL
        + b"\r\nx-request-id: rid\r\n\r\n",
        id="another-proxys-via",
    ),
]


@pytest.mark.parametrize(("raw", "expected"), FORWARDED)
def test_requests_are_forwarded_byte_for_byte_wherever_the_head_is_cut(
    raw: bytes, expected: bytes
) -> None:
    for parsed in every_cut(raw):
        request = read(parsed)
        assert request.refusal is None
        assert forwarded(request) == expected


def test_the_client_request_id_is_kept_and_the_tenant_read() -> None:
    raw = (
        b"POST /invocations HTTP/1.1\r\nHost: r\r\nX-Request-Id: abc\r\n"
        b"X-Amzn-SageMaker-Prefix-Aware-Id: tenant-1\r\nExpect: 100-continue\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
    for parsed in every_cut(raw):
        request = read(parsed)
        assert (request.request_id, request.tenant) == (b"abc", b"tenant-1")
        assert request.expect_continue
        assert request.bodiless
        assert request.kind is Kind.NATIVE


# -- how requests are classified ---------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "target", "kind"),
    [
        (b"POST", b"/v1/chat/completions", Kind.OPENAI),
        (b"POST", b"/v1/completions?stream=1", Kind.OPENAI),
        (b"POST", b"/v1/responses", Kind.OPENAI),
        (b"POST", b"http://x:8/v1/chat/completions", Kind.OPENAI),
        (b"POST", b"/v1/chat/%63ompletions", Kind.OPENAI),
        (b"POST", b"/v1/x/../chat/./completions", Kind.OPENAI),
        (b"POST", b"//v1//chat/completions", Kind.OPENAI),
        (b"POST", b"/V1/chat/completions", Kind.NATIVE),  # servers match case-sensitively
        (b"POST", b"/v1/chat/completions/x", Kind.NATIVE),
        (b"POST", b"/invocations", Kind.NATIVE),
        (b"GET", b"/v1/chat/completions", Kind.PASSTHROUGH),
        (b"PUT", b"/v1/chat/completions", Kind.PASSTHROUGH),
    ],
)
def test_the_kind_follows_the_path_the_backend_routes_on(
    method: bytes, target: bytes, kind: str
) -> None:
    raw = b"%s %s HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n" % (method, target)
    for parsed in every_cut(raw):
        assert read(parsed).kind is kind


# -- requests that are refused -------------------------------------------------------------

REFUSED = [
    pytest.param(b"GET / HTTP/1.1\r\nHost: r\r\nVia: 1.1 " + VIA + b"\r\n\r\n", 508, id="loop"),
    pytest.param(
        b"GET / HTTP/1.1\r\nVia: 1.1 a, 1.1 " + VIA + b"\r\nHost: r\r\n\r\n", 508, id="loop-2nd"
    ),
    pytest.param(b"GET / HTTP/1.1\r\n\r\n", 400, id="no-host"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, id="two-hosts"),
    pytest.param(b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", 400, id="two-hosts-1.0"),
    pytest.param(
        b"GET / HTTP/1.1\r\nHost: r\r\nX-Amzn-SageMaker-Prefix-Aware-Id: a\r\n"
        b"x-amzn-sagemaker-prefix-aware-id: b\r\n\r\n",
        400,
        id="two-tenants",
    ),
    pytest.param(
        b"POST / HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        501,
        id="gzip-chunked",
    ),
    pytest.param(
        b"POST / HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: gzip\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        501,
        id="gzip-then-chunked-lines",
    ),
    pytest.param(b"GET /a#frag HTTP/1.1\r\nHost: r\r\n\r\n", 400, id="fragment"),
    pytest.param(b"GET / HTTP/1.1\r\nHost: r\r\nExpect: magic\r\n\r\n", 417, id="expect"),
]


@pytest.mark.parametrize(("raw", "status"), REFUSED)
def test_heads_the_router_must_not_forward_are_refused(raw: bytes, status: int) -> None:
    for parsed in every_cut(raw):
        refusal = read(parsed).refusal
        assert refusal is not None
        assert refusal[0] == status


# -- responses ----------------------------------------------------------------------------------

RESPONSES = [
    pytest.param(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\n",
        b"GET",
        False,
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\ncontent-length: 5\r\n",
        LENGTH,
        True,
        id="length",
    ),
    pytest.param(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Request-Id: theirs\r\n\r\n",
        b"GET",
        False,
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n",
        CHUNKED,
        True,
        id="chunked-and-their-request-id",
    ),
    pytest.param(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
        b"GET",
        False,
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n",
        CHUNKED,
        True,
        id="gzip-chunked",
    ),
    pytest.param(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"GET",
        False,
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n",
        CHUNKED,
        False,
        id="gzip-until-close",
    ),
    pytest.param(
        b"HTTP/1.1 200 OK\r\n\r\n",
        b"GET",
        False,
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n",
        CHUNKED,
        False,
        id="until-close-to-1.1",
    ),
    pytest.param(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET",
        True,
        b"HTTP/1.1 200 OK\r\nconnection: close\r\n",
        UNTIL_CLOSE,
        True,
        id="chunked-to-1.0",
    ),
    pytest.param(
        b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
        b"GET",
        False,
        b"HTTP/1.1 204 No Content\r\n",
        NO_BODY,
        True,
        id="204-drops-its-length",
    ),
    pytest.param(
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\nETag: x\r\n\r\n",
        b"GET",
        False,
        b"HTTP/1.1 304 Not Modified\r\nETag: x\r\n",
        NO_BODY,
        True,
        id="304-drops-its-length",
    ),
    pytest.param(
        b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n",
        b"HEAD",
        False,
        b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n",
        NO_BODY,
        True,
        id="head-keeps-the-length",
    ),
    pytest.param(
        b"HTTP/1.1 200 OK\r\nX-Private: p\r\nConnection: X-Private, keep-alive\r\n"
        b"Keep-Alive: timeout=5\r\nContent-Length: 0\r\n\r\n",
        b"GET",
        False,
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n",
        LENGTH,
        True,
        id="connection-named-fields-after-them",
    ),
]


@pytest.mark.parametrize(("raw", "method", "http10", "head", "framing", "framed"), RESPONSES)
def test_responses_are_framed_for_the_client_wherever_the_head_is_cut(
    raw: bytes, method: bytes, http10: bool, head: bytes, framing: int, framed: bool
) -> None:
    for parsed in every_cut(raw, response=True):
        response = read_response(
            parsed.status,
            parsed.headers,
            method=method,
            http10=http10,
            keep_alive=not http10,
            request_id=b"rid",
        )
        assert response is not None
        assert response.head == head + b"x-request-id: rid\r\n\r\n"
        assert (response.framing, response.framed) == (framing, framed)
        assert response.keep_alive is (framing != UNTIL_CLOSE and not http10)


def test_a_keep_alive_http10_client_is_told_so() -> None:
    response = read_response(
        200,
        [(b"Content-Length", b"2")],
        method=b"GET",
        http10=True,
        keep_alive=True,
        request_id=b"r",
    )
    assert response is not None
    assert response.head.endswith(b"connection: keep-alive\r\nx-request-id: r\r\n\r\n")
    assert response.keep_alive


def test_a_transfer_coding_cannot_reach_an_http10_client() -> None:
    headers = [(b"Transfer-Encoding", b"gzip, chunked")]
    assert (
        read_response(200, headers, method=b"GET", http10=True, keep_alive=False, request_id=b"r")
        is None
    )
