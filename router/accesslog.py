"""The access log: one JSON line per request, written at its end.

Lines are encoded by msgspec straight from a Struct and buffered like nginx's
``access_log ... buffer=64k flush=1s``: written when 64 KiB are pending or
once a second, so a request costs no system call.  structlog's processor
pipeline gave the same line for 6.1 us against 1.5 us this way (measured on
this machine), so it is kept for lifecycle events (``router.log``) and off
the request path.

The lines are written by a thread of the log's own (``_Writer``), one chunk at
a time: a sink that blocks (a pipe nobody reads, a stalled log shipper, a
slow disk) holds that thread, never the loop.  Meanwhile lines gather, up to
``MAX_PENDING`` bytes; past that they are dropped, counted (``dropped``) and
a warning is logged once each time it starts.  A write that fails (disk
full, the pipe's reader gone) loses that chunk's lines, counted the same
way.  At shutdown what is left gets ``CLOSE_SECONDS`` to be written.
Before, ``os.write`` ran on the loop: a full pipe froze every client, the
admin API and SIGTERM (RELIABILITY.md, defect 32).

A log that is a regular file is followed, as ``tail -F`` and Python's
``WatchedFileHandler`` do: before each chunk the writer checks (``stat``, in
its thread) that the path still names the file it holds, and opens the path
again when logrotate has renamed or removed it, so rotation needs no signal
and loses no line: what was written before goes to the rotated file, the
next chunk to the new one.  ``copytruncate`` works as well (the descriptor
appends).  Every process writing the log (each worker of ``--workers N``)
follows it on its own, within a flush (a second) of its next line.  A path
that cannot be opened again keeps the old file (counted, logged once).

Each line names the client's address (``client``: the peer's, or with
``proxy_protocol`` the one its PROXY header named), as nginx's
``$remote_addr``; a refusal's too, so a client that is refused again and
again can be found.  Never logged: bodies, header values, tenant keys,
query strings.  With
``[advisor] key_digests`` a keyed request's line ends with ``key_digests``
(router.keydigests): digests of its key at several lengths, no text.
"""

from __future__ import annotations

import asyncio
import os
import select
import stat
import sys
import threading
import time
from typing import TYPE_CHECKING

import msgspec

from .config import ConfigError
from .log import get_logger

if TYPE_CHECKING:
    from .exchange import Exchange

__all__ = ["AccessLog", "AccessRecord", "RefusedRecord", "open_target", "prefix_hash"]

BUFFER_BYTES = 64 * 1024
FLUSH_SECONDS = 1.0
# Lines waiting while the writer is busy with the last chunk, at most: 16 chunks,
# ~3,500 lines, seconds of a busy router's lines (more is dropped, counted).
MAX_PENDING = 16 * BUFFER_BYTES
CLOSE_SECONDS = 1.0  # at shutdown, for the lines still pending

log = get_logger("router")


def prefix_hash(key_hash: int) -> str:
    """A routing key's hash as the log writes it (and the admin dry run, the
    decision header): 16 hex digits."""
    return f"{key_hash:016x}"


class AccessRecord(msgspec.Struct, omit_defaults=False):
    event: str
    ts: float
    client: str  # its address (the module's docstring)
    request_id: str
    method: str
    path: str
    kind: str
    prefix_hash: str | None
    key_source: str | None  # where the key came from (router.sessions), None: no key
    tenant: bool
    backend: str | None
    decision: str | None
    status: int
    ttft_ms: float | None
    total_ms: float
    bytes_in: int
    bytes_out: int
    # An A/B experiment's arm (router.arms); absent from the line when there is none.
    arm: str | msgspec.UnsetType = msgspec.UNSET


class RefusedRecord(msgspec.Struct):
    """A request refused before it became an exchange (malformed, too large, too slow)."""

    event: str
    ts: float
    client: str
    status: int
    reason: str  # our message, never the client's bytes


