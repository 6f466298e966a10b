"""Shared fixtures."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from loadtests.simserver import SimConfig, SimServer, Timing

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
