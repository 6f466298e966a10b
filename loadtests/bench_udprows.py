"""Benchmark of UDP rows (router.udprows): what the supervisor spends on them.

    python -m loadtests.bench_udprows [--repeats 2000] [--seconds 3] [--datagrams 400]

Per sample, in one process on 127.0.0.1, a ``Replicas`` over a real shared table
as ``serve`` makes it (4 worker rows and the remote one, ``SLOTS`` columns) and
real UDP sockets as the other replicas:
  send      ``sampled()`` (the table read) + encode, sign and one ``sendto`` per
            other replica, the counts changed since the last sample
  receive   one datagram taken: verify, decode, replace the replica's counts
            and rewrite the remote row
with 7 and 1,000 backends (half of them with something in flight), 1, 3 and 7
other replicas; microseconds, median of --repeats.  Then the loop itself:
``Sender.run`` for --seconds with 3 other replicas and the counts unchanged,
as ``serve`` runs it (the workers signal their changes: a keep-alive every
0.1 s) and without the signal (a sample every ms), as the CPU share of one
core (``time.process_time``), against the same process idle over the same time
in the same run.  Then the counts changing: a worker process flips a cell of
its row and signals every 0.1 ms for --seconds, and the supervisor's loop's
share and sends per second are printed at 7 and 1,000 backends (the sends'
pace holds them to a fifth of the loop, ``router.udprows.Pace``).

Last, the floor under the lag (``replicas.udp.lag_ms``): how long one
process takes to wake on another's datagram on this host (UDP on 127.0.0.1,
--datagrams of them 5 ms apart, the receiver on the sender's CPU and on the
other one): a change reaches another replica's table through two such
wake-ups (the worker's signal to its supervisor, the datagram to the other
supervisor), each with the loop's work around it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

from router.etcd import EtcdClient
from router.replicas import Replicas, Row
from router.shared import TABLE_PLANES, ChangeSignal, SharedLoadTracker, SharedTable
from router.supervisor import SLOTS
from router.udprows import Sample, UdpRows, encode

WORKERS = 4
FLEETS = (7, 1000)
PEERS = (1, 3, 7)


class Sink(asyncio.DatagramProtocol):
    """Another replica's socket: counts what it receives."""

    def __init__(self) -> None:
        self.received = 0

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.received += 1


async def replica(
    backends: int, name: str = "me", changes_fd: int | None = None
) -> tuple[Replicas, SharedTable, UdpRows]:
    table = SharedTable.create(WORKERS + 1, SLOTS, planes=TABLE_PLANES)
    slots = {f"gpu-{i}": i for i in range(backends)}
    udp = UdpRows(name, lambda _: None)
    await udp.open("127.0.0.1:0")
    replicas = Replicas(
        EtcdClient(["http://127.0.0.1:9"]),  # never called: nothing is started
        b"/bench/",
        table,
        lambda: slots,
        lambda: 0,
        replica_id=name,
        udp=udp,
        changes_fd=changes_fd,
    )
    return replicas, table, udp


async def sinks(count: int) -> tuple[list[asyncio.DatagramTransport], list[tuple[str, int]]]:
    loop = asyncio.get_running_loop()
    transports, addresses = [], []
    for _ in range(count):
        transport, _ = await loop.create_datagram_endpoint(Sink, local_addr=("127.0.0.1", 0))
        transports.append(transport)
        addresses.append(transport.get_extra_info("sockname")[:2])
    return transports, addresses