class _Writer(threading.Thread):
    """Writes the chunks it is handed to ``fd``, one at a time, off the loop;
    with ``path``, the file there (the module's docstring: a rotated file is
    followed)."""

    def __init__(self, fd: int, path: str | None):
        super().__init__(name="access log", daemon=True)
        self.fd = fd
        self.lost = 0  # lines of chunks whose write failed
        self.reopened = 0  # the path opened again: it named another file
        self.reopen_failed = 0  # ... and could not be
        self._path = path
        self._identity = _identity(os.fstat(fd)) if path is not None else None
        if self._identity is None:
            self._path = None  # a pipe or a device: nothing to follow
        self._cond = threading.Condition()
        self._chunk: bytes | None = None
        self._stopping = False

    def offer(self, chunk: bytes) -> bool:
        """Take ``chunk`` to write; False while the last one is being written."""
        with self._cond:  # held by the thread only between writes, never during one
            if self._chunk is not None:
                return False
            self._chunk = chunk
            self._cond.notify_all()
            return True

    def idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the chunk being written to be done."""
        with self._cond:
            return self._cond.wait_for(lambda: self._chunk is None, timeout)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._chunk is not None or self._stopping)
                chunk = self._chunk
            if chunk is None:
                return
            self._write(chunk)
            with self._cond:
                self._chunk = None
                self._cond.notify_all()

    def _follow(self, path: str) -> None:
        """Open ``path`` again if it names another file than the one written to."""
        try:
            if _identity(os.stat(path)) == self._identity:
                return
        except OSError:
            pass  # removed (rotated without ``create``): make it again
        try:
            fd = open_target(path)
        except ConfigError:
            self.reopen_failed += 1
            return
        old, self.fd = self.fd, fd
        self._identity = _identity(os.fstat(fd))
        os.close(old)
        self.reopened += 1

    def _write(self, chunk: bytes) -> None:
        if self._path is not None:
            self._follow(self._path)
        view = memoryview(chunk)
        while view:
            try:
                written = os.write(self.fd, view)
            except BlockingIOError:  # a non-blocking sink is full: wait until it is not
                select.select([], [self.fd], [], FLUSH_SECONDS)
                continue
            except OSError:  # disk full, the reader gone: serving matters more than the log
                self.lost += view.tobytes().count(b"\n")
                return
            view = view[written:]


def _identity(status: os.stat_result) -> tuple[int, int] | None:
    """A regular file's (device, inode); None for anything else."""
    return (status.st_dev, status.st_ino) if stat.S_ISREG(status.st_mode) else None


def open_target(target: str) -> int:
    """The file descriptor of ``access_log`` = a path, opened to append (created if
    need be); ConfigError naming it and why when it cannot be (``serve`` checks this
    before starting: exit 2, not a traceback)."""
    try:
        return os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(f"cannot open access_log {target!r}: {exc.strerror}") from None


