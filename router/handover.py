"""Restart without a refused connection: a new router process takes the listening
sockets, the membership and the Responses API ids from the one running.

Contract:
- ``handover_socket = PATH`` (``--handover-socket``): the daemon listens on
  PATH, a Unix socket of mode 0600 (``Handover.listen``); a peer of another
  uid is refused (``SO_PEERCRED``).  A daemon that starts with the same PATH
  first asks there (``take_over``).  Nobody listening (no file, or a stale
  one: ECONNREFUSED) is an ordinary start, which binds its own sockets.
- The running process (the old one), asked: freezes its membership (the
  control's lock is held: an admin write waits), sends its listening sockets
  (client and admin, ``SCM_RIGHTS``) and ``Given``: the membership and
  routing as the state file would hold them (None under etcd, where etcd
  holds them), the response ids it knows, its pid.  It keeps serving
  meanwhile; the ids it learns from the freeze on (``learnt``: the daemon
  taps its table then) follow ``Released`` (forgotten if the handover
  fails).  The new process starts on those sockets (both processes accept
  from them for a moment: each connection goes to one) and sends ``Ready``.
  The old one then retires (``on_ready``: its admin writes are refused with
  503 from here on, its admin server stops accepting before ``Released``, so
  that from then on the new process alone answers on the admin socket; its
  listeners close and it drains its requests as on SIGTERM) and answers
  ``Released``; the new one
  then takes PATH over (binds beside it and renames: the path never stops
  answering; until then the retired one answers ``Busy``).
  A connection waiting in a listener's queue is never reset: the listening
  socket outlives the old process.
- Failure: a new process that dies, or stays silent past ``READY_WAIT``, before
  ``Ready`` leaves the old one as it was (its membership thawed, still
  serving; a warning logged).  Connections the new one had accepted die with
  it.  A new process whose ``Ready`` finds the old one given up (the
  connection closed without ``Released``, the old pid alive) exits rather
  than serve beside it (``Taken.ready`` raises ``HandoverError``).  An old
  process that is busy with another handover answers ``Busy``: the new one
  exits with the reason (``HandoverError``); so does one stopping
  (SIGTERM: its listeners close, there is nothing to hand over).
- The new process hands nothing to a listener on PATH of another uid
  (``SO_PEERCRED``): a socket another user made at PATH (a shared directory)
  would otherwise give it listeners and a membership of its choosing.
- Nothing here is on the request path; each step is a few frames on a local
  socket: the state in one frame, the response ids in ``Ids`` frames of
  ``IDS_PER_FRAME`` (the table at its bound, 10 million ids, is ~500 MB: one
  frame would hold the old process's loop for seconds and pass
  ``MAX_FRAME``), each read from the table as it is sent
  (``ResponseIds.frozen``), the loop let go between them.
- While it drains, the old process's requests are still on the backends: it
  sends its in-flight counts per backend (``Loads``: the host's, every worker
  of it and any process it had taken over from, whose requests it keeps
  reporting until that one is gone; not the other replicas') at once after
  ``Released``, then those that changed, checked every ``LOADS_PERIOD``, and
  all of them every ``LOADS_REFRESH``.  The new one counts them as its own
  (``Taken.ready``'s ``on_loads`` gets the backends whose counts changed,
  and every one at zero once the old process is gone), so its bounds hold
  for the backends' real load, not only for what it sent itself.  Only to
  a new process that said it reads them (``Ready.loads``): an older one
  would end its reading at the first.  Sending is bounded
  (``READY_WAIT``): a peer that asks and reads nothing does not keep the old
  process frozen.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Annotated

import msgspec

from .log import get_logger
from .state import State

if TYPE_CHECKING:
    from .responses import Learnt

__all__ = [
    "FOLLOW_WAIT",
    "IDS_PER_FRAME",
    "LOADS_PERIOD",
    "READY_WAIT",
    "Given",
    "Handover",
    "HandoverError",
    "Load",
    "Taken",
    "take_over",
]

log = get_logger("handover")

VERSION = 1
READY_WAIT = 60.0  # the new process's start-up: etcd's seed and discovery wait 10 s each
STEP_WAIT = 10.0  # any other step: a frame on a local socket, or the old one's lock
MAX_FDS = 253  # SCM_RIGHTS' limit per message (SCM_MAX_FD)
MAX_FRAME = 64 << 20  # the state and one part of the response ids fit many times over
MAX_ASK = 4096  # an Ask is a few bytes: what the old process reads of any local peer
MAX_ASKERS = 16  # connections to PATH at once; more are closed (each holds an fd)
IDS_PER_FRAME = 16384  # response ids per ``Ids`` frame: a few ms to encode, ~1 MB
# While the old process drains, an unknown response id is waited for this long: the
# old one may have just learnt it (its answer ending) and be passing it on.
FOLLOW_WAIT = 0.1
# How often a draining old process checks whether its in-flight counts changed (a
# copy and compare of its counts: a few µs), and sends them all (a backend the new
# process removed and added back meanwhile).  A request sent to the new process within
# the period after one of ours ended may find its backend counted full (a 10 ms period
# let 3 in 16 such requests past a bound in loadtests.bench_handover_loads).
LOADS_PERIOD = 0.002
LOADS_REFRESH = 1.0


class Ask(msgspec.Struct, tag=True, frozen=True):
    pid: int
    version: int = VERSION


class Given(msgspec.Struct, tag=True, frozen=True):
    pid: int
    client: int  # the first ``client`` sockets sent are the client listener's ...
    admin: int  # ... the next ``admin`` the admin API's
    state: State | None  # the membership and routing (None: etcd holds them)
    responses: list[tuple[str, str]] = []  # (response id, backend), oldest first
    parts: int = 0  # ``Ids`` frames that follow: the rest of ``responses``, in order


class Ids(msgspec.Struct, tag=True, frozen=True):
    """A part of the response ids (a full table is ~10 million: one frame would
    hold the old process's loop for seconds and pass ``MAX_FRAME``)."""

    responses: list[tuple[str, str]]


_Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
# A backend's requests in flight, and of those not yet answered (ConcurrencyScope PREFILL).
Load = tuple[str, _Count, _Count]


class Loads(msgspec.Struct, tag=True, frozen=True):
    """The old process's requests in flight as it drains: every backend with some
    (``full``), or those whose counts changed since the last frame (0 0: none now)."""

    loads: list[Load]
    full: bool = False


class Busy(msgspec.Struct, tag=True, frozen=True):
    reason: str


class Ready(msgspec.Struct, tag=True, frozen=True):
    pid: int
    loads: bool = False  # it reads ``Loads`` (an older process ends its reading at one)


class Released(msgspec.Struct, tag=True, frozen=True):
    pass


_Message = Ask | Given | Ids | Loads | Busy | Ready | Released
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Message)


