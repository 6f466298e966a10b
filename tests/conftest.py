"""Shared fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import settings

from loadtests.simserver import SimConfig, SimServer, Timing

# Property tests check what holds, not how fast: no per-example deadline, which a
# pause on a loaded machine (GC, a descheduled thread) would turn into a failure.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

if TYPE_CHECKING:
    from router.app import Router

# 1 model second = 1 real millisecond: simulated prefills and decodes cost almost no
# wall-clock time, while the model's arithmetic (x-sim-ttft-ms, cached tokens) stays exact.
FAST = Timing(time_scale=0.001)

SimFleet = Callable[..., Awaitable[list[SimServer]]]


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

StartRouter = Callable[..., Awaitable["Router"]]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Router tests run on uvloop (production) and on the stdlib loop."""
    import uvloop

    if item.path.name.startswith("test_router"):
        return {"uvloop": uvloop.new_event_loop, "asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


def router_config(backends: list[Any], **overrides: Any) -> dict[str, Any]:
    """A config dict for ``build_config``: SimServers or (name, url) pairs as backends."""
    specs = []
    for backend in backends:
        if isinstance(backend, SimServer):
            specs.append({"name": backend.name, "url": backend.url})
        elif isinstance(backend, dict):
            specs.append(backend)
        else:
            name, url = backend
            specs.append({"name": name, "url": url})
    data: dict[str, Any] = {"listen": "127.0.0.1:0", "access_log": "off", "backends": specs}
    routing = overrides.pop("routing", None)
    if routing is not None:
        data["RoutingConfig"] = routing
    data.update(overrides)
    return data


@pytest.fixture
async def backends() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """``backend = await backends(handler)``: the hand-written recording backends of
    ``tests/test_router_http.py``; request it before ``start_router``."""
    from tests.test_router_http import Backend, Handler, echo  # it imports this module

    started: list[Backend] = []

    async def start(handler: Handler = echo, name: str = "hand") -> Backend:
        backend = Backend(handler, f"{name}-{len(started)}")
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
