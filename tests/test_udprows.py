"""UDP rows (router.udprows): the datagram, and two replicas' sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from router.config import ConfigError, build_config
from router.udprows import MAGIC, MAX_DATAGRAM, Sample, UdpRows, decode, encode, mac, peer_address

KEY = bytes(range(16))
SAMPLE = Sample(7, 1_800_000_000.25, {"gpu-0": 3, "gpu-1": 1}, {"gpu-0": 1})


def test_a_datagram_decodes_only_under_its_replicas_key() -> None:
    data = encode(b"r1", KEY, 1, SAMPLE)
    assert data.startswith(MAGIC)
    assert decode(data, {"r1": KEY}.get) == ("r1", SAMPLE)
    assert decode(data, {"r1": os.urandom(16)}.get) is None  # another key
    assert decode(data, {"r2": KEY}.get) is None  # a replica not in etcd
    renamed = encode(b"r2", KEY, 1, SAMPLE)  # the id is signed too
    assert decode(renamed.replace(b"r2", b"r1", 1), {"r1": KEY}.get) is None
    flipped = bytearray(data)
    flipped[-1] ^= 1  # one bit of the payload
    assert decode(bytes(flipped), {"r1": KEY}.get) is None
    for cut in range(len(data)):  # every truncation
        assert decode(data[:cut], {"r1": KEY}.get) is None
    renumbered = bytearray(data)
    renumbered[len(MAGIC) + 3 + 7] ^= 1  # the datagram's number is signed too
    assert decode(bytes(renumbered), {"r1": KEY}.get) is None
    # Signed, but not a sample: refused, not raised.
    junk, number = b"\x93\x01", (1).to_bytes(8, "big")
    signed = MAGIC + b"\x02r1" + number + mac(KEY, b"r1", number, junk) + junk
    assert decode(signed, {"r1": KEY}.get) is None
    assert decode(data + bytes(MAX_DATAGRAM), {"r1": KEY}.get) is None  # too big: not even read


def test_a_peer_address_is_an_ip_and_a_port() -> None:
    assert peer_address("127.0.0.1:7400") == ("127.0.0.1", 7400)
    assert peer_address("[::1]:7400") == ("::1", 7400)
    for bad in ("localhost:7400", "myhost:7400", "256.1.1.1:7400", "0.0.0.0:7400", "[::]:1",
                "127.0.0.1:0", "127.0.0.1", ""):  # fmt: skip
        assert peer_address(bad) is None, bad


def test_the_settings_that_pay_for_counts_a_tenth_of_a_second_late_are_named() -> None:
    from router.config import PrefixAwareRoutingConfig, RoutingConfig
    from router.replicas import late_counts_cost

    def cost(**fields: object) -> str | None:
        prefix = PrefixAwareRoutingConfig(**fields)  # type: ignore[arg-type]
        return late_counts_cost(RoutingConfig(prefix_aware_routing_config=prefix))

    assert cost() is None  # the default: TRAFFIC + PREFILL
    assert cost(balance_mode="IN_FLIGHT", concurrency_scope="IN_FLIGHT") is None  # SageMaker's
    assert cost(balance_mode="IN_FLIGHT", concurrency_scope="PREFILL") is None
    bounded = cost(balance_mode="IN_FLIGHT", concurrency_scope="PREFILL", balance_factor=1.5)
    assert bounded is not None
    assert "BalanceFactor" in bounded
    assert "TRAFFIC" in str(cost(balance_mode="TRAFFIC", concurrency_scope="IN_FLIGHT"))


def test_replica_listen_needs_etcd_and_an_address_the_others_reach() -> None:
    etcd = ["http://127.0.0.1:2379"]
    assert build_config({"etcd": etcd, "replica_listen": "127.0.0.1:0"}).replica_listen
    with pytest.raises(ConfigError, match="needs etcd"):
        build_config({"replica_listen": "127.0.0.1:7400"})
    for wildcard in ("0.0.0.0:7400", "[::]:7400", "[::0]:7400", "0:7400"):
        with pytest.raises(ConfigError, match=r"wildcard|IP address"):
            build_config({"etcd": etcd, "replica_listen": wildcard})
    with pytest.raises(ConfigError, match="IP address"):
        build_config({"etcd": etcd, "replica_listen": "myhost:7400"})
    with pytest.raises(ConfigError, match="HOST:PORT"):
        build_config({"etcd": etcd, "replica_listen": "7400"})


async def test_two_sockets_exchange_samples_and_count_what_they_drop() -> None:
    one, two = UdpRows("r0", {}.get), UdpRows("r1", {}.get)
    keys = {"r0": one.key, "r1": two.key}
    got: asyncio.Queue[tuple[str, Sample]] = asyncio.Queue()
    one.key_of = two.key_of = keys.get
    two.on_sample = lambda replica, sample: got.put_nowait((replica, sample))
    try:
        await one.open("127.0.0.1:0")
        host, port = (await two.open("127.0.0.1:0")).rsplit(":", 1)
        peer = (host, int(port))
        one.send(SAMPLE, [peer])
        assert await asyncio.wait_for(got.get(), 10) == ("r0", SAMPLE)
        big = Sample(8, time.time(), {f"gpu-{i}": 1 for i in range(MAX_DATAGRAM // 8)}, {})
        one.send(big, [peer])  # too big for one datagram: not sent
        # An address uvloop cannot send to (a name, another IP version) is an error
        # counted, not an exception that stops the sends to the others.
        one.send(SAMPLE, [("localhost", 9), ("::1", 9), peer])
        assert await asyncio.wait_for(got.get(), 10) == ("r0", SAMPLE)
        assert (one.oversize, two.received, two.rejected) == (1, 2, 0)
        assert one.errors >= 1  # raised by uvloop, reported to error_received by asyncio
        # A replayed datagram (the same number) is dropped before its payload is read.
        newer = encode(b"r0", one.key, time.time_ns() // 1000 + 10**9, SAMPLE)
        for _ in range(2):
            two.datagram_received(newer, ("127.0.0.1", 1))
        assert (two.received, two.stale) == (3, 1)
        two.datagram_received(encode(b"r0", one.key, 10, SAMPLE), ("127.0.0.1", 1))
        assert (two.received, two.stale) == (3, 2)  # numbered before the last one taken
    finally:
        one.close()
        two.close()


async def test_a_send_held_up_by_another_process_does_not_hold_the_next_back() -> None:
    """The wait after a send is SHARE_WAIT times its CPU time, not its wall time: a
    sample that spent 50 ms off the CPU (``time.sleep``, as a preemption would)
    leaves the next send free to go within a few milliseconds."""
    from router.udprows import Sender

    udp = UdpRows("r0", {}.get)
    await udp.open("127.0.0.1:0")
    seq = iter(range(10**6))

    def sample() -> tuple[int, list[dict[str, int]]]:
        time.sleep(0.05)  # off the CPU: what the wait must not count
        return next(seq), [{"gpu-0": 1}, {}]

    sender = Sender(udp, sample, {"r1": ("127.0.0.1", 9)}, None)
    try:
        sender.send()
        assert udp.sent == 1
        held = sender.pace.wait()
        assert held < 0.02, held  # wall time would have held it 4 x 50 ms
    finally:
        await sender.close()
        udp.close()


def test_a_run_that_came_early_is_owed_by_the_next(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Pace``: a run that starts before it is due (uvloop runs a delay under half a
    millisecond on the next pass) pushes the next one further out by what it took,
    so runs back to back cannot take more than their share of the loop."""
    from router import udprows

    now = [100.0]
    monkeypatch.setattr(udprows.time, "monotonic", lambda: now[0])
    pace = udprows.Pace()
    assert pace.wait() < 0  # the first run: at once
    pace.ran(0.0001)  # 0.1 ms of CPU: due 0.4 ms later
    assert pace.wait() == pytest.approx(udprows.SHARE_WAIT * 0.0001)
    # Five more runs, each on the next pass (no time passes): each is owed as if
    # it had started when due, its 0.1 ms and its wait, 0.5 ms a run, where a
    # wait counted from each run's end would stay at 0.4 ms, under the half
    # millisecond the timers round away.
    for _ in range(5):
        pace.ran(0.0001)
    step = (1 + udprows.SHARE_WAIT) * 0.0001
    assert pace.wait() == pytest.approx(udprows.SHARE_WAIT * 0.0001 + 5 * step)
    now[0] += 1.0  # idle a second: nothing is owed then
    pace.ran(0.0001)
    assert pace.wait() == pytest.approx(udprows.SHARE_WAIT * 0.0001)


