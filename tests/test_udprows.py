"""UDP rows (router.udprows): the datagram, and two replicas' sockets on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from router.config import ConfigError, build_config
from router.udprows import MAGIC, MAX_DATAGRAM, Sample, UdpRows, decode, encode

KEY = bytes(range(16))
SAMPLE = Sample(7, 1_800_000_000.25, {"gpu-0": 3, "gpu-1": 1}, {"gpu-0": 1})


def test_a_datagram_decodes_only_under_its_replicas_key() -> None:
    data = encode(b"r1", KEY, SAMPLE)
    assert data.startswith(MAGIC)
    assert decode(data, {"r1": KEY}.get) == ("r1", SAMPLE)
    assert decode(data, {"r1": os.urandom(16)}.get) is None  # another key
    assert decode(data, {"r2": KEY}.get) is None  # a replica not in etcd
    renamed = encode(b"r2", KEY, SAMPLE)  # the id is signed too
    assert decode(renamed.replace(b"r2", b"r1", 1), {"r1": KEY}.get) is None
    flipped = bytearray(data)
    flipped[-1] ^= 1  # one bit of the payload
    assert decode(bytes(flipped), {"r1": KEY}.get) is None
    for cut in range(len(data)):  # every truncation
        assert decode(data[:cut], {"r1": KEY}.get) is None
    # Signed, but not a sample: refused, not raised.
    from router.udprows import mac

    junk = b"\x93\x01"
    assert decode(MAGIC + b"\x02r1" + mac(KEY, b"r1", junk) + junk, {"r1": KEY}.get) is None


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
    with pytest.raises(ConfigError, match="wildcard"):
        build_config({"etcd": etcd, "replica_listen": "0.0.0.0:7400"})
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
        one.send(SAMPLE, [(host, int(port))])
        assert await got.get() == ("r0", SAMPLE)
        big = Sample(8, time.time(), {f"gpu-{i}": 1 for i in range(MAX_DATAGRAM // 8)}, {})
        one.send(big, [(host, int(port))])  # too big for one datagram: not sent
        one.send(SAMPLE, [(host, int(port))])
        assert await got.get() == ("r0", SAMPLE)
        assert (one.sent, one.oversize, two.received, two.rejected) == (2, 1, 2, 0)
    finally:
        one.close()
        two.close()


def test_the_benchmark_runs_and_prints_its_table() -> None:
    """``python -m loadtests.bench_udprows``, tiny: it runs and prints (no timing)."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_udprows", "--repeats", "3", "--seconds", "0.05"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 1,000 | 7 |" in done.stdout
    assert "of one core" in done.stdout
