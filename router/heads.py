"""The HTTP/1.1 head rules of a reverse proxy, without I/O: what goes on, what is refused.

Contract:
- Pure functions over heads that llhttp has already parsed (syntax, framing
  conflicts and header-line rules are its job, see ``client.py``): no
  sockets, no clock, no router state; bytes and tuples in, bytes and plain
  objects out.  The data plane calls them once per request and once per
  response; tests call them on byte vectors.
- ``read_request`` decides what a request head means and what is forwarded:
  hop-by-hop fields (RFC 9110 7.6.1: ``HOP_BY_HOP`` and every field named in
  ``Connection``, except ``Host``), ``Proxy-*`` (credentials meant for us;
  ``Proxy:`` is httpoxy's way into CGI backends) and ``X-Forwarded-Proto``
  are dropped; ``X-Forwarded-For`` lines are gathered (``upstream_head``
  appends the client's address), ``X-Request-Id`` is kept for the response.
  It never raises: a head the router must not forward comes back with
  ``refusal`` set to (status, message), checked in this order — our own
  ``Via`` entry (508: a loop), not exactly one ``Host`` on HTTP/1.1 or more
  than one on HTTP/1.0 (400, RFC 9112 3.2), a repeated tenant header (400:
  the backend and the router could read different values; the session
  header too, ``router.sessions``), a transfer
  coding other than ``chunked`` (501, RFC 9112 6.1), a ``#fragment`` (400),
  an ``Expect`` other than ``100-continue`` (417).
- ``path`` is the path the backend's framework routes on
  (``wire.request_path``), so the kind is decided on what the backend will
  serve, whatever the spelling.
- ``upstream_head`` writes the request head a backend receives: origin
  target as sent, HTTP/1.1, the kept fields in order, our framing (chunked
  or a length), a ``Host`` for HTTP/1.0 clients that sent none, then
  ``X-Forwarded-For``, ``X-Forwarded-Proto``, ``Via`` and ``X-Request-Id``.
- ``read_response`` decides how a response is framed towards the client and
  writes its head: no body for HEAD, 204 and 304 (and no length on 204 or
  304); the backend's length if it sent one; else chunked to HTTP/1.1
  clients, with the backend's other transfer codings kept in front, and
  read-until-close to HTTP/1.0 clients (which cannot take a transfer coding:
  None, the exchange answers 502).  ``framed`` says whether the backend's
  body has its own end (a length or a final chunked coding) or ends with
  the connection.
"""

from __future__ import annotations

import enum

from .extract import OPENAI_PATHS
from .wire import HOP_BY_HOP, request_path, status_line

__all__ = [
    "CHUNKED",
    "LENGTH",
    "NO_BODY",
    "TENANT_HEADER",
    "UNTIL_CLOSE",
    "Kind",
    "Request",
    "Response",
    "read_request",
    "read_response",
    "upstream_head",
]

TENANT_HEADER = b"x-amzn-sagemaker-prefix-aware-id"

# Response framing towards the client.
NO_BODY, LENGTH, CHUNKED, UNTIL_CLOSE = 0, 1, 2, 3


class Kind(enum.StrEnum):
    """What routing reads of a request; members are the strings the access log writes."""

    PASSTHROUGH = "passthrough"  # no key: least outstanding
    OPENAI = "openai"  # the extracted prompt text
    NATIVE = "native"  # the first PrefixLength bytes of the raw body


class Request:
    """A request head as the router reads it; ``headers`` are the ones forwarded."""

    __slots__ = (
        "chunked",
        "content_length",
        "expect_continue",
        "has_host",
        "headers",
        "kind",
        "method",
        "path",
        "refusal",
        "request_id",
        "session",
        "target",
        "tenant",
        "xff",
    )

    def __init__(self, method: bytes, target: bytes) -> None:
        self.method = method
        self.target = target
        self.path = target
        self.kind = Kind.PASSTHROUGH
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.chunked = False
        self.expect_continue = False
        self.has_host = False
        self.tenant: bytes | None = None
        self.session: bytes | None = None  # the session header's value (router.sessions)
        self.xff = b""  # every X-Forwarded-For line, in order, each followed by ", "
        self.request_id = b""
        self.refusal: tuple[int, str] | None = None

    @property
    def bodiless(self) -> bool:
        """No Content-Length (or 0) and not chunked."""
        return not self.chunked and not self.content_length


def read_request(
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    http10: bool,
    via_name: bytes,
    session_header: bytes = b"",
) -> Request:
    """What a request head means and what of it is forwarded (see the contract)."""
    request = Request(method, target)
    forwarded = request.headers
    expect: bytes | None = None
    drop: set[bytes] = set()
    codings = b""
    hosts = tenants = sessions = 0
    looped = False
    for name, value in headers:
        lower = name.lower()
        if lower in HOP_BY_HOP:
            if lower == b"content-length":
                request.content_length = int(value)  # llhttp has checked it
            elif lower == b"transfer-encoding":
                request.chunked = True
                codings += value + b","
            elif lower == b"expect":
                expect = value.lower()
            elif lower == b"connection":
                drop.update(t.strip().lower() for t in value.split(b","))
            continue
        if lower == TENANT_HEADER:
            request.tenant = value
            tenants += 1
        elif lower == session_header:
            request.session = value
            sessions += 1
        elif lower == b"x-forwarded-for":
            request.xff += value + b", "
            continue
        elif lower == b"x-request-id":
            request.request_id = value
            continue
        elif lower == b"x-forwarded-proto":
            continue
        elif lower == b"host":
            hosts += 1
        elif lower == b"via":
            looped = looped or via_name in value
        elif lower.startswith(b"proxy"):
            continue
        forwarded.append((name, value))
    if drop:
        drop.discard(b"host")  # "Connection: host" would strip what the backend needs
        request.headers = [(n, v) for n, v in forwarded if n.lower() not in drop]
    request.has_host = hosts == 1
    path = request_path(target)
    if path is not None:
        request.path = path
    if method == b"POST":
        request.kind = Kind.OPENAI if path in OPENAI_PATHS else Kind.NATIVE
    if looped:
        request.refusal = (508, "request loop: it already passed through this router")
    elif hosts > 1 or (hosts == 0 and not http10):
        request.refusal = (400, "a request must carry exactly one Host header")
    elif tenants > 1:
        request.refusal = (400, f"the {TENANT_HEADER.decode()} header must appear once")
    elif sessions > 1:
        request.refusal = (400, f"the {session_header.decode()} header must appear once")
    elif codings and codings.replace(b" ", b"").replace(b"\t", b"").lower() != b"chunked,":
        request.refusal = (501, "transfer codings other than chunked are not supported")
    elif path is None:
        request.refusal = (400, "a request target must not carry a #fragment")
    elif expect is not None:
        if expect == b"100-continue":
            request.expect_continue = True
        else:
            request.refusal = (417, "only Expect: 100-continue is supported")
    return request


