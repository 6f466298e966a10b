"""The supervisor <-> worker channel: length-prefixed msgpack messages on a socketpair.

Contract:
- One ``Channel`` per worker, over one end of a ``socket.socketpair`` (the
  worker's end is passed to it as an inherited file descriptor).  A frame
  is a 4-byte big-endian length and a msgpack-encoded ``Message``; frames
  larger than ``MAX_FRAME`` are a protocol error (the peer is closed).
- Supervisor to worker: ``Init`` once (the fleet as it is now, the config,
  the worker's row), then ``Apply`` (an op, acknowledged by ``Applied`` once
  the worker's ring has it) and ``Query`` (answered by ``Report``, the
  worker's traffic accounting since it started).
- Worker to supervisor: ``Ready`` once it listens; ``Failed``/``Recovered``
  (passive health: the supervisor owns health and decides); ``Idle`` when
  its own count for a draining backend reaches zero.
- ``Signals`` (supervisor to every worker, after each scrape round with
  engine signals on): the engines' figures the worker breaks ties by
  (``router.signals``); ``Init`` carries the last round's.
- ``Explain`` (supervisor to one worker) asks for the admin API's dry run
  (``router.explain``), answered by ``Explained``: the explanation, or the
  data path's refusal.
- Both ways: ``Records``, TRAFFIC placement decisions
  (``hashring.shared.PlacementLog``) and Responses API ids learnt
  (``router.responses``): a worker sends its own every ``PUBLISH_SECONDS``
  when it made any (ids also at the end of the loop iteration that learnt
  them); the supervisor passes them on to every other worker (and to the
  other replicas, ``router.replicas``).
- Messages are answered in order, so a sequence number is enough to pair
  them.  ``send`` never awaits: the socket buffers, and the supervisor
  never sends more than the ops an operator makes.
"""

from __future__ import annotations

import asyncio
import socket

import msgspec

from hashring.shared import Record

from .arms import ArmReport
from .config import Config
from .control.ops import Op
from .explain import DryRequest, Explanation
from .log import get_logger
from .responses import FrozenIds, Learnt
from .signals import Signal
from .slowstart import Ramp
from .tenants import TenantDelta

__all__ = [
    "IDS_PER_PART",
    "Applied",
    "BackendCounts",
    "Channel",
    "ChannelClosed",
    "Explain",
    "Explained",
    "Failed",
    "HistogramData",
    "Idle",
    "Init",
    "Message",
    "Query",
    "Ready",
    "Records",
    "Recovered",
    "Report",
    "Signals",
    "send_ids",
]

MAX_FRAME = 64 << 20  # a Report of a very large fleet stays far below


class Init(msgspec.Struct, tag=True, frozen=True):
    index: int  # the worker's slot: its row in the shared table, its seed offset
    stamp: int  # its name in TRAFFIC placement stamps, unique in the fleet
    config: Config  # backends as they are now (weights included), routing as it is now
    draining: list[str]
    unhealthy: list[str]
    slots: dict[str, int]  # backend -> column of the shared in-flight table
    table_rows: int
    table_slots: int
    # The response ids the fleet knows: none here, they follow in Records of
    # IDS_PER_PART (``send_ids``: 10 million would be ~500 MB, past MAX_FRAME).
    responses: list[Learnt] = []
    ramps: dict[str, Ramp] = {}  # slow starts under way (router.slowstart)
    signals: dict[str, Signal] = {}  # the last scrape round's engine figures (router.signals)


class Ready(msgspec.Struct, tag=True, frozen=True):
    pid: int


class Apply(msgspec.Struct, tag=True, frozen=True):
    seq: int
    op: Op


class Applied(msgspec.Struct, tag=True, frozen=True):
    seq: int


class Query(msgspec.Struct, tag=True, frozen=True):
    seq: int


class BackendCounts(msgspec.Struct, array_like=True, frozen=True):
    requests: int
    overflow: int
    fallback: int
    errors: int
    idle_connections: int
    repeats_sent: int = 0  # router.cachecheck: requests repeating a key sent there
    repeats_answered: int = 0
    tie_breaks: int = 0  # router.signals: routed here because its engine's signal broke a tie


class HistogramData(msgspec.Struct, array_like=True, frozen=True):
    counts: list[int]
    total: float