class HandoverError(Exception):
    """The running process could not hand over (the reason says why)."""


class Snapshot(msgspec.Struct, frozen=True):
    """What the old process hands over besides its sockets."""

    client: list[int]  # listening sockets' fds (still the old process's)
    admin: list[int]
    state: State | None
    # The response ids in ``parts`` lists of at most IDS_PER_FRAME, oldest first, each
    # taken as it is sent (``ResponseIds.frozen``); ``release`` once they are sent.
    responses: Iterable[list[Learnt]] = ()
    parts: int = 0
    release: Callable[[], None] | None = None


# -- frames ---------------------------------------------------------------------------


async def _send(sock: socket.socket, message: _Message) -> None:
    body = _encoder.encode(message)
    await asyncio.get_running_loop().sock_sendall(sock, len(body).to_bytes(4, "big") + body)


async def _exactly(sock: socket.socket, size: int) -> bytes:
    loop = asyncio.get_running_loop()
    parts = bytearray()
    while len(parts) < size:
        chunk = await loop.sock_recv(sock, min(size - len(parts), 1 << 20))
        if not chunk:
            raise HandoverError("the other process closed the handover socket")
        parts += chunk
    return bytes(parts)


async def _receive(sock: socket.socket, limit: int = MAX_FRAME) -> _Message:
    size = int.from_bytes(await _exactly(sock, 4), "big")
    if size > limit:
        raise HandoverError(f"a frame of {size} bytes (at most {limit})")
    try:
        return _decoder.decode(await _exactly(sock, size))
    except msgspec.DecodeError as exc:
        raise HandoverError(f"not a handover message: {exc}") from None


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), ready.set_result, None)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def _refuse(sock: socket.socket, reason: str) -> None:
    """The old process's answer is always one byte (with the sockets, or none) and a frame."""
    await asyncio.get_running_loop().sock_sendall(sock, b"N")
    await _send(sock, Busy(reason))


async def _receive_fds(sock: socket.socket) -> list[int]:
    """The one-byte message that carries the listening sockets (none on a refusal)."""
    while True:
        try:
            data, fds, flags, _ = socket.recv_fds(sock, 1, MAX_FDS)
        except BlockingIOError:
            await _readable(sock)
            continue
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise HandoverError(f"more than {MAX_FDS} listening sockets")
        if not data:
            raise HandoverError("the other process closed the handover socket")
        return fds


