"""Routing keys of large OpenAI bodies, computed in a helper process off the event loop.

Why: the key of any body costs work bounded by ``PrefixLength`` except one
pass that msgspec makes over the whole body to check its JSON syntax (and
to find the fields routing reads, wherever they are).  That pass runs at C
speed but holds the GIL: 40-80 ms for 32 MiB of dense JSON, time during
which no other client is served.  Bodies above ``limits.key_offload_bytes``
(1 MiB: at most ~3 ms on the loop below it) are keyed here instead.

Contract:
- One child process per router process (``python -m router.keyworker``),
  started on the first large body, restarted on the next one after it dies.
  It reads frames from stdin and answers each on stdout, in order:
  request ``<II`` (PrefixLength, body length) + the body; answer ``<I``
  (length) + msgpack ``["ok", key, prompt_cache_key, previous_response_id,
  model, conversation, salted]`` (``model``: the raw JSON of the body's
  field; ``conversation``: its id; ``salted``: the body has a ``cache_salt``)
  or ``["error", message, param, null, null, null, null]``: exactly what
  ``decode_openai`` +
  ``prompt_key`` give on the loop (the same module does the work).
- The loop never copies or joins the body: its pieces are written to the
  pipe as they are (uvloop keeps references, no copy), and reading the
  small answers is all the loop does.  The exchange keeps small reads in one
  buffer, so a body holds a bounded number of pieces (uvloop's pipe refuses
  a ``writelines`` of about a million).
- A write the pipe refuses (closed, or an error) ends that child: what
  waited on it fails with ``WorkerLost``, and the next body starts another.
  A replaced child's late answers and exit are ignored.
- ``key(pieces, size, limit)`` returns a future: a ``Keyed``
  ``(key, prompt_cache_key, previous_response_id, model, conversation,
  salted)`` or ``BadRequest``;
  ``WorkerLost`` when the child died or could not start (the exchange
  answers 503 and blames no backend).  At most ``MAX_PENDING_BYTES`` wait at
  once; past that ``WorkerBusy`` at once.
- A caller that stops caring (client gone) just drops the future; the
  answer is read and discarded, keeping frames in order.
- ``close()`` ends the child: stdin closed, then killed if it has not exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import sys
from collections import deque
from typing import Any, cast

import msgspec

from .extract import BadRequest, conversation_id, decode_openai, has_cache_salt, prompt_key
from .log import get_logger

__all__ = ["MAX_PENDING_BYTES", "KeyWorker", "Keyed", "WorkerBusy", "WorkerLost"]

log = get_logger("keyworker")

# What a body is routed by: key, prompt_cache_key, previous_response_id, its
# ``model`` as raw JSON (read only where the fleet declares models), its
# conversation id (router.sessions), and whether it has a cache_salt.
Keyed = tuple[bytes, str | None, str | None, bytes, str | None, bool]

Frame = list[bytes | bytearray | memoryview]  # what one writelines sends

_REQUEST = struct.Struct("<II")
_ANSWER = struct.Struct("<I")
MAX_PENDING_BYTES = 256 * 1024 * 1024  # bodies waiting for a key at once
CLOSE_TIMEOUT = 2.0

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.Decoder(tuple[str, Any, Any, Any, Any, Any, Any]).decode


class WorkerLost(Exception):
    """The key worker died or could not start; the request was not keyed."""


class WorkerBusy(Exception):
    """Too many large bodies wait for their keys already."""


# -- the child ------------------------------------------------------------------------


def answer(body: bytes, limit: int) -> bytes:
    """The answer frame's payload for one body (what the loop would have computed)."""
    try:
        request = decode_openai(body, limit)
        key = prompt_key(request, limit)
    except BadRequest as exc:
        return _encode(("error", str(exc), exc.param, None, None, None, None))
    return _encode(
        (
            "ok",
            key,
            request.prompt_cache_key,
            request.previous_response_id,
            bytes(request.model),
            conversation_id(request.conversation),
            has_cache_salt(request),
        )
    )


def main() -> None:
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = source.read(_REQUEST.size)
        if len(head) < _REQUEST.size:
            return  # the router closed the pipe
        limit, size = _REQUEST.unpack(head)
        body = source.read(size)
        if len(body) < size:
            return
        payload = answer(body, limit)
        sink.write(_ANSWER.pack(len(payload)) + payload)
        sink.flush()


# -- the router's side -------------------------------------------------------------------


class _Pipe(asyncio.SubprocessProtocol):
    def __init__(self, worker: KeyWorker):
        self.worker = worker
        self.buffer = bytearray()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd == 1 and self.worker._pipe is self:  # a replaced child's answers are void
            self.buffer += data
            self.worker._answers(self.buffer)

    def process_exited(self) -> None:
        if self.worker._pipe is self:
            self.worker._lost()