class Report(msgspec.Struct, tag=True, frozen=True):
    seq: int
    backends: dict[str, BackendCounts]
    requests: list[tuple[str, str, str, int, int]]  # backend, kind, decision, status, count
    decisions: dict[str, int]
    ttft: dict[str, HistogramData]
    duration: dict[str, HistogramData]
    windows: dict[str, list[float]]  # the last TTFTs per backend, ms
    no_backend: int
    refused: dict[int, int]
    tracing: dict[str, int] = {}  # Tracer.counts(); empty while tracing is off
    models: dict[str, int] = {}  # requests per model pool (Recorder.models)
    sources: dict[str, int] = {}  # requests per affinity key source (Recorder.sources)
    responses: dict[str, int] = {}  # ResponseIds.counts()
    tenants: list[TenantDelta] = []  # per-tenant counts since the last report (router.tenants)
    queue: tuple[int, int] = (0, 0)  # the admission queue: requests and tenants waiting
    connections: tuple[int, int] = (0, 0)  # client connections open, accepted since start
    arms: list[ArmReport] = []  # an A/B experiment's arms, totals (router.arms)


class Explain(msgspec.Struct, tag=True, frozen=True):
    seq: int
    request: DryRequest
    k: int
    view: str  # whose counts the answer reads, said in it


class Explained(msgspec.Struct, tag=True, frozen=True):
    seq: int
    explanation: Explanation | None  # None: refused, with ``error``
    error: str = ""
    param: str | None = None


class Signals(msgspec.Struct, tag=True, frozen=True):
    figures: dict[str, Signal]  # per backend; absent: its scrape failed (rank 0)


class Failed(msgspec.Struct, tag=True, frozen=True):
    name: str
    reason: str


class Recovered(msgspec.Struct, tag=True, frozen=True):
    name: str


class Idle(msgspec.Struct, tag=True, frozen=True):
    name: str


class Records(msgspec.Struct, tag=True, frozen=True):
    records: list[Record]
    responses: list[Learnt] = []  # (response id, backend) learnt since the last message
    # The ids the fleet knew as this worker started, newest first (``ResponseIds.seed``).
    seed: bool = False


Message = (
    Init
    | Ready
    | Apply
    | Applied
    | Query
    | Report
    | Failed
    | Recovered
    | Idle
    | Records
    | Explain
    | Explained
    | Signals
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class ChannelClosed(Exception):
    """The other end is gone (it exited, or sent something that is not a frame)."""


class Channel:
    __slots__ = ("_reader", "_writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> Channel:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=MAX_FRAME)
        return cls(reader, writer)

    def send(self, message: Message) -> None:
        if self._writer.is_closing():
            raise ChannelClosed("the channel is closed")
        body = _encoder.encode(message)
        self._writer.write(len(body).to_bytes(4, "big") + body)

    async def receive(self) -> Message:
        try:
            size = int.from_bytes(await self._reader.readexactly(4), "big")
            if size > MAX_FRAME:
                raise ChannelClosed(f"a frame of {size} bytes (at most {MAX_FRAME})")
            return _decoder.decode(await self._reader.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ChannelClosed("the other end closed the channel") from exc
        except msgspec.DecodeError as exc:
            raise ChannelClosed(f"not a message: {exc}") from exc

    async def drained(self) -> None:
        """Return once what was sent is in the kernel's buffer (or nearly): a sender of
        many messages waits here between them rather than queue them all in memory."""
        try:
            await self._writer.drain()
        except ConnectionError as exc:
            raise ChannelClosed("the other end closed the channel") from exc

    def close(self) -> None:
        self._writer.close()


IDS_PER_PART = 16384  # response ids per Records message to a worker starting (~1 MB)
SEND_WAIT = 60.0  # a starting worker that reads none of them for this long gets no more
# (a worker builds its ring before it reads: 8,192 backends take seconds of CPU)


async def send_ids(channel: Channel, ids: FrozenIds) -> None:
    """The response ids the fleet knows, to a worker just started, newest first, in
    Records of IDS_PER_PART marked ``seed``, each once the last is on its way: one Init
    of 10 million would pass the channel's frame bound (the worker could never start)
    and hold the loop for seconds.  It serves meanwhile: what it learns or is told
    meanwhile stays the more recent (``ResponseIds.seed``), and an id not there yet is
    waited for briefly, as any unknown id.  A worker that reads nothing for
    SEND_WAIT gets no more of them (the table is held still while they go)."""
    try:
        for part in ids:
            channel.send(Records([], part, seed=True))
            async with asyncio.timeout(SEND_WAIT):
                await channel.drained()
    except ChannelClosed:
        pass  # it exited: its successor gets them all again
    except TimeoutError:
        get_logger("supervisor").warning(
            "a starting worker read no response ids for a while: no more sent"
        )
    finally:
        ids.close()