# -- the running process ---------------------------------------------------------------


class Handover:
    """PATH, listened on by the running daemon (see the module contract)."""

    def __init__(
        self,
        freeze: Callable[[], Awaitable[Snapshot]],
        thaw: Callable[[], None],
        on_ready: Callable[[int], Awaitable[None] | None],
    ):
        """``freeze`` holds the membership still and says what to hand over; ``thaw``
        lets it go (the handover failed); ``on_ready(pid)``: the process ``pid`` serves
        from now on, retire."""
        self._freeze = freeze
        self._thaw = thaw
        self._on_ready = on_ready
        self._sock: socket.socket | None = None
        self._path = ""
        self._inode: tuple[int, int] | None = None  # PATH's (st_dev, st_ino) as bound
        self._task: asyncio.Task[None] | None = None
        self._asked: set[asyncio.Task[None]] = set()  # one per connection to PATH
        self._busy = False
        self.retired = False
        self._learnt: list[Learnt] = []  # ids learnt since the freeze, not yet passed on
        self._more = asyncio.Event()
        self._closing = False
        self.stopping = False  # set as the daemon stops: its listeners are closing
        # Our requests in flight per backend, sent while we drain (``Loads``).
        self.loads: Callable[[], list[Load]] = list

    async def listen(self, path: str) -> None:
        """Listen on ``path``: bound beside it and renamed over it, so a process that
        asks at any moment finds one of us (a file there that is not a socket is an
        error, not replaced)."""
        _check_path(path)
        temporary = f"{path}.{os.getpid()}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            sock.bind(temporary)
            os.chmod(temporary, 0o600)  # before listen: nobody could connect until now
            sock.listen(4)
            sock.setblocking(False)
            os.rename(temporary, path)
        except OSError as exc:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise HandoverError(f"handover_socket {path}: {exc.strerror or exc}") from None
        info = os.stat(path)
        self._sock, self._path, self._inode = sock, path, (info.st_dev, info.st_ino)
        self._task = asyncio.create_task(self._serve(sock))

    async def _serve(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            if len(self._asked) >= MAX_ASKERS:
                conn.close()  # a local process opening connections: not one each
                continue
            conn.setblocking(False)
            task = asyncio.create_task(self._one(conn))
            self._asked.add(task)
            task.add_done_callback(self._asked.discard)

    async def _one(self, conn: socket.socket) -> None:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", creds)
        try:
            if uid != os.getuid():  # before reading anything of it
                log.warning("handover refused: another user", pid=pid, uid=uid)
                await _refuse(conn, f"the running router hands over to uid {os.getuid()} only")
                return
            async with asyncio.timeout(STEP_WAIT):
                ask = await _receive(conn, MAX_ASK)
            if not isinstance(ask, Ask) or ask.version != VERSION:
                await _refuse(conn, f"expected a version {VERSION} Ask")
            elif self._busy or self.retired:
                await _refuse(conn, "a handover is already under way")
            elif self.stopping:
                await _refuse(conn, "the running router is stopping: start once it has exited")
            else:
                self._busy = True
                try:
                    await self._hand_over(conn, pid)
                finally:
                    self._busy = False
        except (HandoverError, OSError, TimeoutError) as exc:
            log.warning("handover not started", pid=pid, error=str(exc) or type(exc).__name__)
        finally:
            conn.close()

    async def _hand_over(self, conn: socket.socket, pid: int) -> None:
        log.info("handing over", to_pid=pid)
        snapshot = await self._freeze()
        ready = False
        try:
            fds = [*snapshot.client, *snapshot.admin]
            socket.send_fds(conn, [b"F"], fds)  # first: the frame after may fill the buffer
            given = Given(
                os.getpid(),
                len(snapshot.client),
                len(snapshot.admin),
                snapshot.state,
                parts=snapshot.parts,
            )
            # Bounded: a peer that asks and reads nothing must not freeze us for ever.
            async with asyncio.timeout(READY_WAIT):
                await _send(conn, given)
                for part in snapshot.responses:
                    await _send(conn, Ids(part))
                    await asyncio.sleep(0)  # sock_sendall returns at once while there is room
            if snapshot.release is not None:
                snapshot.release()  # sent: the ids move again
            async with asyncio.timeout(READY_WAIT):
                message = await _receive(conn)
            ready = isinstance(message, Ready)
            if not isinstance(message, Ready):
                raise HandoverError(f"expected Ready, got {type(message).__name__}")
            reads_loads = message.loads
        except (HandoverError, OSError, TimeoutError) as exc:
            log.warning(
                "handover failed: still serving", to_pid=pid, error=str(exc) or "no Ready in time"
            )
            return
        finally:
            if snapshot.release is not None:
                snapshot.release()  # (once: a second call does nothing)
            if not ready:
                self._learnt = []  # learnt since the freeze, for a process that is gone
                self._thaw()
        self.retired = True
        log.info("handed over: draining", to_pid=pid)
        retiring = self._on_ready(pid)
        if retiring is not None:
            await retiring  # (bounded by the caller: it stops accepting, nothing more)
        try:
            await _send(conn, Released())
            await self._forward(conn, reads_loads)
        except (OSError, TimeoutError) as exc:
            log.warning("response ids learnt while draining not passed on", error=str(exc))

    def learnt(self, ids: list[Learnt]) -> None:
        """Response ids learnt (or applied) here since the freeze: passed on to the new
        process once it took over, so follow-ups of answers that ended while it started
        or while we drain find them."""
        self._learnt += ids
        self._more.set()

    async def _forward(self, conn: socket.socket, reads_loads: bool) -> None:
        """Send ``learnt`` ids as they come, and our loads (to a process that reads
        them), until ``close`` (each send bounded)."""
        loop = asyncio.get_running_loop()
        sent: dict[str, tuple[int, int]] = {}  # what the new process counts for us
        last: list[Load] | None = None  # ``loads()`` as last read
        refresh = 0.0  # when to send them all (at once, the first time)
        while True:
            while self._learnt:
                batch, self._learnt = self._learnt[:IDS_PER_FRAME], self._learnt[IDS_PER_FRAME:]
                async with asyncio.timeout(STEP_WAIT):
                    await _send(conn, Ids(batch))
            loads = self.loads() if reads_loads else None
            frame = None
            if loads is not None and (loads is not last or loop.time() >= refresh):
                now = {name: (count, waiting) for name, count, waiting in loads}
                if loop.time() >= refresh:
                    frame = Loads(loads, full=True)
                    refresh = loop.time() + LOADS_REFRESH
                else:
                    names = [
                        name for name in sent.keys() | now.keys() if now.get(name) != sent.get(name)
                    ]
                    changed = [(name, *now.get(name, (0, 0))) for name in sorted(names)]
                    frame = Loads(changed) if changed else None
                sent, last = now, loads
            if frame is not None:
                async with asyncio.timeout(STEP_WAIT):
                    await _send(conn, frame)
            if self._closing:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LOADS_PERIOD):
                    await self._more.wait()
            self._more.clear()

    async def close(self) -> None:
        """Stop listening (once the ids learnt since the freeze are passed on, bounded);
        PATH is removed only while it is still ours."""
        self._closing = True
        self._more.set()
        forwarding = [task for task in self._asked if not task.done()]
        if forwarding and self.retired:
            await asyncio.wait(forwarding, timeout=STEP_WAIT)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for task in list(self._asked):
            task.cancel()
        if self._sock is None:
            return
        self._sock.close()
        self._sock = None
        with contextlib.suppress(OSError):
            info = os.stat(self._path)
            if (info.st_dev, info.st_ino) == self._inode:
                os.unlink(self._path)