def median_us(run: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        run()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


async def per_sample(repeats: int) -> None:
    print("| backends | other replicas | send us | receive us |")
    print("|---:|---:|---:|---:|")
    for backends in FLEETS:
        for peers in PEERS:
            send_us, receive_us = await one_case(backends, peers, repeats)
            print(f"| {backends:,} | {peers} | {send_us:.1f} | {receive_us:.1f} |")


async def one_case(backends: int, peers: int, repeats: int) -> tuple[float, float]:
    """(send, receive) in microseconds, medians."""
    replicas, table, udp = await replica(backends)
    trackers = [SharedLoadTracker(table, 0, row) for row in range(WORKERS)]
    for tracker in trackers:
        for slot in range(backends):
            tracker.assign(f"gpu-{slot}", slot)
    held = [trackers[0].acquire(f"gpu-{i}") for i in range(0, backends, 2)]
    transports, addresses = await sinks(peers)
    replicas._peers.update((f"p{i}", address) for i, address in enumerate(addresses))
    flip = trackers[1]

    turns = iter(range(10**9))

    def send() -> None:
        # A change: the sample differs from the last one (backend 1 or 3 has one more).
        lease = flip.acquire("gpu-1" if next(turns) % 2 else "gpu-3")
        seq, (loads, waiting) = replicas.sampled()
        udp.send(Sample(seq, time.time(), loads, waiting), list(replicas._peers.values()))
        lease.release()

    # Receiving: another replica's datagram, as its socket would hand it over; the own
    # counts kept as the 10 ms estimate loop keeps them.
    replicas.remember(time.time(), replicas.local())
    key = os.urandom(16)
    replicas._keys["p0"] = key
    replicas.others["p0"] = Row(0)
    loads = {f"gpu-{i}": 1 for i in range(0, backends, 2)}
    numbers = iter(range(1, 10**9))

    def signed() -> bytes:
        number = next(numbers)
        return encode(b"p0", key, number, Sample(number, time.time(), loads, {}))

    def receive() -> None:
        udp.datagram_received(signed(), ("127.0.0.1", 1))
        replicas._write_remote()  # what the loop's next pass does (once for all that came)

    try:
        return median_us(send, repeats), median_us(receive, repeats) - median_us(signed, repeats)
    finally:
        await asyncio.sleep(0)  # the one write the datagrams scheduled, before the table goes
        for lease in held:
            lease.release()
        for transport in transports:
            transport.close()
        udp.close()
        for tracker in trackers:
            tracker.close()
        table.close()


async def loop_share(seconds: float) -> None:
    sampled = await one_loop(seconds, signalled=False)
    signalled = await one_loop(seconds, signalled=True)
    print("\nThe loop with 3 other replicas and nothing changing, % of one core (the same process")
    print("idle over the same time in brackets):")
    print(f"- workers signal their changes (serve): {_shares(signalled)}, a keep-alive every 0.1 s")
    print(f"- sampled every ms (no signal): {_shares(sampled)}")
    print("\nA worker process changing its row and signalling every 0.1 ms (as a loaded worker's")
    print("loop passes would), 3 other replicas: the supervisor's share of one core, its sends")
    print("per second (at most a fifth of the loop goes to the sends, router.udprows.Pace):")
    print("| backends | loop % of one core | sends per s | CPU per send, us |")
    print("|---:|---:|---:|---:|")
    for backends in FLEETS:
        share, rate = await signalled_loop(seconds, backends)
        print(f"| {backends:,} | {100 * share:.1f} | {rate:,.0f} | {1e6 * share / rate:.0f} |")


def _shares(shares: tuple[float, float]) -> str:
    idle, busy = shares
    return f"{100 * busy:.1f} % ({100 * idle:.1f} %)"


async def one_loop(seconds: float, *, signalled: bool) -> tuple[float, float]:
    changes_fd = ChangeSignal.open() if signalled else None
    replicas, table, udp = await replica(7, changes_fd=changes_fd)
    transports, addresses = await sinks(3)
    replicas._peers.update((f"p{i}", address) for i, address in enumerate(addresses))
    idle = await cpu_share(seconds)
    assert replicas.sender is not None
    task = asyncio.create_task(replicas.sender.run())
    busy = await cpu_share(seconds)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for transport in transports:
        transport.close()
    udp.close()
    table.close()
    if changes_fd is not None:
        os.close(changes_fd)
    return idle, busy


# A worker: its row's cell for backend 1 goes up and down, the eventfd written after each.
_WORKER = """
import os, sys, time
from router.shared import ChangeSignal, SharedTable
table_fd, rows, slots, planes, changes_fd, seconds = map(float, sys.argv[1:])
table = SharedTable.attach(int(table_fd), int(rows), int(slots), int(planes))
cell = table.index(0, 0, 1)
end = time.monotonic() + seconds
while time.monotonic() < end:
    table.cells[cell] ^= 1
    ChangeSignal.notify(int(changes_fd))
    time.sleep(0.0001)
"""


async def signalled_loop(seconds: float, backends: int) -> tuple[float, float]:
    """(the loop's CPU share, sends per second) while a worker process signals."""
    changes_fd = ChangeSignal.open()
    replicas, table, udp = await replica(backends, changes_fd=changes_fd)
    transports, addresses = await sinks(3)
    replicas._peers.update((f"p{i}", address) for i, address in enumerate(addresses))
    assert replicas.sender is not None
    replicas.sender.start()
    args = (table.fd, table.rows, table.slots, TABLE_PLANES, changes_fd, seconds)
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WORKER, *map(str, args), pass_fds=(table.fd, changes_fd)
    )
    sent = udp.sent
    start_cpu, start = time.process_time(), time.perf_counter()
    await worker.wait()
    share = (time.process_time() - start_cpu) / (time.perf_counter() - start)
    rate = (udp.sent - sent) / (time.perf_counter() - start)
    await replicas.sender.close()
    for transport in transports:
        transport.close()
    udp.close()
    table.close()
    os.close(changes_fd)
    return share, rate


