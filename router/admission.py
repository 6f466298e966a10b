"""Admission: caps on client connections, the router's own at its fd limit and one per address.

Contract:
- Every client connection costs one file descriptor, and one more for its
  upstream connection while a request is in flight.  Past ``RLIMIT_NOFILE``
  an accept fails: libuv then accepts and closes at once (the client reads
  an EOF) and nothing else can open a socket either, the admin API
  (``/healthz`` included) and the health checks among them.
- So client connections are capped (as nginx's ``worker_connections`` and
  HAProxy's ``maxconn`` computed from ``ulimit -n``), at what the limit
  leaves after a reserve::

      spare = nofile - RESERVE - backends * PER_BACKEND
      idle  = min(max_idle_upstream * backends, spare // 3)   # pooled upstreams
      cap   = (spare - idle) // 2                             # client + its upstream

  ``RESERVE`` covers the process's own fds, the admin listener and its
  clients, the state file's write and the refusals below; ``PER_BACKEND``
  a health check and a metrics scrape per backend.  The cap follows the
  number of backends (recomputed when it changes, not per accept).
- A client past the cap is answered, not dropped: a 503 JSON error with
  ``connection: close``, then a half-close; what it sends meanwhile is read
  and dropped (so the kernel does not reset the answer away) until it
  closes or ``LINGER_SECONDS`` pass.  At most ``MAX_REFUSING`` refusals
  linger at once; past that they are answered and closed at once.
- The counting is exact and cheap: +1 when the protocol is built (in the
  accept callback, before ``connection_made``, so a burst of accepts in one
  loop iteration is counted as it happens), -1 in ``connection_lost``.
- ``[limits] client_connections`` (0: off, the default) caps what one client
  address holds open at once, as nginx's ``limit_conn`` or HAProxy's
  ``sc_conn_cur``: without it one client can take every place under the cap
  above and lock the others out.  The count is per address: an IPv4 one (an
  IPv4-mapped IPv6 one counts as its IPv4 address), or an IPv6 one's network
  of ``client_ipv6_prefix`` bits, /64 by default (one host is usually given
  a /64: counted per /128, it could open the limit from each of 2**64
  addresses; 128 counts each address), kept from ``connection_made`` (the factory is not given the
  peer) to ``connection_lost``; an address's entry goes at zero, so the table
  holds one entry per address with a connection open.  A connection past it
  is refused as a request is (``ClientConnection._refuse``): a 429 with
  ``Retry-After: 1``, a ``refused`` access-log line and
  ``prefix_router_refused_requests_total{status="429"}``, a lingering close;
  it still counts against the cap above until it closes, so at most
  ``MAX_REFUSING`` of these and the cap's refusals linger at once, the rest
  are closed as soon as answered (else an address that keeps connecting
  fills the cap with its refusals).  A reload applies
  to the connections opened after it (those open before a limit was set
  are not counted against it).  With ``--workers N`` each worker counts its
  own connections: the kernel spreads one client's connections over the
  workers (``SO_REUSEPORT`` hashes the 4-tuple), so a host lets one address
  hold between the limit and N times it, never more.
- On a TLS listener (``tls_cert``) a connection is counted from the accept
  too, but asyncio calls neither ``connection_made`` nor ``connection_lost``
  of a connection whose handshake fails (plain HTTP on the TLS port, a TCP
  health check that connects and closes, a scanner): before, each one stayed
  counted forever, and enough of them (the cap, ~10,000 at the usual limit)
  had every client refused with a 503 until a restart.  So the handshake has
  a deadline (``ssl_handshake_timeout`` = ``timeouts.client_header``) and a
  connection still not made ``HANDSHAKE_MARGIN`` past it is uncounted by
  ``sweep`` (every ``SWEEP_SECONDS``, router.app): it is gone.  One made
  after all (a loop held past the margin) is counted again then.
- With ``proxy_protocol`` (``router.proxyproto``) a connection is first an
  ``_AwaitingHeader``, counted under the cap as a client from the accept: it
  reads the PROXY header, then hands the transport to its ``_Client``
  (``set_protocol``) with the address the header names, and the bytes that
  followed the header in the same read.  Only then is the connection counted
  against ``client_connections`` (under the client's address, not the
  proxy's), added to the router's connections and given the request-head
  deadline.  A header not complete within ``timeouts.client_header`` closes
  the connection (a 408 if part of one came); bytes that cannot be a header
  get a 400 saying what the listener expects, a ``refused`` access-log line,
  and a lingering close.  The request path does not test for it: a
  connection's protocol is the client from the handover on.  At shutdown
  (``hold_awaiting``) one that has waited ``STOPPING_IDLE_SECONDS`` is closed;
  a younger one gets the rest of that, counted in the router's drain, and if
  its header comes, its request is served as any held connection's is
  (``ClientConnection.hold``).
- ``raise_nofile()`` lifts the soft limit to the hard one (start-up only).
"""

