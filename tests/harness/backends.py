"""Hand-written backends: ``asyncio`` HTTP/1.1 servers on 127.0.0.1 that record every
request head and body they receive (``Seen``) and answer with exact bytes.

A ``Handler`` writes the answer (or not) and says whether to keep the connection;
``echo`` answers JSON naming the method, target and body length, ``hold`` does so
once the test sets ``backend.release``; ``reset`` ends a
connection with a TCP RST.  ``backend.body_read``, when a test sets it, is awaited
before each read in the middle of a request body: a backend that takes a head and
then holds off reading the body.  The ``backends`` fixture (conftest) starts them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httptools

from tests.harness.http import WAIT, header_value, header_values, response

__all__ = ["Backend", "Handler", "Seen", "StartBackend", "echo", "hold", "reset"]


@dataclass
class Seen:
    """One request as a backend received it (``body`` once it is complete)."""

    method: bytes
    target: bytes
    version: str
    headers: list[tuple[bytes, bytes]]
    connection: int  # which backend connection (1-based, in accept order)
    number: int  # which request on that connection (1-based)
    body: bytes = b""
    complete: bool = False
    body_pieces: int = 0  # how many pieces the parser handed over: one per chunk at least

    def values(self, name: str) -> list[bytes]:
        return header_values(self.headers, name)

    def value(self, name: str) -> bytes | None:
        return header_value(self.headers, name)


# handler(backend, request, writer) writes an answer (or not) and says whether
# to keep the connection open.
Handler = Callable[["Backend", Seen, asyncio.StreamWriter], Awaitable[bool]]


async def echo(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
    body = json.dumps(
        {"method": seen.method.decode(), "target": seen.target.decode(), "length": len(seen.body)}
    ).encode()
    writer.write(response(200, body, [(b"Content-Type", b"application/json")]))
    return True


async def hold(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
    """``echo``, once the test sets ``backend.release``: a request held in flight
    (``backend.requests`` shows it arrived)."""
    await backend.release.wait()
    return await echo(backend, seen, writer)


class _Parse:
    """httptools callbacks for one backend connection."""

    def __init__(self, backend: Backend, connection: int):
        self.backend = backend
        self.connection = connection
        self.parser = httptools.HttpRequestParser(self)
        self.count = 0
        self.current: Seen | None = None
        self.ready: list[Seen] = []
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", [], []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.count += 1
        parser = self.parser
        self.current = Seen(
            parser.get_method(),
            self._url,
            parser.get_http_version(),
            self._headers,
            self.connection,
            self.count,
        )
        self._headers = []  # trailers, if any, are not headers
        self.backend.heads.append(self.current)
        self.backend.changed()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        seen = self.current
        assert seen is not None
        seen.body = b"".join(self._body)
        seen.body_pieces = len(self._body)
        seen.complete = True
        self.ready.append(seen)
        self.backend.requests.append(seen)
        self.backend.changed()


class Backend:
    """An HTTP/1.1 server on 127.0.0.1 that records what it receives."""

    def __init__(self, handler: Handler, name: str, tls: ssl.SSLContext | None = None):
        self.handler = handler
        self.name = name
        self.tls = tls  # a server context: an https:// backend
        self.connections = 0  # accepted
        self.closed = 0  # ended, either side
        self.heads: list[Seen] = []  # every request head, complete or not
        self.requests: list[Seen] = []  # complete requests
        self.errors: list[str] = []  # what the backend's parser rejected
        self.release = asyncio.Event()  # handlers that hold wait on this
        # Awaited before each read while a request's body is incomplete (None: read on).
        self.body_read: Callable[[Seen], Awaitable[None]] | None = None
        self._event = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    @property
    def spec(self) -> tuple[str, str]:
        return self.name, self.url

    def changed(self) -> None:
        self._event.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT):
            while not predicate():
                self._event.clear()
                await self._event.wait()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        # A connection accepted just before the close gets its handler a few passes
        # later (asyncio's accept is a task, then the protocol's connection_made,
        # then the handler's task): let those start, so they are cancelled and close
        # their writer here, not left open until garbage collected.
        for _ in range(4):
            await asyncio.sleep(0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        parse = _Parse(self, self.connections)
        self.changed()
        try:
            keep = True
            while keep:
                seen = parse.current
                if self.body_read is not None and seen is not None and not seen.complete:
                    await self.body_read(seen)  # meanwhile the socket's buffers fill
                data = await reader.read(65536)
                if not data:
                    break
                try:
                    parse.parser.feed_data(data)
                except httptools.HttpParserError as exc:
                    self.errors.append(str(exc))
                    break
                while keep and parse.ready:
                    keep = await self.handler(self, parse.ready.pop(0), writer)
                    await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # cancelled by close(): end quietly (asyncio logs cancelled stream handlers)
        finally:
            self.closed += 1
            self.changed()
            writer.close()


StartBackend = Callable[..., Awaitable[Backend]]


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST instead of a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
