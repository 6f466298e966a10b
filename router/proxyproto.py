"""The PROXY protocol header (HAProxy's, versions 1 and 2): who the client is behind a proxy.

Why: behind an L4 proxy or load balancer (AWS NLB, HAProxy ``send-proxy``,
Envoy, nginx's ``proxy_protocol on`` in a stream block) every connection
comes from the proxy's address, so ``X-Forwarded-For`` names the proxy and
``[limits] client_connections`` counts all clients as one.  Such a proxy can
open each connection with a header naming the client
(https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt); with
``proxy_protocol = true`` the router reads it (``router.admission``).

Contract:
- ``parse(data)`` reads a header at the start of ``data``: ``None`` while the
  bytes so far are a header's beginning and more are needed; else ``(size,
  address)``, the header's length in bytes and the client's address as the
  router keeps it (``b"203.0.113.7"``, ``b"2001:db8::1"``), or ``None`` for
  an address to take from the socket: version 2's ``LOCAL`` command (the
  proxy's own health checks), version 1's ``UNKNOWN``, or an address family
  that is neither IPv4 nor IPv6 (a Unix socket).  Ports and version 2's TLVs
  are read past and not kept.
- Anything else raises ``ProxyHeaderError`` with what was wrong, as soon as
  the bytes show it: a client that speaks HTTP straight to the port is told at
  its first bytes, not at a timeout.
- Version 1 is at most ``V1_MAX`` bytes, CRLF included (the specification's
  bound); version 2 at most ``V2_MAX`` (16 bytes and what its length says:
  the addresses and TLVs AWS, GCP and Azure add fit many times over, and a
  connection cannot make the router hold more than that while it waits).
- Pure: no I/O, no clock.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["V1_MAX", "V2_MAX", "V2_SIGNATURE", "ProxyHeaderError", "parse"]

V1_PREFIX = b"PROXY "
V1_MAX = 107
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_MAX = 16 + 4096

# Version 2's address families (the high nibble of byte 13) and their blocks'
# sizes: two addresses, two ports.
_INET, _INET6 = 1, 2
_BLOCK = {_INET: 12, _INET6: 36}


class ProxyHeaderError(ValueError):
    """The bytes are not a PROXY protocol header; the message says why."""


def parse(data: bytes) -> tuple[int, bytes | None] | None:
    """The header at the start of ``data`` (the module's contract)."""
    if data[:12] == V2_SIGNATURE[: len(data)]:
        return _v2(data) if len(data) >= 16 else None
    if data[:6] == V1_PREFIX[: len(data)]:
        return _v1(data) if len(data) > 6 else None
    raise ProxyHeaderError(
        "expected a PROXY protocol header (proxy_protocol = true): a version 1 line"
        " or version 2's signature, got " + repr(bytes(data[:16]))
    )


def _v1(data: bytes) -> tuple[int, bytes | None] | None:
    lf = data.find(b"\n", 0, V1_MAX)  # after "PROXY ": 6 at least
    if lf < 0:
        if len(data) >= V1_MAX:
            raise ProxyHeaderError(f"PROXY protocol v1 line without CRLF in {V1_MAX} bytes")
        return None
    if data[lf - 1] != 0x0D:
        raise ProxyHeaderError("PROXY protocol v1 line ends in a bare LF, not CRLF")
    end = lf - 1
    fields = data[6:end].split(b" ")
    if fields[0] == b"UNKNOWN":
        return end + 2, None
    if fields[0] not in (b"TCP4", b"TCP6") or len(fields) != 5:
        raise ProxyHeaderError(
            "PROXY protocol v1: expected 'TCP4|TCP6 SRC DST SRCPORT DSTPORT' or 'UNKNOWN', got "
            + repr(bytes(data[:end]))
        )
    version = 4 if fields[0] == b"TCP4" else 6
    addresses = []
    for text in fields[1:3]:
        try:
            address = ipaddress.ip_address(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            raise ProxyHeaderError(f"PROXY protocol v1: {text!r} is not an address") from None
        if address.version != version:
            raise ProxyHeaderError(f"PROXY protocol v1: {text!r} is not an IPv{version} address")
        if getattr(address, "scope_id", None) is not None:
            # "fe80::1%<any byte but a space>": into X-Forwarded-For as it came
            raise ProxyHeaderError(f"PROXY protocol v1: {text!r} is not an address (a zone)")
        addresses.append(address)
    for text in fields[3:5]:
        if not (text.isdigit() and len(text) <= 5 and int(text) <= 65_535):
            raise ProxyHeaderError(f"PROXY protocol v1: {text!r} is not a port")
    # Written as the socket and version 2 give it ("2001:db8::1", "::ffff:192.0.2.1";
    # str() spells the latter "::ffff:c000:201" before Python 3.13): one client, one
    # spelling in X-Forwarded-For, the access log and the per-address count.
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    return end + 2, socket.inet_ntop(family, addresses[0].packed).encode()


def _v2(data: bytes) -> tuple[int, bytes | None] | None:
    version, command = data[12] >> 4, data[12] & 0x0F
    if version != 2 or command > 1:
        raise ProxyHeaderError(
            f"PROXY protocol v2: version {version} command {command} (2 and LOCAL or PROXY"
            " expected)"
        )
    family = data[13] >> 4
    size = 16 + int.from_bytes(data[14:16], "big")
    if size > V2_MAX:
        raise ProxyHeaderError(f"PROXY protocol v2 header of {size} bytes: over {V2_MAX}")
    if len(data) < size:
        return None
    if command == 0 or family not in _BLOCK:  # LOCAL, UNSPEC or a Unix socket
        return size, None
    if data[13] & 0x0F == 2:
        raise ProxyHeaderError("PROXY protocol v2: a UDP (DGRAM) source on a TCP listener")
    if size - 16 < _BLOCK[family]:
        raise ProxyHeaderError(
            f"PROXY protocol v2: {size - 16} bytes of addresses, {_BLOCK[family]} needed"
        )
    if family == _INET:
        source = socket.inet_ntop(socket.AF_INET, data[16:20])
    else:
        source = socket.inet_ntop(socket.AF_INET6, data[16:32])
    return size, source.encode()
