"""Listening sockets the router makes itself, so that they can be passed on: to
worker processes (``router.supervisor``), to the process that replaces this
one (``router.handover``).

Contract:
- ``listen(host, port, backlog=..., reuse_port=...)`` binds and listens on
  every address ``host`` resolves to (as ``loop.create_server`` does:
  SO_REUSEADDR, IPV6_V6ONLY on IPv6), all on one port: port 0 takes the
  port the first address got.  Non-blocking, ready for
  ``create_server(sock=...)``.  On an error nothing stays bound.
- ``deal(sockets, count)`` shares listening sockets out among ``count``
  workers, one (or more) per address each, binding more with SO_REUSEPORT
  where there are fewer than workers.
- Resolving a host name blocks for as long as the resolver takes; it runs
  at start-up, before anything is served.
"""

from __future__ import annotations

import socket

__all__ = ["deal", "listen"]


def listen(host: str, port: int, *, backlog: int, reuse_port: bool = False) -> list[socket.socket]:
    held: list[socket.socket] = []
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    try:
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((address[0], port, *address[2:]))
            sock.listen(backlog)
            sock.setblocking(False)
            port = sock.getsockname()[1]  # port 0: every address on the one the first got
    except OSError:
        for sock in held:
            sock.close()
        raise
    return held


def deal(sockets: list[socket.socket], count: int, *, backlog: int) -> list[list[socket.socket]]:
    """The listening sockets of each of ``count`` workers: ``sockets`` (SO_REUSEPORT, one
    or more per address) grouped by address and dealt out in turn.  An address with
    fewer sockets than workers gets more (each worker its own accept queue, the
    kernel spreading connections over them); one with more gives some workers
    several (none is closed: a connection waiting in its queue would be reset)."""
    groups: dict[tuple[str, int], list[socket.socket]] = {}
    for sock in sockets:
        host, port = sock.getsockname()[:2]
        groups.setdefault((host, port), []).append(sock)
    slots: list[list[socket.socket]] = [[] for _ in range(count)]
    for (host, port), group in groups.items():
        while len(group) < count:
            group += listen(host, port, backlog=backlog, reuse_port=True)
        for i, sock in enumerate(group):
            slots[i % count].append(sock)
    return slots
