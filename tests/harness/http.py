"""A raw HTTP/1.1 client for the router: exact bytes out, strict parsing of what comes back.

``req``/``chunked``/``response`` build exact wire bytes; ``connect(router)`` opens a
raw socket (``Client``) that writes them and checks the exact framing it reads back
(``Response``: status, headers, body, which framing, whether its end was seen).
``quiet``, ``assert_error`` and ``still_serves`` are the checks most tests end with.
Every wait is bounded by ``WAIT``; tests that use the harness wait on no sleep,
except where one plays a slow peer on purpose and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp

    from router.app import Router
    from tests.harness.backends import Backend

__all__ = [
    "COMPLETION",
    "NATIVE_BODY",
    "SMUGGLED",
    "WAIT",
    "Client",
    "Response",
    "assert_error",
    "chunked",
    "connect",
    "header_value",
    "header_values",
    "post_generate",
    "quiet",
    "req",
    "response",
    "still_serves",
    "until",
]

WAIT = 5.0  # seconds: the bound on every wait of the harness and the tests that use it

COMPLETION = json.dumps(
    {"model": "m", "prompt": "The quick brown fox jumps over the lazy dog. " * 8, "max_tokens": 1}
).encode()
# Longer than the default PrefixLength (4096): the router routes on the first
# 4096 bytes, then streams the rest through.
NATIVE_BODY = b"".join(b"%05d|" % i for i in range(3000))
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: router.test\r\n\r\n"

# -- wire helpers -------------------------------------------------------------------


def req(
    method: bytes,
    target: bytes,
    *,
    body: bytes | None = None,
    chunks: list[bytes] | None = None,
    headers: bytes = b"",
    version: bytes = b"1.1",
) -> bytes:
    """A request with a Host header; ``chunks`` sends the body chunked."""
    head = b"%s %s HTTP/%s\r\nHost: router.test\r\n%s" % (method, target, version, headers)
    if chunks is not None:
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(*chunks)
    if body is not None:
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    return head + b"\r\n"


def chunked(*pieces: bytes, trailers: bytes = b"") -> bytes:
    """Chunked framing; empty pieces are skipped (a zero-size chunk ends the body)."""
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p)
    return body + b"0\r\n" + trailers + b"\r\n"


def response(
    status: int = 200,
    body: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
    reason: bytes = b"OK",
) -> bytes:
    head = b"HTTP/1.1 %d %s\r\n" % (status, reason)
    head += b"".join(b"%s: %s\r\n" % h for h in headers or [])
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def header_values(headers: list[tuple[bytes, bytes]], name: str) -> list[bytes]:
    key = name.lower().encode()
    return [v for n, v in headers if n.lower() == key]


def header_value(headers: list[tuple[bytes, bytes]], name: str) -> bytes | None:
    values = header_values(headers, name)
    assert len(values) <= 1, f"{name} appears {len(values)} times: {values}"
    return values[0] if values else None


# -- a raw client -------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    framing: str = "none"  # "length", "chunked", "close" or "none"
    complete: bool = True  # the framing's end was seen
    trailers: list[bytes] = field(default_factory=list)

    def values(self, name: str) -> list[bytes]:
        return header_values(self.headers, name)

    def value(self, name: str) -> bytes | None:
        return header_value(self.headers, name)

    def json(self) -> Any:
        return json.loads(self.body)


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    async def send(self, *pieces: bytes) -> None:
        for piece in pieces:
            self.writer.write(piece)
            await self.writer.drain()

    async def send_bytewise(self, data: bytes) -> None:
        for i in range(len(data)):
            self.writer.write(data[i : i + 1])
            await self.writer.drain()

    async def head(self) -> Response:
        """Status line and headers, strictly parsed."""
        async with asyncio.timeout(WAIT):
            raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw[:-4].split(b"\r\n")
        match = re.fullmatch(rb"HTTP/1\.[01] (\d{3}) [^\r\n]*", lines[0])
        assert match, lines[0]
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            assert sep, line
            assert re.fullmatch(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name), line
            headers.append((name, value.strip(b" \t")))
        return Response(int(match[1]), headers)

    async def body(self, resp: Response, *, no_body: bool = False) -> Response:
        """Read ``resp``'s body as its framing says; a cut-off body is ``complete=False``."""
        te, cl = resp.value("transfer-encoding"), resp.value("content-length")
        async with asyncio.timeout(WAIT):
            if no_body or resp.status in (204, 304) or resp.status < 200:
                resp.framing = "none"
            elif te is not None:
                assert te.lower() == b"chunked", te
                assert cl is None, (te, cl)
                resp.framing = "chunked"
                await self._chunks(resp)
            elif cl is not None:
                resp.framing = "length"
                try:
                    resp.body = await self.reader.readexactly(int(cl))
                except asyncio.IncompleteReadError as exc:
                    resp.body, resp.complete = exc.partial, False
            else:
                resp.framing = "close"
                resp.body = await self.rest()
        return resp

    async def _chunks(self, resp: Response) -> None:
        pieces = []
        try:
            while True:
                line = await self.reader.readuntil(b"\r\n")
                size = line[:-2].split(b";")[0]
                assert re.fullmatch(rb"[0-9a-fA-F]+", size), line
                if int(size, 16) == 0:
                    while (trailer := await self.reader.readuntil(b"\r\n")) != b"\r\n":
                        resp.trailers.append(trailer)
                    break
                data = await self.reader.readexactly(int(size, 16) + 2)
                assert data.endswith(b"\r\n"), data[-8:]
                pieces.append(data[:-2])
        except (asyncio.IncompleteReadError, ConnectionResetError):
            resp.complete = False
        resp.body = b"".join(pieces)

    async def chunk(self) -> bytes:
        """One chunk of a chunked body (b"" for the last one)."""
        async with asyncio.timeout(WAIT):
            size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
            data = await self.reader.readexactly(size + 2)
        assert data.endswith(b"\r\n")
        return data[:-2]

    async def response(self, *, no_body: bool = False) -> Response:
        return await self.body(await self.head(), no_body=no_body)

    async def rest(self) -> bytes:
        """Everything until the router closes the connection."""
        pieces = []
        async with asyncio.timeout(WAIT):
            try:
                while data := await self.reader.read(65536):
                    pieces.append(data)
            except ConnectionResetError:
                pass
        return b"".join(pieces)

    async def closed(self) -> None:
        """The router closes this connection without sending anything more."""
        assert await self.rest() == b""


