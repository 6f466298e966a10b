"""A minimal OpenAI-shaped responder that costs little CPU: the backend of proxy benchmarks.

Contract:
- ``python -m loadtests.fastbackend --count 2`` serves ``fb-0`` .. ``fb-N`` on free
  ports of 127.0.0.1 (``--port`` to choose the first one) in ONE process and one
  event loop (uvloop when installed), and prints one JSON line per instance on
  stdout, ``{"name": "fb-0", "url": "http://127.0.0.1:PORT"}``, once all listen.
  SIGTERM or SIGINT closes the listeners and exits 0.
- It answers at once and never models an engine: what it costs per request is a
  parse by httptools and a write of prebuilt bytes, so that a proxy benchmark
  measures the proxy.  Every response names the instance (``x-backend``).
- Routes (any method prefix match is exact on the path, query ignored):
  ``POST /v1/chat/completions`` and ``/v1/completions``: a small non-streaming
  completion, or with ``"stream": true`` in the body an SSE stream of
  ``--events`` chunks plus ``data: [DONE]``, chunked, one chunk per loop
  iteration (so a proxy sees them as separate reads, as from a real engine).
  A prompt containing ``[[sse:EVENTS:INTERVAL_MS]]`` streams EVENTS chunks,
  the first at once, then one every INTERVAL_MS: the idle-stream workload;
  ``[[sse:EVENTS:INTERVAL_MS:FIRST_MS]]`` sends the head at once and the first
  chunk FIRST_MS later, as after a prefill (a proxy that holds small segments,
  Nagle, then shows a stall on keep-alive connections).
  ``POST /invocations``: the body is counted, never held; a small JSON answer.
  ``POST /v1/traces``: an OTLP/HTTP collector that keeps nothing (200, empty
  ExportTraceServiceResponse), so a traced router's exporter has a sink.
  ``POST /tokenize``, ``/v1/chat/completions/render``, ``/v1/completions/render``:
  vLLM's shapes with "token ids" read as little-endian uint32 from the body
  bytes (vllm-router's cache_aware policy asks every worker for them); answers
  are cached per body, so a benchmark's repeated prompts cost a lookup.
  ``GET /health`` 200; ``GET /v1/models`` a one-model list; ``GET /_stats`` the
  instance's request and body-byte counts; ``GET /_tiny/N`` N bytes in 2-byte
  chunks, in one write (a backend framing its answer to cost a proxy most;
  the last size's answer is kept); any other path 404.
- Only the first ``SNIFF_BYTES`` of a body are kept (to find ``stream`` and the
  marker); the rest is counted and dropped: memory does not grow with bodies.
- Keep-alive as the client asks (HTTP/1.0 without keep-alive, or
  ``Connection: close``, closes after the response).  Requests pipelined behind
  a stream wait for it: responses leave in order.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import socket
import sys
from array import array
from collections import OrderedDict, deque

import httptools

SNIFF_BYTES = 16 * 1024  # a proxy that re-serialises may move "stream" after the messages
TOKEN_CACHE = 512  # distinct bodies whose render/tokenize answer is kept
_MARKER = re.compile(rb"\[\[sse:(\d+):(\d+)(?::(\d+))?\]\]")
_STREAM_TRUE = (b'"stream":true', b'"stream": true')
_CHAT_PATHS = (b"/v1/chat/completions", b"/v1/completions")
_RENDER_PATHS = (b"/tokenize", b"/v1/chat/completions/render", b"/v1/completions/render")


def _response(
    status: bytes,
    backend: bytes,
    body: bytes,
    close: bool = False,
    content_type: bytes = b"application/json",
) -> bytes:
    return b"".join(
        (
            b"HTTP/1.1 ",
            status,
            b"\r\ncontent-type: ",
            content_type,
            b"\r\ncontent-length: ",
            str(len(body)).encode(),
            b"\r\nx-backend: ",
            backend,
            b"\r\nconnection: close\r\n\r\n" if close else b"\r\n\r\n",
            body,
        )
    )


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Instance:
    """One named backend: its prebuilt answers, shared by its connections."""

    def __init__(self, name: str, events: int):
        self.name = name
        b = name.encode()
        self.backend = b
        self.events = events
        chat = {
            "id": f"chatcmpl-{name}",
            "object": "chat.completion",
            "created": 0,
            "model": "fast",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok " * 8},
                    "finish_reason": "length",
                }
            ],
            "usage": {"prompt_tokens": 1024, "completion_tokens": 16, "total_tokens": 1040},
        }
        chat_body = json.dumps(chat, separators=(",", ":")).encode()
        invocation = json.dumps({"generated_text": "ok " * 8, "backend": name}).encode()
        models = json.dumps(
            {"object": "list", "data": [{"id": "fast", "object": "model", "owned_by": "bench"}]}
        ).encode()
        self.ok = {
            key: (_response(b"200 OK", b, body), _response(b"200 OK", b, body, close=True))
            for key, body in (("chat", chat_body), ("invocation", invocation), ("models", models))
        }
        self.health = (_response(b"200 OK", b, b""), _response(b"200 OK", b, b"", close=True))
        self.traces = (
            _response(b"200 OK", b, b"", content_type=b"application/x-protobuf"),
            _response(b"200 OK", b, b"", close=True, content_type=b"application/x-protobuf"),
        )
        missing = json.dumps({"detail": "Not Found"}).encode()
        self.missing = (
            _response(b"404 Not Found", b, missing),
            _response(b"404 Not Found", b, missing, close=True),
        )
        self.sse_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\nx-backend: " + b + b"\r\n"
        )
        event = {
            "id": f"chatcmpl-{name}",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "fast",
            "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}],
        }
        self.event = _chunk(b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")
        self.done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self.tokens: OrderedDict[tuple[bytes, bytes], bytes] = OrderedDict()
        self.tiny: tuple[bytes, bytes] = (b"", b"")  # (path, answer) of the last /_tiny/N
        self.requests = 0
        self.body_bytes = 0

    def tiny_answer(self, path: bytes) -> bytes:
        """``GET /_tiny/N``: N bytes of text in 2-byte chunks (closes after it)."""
        if self.tiny[0] != path:
            size = int(path.rpartition(b"/")[2] or 0)
            text = b"ab" * (size // 2) + b"a" * (size % 2)
            head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
            body = b"".join(_chunk(text[i : i + 2]) for i in range(0, size, 2))
            self.tiny = (path, head + body + b"0\r\n\r\n")
        return self.tiny[1]

    def token_answer(self, path: bytes, body: bytes, close: bool) -> bytes:
        key = (path, body)
        cached = self.tokens.get(key)
        if cached is None:
            ids = array("I")
            ids.frombytes(body[: len(body) // 4 * 4])
            listed = ids.tolist()
            if path == b"/tokenize":
                reply = {"count": len(listed), "max_model_len": 131072, "tokens": listed}
            else:
                reply = {"request_id": "render", "token_ids": listed, "model": "fast"}
            cached = json.dumps(reply, separators=(",", ":")).encode()
            self.tokens[key] = cached
            if len(self.tokens) > TOKEN_CACHE:
                self.tokens.popitem(last=False)
        else:
            self.tokens.move_to_end(key)
        return _response(b"200 OK", self.backend, cached, close)


class Connection(asyncio.Protocol):
    __slots__ = (
        "_body",
        "_body_len",
        "_busy",
        "_closed",
        "_loop",
        "_pending",
        "_url",
        "inst",
        "parser",
        "transport",
    )

    def __init__(self, inst: Instance):
        self.inst = inst
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._url = b""
        self._body: list[bytes] = []
        self._body_len = 0
        self._busy = False  # a stream is being written
        self._pending: deque[tuple[bytes, bytes, bytes, bool]] = deque()
        self._closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._pending.clear()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # an h2c or prior-knowledge probe: answered by the 404 path or dropped
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    # -- httptools callbacks -------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._body = []
        self._body_len = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        if self._body_len < SNIFF_BYTES:
            self._body.append(body)
        self._body_len += len(body)

    def on_message_complete(self) -> None:
        parser = self.parser
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = (
            parser.get_method(),
            self._url.partition(b"?")[0],
            body,
            parser.should_keep_alive(),
        )
        self.inst.requests += 1
        self.inst.body_bytes += self._body_len
        self._body = []
        if self._busy:
            self._pending.append(request)
        else:
            self._answer(*request)

    # -- answers ---------------------------------------------------------------

    def _answer(self, method: bytes, path: bytes, body: bytes, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None or self._closed:
            return
        inst = self.inst
        close = not keep_alive
        if method == b"POST":
            if path in _RENDER_PATHS:
                transport.write(inst.token_answer(path, body, close))
            elif path in _CHAT_PATHS:
                if _STREAM_TRUE[0] in body or _STREAM_TRUE[1] in body:
                    self._stream(body, close)
                    return
                transport.write(inst.ok["chat"][close])
            elif path == b"/invocations":
                transport.write(inst.ok["invocation"][close])
            elif path == b"/v1/traces":
                transport.write(inst.traces[close])
            else:
                transport.write(inst.missing[close])
        elif path == b"/health":
            transport.write(inst.health[close])
        elif path == b"/v1/models":
            transport.write(inst.ok["models"][close])
        elif path.startswith(b"/_tiny/") and path[7:].isdigit():
            transport.write(inst.tiny_answer(path))
            close = True
        elif path == b"/_stats":  # what a benchmark reads to see how requests split
            stats = {"name": inst.name, "requests": inst.requests, "body_bytes": inst.body_bytes}
            transport.write(_response(b"200 OK", inst.backend, json.dumps(stats).encode(), close))
        else:
            transport.write(inst.missing[close])
        if close:
            transport.close()

    def _stream(self, body: bytes, close: bool) -> None:
        assert self.transport is not None
        inst = self.inst
        events, interval, first = inst.events, 0.0, 0.0
        marker = _MARKER.search(body) if b"[[sse:" in body else None
        if marker is not None:
            events, interval = int(marker[1]), int(marker[2]) / 1000.0
            first = int(marker[3] or 0) / 1000.0
        self._busy = True
        self.transport.pause_reading()
        head = inst.sse_head + (b"connection: close\r\n\r\n" if close else b"\r\n")
        self.transport.write(head)
        if first:
            self._loop.call_later(first, self._event, events, interval, close)
        else:
            self._loop.call_soon(self._event, events, interval, close)

    def _event(self, left: int, interval: float, close: bool) -> None:
        transport = self.transport
        if self._closed or transport is None or transport.is_closing():
            return
        if left <= 0:
            transport.write(self.inst.done)
            self._busy = False
            if close:
                transport.close()
                return
            transport.resume_reading()
            while self._pending and not self._busy:
                self._answer(*self._pending.popleft())
            return
        transport.write(self.inst.event)
        if interval:
            self._loop.call_later(interval, self._event, left - 1, interval, close)
        else:
            self._loop.call_soon(self._event, left - 1, interval, close)


async def serve(count: int, first_port: int, events: int, name: str) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    lines = []
    for i in range(count):
        inst = Instance(f"{name}-{i}", events)
        port = first_port + i if first_port else 0
        server = await loop.create_server(
            lambda inst=inst: Connection(inst),  # type: ignore[misc]
            "127.0.0.1",
            port,
            backlog=4096,
            reuse_address=True,
        )
        servers.append(server)
        bound = server.sockets[0].getsockname()[1]
        lines.append(json.dumps({"name": inst.name, "url": f"http://127.0.0.1:{bound}"}))
    print("\n".join(lines), flush=True)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()
    for server in servers:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                await server.wait_closed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.fastbackend", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--count", type=int, default=2, help="instances to serve (default 2)")
    parser.add_argument("--port", type=int, default=0, help="first port (default: free ports)")
    parser.add_argument("--events", type=int, default=64, help="SSE chunks per stream (64)")
    parser.add_argument("--name", default="fb", help="instance name prefix (default fb)")
    args = parser.parse_args(argv)
    if args.count < 1 or args.events < 0:
        parser.error("--count must be >= 1 and --events >= 0")
    try:
        import uvloop
    except ImportError:
        runner = asyncio.run
    else:
        runner = uvloop.run
    runner(serve(args.count, args.port, args.events, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