class AccessLog:
    __slots__ = (
        "_buffer",
        "_dropping",
        "_encoder",
        "_fd",
        "_owns_fd",
        "_path",
        "_reopened",
        "_timer",
        "_writer",
        "dropped",
        "enabled",
    )

    def __init__(self, target: str):
        self.enabled = target != "off"
        self._owns_fd = target not in ("-", "off")
        if target == "-":
            self._fd = sys.stdout.fileno()
        elif self._owns_fd:
            self._fd = open_target(target)
        else:
            self._fd = -1
        self._buffer = bytearray()
        self._encoder = msgspec.json.Encoder()
        self._timer: asyncio.TimerHandle | None = None
        self._writer: _Writer | None = None  # started at the first flush
        self._dropping = False  # lines are being dropped (logged once each time)
        self.dropped = 0  # lines dropped: the writer too far behind
        self._path = target if self._owns_fd else None  # a file to follow through rotations
        self._reopened = (0, 0)  # the writer's (reopened, reopen_failed) as last logged

    @property
    def lost(self) -> int:
        """Lines never written: dropped while the sink was too slow, or their write failed."""
        return self.dropped + (self._writer.lost if self._writer is not None else 0)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.enabled:
            self._timer = loop.call_later(FLUSH_SECONDS, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self.flush()
        self._timer = loop.call_later(FLUSH_SECONDS, self._tick, loop)

    def record(self, exchange: Exchange) -> None:
        if not self.enabled:
            return
        choice = exchange.choice
        key_hash = exchange.key_hash
        record = AccessRecord(
            "access",
            time.time(),
            exchange.client_ip.decode("ascii"),
            exchange.request_id.decode("latin-1"),
            exchange.method.decode("latin-1"),
            exchange.path.decode("latin-1"),
            exchange.kind,
            prefix_hash(key_hash) if key_hash is not None else None,
            exchange.key_source,
            exchange.tenant,
            choice.backend.name if choice is not None else None,
            choice.label if choice is not None else None,
            exchange.status,
            round((exchange.ttft - exchange.started) * 1000, 3) if exchange.ttft else None,
            round((exchange.ended - exchange.started) * 1000, 3),
            exchange.bytes_in,
            exchange.bytes_out,
            msgspec.UNSET if exchange.arm is None else exchange.arm.name,
        )
        buffer = self._buffer
        self._encoder.encode_into(record, buffer, -1)
        digests = exchange.key_digests
        if digests is not None:  # [advisor] key_digests: one more member, same line
            buffer[-1:] = b',"key_digests":'
            self._encoder.encode_into(digests.field(), buffer, -1)
            buffer += b"}"
        buffer += b"\n"
        if len(buffer) >= BUFFER_BYTES:
            self.flush()

    def refused(self, status: int, reason: str, client: bytes) -> None:
        if not self.enabled:
            return
        buffer = self._buffer
        record = RefusedRecord("refused", time.time(), client.decode("ascii"), status, reason)
        self._encoder.encode_into(record, buffer, -1)
        buffer += b"\n"
        if len(buffer) >= BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        """Hand the pending lines to the writer; if it is still busy, keep them (up
        to ``MAX_PENDING`` bytes: past that they are dropped and counted)."""
        buffer = self._buffer
        if not buffer:
            return
        writer = self._writer
        if writer is None:
            writer = self._writer = _Writer(self._fd, self._path)
            writer.start()
        if (writer.reopened, writer.reopen_failed) != self._reopened:
            self._log_reopens(writer)
        if writer.offer(bytes(buffer)):
            buffer.clear()
            if self._dropping:
                self._dropping = False
                log.info("access log: writing again", dropped=self.dropped)
            return
        if len(buffer) > MAX_PENDING:
            self.dropped += buffer.count(b"\n")
            buffer.clear()
            if not self._dropping:
                self._dropping = True
                log.warning(
                    "access log: the sink is not keeping up, dropping lines",
                    pending_bytes=MAX_PENDING,
                )

    def _log_reopens(self, writer: _Writer) -> None:
        """Say on the loop what the writer's thread did since the last time."""
        reopened, failed = self._reopened
        if writer.reopened != reopened:
            log.info("access log reopened: its path names a new file", path=self._path)
        if writer.reopen_failed != failed and not failed:  # once, not per chunk
            log.warning(
                "access log: cannot open its path again; writing to the old file", path=self._path
            )
        self._reopened = (writer.reopened, writer.reopen_failed)

    def sync(self, timeout: float = CLOSE_SECONDS) -> bool:
        """Flush and wait (blocking, up to ``timeout``) until every pending line is
        written: for shutdown and tests, never on the request path."""
        deadline = time.monotonic() + timeout
        while True:
            self.flush()
            writer = self._writer
            if writer is None:
                return True
            if not writer.idle(max(0.0, deadline - time.monotonic())):
                return False  # a sink that blocks
            if not self._buffer:
                return True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        deadline = time.monotonic() + CLOSE_SECONDS
        self.sync(CLOSE_SECONDS)  # what is still pending after it is lost
        writer = self._writer
        if writer is not None:
            writer.stop()
            writer.join(max(0.0, deadline - time.monotonic()))
            if writer.is_alive():
                return  # stuck in a write: the fd stays open (the thread is a daemon)
        if self._owns_fd:
            os.close(writer.fd if writer is not None else self._fd)  # the writer's: followed
            self._owns_fd = False