def test_signals_faster_than_the_pace_are_sent_at_the_pace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker signalling on every pass: the sends still keep to their share, on
    uvloop (the supervisor's loop, whose timers round a delay under half a
    millisecond to the next pass).  Each send is made to cost 0.1 ms of CPU (a fake
    ``thread_time``), so at most one send per (1 + SHARE_WAIT) x 0.1 ms of wall time may
    go, plus the first, and what the timers may fire early: the delay rounded to
    whole ms (0.5) on a loop clock of whole ms read at the pass's start (1 more).
    Counted from each run's end instead, the sends went on every pass (399 of 400)."""
    import uvloop

    from router import udprows
    from router.shared import ChangeSignal
    from router.udprows import Sender

    cpu = [0.0]
    monkeypatch.setattr(udprows.time, "thread_time", lambda: cpu[0])
    monkeypatch.setattr(udprows, "KEEPALIVE", 3600.0)  # every datagram a signal's
    seq = iter(range(10**6))

    def sample() -> tuple[int, list[dict[str, int]]]:
        cpu[0] += 0.0001
        return next(seq), [{"gpu-0": 1}, {}]

    async def signal_every_pass() -> tuple[int, float]:
        udp = UdpRows("r0", {}.get)
        await udp.open("127.0.0.1:0")
        fd = ChangeSignal.open()
        sender = Sender(udp, sample, {"r1": ("127.0.0.1", 9)}, fd)
        sender.start()
        try:
            start = time.monotonic()
            for _ in range(400):
                ChangeSignal.notify(fd)
                await asyncio.sleep(0)
            elapsed = time.monotonic() - start
            assert sender.signals >= 1
            return udp.sent, elapsed
        finally:
            await sender.close()
            udp.close()
            os.close(fd)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        sent, elapsed = runner.run(signal_every_pass())
    allowed = 2 + (elapsed + 0.002) / ((1 + udprows.SHARE_WAIT) * 0.0001)
    assert sent <= allowed, (sent, elapsed)


def test_the_benchmark_runs_and_prints_its_table() -> None:
    """``python -m loadtests.bench_udprows``, tiny: it runs and prints (no timing)."""
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_udprows", "--repeats", "3", "--seconds", "0.05",
         "--datagrams", "5"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 1,000 | 7 |" in done.stdout
    assert "of one core" in done.stdout
    assert "- workers signal their changes (serve): " in done.stdout
    assert "| backends | loop % of one core | sends per s |" in done.stdout  # a worker signals
    assert "| the sender's CPU |" in done.stdout  # the wake-up floor


def test_the_lag_reported_is_the_last_minutes(monkeypatch: pytest.MonkeyPatch) -> None:
    from router import udprows

    udp = UdpRows("r0", {}.get)
    assert udp.lag() is None  # none yet
    udp.taken(time.time() - 0.002)
    udp.written()
    lag = udp.lag()
    assert lag is not None
    assert lag.samples == 1
    assert lag.p50 >= 2.0
    # A replica that went quiet: its last lags age out instead of standing forever.
    monkeypatch.setattr(udprows, "LAG_WINDOW", -1.0)
    assert udp.lag() is None