from __future__ import annotations

import asyncio
import resource
import socket
from typing import TYPE_CHECKING, TypeVar, cast

from .client import STOPPING_IDLE_SECONDS, ClientConnection, peer_address
from .log import get_logger
from .proxyproto import ProxyHeaderError, parse
from .wire import error_response

if TYPE_CHECKING:
    from .app import Router

__all__ = [
    "LINGER_SECONDS",
    "MAX_REFUSING",
    "PER_BACKEND",
    "RESERVE",
    "Admission",
    "client_cap",
    "nofile_limit",
    "raise_nofile",
]

log = get_logger("router")

_P = TypeVar("_P", bound=asyncio.Protocol)

# What a running router holds besides clients and upstreams (measured: 17 fds
# for python, uvloop's epoll/eventfd/signal pipes, both listeners, stdio and the
# access log), with room for: admin clients (16), a state-file save (temp file +
# directory: 2), the refusals that linger (MAX_REFUSING) and a margin.
MAX_REFUSING = 32
RESERVE = 24 + 16 + 2 + MAX_REFUSING + 6
PER_BACKEND = 2  # an active health check and a metrics scrape, each a connection
LINGER_SECONDS = 1.0
# Past a TLS handshake's deadline, before its connection is taken for lost: the
# deadline's timer starts a loop pass or two after the accept.
HANDSHAKE_MARGIN = 1.0
BUSY_MESSAGE = "the router is at its connection limit; retry later"
_MAPPED = bytes(10) + b"\xff\xff"  # ::ffff:a.b.c.d, an IPv4 address on an IPv6 socket


