"""Replicas' in-flight counts over UDP, a millisecond after they change (router.replicas).

Contract:
- Opt-in: ``replica_listen = "HOST:PORT"`` (``--replica-listen``), with etcd
  only.  The replica binds a UDP socket there and publishes the address (the
  port the OS gave, for port 0) and a key of 16 random bytes made at start in
  its etcd row (``Row.udp``, ``Row.udp_key``).  HOST is what the other
  replicas send to, so a wildcard address is refused.
- ``Replicas`` samples its own counts every ``FAST_PERIOD`` and, when they
  changed (or ``KEEPALIVE`` passed), sends one datagram to every other
  replica that published an address: its id, the sample's number (``seq``,
  the same numbering as the etcd row's), its wall-clock time, and the counts
  of both planes by backend name, as a whole (not as changes: a lost
  datagram is made good by the next one, or by the next etcd row).
- A datagram is taken only when it names a replica whose etcd row this
  replica holds, its MAC (HMAC-SHA256 over the id and the payload, the first
  16 bytes, under that row's key) checks, and it decodes.  Anything else is
  dropped and counted (``rejected``); nothing is ever answered, so the port
  cannot be used to amplify or probe.  Whoever can read etcd can sign: the
  same trust as writing membership there.  Replays and reordering: a sample
  older than the one held from that replica is ignored by ``Replicas``.
- The size: counts of backends with something in flight only; a sample
  whose datagram would exceed ``MAX_DATAGRAM`` is not sent (``oversize``),
  the etcd row still carries it.
- Cost: nothing on the request path.  The supervisor's loop wakes every
  ``FAST_PERIOD`` while another replica listens, samples (the same read as
  the 10 ms estimate's), and sends one ``sendto`` per other replica when a
  count changed; measured in ``python -m loadtests.bench_udprows``.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import socket
from collections.abc import Callable

import msgspec

from .config import parse_address
from .log import get_logger

__all__ = ["FAST_PERIOD", "KEEPALIVE", "Sample", "UdpRows"]

log = get_logger("replicas")

# How often the counts are sampled for the datagram: offline, a BalanceFactor on
# requests not yet answered needs the others' counts within ~1 ms (sysprompt, 4
# routers: P90 x1.03 at 1 ms, x1.15 at 3 ms, x1.33 at 10 ms; loadtests/RESULTS.md).
FAST_PERIOD = 0.001
KEEPALIVE = 0.1  # a datagram at least this often, changed or not
# Without a datagram for this long, a replica is taken as not reaching us by UDP
# (its counts are then estimated between etcd rows, router.replicas).
FAST_STALE = 0.5
MAX_DATAGRAM = 60_000
MAGIC = b"PRu1"
MAC_BYTES = 16


class Sample(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    at: float  # wall-clock time of the sample
    loads: dict[str, int]
    waiting: dict[str, int]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Sample)


def mac(key: bytes, replica: bytes, payload: bytes) -> bytes:
    return hmac.digest(key, replica + b"\0" + payload, "sha256")[:MAC_BYTES]


def encode(replica: bytes, key: bytes, sample: Sample) -> bytes:
    """One datagram: MAGIC, the id's length (one byte), the id, the MAC, the payload."""
    payload = _encoder.encode(sample)
    return b"".join((MAGIC, bytes((len(replica),)), replica, mac(key, replica, payload), payload))


def decode(data: bytes, key_of: Callable[[str], bytes | None]) -> tuple[str, Sample] | None:
    """The sender and its sample, or None for anything not signed by a replica we know."""
    if len(data) < len(MAGIC) + 1 or not data.startswith(MAGIC):
        return None
    start = len(MAGIC) + 1
    end = start + data[len(MAGIC)]
    if len(data) < end + MAC_BYTES:
        return None
    replica, payload = data[start:end], data[end + MAC_BYTES :]
    name = replica.decode(errors="replace")
    key = key_of(name)
    if key is None:
        return None
    if not hmac.compare_digest(data[end : end + MAC_BYTES], mac(key, replica, payload)):
        return None
    try:
        return name, _decoder.decode(payload)
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
        self._transport: asyncio.DatagramTransport | None = None

    async def open(self, listen: str) -> str:
        host, port = parse_address(listen, "replica_listen")  # Config refused wildcards
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
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
        data = encode(self.id, self.key, sample)
        if len(data) > MAX_DATAGRAM:
            self.oversize += 1
            return
        for peer in peers:
            transport.sendto(data, peer)
        self.sent += len(peers)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        got = decode(data, self.key_of)
        if got is None:
            self.rejected += 1
            return
        self.received += 1
        if self.on_sample is not None:
            self.on_sample(*got)

    def error_received(self, exc: Exception) -> None:
        self.errors += 1  # e.g. ECONNREFUSED: a replica that left; its row goes with its lease

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None


def peer_address(text: str) -> tuple[str, int] | None:
    """A row's ``udp`` as a sendto address, None if it is not one."""
    try:
        return parse_address(text, "udp")
    except ValueError:
        return None
