"""Engine-side cache isolation (issue 14 §4) in the daemon: workers, replicas, the secret
(the rest, in process: ``tests/test_router_cache_salt.py``).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.harness.etcd import EtcdServer
from tests.harness.processes import ROOT, spawn_router, stop
from tests.harness.routers import SimFleet
from tests.harness.salt import DOCUMENT, MODEL, cached_tokens, client

pytestmark = pytest.mark.timeout(120)


async def test_two_workers_give_a_tenant_one_salt(sim_fleet: SimFleet, secret_file: Path) -> None:
    """The same secret in every worker: a tenant's entry made through one worker is
    hit through the other (a connection per request spreads them; the
    ``x-request-id`` prefix names the worker)."""
    (sim,) = await sim_fleet(1)
    flags = [
        "--workers", "2", "--no-health-checks", "--backend", f"{sim.name}={sim.url}",
        "--cache-salt", "--cache-salt-secret-file", str(secret_file),
    ]  # fmt: skip
    proc, port = await spawn_router(*flags)
    try:
        async with client(port, default_headers={"Connection": "close"}) as via:
            first = await via.chat.completions.with_raw_response.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": DOCUMENT},
                    {"role": "user", "content": "Hi"},
                ],
                max_tokens=2,
                extra_body={"prompt_cache_key": "tenant-a"},
            )
            worker = first.headers["x-request-id"].partition("-")[0]
            crossed = 0
            for _ in range(40):  # each lands on the other worker with probability 1/2
                raw = await via.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=[
                        {"role": "system", "content": DOCUMENT},
                        {"role": "user", "content": "Hi"},
                    ],
                    max_tokens=2,
                    extra_body={"prompt_cache_key": "tenant-a"},
                )
                if raw.headers["x-request-id"].partition("-")[0] != worker:
                    crossed += 1
                    assert int(raw.headers["x-sim-cached-tokens"]) > 500
                    break
            assert crossed == 1  # 40 misses in a row: 2^-40
            other = await cached_tokens(via, "tenant-b")
            assert other == 0
    finally:
        await stop(proc)


async def test_two_replicas_with_one_secret_give_a_tenant_one_salt(
    sim_fleet: SimFleet, etcd: EtcdServer, secret_file: Path
) -> None:
    """A tenant's entry made through one replica is hit through the other; another
    tenant's, never."""
    (sim,) = await sim_fleet(1)
    routers = []
    for i in range(2):
        flags = ["--etcd", etcd.url, "--etcd-prefix", "/salt/", "--replica-id", f"r{i}"]
        flags += ["--no-health-checks", "--backend", f"{sim.name}={sim.url}"]
        flags += ["--cache-salt", "--cache-salt-secret-file", str(secret_file)]
        routers.append(await spawn_router(*flags))
    try:
        async with client(routers[0][1]) as one, client(routers[1][1]) as other:
            assert await cached_tokens(one, "tenant-a") == 0
            assert await cached_tokens(other, "tenant-a") > 500
            assert await cached_tokens(other, "tenant-b") == 0
            assert await cached_tokens(one, "tenant-b") > 500
    finally:
        for proc, _ in routers:
            await stop(proc)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--cache-salt"], "give it a secret_file or $PREFIX_ROUTER_CACHE_SALT_SECRET"),
        (["--cache-salt", "--cache-salt-secret-file", "/nonexistent/s"], "cannot read"),
        (["--cache-salt", "--cache-salt-secret-file", "SHORT"], "at least 16 bytes"),
    ],
)
async def test_a_missing_or_weak_secret_is_refused_at_start(
    tmp_path: Path, flags: list[str], words: str
) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"tiny\n")
    flags = [str(short) if flag == "SHORT" else flag for flag in flags]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}  # no secret in the environment
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admin", "serve", "--backend", "a=http://127.0.0.1:9", *flags,
        cwd=ROOT, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    async with asyncio.timeout(20):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert words in err.decode()
    assert "tiny" not in err.decode()  # never the secret
