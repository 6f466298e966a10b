"""Panic (``[health] panic``, ``router/fleet.py``) in the daemon with two workers:
the supervisor's health checks mark every backend down, every worker routes to
them all the same, and ``/admin/stats`` says so."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.harness.processes import admin_call, spawn_router, stop

pytestmark = pytest.mark.timeout(90)

WAIT = 20.0


async def test_with_two_workers_every_worker_routes_to_backends_all_down(tmp_path: Path) -> None:
    async def health(request: web.Request) -> web.Response:
        return web.Response(status=404)  # the engines serve; their health path does not

    async def completion(request: web.Request) -> web.Response:
        return web.json_response({"choices": []})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completion)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    config = tmp_path / "router.toml"
    config.write_text("[health]\ninterval = 0.05\ntimeout = 0.5\nunhealthy_threshold = 2\n")
    proc, port = await spawn_router(
        "--config", str(config), "--workers", "2", "--backend", f"a={url}", "--backend", f"b={url}"
    )
    try:
        async with aiohttp.ClientSession() as http:
            async with asyncio.timeout(WAIT):
                while True:  # the supervisor's health checks: no event to wait on here
                    _, stats = await admin_call(http, proc, "GET", "/admin/stats")
                    if stats["panic"] == ["a", "b"]:
                        break
                    await asyncio.sleep(0.05)
            # Once more: its query to the workers goes after the supervisor's SetHealthy
            # ops on the same ordered channel, so every worker has them when it answers.
            _, stats = await admin_call(http, proc, "GET", "/admin/stats")
            assert stats["panic"] == ["a", "b"]
            assert not any(b["healthy"] for b in stats["backends"])  # type: ignore[union-attr]
            workers: set[str] = set()
            statuses = []
            # A connection each: the kernel spreads them over the workers.
            for i in range(200):
                async with http.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"prompt": f"document {i} " * 20},
                    headers={"Connection": "close"},
                ) as resp:
                    statuses.append(resp.status)
                    workers.add(resp.headers["x-request-id"].partition("-")[0])
                if len(workers) == 2 and i >= 20:
                    break
            assert set(statuses) == {200}
            assert len(workers) == 2  # both workers routed (200 misses in a row: 2^-199)
    finally:
        await stop(proc)
        await runner.cleanup()
