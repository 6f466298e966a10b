"""HTTP/1.1 wire helpers shared by both sides of the proxy (pure, no I/O).

Status lines are built once at import; error bodies are OpenAI-style JSON so
that an OpenAI client shows the router's message as it would the server's.
"""

from __future__ import annotations

import email.utils
import http
import re
import time

import msgspec

__all__ = [
    "CHUNKED_END",
    "HOP_BY_HOP",
    "DateHeader",
    "error_response",
    "json_response",
    "normalised_path",
    "request_path",
    "status_line",
]

# RFC 9110 7.6.1: connection-specific fields, never forwarded; plus the
# framing fields we set ourselves and Proxy-* credentials meant for us.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"expect",
    }
)

CHUNKED_END = b"0\r\n\r\n"
CONTINUE_100 = b"HTTP/1.1 100 Continue\r\n\r\n"

_STATUS_LINES = {
    status.value: f"HTTP/1.1 {status.value} {status.phrase}\r\n".encode()
    for status in http.HTTPStatus
}


_ABSOLUTE_FORM = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*")
_PERCENT = re.compile(rb"%([0-9A-Fa-f]{2})")


_PATH_CACHE: dict[bytes, bytes | None] = {}  # clients send a few targets over and over
_PATH_CACHE_SIZE = 1024


def request_path(target: bytes) -> bytes | None:
    """``normalised_path(target)``, remembered for the last targets seen (bounded)."""
    path = _PATH_CACHE.get(target, b"")
    if path == b"":  # not cached (no path normalises to b"")
        if len(_PATH_CACHE) >= _PATH_CACHE_SIZE:
            _PATH_CACHE.clear()
        path = _PATH_CACHE[target] = normalised_path(target)
    return path


def normalised_path(target: bytes) -> bytes | None:
    """The path a backend's framework routes on, or None for a target no server should take.

    Backends (aiohttp, uvicorn) accept the absolute form, drop the query,
    percent-decode the path and resolve dot segments before they match a
    route, so ``POST http://x/v1/chat/%63ompletions`` is a chat completion to
    them: the router must classify it as one too.  Repeated slashes are
    merged, which makes the classification err towards "OpenAI" (its limits
    and key rule apply), never away from it.  A fragment is not part of a
    request target (RFC 9112 3.2): None.
    """
    if b"#" in target:
        return None
    if target[:1] != b"/":
        match = _ABSOLUTE_FORM.match(target)
        if match is None:
            return target  # asterisk-form ("OPTIONS *") or garbage: nothing to route on
        target = target[match.end() :] or b"/"
    path = target.partition(b"?")[0]
    if b"%" in path:
        path = _PERCENT.sub(lambda m: bytes((int(m[1], 16),)), path)
    if b"/." in path or b"//" in path:
        segments: list[bytes] = []
        for segment in path.split(b"/"):
            if segment == b"..":
                if segments:
                    segments.pop()
            elif segment not in (b".", b""):
                segments.append(segment)
        trailing = b"/" if path.endswith((b"/", b"/.", b"/..")) and segments else b""
        path = b"/" + b"/".join(segments) + trailing
    return path


def status_line(code: int) -> bytes:
    line = _STATUS_LINES.get(code)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % code


class DateHeader:
    """The ``Date`` header, formatted at most once a second (not per request)."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    @property
    def value(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = b"date: " + email.utils.formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._value


_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    414: "invalid_request_error",
    417: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    501: "invalid_request_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
    508: "loop_detected",
}

_encoder = msgspec.json.Encoder()


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    close: bool = False,
    date: bytes = b"",
    request_id: bytes = b"",
    extra: bytes = b"",
) -> bytes:
    """A complete response with an OpenAI-style JSON error body (``code``: the
    status unless given, e.g. ``model_not_found``; ``extra``: header lines, each
    ending in CRLF, such as ``retry-after``)."""
    error_type = "invalid_request_error" if code is not None and status != 429 else None
    body = {
        "error": {
            "message": message,
            "type": error_type or _ERROR_TYPES.get(status, "router_error"),
            "param": param,
            "code": status if code is None else code,
        }
    }
    return json_response(status, body, close=close, date=date, request_id=request_id, extra=extra)


def json_response(
    status: int,
    body: object,
    *,
    close: bool = False,
    date: bytes = b"",
    request_id: bytes = b"",
    extra: bytes = b"",
) -> bytes:
    """A complete response carrying ``body`` as JSON."""
    payload = _encoder.encode(body)
    head = [
        status_line(status),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(payload),
        date,
    ]
    if request_id:
        head.append(b"x-request-id: " + request_id + b"\r\n")
    if extra:
        head.append(extra)
    head.append(b"connection: close\r\n\r\n" if close else b"\r\n")
    return b"".join(head) + payload