class KeyWorker:
    __slots__ = (
        "_exited",
        "_loop",
        "_pending",
        "_pending_bytes",
        "_pipe",
        "_starting",
        "_transport",
        "_waiting",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._transport: asyncio.SubprocessTransport | None = None
        self._pipe: _Pipe | None = None  # the current child's protocol
        self._starting: asyncio.Task[None] | None = None
        self._waiting: list[Frame] = []  # frames written once the child is up
        self._exited = asyncio.Event()
        # (future, body size) per frame written, in order
        self._pending: deque[tuple[asyncio.Future[Keyed], int]] = deque()
        self._pending_bytes = 0

    def key(self, pieces: Frame, size: int, limit: int) -> asyncio.Future[Keyed]:
        future: asyncio.Future[Keyed] = self._loop.create_future()
        if self._pending_bytes + size > MAX_PENDING_BYTES:
            future.set_exception(WorkerBusy())
            return future
        self._pending.append((future, size))
        self._pending_bytes += size
        frame = [_REQUEST.pack(limit, size), *pieces]
        if self._transport is not None:
            self._write_or_replace(frame)
        else:
            self._waiting.append(frame)
            if self._starting is None:
                self._starting = self._loop.create_task(self._spawn())
        return future

    def _write(self, frame: Frame) -> None:
        assert self._transport is not None
        # uvloop's pipe transports implement WriteTransport without subclassing it.
        stdin = cast(asyncio.WriteTransport | None, self._transport.get_pipe_transport(0))
        if stdin is None or stdin.is_closing():
            raise WorkerLost("the key worker's pipe is closed")
        stdin.writelines(frame)

    def _write_or_replace(self, frame: Frame) -> None:
        """Write a frame; a pipe that fails ends the child (the next body starts another)."""
        transport = self._transport
        assert transport is not None
        try:
            self._write(frame)
        except Exception as exc:
            # What waits, this frame's future included, fails as the child is
            # gone; the transport is dropped now so the next body spawns anew.
            log.error("key worker pipe failed", error=repr(exc))
            self._transport = self._pipe = None
            transport.kill()
            transport.close()
            self._fail_all()

    async def _spawn(self) -> None:
        self._exited.clear()
        try:
            transport, pipe = await self._loop.subprocess_exec(
                lambda: _Pipe(self),
                sys.executable,
                "-m",
                "router.keyworker",
                stderr=None,
            )
        except OSError as exc:
            log.error("key worker did not start", error=str(exc))
            self._fail_all()
            return
        finally:
            self._starting = None
        self._transport, self._pipe = transport, pipe
        log.info("key worker started", pid=transport.get_pid())
        waiting, self._waiting = self._waiting, []
        for frame in waiting:
            self._write_or_replace(frame)
            if self._transport is None:
                return

    def _answers(self, buffer: bytearray) -> None:
        while len(buffer) >= _ANSWER.size:
            (length,) = _ANSWER.unpack_from(buffer)
            end = _ANSWER.size + length
            if len(buffer) < end:
                return
            status, first, second, third, fourth, fifth, sixth = _decode(
                bytes(buffer[_ANSWER.size : end])
            )
            del buffer[:end]
            future, size = self._pending.popleft()
            self._pending_bytes -= size
            if future.done():
                continue  # its caller stopped caring
            if status == "ok":
                future.set_result((first, second, third, fourth, fifth, sixth))
            else:
                future.set_exception(BadRequest(first, second))

    def _lost(self) -> None:
        self._exited.set()
        transport, self._transport, self._pipe = self._transport, None, None
        if transport is not None:
            log.warning("key worker exited", returncode=transport.get_returncode())
            transport.close()
        self._fail_all()

    def _fail_all(self) -> None:
        self._waiting = []
        pending, self._pending = self._pending, deque()
        self._pending_bytes = 0
        for future, _ in pending:
            if not future.done():
                future.set_exception(WorkerLost())

    @property
    def pid(self) -> int | None:
        return self._transport.get_pid() if self._transport is not None else None

    async def close(self) -> None:
        transport = self._transport
        if self._starting is not None:
            self._starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._starting
            transport = self._transport
        if transport is None:
            return
        stdin = transport.get_pipe_transport(0)
        if stdin is not None:
            stdin.close()  # the child reads EOF and exits
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                await self._exited.wait()
        except TimeoutError:
            transport.kill()
        transport.close()
        self._transport = self._pipe = None
        self._fail_all()


if __name__ == "__main__":
    main()
