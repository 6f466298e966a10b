"""Replicas' in-flight counts over UDP, a millisecond after they change (router.replicas).

Contract:
- Opt-in: ``replica_listen = "HOST:PORT"`` (``--replica-listen``), with etcd
  only.  The replica binds a UDP socket there and publishes the address (the
  port the OS gave, for port 0) and a key of 16 random bytes made at start in
  its etcd row (``Row.udp``, ``Row.udp_key``).  HOST is what the other
  replicas send to, so a wildcard address is refused.
- ``Sender`` samples the replica's own counts (``Replicas.sampled``) each
  time a worker signals a change of its row (an eventfd,
  ``router.shared.ChangeSignal``: once per pass of that worker's loop) and
  at least every ``KEEPALIVE`` (without the signal, every
  ``FAST_PERIOD``), and when they changed (or ``KEEPALIVE`` passed) sends
  one datagram to every other replica that published an address: its id,
  the sample's number (``seq``, the same numbering as the etcd row's), its
  wall-clock time, and the counts of both planes by backend name, as a whole
  (not as changes: a lost datagram is made good by the next one, or by the
  next etcd row).  After each send the next waits four times as long as the
  send took in CPU time (not wall time: a send preempted by another process
  is not dear), counted as if the send had started when it was due
  (``Pace``: uvloop runs a delay under half a millisecond on the next pass,
  and what a send came early is owed by the next), so the sends take at most
  a fifth of the supervisor's loop however fast the counts change.  The
  keep-alive goes ``KEEPALIVE`` after the last datagram, whatever sent it.
  ``signals`` counts the workers' signals taken (``/admin/stats``).
- A datagram is taken only when it names a replica whose etcd row this
  replica holds, its MAC (HMAC-SHA256 over the id, the datagram's number and
  the payload, the first 16 bytes, under that row's key) checks, and it
  decodes.  Anything else is dropped and counted (``rejected``); nothing is
  ever answered, so the port cannot be used to amplify or probe.  Whoever
  can read etcd can sign: the same trust as writing membership there.
- Replays: each datagram carries a number, the wall clock in microseconds
  or one more than the last, so a restarted replica's come after its last
  life's; one not above the last taken from that replica (under the same
  key) is dropped before its payload is decoded (``stale``).  Samples are
  numbered the same way (``Replicas``): a sample older than the one held is
  ignored, and a replica restarted under the same id is newer at once.
- Lag: ``Replicas`` tells its ``UdpRows`` when a sample replaced a
  replica's counts (``taken``) and when those are in the remote row
  (``written``); ``lag()`` gives the quantiles of the last ``LAG_SAMPLES``
  written in the last ``LAG_WINDOW`` seconds (``/admin/stats``
  ``replicas.udp.lag_ms``; None once none is that recent): from the change
  on the other replica's worker to the write here, across hosts plus their
  clocks' skew.
  The change's time comes in the sample (``changed``: each worker stamps the
  first change of a pass in its row, ``router.shared.ChangeSignal``, and the
  sender takes the oldest); a sample without it (no signal: sampled every
  ``FAST_PERIOD``) is timed from the sample.
- Peers: only an IP literal of the socket's own version is sent to (a row
  with a name or another version is not a peer); a send the OS or uvloop
  refuses is counted (``errors``) and the others still go.
- The size: counts of backends with something in flight only; a sample
  whose datagram would exceed ``MAX_DATAGRAM`` is not sent (``oversize``),
  the etcd row still carries it.
- Cost: on the request path, a worker's eventfd write once per loop pass
  that changed its row (``ChangeSignal``).  The supervisor wakes on it,
  samples (the same read as the 10 ms estimate's) and sends one ``sendto``
  per other replica, and otherwise once a ``KEEPALIVE``; it decodes each
  other replica's datagrams, so the receiving side grows with R - 1 and the
  fleet's size (at 1,000 busy backends ~60 us a datagram: past ~8 replicas
  that is most of the supervisor's loop); measured in
  ``python -m loadtests.bench_udprows``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import math
import os
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

import msgspec

from .config import parse_address
from .control import LagView
from .shared import ChangeSignal

__all__ = ["FAST_PERIOD", "KEEPALIVE", "SHARE_WAIT", "Pace", "Sample", "Sender", "UdpRows"]

# How often the counts are sampled for the datagram where the workers do not
# signal their changes: offline, a BalanceFactor on requests not yet answered
# needs the others' counts within ~1 ms (sysprompt, 4 routers: P90 x1.03 at 1 ms,
# x1.15 at 3 ms, x1.33 at 10 ms; loadtests/RESULTS.md).
FAST_PERIOD = 0.001
KEEPALIVE = 0.1  # a datagram at least this often, changed or not
# Without a datagram for this long, a replica is taken as not reaching us by UDP
# (its counts are then estimated between etcd rows, router.replicas).
FAST_STALE = 0.5
MAX_DATAGRAM = 60_000
MAGIC = b"PRu2"
MAC_BYTES = 16
# After each send (and each remote-row write, router.replicas), wait this many
# times as long as it took: at most 1/(1 + SHARE_WAIT), a fifth, of the supervisor's loop.
SHARE_WAIT = 4
LAG_SAMPLES = 1000  # lags kept for /admin/stats (the last samples written)
LAG_WINDOW = 60.0  # s: older lags are not reported (a replica that went quiet)


class Pace:
    """A repeated job's share of the loop held to 1/(1 + SHARE_WAIT): after a run that
    took ``took`` seconds of CPU, the next is due SHARE_WAIT times that after it
    ended, each run's CPU and wait together (1 + SHARE_WAIT) x ``took``.

    uvloop's timers count whole milliseconds and run a delay under half of one on
    the next pass, so a run can start before it is due; the time it came early is
    owed, not forgiven: the run is taken to have started when it was due (or when
    it did, if later), so it ends ``took`` after that and the wait counts from
    there.  Over many runs the share holds within half a millisecond."""

    __slots__ = ("due",)

    def __init__(self) -> None:
        self.due = 0.0  # time.monotonic: uvloop's loop clock is coarser than the waits

    def wait(self) -> float:
        """Seconds until the next run is due (not positive: now)."""
        return self.due - time.monotonic()

    def later(self, callback: Callable[[], object]) -> asyncio.Handle:
        """``callback`` on the running loop when it is due (on the next pass if it is)."""
        loop = asyncio.get_running_loop()
        wait = self.wait()
        return loop.call_later(wait, callback) if wait > 0 else loop.call_soon(callback)

    def ran(self, took: float) -> None:
        """A run just ended; it took ``took`` seconds of CPU (``time.thread_time``:
        a run preempted by another process did not cost this loop the wall time)."""
        self.due = max(self.due + took, time.monotonic()) + SHARE_WAIT * took


class Sample(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    at: float  # wall-clock time of the sample
    loads: dict[str, int]
    waiting: dict[str, int]
    # when (wall clock) the oldest change in it was made, 0.0: not known (the
    # workers do not signal, or nothing changed); a replica before this field
    # sends four elements, and one before it ignores the fifth
    changed: float = 0.0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Sample)


def mac(key: bytes, replica: bytes, counter: bytes, payload: bytes) -> bytes:
    return hmac.digest(key, b"".join((replica, b"\0", counter, payload)), "sha256")[:MAC_BYTES]


def encode(replica: bytes, key: bytes, counter: int, sample: Sample) -> bytes:
    """One datagram: MAGIC, the id's length (one byte), the id, the datagram's
    number (8 bytes, big-endian; each newer than the last), the MAC, the payload."""
    payload = _encoder.encode(sample)
    number = counter.to_bytes(8, "big")
    signed = mac(key, replica, number, payload)
    return b"".join((MAGIC, bytes((len(replica),)), replica, number, signed, payload))


class Signed(NamedTuple):
    replica: str
    key: bytes
    counter: int
    payload: bytes


def open_signed(data: bytes, key_of: Callable[[str], bytes | None]) -> Signed | None:
    """The sender, its key, the datagram's number and the payload (not decoded), or
    None for anything not signed by a replica we know."""
    if len(data) > MAX_DATAGRAM or not data.startswith(MAGIC) or len(data) < len(MAGIC) + 1:
        return None
    start = len(MAGIC) + 1
    end = start + data[len(MAGIC)]
    if len(data) < end + 8 + MAC_BYTES:
        return None
    replica, number = data[start:end], data[end : end + 8]
    payload = data[end + 8 + MAC_BYTES :]
    name = replica.decode(errors="replace")
    key = key_of(name)
    if key is None:
        return None
    if not hmac.compare_digest(
        data[end + 8 : end + 8 + MAC_BYTES], mac(key, replica, number, payload)
    ):
        return None
    return Signed(name, key, int.from_bytes(number, "big"), payload)


def decode(data: bytes, key_of: Callable[[str], bytes | None]) -> tuple[str, Sample] | None:
    """The sender and its sample, or None for anything not signed by a replica we
    know or not a sample."""
    signed = open_signed(data, key_of)
    if signed is None:
        return None
    try:
        return signed.replica, _decoder.decode(signed.payload)
    except msgspec.DecodeError:
        return None


class UdpRows(asyncio.DatagramProtocol):
    """This replica's UDP socket: ``send`` a sample to peers, ``on_sample`` for theirs."""

    def __init__(self, replica_id: str, key_of: Callable[[str], bytes | None]):
        """``key_of(replica)``: that replica's key as its etcd row says, None if unknown."""
        self.id = replica_id.encode()
        if len(self.id) > 255:
            raise ValueError("a replica id for UDP rows is at most 255 bytes")
        self.key = os.urandom(16)
        self.key_of = key_of
        self.on_sample: Callable[[str, Sample], None] | None = None
        self.address = ""  # HOST:PORT as published, once open
        self.sent = self.received = self.rejected = self.oversize = self.errors = 0
        self.stale = 0  # signed, but not newer than the last from that replica: replays
        self.family = socket.AF_INET
        self._transport: asyncio.DatagramTransport | None = None
        self._counter = 0  # the last datagram's number
        self._last: dict[str, tuple[bytes, int]] = {}  # replica -> (its key, last number)
        # The wall-clock times of the samples taken and not yet written into the
        # remote row, and how late the last LAG_SAMPLES were written (ms).
        self._unwritten: list[float] = []
        self._lags: deque[tuple[float, float]] = deque(maxlen=LAG_SAMPLES)  # (monotonic, ms)

    async def open(self, listen: str) -> str:
        host, port = parse_address(listen, "replica_listen")  # Config refused wildcards
        family = self.family = socket.AF_INET6 if ":" in host else socket.AF_INET
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: self, local_addr=(host, port), family=family
        )
        bound = transport.get_extra_info("sockname")[1]
        self.address = f"[{host}]:{bound}" if family == socket.AF_INET6 else f"{host}:{bound}"
        return self.address

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's UDPTransport

    def send(self, sample: Sample, peers: list[tuple[str, int]]) -> None:
        transport = self._transport
        if transport is None or not peers:
            return
        # Numbered from the wall clock in microseconds: a restarted replica's come
        # after its last life's (it cannot send a million a second).
        self._counter = max(self._counter + 1, time.time_ns() // 1000)
        data = encode(self.id, self.key, self._counter, sample)
        if len(data) > MAX_DATAGRAM:
            self.oversize += 1
            return
        for peer in peers:
            try:
                transport.sendto(data, peer)
            except (OSError, ValueError):  # uvloop raises for an address it cannot use
                self.errors += 1
            else:
                self.sent += 1

    def reaches(self, address: tuple[str, int]) -> bool:
        """``address`` is one this socket can send to (the same IP version)."""
        return (":" in address[0]) == (self.family == socket.AF_INET6)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        signed = open_signed(data, self.key_of)
        if signed is None:
            self.rejected += 1
            return
        last = self._last.get(signed.replica)
        if last is not None and last[0] == signed.key and signed.counter <= last[1]:
            self.stale += 1  # checked before the payload is decoded
            return
        try:
            sample = _decoder.decode(signed.payload)
        except msgspec.DecodeError:
            self.rejected += 1
            return
        self._last[signed.replica] = (signed.key, signed.counter)
        self.received += 1
        if self.on_sample is not None:
            self.on_sample(signed.replica, sample)

    def taken(self, at: float) -> None:
        """A sample whose oldest change was made at wall-clock time ``at`` replaced a
        replica's counts (``Replicas``)."""
        self._unwritten.append(at)

    def written(self) -> None:
        """The counts taken since the last call are in the remote row now: their lags."""
        now, written = time.time(), time.monotonic()
        self._lags.extend((written, 1000 * (now - at)) for at in self._unwritten)
        self._unwritten.clear()

    def lag(self) -> LagView | None:
        """Quantiles of the lags kept and written in the last LAG_WINDOW seconds, for
        /admin/stats; None if there are none."""
        since = time.monotonic() - LAG_WINDOW
        lags = self._lags
        while lags and lags[0][0] < since:
            lags.popleft()
        return lag_view(lag for _, lag in lags)

    def error_received(self, exc: Exception) -> None:
        self.errors += 1  # e.g. ECONNREFUSED: a replica that left; its row goes with its lease

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


def peer_address(text: str) -> tuple[str, int] | None:
    """A row's ``udp`` as a sendto address: an IP literal (not a wildcard) and a
    port; None if it is not one."""
    try:
        host, port = parse_address(text, "udp")
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_unspecified or port == 0:
        return None
    return host, port


def lag_view(lags: Iterable[float]) -> LagView | None:
    """Quantiles of ``lags`` (ms), None if there are none."""
    ordered = sorted(lags)
    if not ordered:
        return None
    last = len(ordered) - 1
    p50, p90, p99 = (round(ordered[min(last, int(q * len(ordered)))], 3) for q in (0.5, 0.9, 0.99))
    return LagView(len(ordered), p50, p90, p99, round(ordered[-1], 3))


class Sender:
    """When this replica's counts go out (the contract): on each worker's signal on
    ``changes_fd`` (or, without one, every FAST_PERIOD) and KEEPALIVE after the last
    datagram, to ``peers`` (replica -> address: ``Replicas``' own dict, changed in
    place); ``sample()`` gives the own counts' number and both planes,
    ``changed_at()`` when the oldest change since its last call was made (0.0: not
    known).  Times are ``time.monotonic``: uvloop's loop clock has whole
    milliseconds, coarser than the waits here."""

    def __init__(
        self,
        udp: UdpRows,
        sample: Callable[[], tuple[int, list[dict[str, int]]]],
        peers: dict[str, tuple[str, int]],
        changes_fd: int | None,
        changed_at: Callable[[], float] | None = None,
    ):
        self.udp = udp
        self.sample = sample
        self.changed_at = changed_at
        self.peers = peers
        self.changes_fd = changes_fd
        self.signals = 0  # the workers' signals taken (each one wakes a send)
        self._pending: asyncio.Handle | None = None  # a send, waiting for its pace
        self.pace = Pace()
        self._sent_seq, self._sent_at = -1, -math.inf  # the last datagram's sample, when
        self._task: asyncio.Task[None] | None = None
        self._reading = False  # changes_fd is in the loop's readers

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self.run(), name="replica udp")
        if self.changes_fd is not None:
            loop.add_reader(self.changes_fd, self.on_change)
            self._reading = True

    async def close(self) -> None:
        """Stop sending: the reader off ``changes_fd`` (before its owner closes it),
        a pending send cancelled, the timer stopped."""
        if self._reading:
            assert self.changes_fd is not None
            asyncio.get_running_loop().remove_reader(self.changes_fd)
            self._reading = False
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        """The timer: the keep-alive, or with no signal the sampling too."""
        while True:
            if self.changes_fd is None:
                wait = FAST_PERIOD
            else:  # KEEPALIVE after the last datagram, signalled or not
                wait = max(self._sent_at + KEEPALIVE - time.monotonic(), FAST_PERIOD)
            await asyncio.sleep(wait if self.peers else KEEPALIVE)
            if self._pending is None:
                self.send()

    def on_change(self) -> None:
        """A worker's row changed: send now, or when the last send's wait is over."""
        assert self.changes_fd is not None
        if not ChangeSignal.take(self.changes_fd):
            return
        self.signals += 1
        if not self.peers or self._pending:
            return
        if self.pace.wait() > 0:
            self._pending = self.pace.later(self.send)
        else:
            self.send()

    def send(self) -> None:
        """The own counts to every peer, if they changed since the last datagram or
        KEEPALIVE passed; the next send waits SHARE_WAIT times as long as this one took
        (its CPU time)."""
        self._pending = None
        if not self.peers:
            return
        # CPU time: a send the VM or another process preempted took no more of this
        # loop (measured as wall time, one preempted for 37 ms held the next 150 ms).
        start = time.thread_time()
        # The changes stamped before the sample is read are in it (taken, sent or not).
        changed = self.changed_at() if self.changed_at is not None else 0.0
        seq, (loads, waiting) = self.sample()
        now = time.monotonic()
        if seq == self._sent_seq and now - self._sent_at < KEEPALIVE:
            return
        sample = Sample(seq, time.time(), loads, waiting, changed)
        self.udp.send(sample, list(self.peers.values()))
        self._sent_seq, self._sent_at = seq, now
        self.pace.ran(time.thread_time() - start)