async def cpu_share(seconds: float) -> float:
    start_cpu, start = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    return (time.process_time() - start_cpu) / (time.perf_counter() - start)


def wake_floor(datagrams: int) -> None:
    """P50/P90/P99 of a datagram's trip from one process to another that waits on it."""
    cpus = sorted(os.sched_getaffinity(0))
    print("\nThe floor: one process waking on another's datagram, microseconds")
    print("| receiver | P50 | P90 | P99 | max |")
    print("|---|---:|---:|---:|---:|")
    for where, cpu in (("the sender's CPU", cpus[0]), ("the other CPU", cpus[-1])):
        if where == "the other CPU" and len(cpus) < 2:
            continue
        trips = sorted(_trips(datagrams, cpus[0], cpu))
        last = len(trips) - 1
        p50, p90, p99 = (trips[min(last, int(q * len(trips)))] for q in (0.5, 0.9, 0.99))
        print(f"| {where} | {p50:.0f} | {p90:.0f} | {p99:.0f} | {trips[-1]:.0f} |")


def _trips(datagrams: int, sender_cpu: int, receiver_cpu: int) -> list[float]:
    """Each datagram carries its send time; a forked receiver pinned to ``receiver_cpu``
    writes back how long each took (microseconds), through a pipe."""
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(10)
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    read, write = os.pipe()
    affinity = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:  # the receiver: blocking calls only, then out without cleanup
        code = 1
        try:
            os.sched_setaffinity(0, {receiver_cpu})
            trips = []
            for _ in range(datagrams):
                sent = int(receiver.recv(64))
                trips.append((time.time_ns() - sent) / 1000)
            os.write(write, " ".join(f"{trip:.1f}" for trip in trips).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        os.sched_setaffinity(0, {sender_cpu})
        address = receiver.getsockname()
        for _ in range(datagrams):
            time.sleep(0.005)  # pacing: each datagram finds the receiver asleep
            sender.sendto(str(time.time_ns()).encode(), address)
        chunks = []
        while chunk := os.read(read, 1 << 16):
            chunks.append(chunk)
    finally:
        os.sched_setaffinity(0, affinity)
        os.waitpid(pid, 0)
        os.close(read)
        sender.close()
        receiver.close()
    return [float(trip) for trip in b"".join(chunks).split()]


async def main(args: argparse.Namespace) -> None:
    print(f"# UDP rows: median of {args.repeats} samples; loop share over {args.seconds} s each")
    await per_sample(args.repeats)
    await loop_share(args.seconds)


def cli(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=2000)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--datagrams", type=int, default=400)
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main(args))
    wake_floor(args.datagrams)  # after the loop is gone: the fork copies no running loop


if __name__ == "__main__":
    cli()
