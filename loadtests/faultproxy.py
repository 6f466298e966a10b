"""A fault-injecting TCP proxy: put it between the router and an instance.

    proxy = FaultProxy(("127.0.0.1", 8000), RandomFaults(rate=0.3, seed=7))
    await proxy.start()           # proxy.url: give it to the router as the backend
    ...
    proxy.kill()                  # the instance "dies": every connection reset, connects refused
    await proxy.start()           # ... and comes back on the same port
    await proxy.close()

    python -m loadtests.faultproxy --target 127.0.0.1:8000 --rate 0.2 --seed 1

Contract:
- Each accepted connection gets one ``Fault`` from the plan (a callable of the
  connection's number), decided when it is accepted, and is then relayed both
  ways: ``up`` is what the router sends (requests), ``down`` what the instance
  answers (responses).  Offsets count the bytes of the *connection* in that
  direction, so on a pooled keep-alive connection a fault can strike the second
  or tenth request, mid-head, mid-body or between two requests.
- Kinds (``offset`` bytes of ``direction`` pass untouched first):
  ``pass`` relays everything; ``reset`` aborts both sides with a TCP RST;
  ``close`` closes both sides with a FIN (a clean-looking truncation);
  ``delay`` holds the rest of that direction for ``seconds`` once, then relays;
  ``stall`` drops the rest of that direction (a hang: only a timeout of the
  peer ends it); ``split`` relays that direction in pieces of 1-7 bytes, a
  loop turn apart (no error: framing must survive fragmentation; the peer's
  kernel may still coalesce them).
- Nothing is ever altered, only cut, held or split: the proxy injects
  transport faults, not HTTP ones (tests/test_router_exchange.py and
  tests/test_router_upstream.py have those).
- ``stats`` counts connections per kind and how many faults ``fired`` (a
  fault whose offset lies past the end of its connection never acts).
- ``kill`` resets every connection accepted before it, also one whose task has
  not run yet when ``start`` listens again (a revival is a new instance).
- Bounded: every task belongs to the proxy and ``close``/``kill`` cancel them.
  An upstream that refuses the connection is relayed as a reset.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import struct
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["KINDS", "Fault", "FaultProxy", "RandomFaults", "no_faults"]

KINDS = ("pass", "reset", "close", "delay", "stall", "split")
READ_BYTES = 65536


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str = "pass"
    direction: str = "down"  # "up": towards the instance; "down": towards the router
    offset: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; one of {KINDS}")
        if self.direction not in ("up", "down"):
            raise ValueError(f"direction is 'up' or 'down', not {self.direction!r}")


Plan = Callable[[int], Fault]


def no_faults(number: int) -> Fault:
    return Fault()


@dataclass
class RandomFaults:
    """Each connection is faulted with probability ``rate``: a kind drawn from
    ``kinds``, a direction, an offset uniform in [0, ``max_offset``] and, for
    ``delay``, ``seconds`` uniform in ``delay``.  Seeded: a run can be replayed."""

    rate: float
    seed: int = 0
    kinds: Sequence[str] = ("reset", "close", "delay", "stall", "split")
    max_offset: int = 16384
    delay: tuple[float, float] = (0.01, 0.5)
    directions: Sequence[str] = ("down", "down", "up")  # responses are longer: cut them more
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        for kind in self.kinds:
            Fault(kind)  # validates

    def __call__(self, number: int) -> Fault:
        rng = self.rng
        if rng.random() >= self.rate:
            return Fault()
        return Fault(
            rng.choice(list(self.kinds)),
            rng.choice(list(self.directions)),
            rng.randint(0, self.max_offset),
            rng.uniform(*self.delay),
        )


class _Link:
    """One proxied connection: two pumps and the fault that applies to one of them."""

    def __init__(self, proxy: FaultProxy, number: int, fault: Fault):
        self.proxy = proxy
        self.number = number
        self.fault = fault
        self.writers: list[asyncio.StreamWriter] = []
        self.fired = False

    def abort(self, rst: bool) -> None:
        for writer in self.writers:
            if rst:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                writer.transport.abort()
            else:
                writer.close()

    def fire(self) -> None:
        if not self.fired:
            self.fired = True
            self.proxy.stats["fired " + self.fault.kind] += 1

    async def pump(
        self, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        fault = self.fault if self.fault.direction == direction else Fault()
        passed = 0
        try:
            while data := await reader.read(READ_BYTES):
                if fault.kind == "pass" or passed + len(data) <= fault.offset:
                    passed += len(data)
                    writer.write(data)
                    await writer.drain()
                    continue
                head, rest = (
                    data[: max(0, fault.offset - passed)],
                    data[max(0, fault.offset - passed) :],
                )
                passed += len(data)
                if head:
                    writer.write(head)
                    await writer.drain()
                kind = fault.kind
                self.fire()
                if kind in ("reset", "close"):
                    self.abort(rst=kind == "reset")
                    return
                if kind == "stall":
                    fault = Fault("stall", direction, -1)
                    while await reader.read(READ_BYTES):
                        pass  # swallowed: the peer waits for bytes that never come
                    break
                if kind == "delay":
                    await asyncio.sleep(fault.seconds)  # the fault itself: a slow peer
                    fault = Fault()  # once
                    writer.write(rest)
                    await writer.drain()
                    continue
                # split: from here on, tiny pieces, each written on its own
                fault = Fault("split", direction, -1)
                rng = self.proxy.rng
                view = memoryview(rest)
                while view:
                    size = rng.randint(1, 7)
                    writer.write(bytes(view[:size]))
                    view = view[size:]
                    self.proxy.stats["split pieces"] += 1
                    await writer.drain()
                    await asyncio.sleep(0)  # a loop turn: an in-process peer reads each piece
            # EOF from this side: pass the half-close on.
            if writer.can_write_eof() and not writer.is_closing():
                writer.write_eof()
        except (ConnectionError, OSError):
            self.abort(rst=True)  # a reset on one side is a reset on the other


class FaultProxy:
    def __init__(
        self,
        target: tuple[str, int],
        plan: Plan = no_faults,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int = 0,
    ):
        self.target = target
        self.plan = plan
        self.host = host
        self.port = port
        self.rng = random.Random(seed)
        self.stats: Counter[str] = Counter()
        self.faults: list[Fault] = []  # one per connection, in accept order
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._accepted: dict[asyncio.Task[None], socket.socket] = {}
        self._links: set[_Link] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def open_links(self) -> int:
        return len(self._links)

    async def start(self) -> str:
        """Listen (again, on the same port after ``kill``); returns the URL."""
        if self._listener is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setblocking(False)
            try:
                sock.bind((self.host, self.port))
                sock.listen(socket.SOMAXCONN)
            except OSError:
                sock.close()
                raise
            self.port = sock.getsockname()[1]
            self._listener = sock
            self._acceptor = asyncio.create_task(self._accept_loop(sock))
        return self.url

    async def _accept_loop(self, listener: socket.socket) -> None:
        # Our own accept loop, not asyncio.start_server: before Python 3.12, a
        # Server closed while a connection it accepted waits for its transport
        # fails an assertion in Server._attach and leaks that half-made transport
        # (kill() closes the listener at any moment, under load).  Nor is this loop
        # cancelled: a sock_accept cancelled while its accept is due loses the
        # connection it accepts.  kill() shuts the listener down instead, which
        # refuses new connections and ends the pending accept with an error.
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    conn, _ = await loop.sock_accept(listener)
                except OSError:
                    return  # shut down by kill()
                task = asyncio.create_task(self._connected(conn, listener))
                self._accepted[task] = conn  # until the task runs: close() may cancel it first
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            listener.close()

    async def _connected(self, conn: socket.socket, listener: socket.socket) -> None:
        del self._accepted[asyncio.current_task()]  # type: ignore[arg-type]
        if self._listener is not listener:  # killed since (perhaps started again): reset
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            self.stats["reset at kill"] += 1
            return
        try:
            reader, writer = await asyncio.open_connection(sock=conn)
        except BaseException:
            conn.close()
            raise
        await self._relay(reader, writer, listener)

    def kill(self) -> None:
        """The instance dies: stop listening and reset every connection, at once.

        A connection accepted but not yet relayed is reset when its task runs, even
        if ``start`` has listened again by then: it belonged to the killed instance."""
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # refused from now on; the loop ends
        for link in list(self._links):
            link.abort(rst=True)
        self.stats["killed"] += 1

    async def close(self) -> None:
        self.kill()
        if self._acceptor is not None:
            await self._acceptor
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conn in self._accepted.values():  # cancelled before they ran
            conn.close()
        self._accepted.clear()

    async def _relay(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        listener: socket.socket,
    ) -> None:
        number = len(self.faults)
        fault = self.plan(number)
        self.faults.append(fault)
        self.stats[fault.kind] += 1
        link = _Link(self, number, fault)
        link.writers.append(writer)
        self._links.add(link)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                self.stats["refused"] += 1
                link.abort(rst=True)  # as the instance's kernel would have
                return
            link.writers.append(up_writer)
            # Killed while we connected: reset, even if start() has listened again
            # since (a revival is a new instance; this connection was the old one's).
            if self._listener is not listener:
                link.abort(rst=True)
                return
            for w in link.writers:
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):  # already reset by its peer
                        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await asyncio.gather(
                link.pump("up", reader, up_writer), link.pump("down", up_reader, writer)
            )
        except asyncio.CancelledError:
            link.abort(rst=True)  # close() ends us
        finally:
            link.abort(rst=False)
            self._links.discard(link)


async def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.faultproxy", description=__doc__)
    parser.add_argument("--target", required=True, metavar="HOST:PORT")
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT")
    parser.add_argument("--rate", type=float, default=0.1, help="share of connections faulted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kinds", default="reset,close,delay,stall,split")
    parser.add_argument("--max-offset", type=int, default=16384)
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    lhost, _, lport = args.listen.rpartition(":")
    plan = RandomFaults(args.rate, args.seed, args.kinds.split(","), args.max_offset)
    proxy = FaultProxy((host, int(port)), plan, host=lhost, port=int(lport), seed=args.seed)
    await proxy.start()
    print(json.dumps({"url": proxy.url}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await proxy.close()
    print(json.dumps(dict(proxy.stats)), file=sys.stderr, flush=True)


if __name__ == "__main__":
    asyncio.run(_main())