def nofile_limit() -> int | None:
    """The soft RLIMIT_NOFILE, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def raise_nofile() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        # Linux refuses a soft limit above fs.nr_open, "unlimited" included.
        try:
            with open("/proc/sys/fs/nr_open") as file:
                target = int(file.read())
        except (OSError, ValueError):
            return soft, soft
    if soft == resource.RLIM_INFINITY or target <= soft:
        return soft, soft  # nothing to raise (never lower it)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


def client_key(address: bytes, ipv6_prefix: int) -> bytes:
    """What ``client_connections`` counts ``address`` under: an IPv4 address (an
    IPv4-mapped IPv6 one too: a dual-stack listener's IPv4 clients) as it is, an
    IPv6 one by its first ``ipv6_prefix`` bits."""
    if b":" not in address:
        return address
    try:
        packed = socket.inet_pton(socket.AF_INET6, address.decode("ascii"))
    except (OSError, UnicodeDecodeError):
        return address  # a scope id (fe80::1%eth0), or not IPv6 after all: as given
    if packed.startswith(_MAPPED):
        return socket.inet_ntop(socket.AF_INET, packed[12:]).encode()
    if ipv6_prefix == 128:
        return address
    kept = int.from_bytes(packed, "big") >> (128 - ipv6_prefix) << (128 - ipv6_prefix)
    network = socket.inet_ntop(socket.AF_INET6, kept.to_bytes(16, "big"))
    return f"{network}/{ipv6_prefix}".encode()


def client_cap(nofile: int, backends: int, max_idle: int) -> int:
    """Client connections the limit allows (see the module docstring)."""
    spare = nofile - RESERVE - backends * PER_BACKEND
    idle = min(max_idle * backends, spare // 3)
    return max(0, (spare - idle) // 2)


class _Client(ClientConnection):
    __slots__ = ("_counted", "_lingering", "_where")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        admission = self.router.admission
        if admission.made(self):
            admission.clients += 1  # taken for a failed handshake, made after all
        super().connection_made(transport)
        self._lingering = False
        # What the connection counts under: its address, or its IPv6 /64 (the module's
        # docstring); kept, so a reload that changes the prefix meanwhile cannot
        # make its close count down another entry.  Without a limit nothing is counted:
        # no key to work out (an IPv6 address is parsed for it).
        limits = self.router.config.limits
        if limits.client_connections:
            self._where = client_key(self.peer_ip, limits.client_ipv6_prefix)
        else:
            self._where = self.peer_ip
        self._counted = admission.opened(self._where)
        if self._counted is None:
            limit = self.router.config.limits.client_connections
            message = (
                f"this client address has {limit} connections open to the router, the limit "
                "per address ([limits] client_connections); retry after 1 s"
            )
            # A lingering refusal holds its place under the cap for up to
            # LINGER_SECONDS: unbounded, an address that keeps connecting would
            # fill the cap with its refusals, the lock-out this limit exists to
            # prevent.  So at most MAX_REFUSING linger (shared with the cap's
            # own), the rest are answered and closed at once.
            self._lingering = admission.refusing < MAX_REFUSING
            if self._lingering:
                admission.refusing += 1
            self._refuse(429, message, b"retry-after: 1\r\n", lingering=self._lingering)

    def connection_lost(self, exc: Exception | None) -> None:
        admission = self.router.admission
        admission.clients -= 1
        if self._counted:
            admission.closed(self._where)
        if self._lingering:
            admission.refusing -= 1
        super().connection_lost(exc)


class _Refusal(asyncio.Protocol):
    """A client past the cap: a 503, a half-close, its bytes dropped, then close."""

    __slots__ = ("admission", "timer", "transport")

    def __init__(self, admission: Admission):
        self.admission = admission
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        t = cast(asyncio.Transport, transport)  # uvloop's do not subclass it
        admission = self.admission
        if admission.made(self):
            admission.refusing += 1  # taken for a failed handshake, made after all
        router = admission.router
        t.write(error_response(503, BUSY_MESSAGE, close=True, date=router.date.value))
        router.request_refused(503, "connection limit", peer_address(t))
        if admission.refusing > MAX_REFUSING or not t.can_write_eof():
            t.close()
            return
        t.write_eof()
        self.timer = router.loop.call_later(LINGER_SECONDS, t.close)

    def data_received(self, data: bytes) -> None:
        pass  # the request is not served: read and drop it

    def eof_received(self) -> bool:
        return False  # the client is done: close

    def connection_lost(self, exc: Exception | None) -> None:
        self.admission.refusing -= 1
        if self.timer is not None:
            self.timer.cancel()


class _AwaitingHeader(asyncio.Protocol):
    """A connection on a ``proxy_protocol`` listener until its PROXY header is read
    (the module's contract); ``client`` takes it over then."""

    __slots__ = ("buffer", "client", "held", "refused", "since", "timer", "transport")

    def __init__(self, client: _Client):
        self.client = client
        self.buffer = b""  # what came of the header so far
        self.refused = False
        self.held = False  # counted in the router's drain (hold_awaiting)
        self.since = 0.0  # loop time of connection_made
        self.timer: asyncio.TimerHandle | None = None
        # Set by connection_made; None until then (a factory call at shutdown).
        self.transport: asyncio.Transport = None  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's do not subclass it
        router = self.client.router
        self.since = router.loop.time()
        self.timer = router.loop.call_later(router.config.timeouts.client_header, self._late)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # read and drop what still comes
        buffer = self.buffer + data if self.buffer else data
        try:
            header = parse(buffer)
        except ProxyHeaderError as exc:
            # The answer quotes the bytes; the access log keeps a fixed reason
            # (router.accesslog: never the client's bytes).
            self._refuse(400, str(exc), "malformed PROXY protocol header")
            return
        if header is None:
            self.buffer = buffer  # at most V2_MAX bytes: parse refuses past that
            return
        size, address = header
        if self.timer is not None:
            self.timer.cancel()
        client, transport = self.client, self.transport
        router = client.router
        router.admission.awaiting.discard(self)
        if router.stopping and not self.held:  # (the drain was over when it came)
            transport.close()
            return
        if address is not None:
            client.peer_ip = address  # connection_made keeps it over the socket's
        transport.set_protocol(client)
        client.connection_made(transport)
        if self.held:  # the drain counts the client now, until its request starts
            self.held = False
            if client.hold():
                router.exchange_started()
            router.unhold()
        if size < len(buffer):
            # A copy of the rest of this one read, once per connection.
            client.data_received(buffer[size:])

    def eof_received(self) -> bool:
        return False  # closed before its header: close

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        router = self.client.router
        router.admission.awaiting.discard(self)
        router.admission.clients -= 1
        if self.held:
            self.held = False
            router.unhold()

    def _late(self) -> None:
        self.timer = None
        if self.buffer:
            self._refuse(408, "PROXY protocol header not received in time")
        else:
            self.transport.close()  # sent nothing: closed as an idle connection is

    def _refuse(self, status: int, message: str, logged: str | None = None) -> None:
        """Answer, half-close, drop what still comes, close after ``LINGER_SECONDS``."""
        router, transport = self.client.router, self.transport
        self.refused, self.buffer = True, b""
        transport.write(error_response(status, message, close=True, date=router.date.value))
        router.request_refused(status, logged or message, peer_address(transport))
        if self.timer is not None:
            self.timer.cancel()
        try:
            transport.write_eof()
        except (OSError, NotImplementedError):
            transport.close()  # gone already (ENOTCONN), or no half-close
            return
        self.timer = router.loop.call_later(LINGER_SECONDS, transport.close)


class Admission:
    """The protocol factory of the client listener, with its connection cap."""

    __slots__ = (
        "_backends",
        "accepted",
        "awaiting",
        "by_address",
        "cap",
        "clients",
        "full",
        "handshake",
        "handshaking",
        "nofile",
        "refusing",
        "router",
    )

    def __init__(self, router: Router, nofile: int | None, handshake: float | None = None):
        self.router = router
        # A TLS listener's handshake deadline (None: plain TCP), and the connections
        # counted whose handshake is under way: protocol -> when to take it for lost.
        self.handshake = handshake
        self.handshaking: dict[asyncio.Protocol, float] = {}
        self.nofile = nofile  # None: no limit, no cap
        self.clients = 0  # open client connections (counted from the accept)
        self.accepted = 0  # client connections accepted since start, refused ones included
        # proxy_protocol: connections whose header is not read yet (closed at shutdown)
        self.awaiting: set[_AwaitingHeader] = set()
        self.refusing = 0  # refusals still lingering
        self.full = False  # at the cap (logged once each time it is reached)
        # address -> its client connections counted against client_connections
        self.by_address: dict[bytes, int] = {}
        self._backends = -1
        self.cap = 0
        self._update()

    def _update(self) -> None:
        backends = len(self.router.pools)
        self._backends = backends
        if self.nofile is None:
            self.cap = 1 << 62
            return
        max_idle = self.router.config.limits.max_idle_upstream
        self.cap = client_cap(self.nofile, backends, max_idle)

    def __call__(self) -> asyncio.Protocol:
        self.accepted += 1
        if len(self.router.pools) != self._backends:
            self._update()
        if self.clients < self.cap:
            if self.full and self.clients < self.cap * 9 // 10:
                self.full = False
                log.info("connection limit: accepting again", clients=self.clients, cap=self.cap)
            self.clients += 1
            client = _Client(self.router)
            if self.router.config.proxy_protocol:
                awaiting = _AwaitingHeader(client)
                self.awaiting.add(awaiting)
                return awaiting
            return self._shaking(client)
        if not self.full:
            self.full = True
            log.warning(
                "connection limit reached: refusing new clients with 503",
                cap=self.cap,
                nofile=self.nofile,
            )
        self.refusing += 1
        return self._shaking(_Refusal(self))

    def _shaking(self, protocol: _P) -> _P:
        if self.handshake is not None:
            deadline = self.router.loop.time() + self.handshake + HANDSHAKE_MARGIN
            self.handshaking[protocol] = deadline
        return protocol

    def hold_awaiting(self) -> None:
        """Shutdown: close the connections that have waited ``STOPPING_IDLE_SECONDS``
        for their PROXY header; the others get the rest of it, counted in the drain."""
        router = self.router
        now = router.loop.time()
        for protocol in list(self.awaiting):
            transport = protocol.transport
            if transport is None:
                continue
            left = protocol.since + STOPPING_IDLE_SECONDS - now
            if left <= 0 or protocol.refused:
                transport.close()
                continue
            protocol.held = True
            router.exchange_started()
            if protocol.timer is not None:
                protocol.timer.cancel()
            protocol.timer = router.loop.call_later(left, protocol._late)

    def hold_handshaking(self) -> None:
        """Shutdown: a TLS connection accepted less than ``STOPPING_IDLE_SECONDS`` ago,
        its handshake still under way, is counted in the drain for the rest of that."""
        if self.handshake is None:
            return
        loop = self.router.loop
        now = loop.time()
        for protocol, deadline in self.handshaking.items():
            accepted = deadline - self.handshake - HANDSHAKE_MARGIN
            left = accepted + STOPPING_IDLE_SECONDS - now
            if isinstance(protocol, _Client) and left > 0:
                protocol.hold_handshake()
                loop.call_later(left, protocol.handshake_late)

    def made(self, protocol: asyncio.Protocol) -> bool:
        """``protocol``'s connection is made: True if ``sweep`` had uncounted it."""
        if self.handshake is None:
            return False
        return self.handshaking.pop(protocol, None) is None

    def sweep(self) -> None:
        """Uncount the connections whose TLS handshake is past its deadline: failed
        (asyncio tells their protocol nothing: the module's docstring)."""
        if not self.handshaking:
            return
        now = self.router.loop.time()
        lost = [p for p, deadline in self.handshaking.items() if deadline < now]
        for protocol in lost:
            del self.handshaking[protocol]
            if isinstance(protocol, _Refusal):
                self.refusing -= 1
            else:
                self.clients -= 1

    def opened(self, address: bytes) -> bool | None:
        """A client connection from ``address`` (a ``client_key``) is made: True if
        it is counted against ``client_connections``, False if not (no limit, no
        address), None if the address is at the limit (refuse it)."""
        limit = self.router.config.limits.client_connections
        if not limit or not address:
            return False
        by_address = self.by_address
        open_now = by_address.get(address, 0)
        if open_now >= limit:
            return None
        by_address[address] = open_now + 1
        return True

    def closed(self, address: bytes) -> None:
        """A connection ``opened`` counted is lost."""
        by_address = self.by_address
        left = by_address[address] - 1
        if left:
            by_address[address] = left
        else:
            del by_address[address]
