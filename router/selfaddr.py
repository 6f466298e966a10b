"""Is this backend the router itself?  A backend url that reaches one of the
router's own listeners makes every request it gets loop back in.

Contract:
- ``Listener`` is one socket the router listens on (its client listener, its
  admin listener) and what to call it in a message.
- ``own_listener(host, port, listeners)`` returns the listener a backend at
  ``host:port`` would reach, or None.  Only listeners on ``port`` matter, so
  the host is resolved only when its port is one of ours, with
  ``loop.getaddrinfo`` (in the loop's thread pool: the loop never blocks),
  within ``RESOLVE_SECONDS``.  A host that does not resolve is not refused:
  nothing shows that it is us (the data plane's ``Via`` check catches a loop
  that appears later, when its name resolves elsewhere).
- A listener on ``0.0.0.0`` or ``::`` stands for every local address: the
  loopback ranges (127.0.0.0/8, ::1), the unspecified addresses themselves
  (connecting to 0.0.0.0 reaches this host) and every address of this host's
  interfaces, found by binding a socket to it (port 0: no traffic, no wait;
  a foreign address fails with EADDRNOTAVAIL).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import NamedTuple

__all__ = ["RESOLVE_SECONDS", "Listener", "is_local", "own_listener"]

RESOLVE_SECONDS = 5.0

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class Listener(NamedTuple):
    name: str  # "client listener", "admin listener"
    host: str  # as bound: an address, or 0.0.0.0 / ::
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.name} {host}:{self.port}"


def _ip(text: str) -> IPAddress | None:
    try:
        ip = ipaddress.ip_address(text.partition("%")[0])  # no IPv6 zone
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_local(ip: IPAddress) -> bool:
    """True for an address that reaches this host."""
    if ip.is_loopback or ip.is_unspecified:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(ip), 0))
    except OSError:
        return False
    return True


async def _resolve(host: str, port: int) -> set[IPAddress]:
    literal = _ip(host)
    if literal is not None:
        return {literal}
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_SECONDS):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        return set()
    found = (_ip(str(info[4][0])) for info in infos)
    return {ip for ip in found if ip is not None}


async def own_listener(host: str, port: int, listeners: list[Listener]) -> Listener | None:
    """The listener of ours that ``host:port`` reaches, or None."""
    candidates = [listener for listener in listeners if listener.port == port]
    if not candidates:
        return None
    addresses = await _resolve(host, port)
    for listener in candidates:
        bound = _ip(listener.host)
        for ip in addresses:
            if ip == bound:
                return listener
            if ip.is_unspecified or (bound is not None and bound.is_unspecified and is_local(ip)):
                return listener
    return None