def upstream_head(
    request: Request,
    *,
    host: bytes,
    client_ip: bytes,
    tail: bytes,
    request_id: bytes,
) -> bytes:
    """The request head a backend receives.

    ``host`` is ``host:port`` of the backend, used when the client sent no
    Host (HTTP/1.0); ``tail`` is the router's constant ``X-Forwarded-Proto``
    and ``Via`` lines, each starting with CRLF.
    """
    pieces = [request.method, b" ", request.target, b" HTTP/1.1\r\n"]
    for name, value in request.headers:
        pieces += (name, b": ", value, b"\r\n")
    if request.chunked:
        pieces.append(b"transfer-encoding: chunked\r\n")
    elif request.content_length is not None:
        pieces.append(b"content-length: %d\r\n" % request.content_length)
    if not request.has_host:
        pieces += (b"host: ", host, b"\r\n")
    pieces += (
        b"x-forwarded-for: ",
        request.xff,
        client_ip,
        tail,
        b"\r\nx-request-id: ",
        request_id,
        b"\r\n\r\n",
    )
    return b"".join(pieces)


class Response:
    """How a response goes to the client: its head, framing and connection fate."""

    __slots__ = ("framed", "framing", "head", "keep_alive")

    def __init__(self, head: bytes, framing: int, framed: bool, keep_alive: bool) -> None:
        self.head = head
        self.framing = framing
        self.framed = framed  # the backend's body has its own end
        self.keep_alive = keep_alive  # the client connection stays open after it


def read_response(
    status: int,
    headers: list[tuple[bytes, bytes]],
    *,
    method: bytes,
    http10: bool,
    keep_alive: bool,
    request_id: bytes,
    extra: bytes = b"",
) -> Response | None:
    """The client's response head and framing; None when it cannot be relayed.

    ``extra``: header lines of ours to add, each ending in CRLF.

    ``keep_alive`` is whether the client connection may stay open as far as
    the request is concerned; the result's may be False where the framing
    needs the close.
    """
    content_length = None
    codings: list[bytes] = []  # transfer codings besides chunked (gzip, ...)
    framed = False
    pieces = [status_line(status)]
    drop: tuple[bytes, ...] = ()
    for name, value in headers:
        lower = name.lower()
        if lower in HOP_BY_HOP:
            if lower == b"content-length":
                content_length = value
                framed = True
            elif lower == b"transfer-encoding":
                codings += (c.strip().lower() for c in value.split(b","))
                # Chunked last frames the body; otherwise it runs to the close.
                framed = codings[-1] == b"chunked"
                if framed:
                    codings.pop()
            elif lower == b"connection":
                drop += tuple(t.strip().lower() for t in value.split(b","))
            continue
        if lower == b"x-request-id" or (drop and lower in drop):
            continue  # ours is added below
        pieces += (name, b": ", value, b"\r\n")
    if drop:  # a Connection header may come after the fields it names
        pieces = _without_fields(pieces, drop)
    if status in (204, 304):
        # 204 must not carry a length; 304's is optional: neither is relayed.
        framing = NO_BODY
    elif method == b"HEAD":
        framing = NO_BODY
        if content_length is not None:  # the length a GET would have had
            pieces += (b"content-length: ", content_length, b"\r\n")
    elif codings and http10:
        return None
    elif content_length is not None:
        framing = LENGTH
        pieces += (b"content-length: ", content_length, b"\r\n")
    elif http10:
        framing = UNTIL_CLOSE
        keep_alive = False
    else:
        framing = CHUNKED
        if codings:  # relayed as the backend applied them; only the chunking is ours
            pieces += (b"transfer-encoding: ", b", ".join(codings), b", chunked\r\n")
        else:
            pieces.append(b"transfer-encoding: chunked\r\n")
    if not keep_alive:
        pieces.append(b"connection: close\r\n")
    elif http10:
        pieces.append(b"connection: keep-alive\r\n")
    pieces += (b"x-request-id: ", request_id, b"\r\n", extra, b"\r\n")
    return Response(b"".join(pieces), framing, framed, keep_alive)


def _without_fields(pieces: list[bytes], names: tuple[bytes, ...]) -> list[bytes]:
    """Drop the fields a response's Connection header names (4 pieces per field)."""
    kept = pieces[:1]
    for index in range(1, len(pieces), 4):
        if pieces[index].lower() not in names:
            kept += pieces[index : index + 4]
    return kept
