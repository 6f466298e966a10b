"""DNS discovery: ``--discover dns:NAME:PORT`` re-resolves NAME every ``interval`` s.

Contract:
- Every address NAME resolves to (A and AAAA: ``getaddrinfo`` with
  ``AF_UNSPEC``, run by the loop in its executor, so the loop never blocks)
  is a serving endpoint ``<ip>:PORT``; an address that leaves the answer
  drains out (``router.discovery.Reconciler``).  A headless Service's name
  answers with its ready pods' addresses.
- A lookup that fails (timeout, SERVFAIL, NXDOMAIN, no address) is a failure,
  not an empty fleet: DNS cannot tell "no pods" from "DNS broken", and an
  empty fleet answers 503 to everything.  The last membership stays, the
  next lookup comes after a backoff (0.5 s doubling, at most ``interval``).
- ``resolve`` is injectable: an ``async (name, port) -> [address, ...]``.
- A big answer is turned into endpoints ``SLICE`` addresses at a time, the
  loop's other work running between slices: ~5 us an address, so 4,000
  addresses (a 64 KiB answer over TCP) held the loop 20 ms at every lookup.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

from ..config import ConfigError
from . import Backoff, Endpoint, Sink, endpoint

__all__ = ["SLICE", "DnsSource", "Resolve", "parse_target", "system_resolve"]

SLICE = 500  # addresses made endpoints per pass of the loop: ~2.5 ms

Resolve = Callable[[str, int], Awaitable[list[str]]]


async def system_resolve(name: str, port: int) -> list[str]:
    """A and AAAA addresses of ``name`` through the system resolver, off the loop."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
    )
    # Each address once, in the answer's order; a dict, not a list searched per
    # address: a 64 KiB answer holds ~4,000 A records (148 ms of loop that way).
    addresses = dict.fromkeys(
        str(sockaddr[0]).partition("%")[0]  # drop an IPv6 zone
        for _family, _type, _proto, _canon, sockaddr in infos
    )
    return list(addresses)


def parse_target(source: str) -> tuple[str, int]:
    """``dns:NAME:PORT`` -> (NAME, PORT), or ConfigError saying what is wrong."""
    rest = source.removeprefix("dns:")
    name, sep, port = rest.rpartition(":")
    if not sep or not name or not port.isdigit() or not 1 <= int(port) <= 65_535:
        raise ConfigError(
            f"discover {source!r} must look like dns:NAME:PORT (a port from 1 to 65535)"
        )
    return name.strip("[]"), int(port)


class DnsSource:
    def __init__(
        self,
        name: str,
        port: int,
        *,
        interval: float = 5.0,
        resolve: Resolve = system_resolve,
        models: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.models = models  # every address serves these
        self.port = port
        self.interval = interval
        self.resolve = resolve
        self.backoff = Backoff(0.5, interval)
        self.description = f"dns {name}:{port}"
        self.lookups = 0

    async def run(self, sink: Sink) -> None:
        while True:
            self.lookups += 1
            try:
                addresses = await self.resolve(self.name, self.port)
                if not addresses:
                    raise OSError(f"{self.name} has no address")
            except OSError as exc:  # socket.gaierror included
                sink.failed(f"{self.description}: {exc}")
                await asyncio.sleep(self.backoff.next())
                continue
            self.backoff.reset()
            found: dict[str, Endpoint] = {}
            for start in range(0, len(addresses), SLICE):
                if start:
                    await asyncio.sleep(0)  # requests run between slices of a big answer
                for address in addresses[start : start + SLICE]:
                    made = endpoint(address, self.port, True, self.models)
                    found[made.name] = made
            sink.publish(found)
            await asyncio.sleep(self.interval)

    async def close(self) -> None:
        return None