# -- the new process -------------------------------------------------------------------


class Taken:
    """What the running process handed over; ``ready()`` once this one serves."""

    def __init__(
        self,
        conn: socket.socket,
        given: Given,
        fds: list[int],
        responses: list[tuple[str, str]] | None = None,
    ):
        self._conn = conn
        self.pid = given.pid
        self.state = given.state
        self.responses = given.responses if responses is None else responses
        sockets = [socket.socket(fileno=fd) for fd in fds]
        self.client = sockets[: given.client]
        self.admin = sockets[given.client : given.client + given.admin]
        for extra in sockets[given.client + given.admin :]:
            extra.close()

    async def ready(
        self,
        on_ids: Callable[[list[Learnt]], None],
        on_loads: Callable[[dict[str, tuple[int, int]]], None],
    ) -> asyncio.Task[None] | None:
        """Tell the old process we serve; it retires (its answer awaited, bounded).  The
        task returned passes the response ids it learns while it drains to ``on_ids``
        and the backends whose in-flight counts there changed to ``on_loads``
        (``name -> (in flight, not answered)``; every one at zero once it has exited)
        until it exits (cancel it at shutdown); None if it did not answer."""
        closed = False
        try:
            await _send(self._conn, Ready(os.getpid(), loads=True))
            async with asyncio.timeout(STEP_WAIT):
                message = await _receive(self._conn)
            if not isinstance(message, Released):
                raise HandoverError(f"expected Released, got {type(message).__name__}")
        except (HandoverError, OSError, TimeoutError) as exc:
            # The old process closed without Released: it gave up on us (READY_WAIT
            # passed: it thawed and serves on) unless it is gone.  Serving beside it
            # would split the fleet's membership in two (one admin socket, two
            # processes accepting from it): we leave it be.
            closed = not isinstance(exc, TimeoutError)
            self._conn.close()
            if closed and _alive(self.pid):
                raise HandoverError(
                    f"the running router (pid {self.pid}) gave up on this handover (it"
                    f" waits {READY_WAIT:g} s for a new process to start) and serves on"
                ) from None
            log.warning("no word from the old process after Ready", pid=self.pid, error=str(exc))
            return None
        log.info("took over", from_pid=self.pid)
        return asyncio.create_task(self._follow(on_ids, on_loads))

    async def _follow(
        self,
        on_ids: Callable[[list[Learnt]], None],
        on_loads: Callable[[dict[str, tuple[int, int]]], None],
    ) -> None:
        held: dict[str, tuple[int, int]] = {}  # the old process's counts, as reported
        try:
            while True:
                message = await _receive(self._conn)
                if isinstance(message, Ids):
                    on_ids(message.responses)
                elif isinstance(message, Loads):
                    reported = {name: (count, waiting) for name, count, waiting in message.loads}
                    if message.full:
                        reported |= {name: (0, 0) for name in held.keys() - reported.keys()}
                    changes = {n: c for n, c in reported.items() if held.get(n, (0, 0)) != c}
                    held |= changes
                    if changes:
                        on_loads(changes)
        except (HandoverError, OSError):
            pass  # the old process exited: all it learnt has come, its requests are over
        except Exception:
            log.exception("following the old process failed: its ids and requests no more")
        finally:
            self._conn.close()
            # Every count at zero (once it has exited, or we stop or failed reading).
            if ended := {name: (0, 0) for name, counts in held.items() if counts != (0, 0)}:
                try:
                    on_loads(ended)
                except Exception:
                    log.exception("the old process's requests not uncounted")

    def abandon(self) -> None:
        """Start-up failed: the old process thaws and keeps serving."""
        self._conn.close()
        for sock in (*self.client, *self.admin):
            sock.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_path(path: str) -> None:
    """At start, before anything is served: ``path``'s directory exists, and a file
    at ``path`` that is not a socket is someone else's (never replaced)."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise HandoverError(f"handover_socket {path}: no directory {directory}")
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise HandoverError(f"handover_socket {path}: exists and is not a socket")


async def take_over(path: str) -> Taken | None:
    """Ask the process listening on ``path`` for its sockets; None if none listens."""
    _check_path(path)
    loop = asyncio.get_running_loop()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.setblocking(False)
    try:
        await loop.sock_connect(conn, path)
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None  # nobody there (or a stale file): an ordinary start
    except OSError as exc:
        conn.close()
        raise HandoverError(f"handover_socket {path}: {exc.strerror or exc}") from None
    # Whoever listens there hands us sockets and the membership: it must be us (a path
    # in a shared directory such as /tmp can be another user's socket).
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    peer_pid, peer_uid, _ = struct.unpack("3i", creds)
    if peer_uid != os.getuid():
        conn.close()
        raise HandoverError(
            f"handover_socket {path}: listened on by uid {peer_uid} (pid {peer_pid}),"
            f" not ours ({os.getuid()}): refused"
        )
    fds: list[int] = []
    try:
        await _send(conn, Ask(os.getpid()))
        async with asyncio.timeout(STEP_WAIT):
            fds = await _receive_fds(conn)
            given = await _receive(conn)
        if isinstance(given, Busy):
            raise HandoverError(f"handover_socket {path}: {given.reason}")
        if not isinstance(given, Given):
            raise HandoverError(f"handover_socket {path}: {type(given).__name__} unexpected")
        responses = list(given.responses)
        for _ in range(given.parts):
            async with asyncio.timeout(STEP_WAIT):
                part = await _receive(conn)
            if not isinstance(part, Ids):
                raise HandoverError(f"handover_socket {path}: {type(part).__name__} unexpected")
            responses += part.responses
    except BaseException as exc:
        conn.close()
        for fd in fds:
            os.close(fd)
        if isinstance(exc, TimeoutError):
            raise HandoverError(f"handover_socket {path}: no answer in {STEP_WAIT} s") from None
        raise
    return Taken(conn, given, fds, responses)
