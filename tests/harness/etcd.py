"""A real etcd on 127.0.0.1 for tests, and a relay to it that a test can cut.

``etcd_binary`` and ``EtcdServer`` are ``loadtests.etcd``'s (the live bench
runs the same etcd): start, kill, restart on the same data and ports; here a
start elects its lone member sooner (``QUICK_ELECTION``).  The tests that need
etcd skip saying so when ``etcd_binary()`` is None.  ``Gate`` is a partition
between the routers and a running etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

from loadtests import etcd
from loadtests.etcd import etcd_binary

__all__ = ["QUICK_ELECTION", "EtcdServer", "Gate", "etcd_binary"]

# A lone member answers /health once it has elected itself, an election timeout
# after it starts (randomized, up to twice that; a restart waits the whole of it):
# with etcd's defaults (heartbeat 100 ms, election 1 s) a start took 0.1-1.0 s,
# 0.6 s on average, about 45 starts a suite run.  A tenth of both: 0.1-0.2 s.
# Nothing else changes for a single member (no follower can call an election), but
# the shortest lease etcd grants, 1.5 election timeouts (0.3 s here, 1.5 s by
# default): the router's lease is 3 s (router.replicas.TTL), the tests' 30 s.
QUICK_ELECTION = ("--heartbeat-interval=20", "--election-timeout=200")


class EtcdServer(etcd.EtcdServer):
    """``loadtests.etcd.EtcdServer`` with ``QUICK_ELECTION`` (``flags`` after it)."""

    def __init__(self, binary: str, data_dir: Path, flags: Sequence[str] = ()) -> None:
        super().__init__(binary, data_dir, [*QUICK_ELECTION, *flags])


class Gate:
    """A TCP relay to etcd that a test can cut: ``block()`` resets every relayed
    connection and refuses new ones (a partition, with etcd still up and
    writable directly); ``unblock()`` lets connections through again."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.blocked = False
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.block()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def block(self) -> None:
        self.blocked = True
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    def unblock(self) -> None:
        self.blocked = False

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.blocked:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self._writers |= pair
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._writers -= pair
            for each in pair:
                each.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    writer.transport.abort()