@contextlib.asynccontextmanager
async def connect(
    router: Router, *, rcvbuf: int | None = None, source: str | None = None
) -> AsyncIterator[Client]:
    """A raw client connection to ``router``, from ``source`` if given (any
    127.0.0.0/8 address is this host's on Linux: another client address)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if source is not None:
        sock.bind((source, 0))
    if rcvbuf is not None:  # before connect: no window autotuning
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    async with asyncio.timeout(WAIT):
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", router.port))
        reader, writer = await asyncio.open_connection(sock=sock)
    try:
        yield Client(reader, writer)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def quiet(router: Router) -> None:
    """No request in flight and no lease held."""
    async with asyncio.timeout(WAIT):
        await router.wait_quiet()
    assert router.fleet.loads.total == 0, dict(router.fleet.loads.counts)


def assert_error(resp: Response, status: int, kind: str | None = None) -> dict[str, Any]:
    """An OpenAI-style JSON error from the router."""
    assert resp.status == status, resp.body
    assert resp.value("content-type") == b"application/json"
    error: dict[str, Any] = resp.json()["error"]
    assert error["code"] == status
    if kind is not None:
        assert error["type"] == kind
    return error


async def still_serves(router: Router, backend: Backend, target: bytes = b"/health") -> None:
    """A new connection gets a normal answer, which reaches the backend."""
    async with connect(router) as client:
        await client.send(req(b"GET", target))
        resp = await client.response()
    assert resp.status == 200
    assert resp.json()["target"] == target.decode()
    assert backend.requests[-1].target == target


async def until(predicate: Callable[[], bool | Awaitable[bool]], every: float = 0.01) -> None:
    """Wait for a condition the router offers no event for (bounded by WAIT), asking
    ``every`` seconds: shorter for a test that waits hundreds of times on a local read.
    ``predicate`` may be a coroutine function (a read of another process's admin API)."""
    async with asyncio.timeout(WAIT):
        while True:
            met = predicate()
            if inspect.isawaitable(met):
                met = await met
            if met:
                return
            await asyncio.sleep(every)


async def post_generate(http: aiohttp.ClientSession, port: int, body: str) -> int:
    """A native request keyed by its body, on a connection of its own: its status."""
    async with http.post(
        f"http://127.0.0.1:{port}/generate", data=body, headers={"Connection": "close"}
    ) as resp:
        await resp.read()
        return resp.status
