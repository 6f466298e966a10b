"""``prefix-router serve`` as a real process: start it, call its admin API, stop it.

``spawn_router(*flags)`` runs ``python -m admin serve`` on ephemeral ports and returns
once both the router and its admin API listen; ``admin_call`` calls that admin API;
``stop`` sends SIGTERM and expects exit 0; ``serving`` is ``spawn_router`` killed at
the end if still there; ``serve_exit`` runs one expected to exit by itself.  ``ROOT``
is the repository.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

__all__ = ["RESTART_WAIT", "ROOT", "admin_call", "serve_exit", "serving", "spawn_router", "stop"]

ROOT = Path(__file__).resolve().parents[2]
# A worker restart is a new Python process importing the router: ~1 s on a quiet
# machine, several beside a parallel test suite on 2 cores (5 s was seen to run out).
RESTART_WAIT = 30.0
ADMIN_PORTS: dict[int, int] = {}  # router pid -> its admin API port
# A log line can be long: "listening" names every backend (8,192 of them: ~90 KiB).
LINE_LIMIT = 1 << 20


async def spawn_router(
    *args: str, events: list[dict[str, Any]] | None = None, within: float = 20.0
) -> tuple[asyncio.subprocess.Process, int]:
    """Start ``python -m admin serve ARGS`` and return it with its port (the
    admin API, on an ephemeral port, is up too once this returns, ``within``
    seconds); the log events read until then are appended to ``events``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "admin",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--access-log",
        "off",
        "--admin-listen",
        "127.0.0.1:0",
        *args,
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        limit=LINE_LIMIT,
    )
    assert proc.stderr is not None
    port = None
    async with asyncio.timeout(within):
        while True:
            line = await proc.stderr.readline()
            assert line, "router exited before listening"
            event = json.loads(line)
            if events is not None:
                events.append(event)
            if event["event"] == "listening":
                port = int(event["address"].rpartition(":")[2])
            elif event["event"] == "admin listening":
                assert port is not None
                ADMIN_PORTS[proc.pid] = int(event["address"].rpartition(":")[2])
                return proc, port


async def admin_call(
    http: aiohttp.ClientSession,
    proc: asyncio.subprocess.Process,
    method: str,
    path: str,
    body: object = None,
    token: str | None = None,
) -> tuple[int, dict[str, object]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}{path}"
    async with http.request(method, url, json=body, headers=headers) as resp:
        return resp.status, await resp.json()


async def stop(proc: asyncio.subprocess.Process) -> bytes:
    """SIGTERM, expect exit 0, return what it logged after start-up."""
    proc.send_signal(signal.SIGTERM)
    assert proc.stderr is not None
    async with asyncio.timeout(20):
        rest = await proc.stderr.read()
        assert await proc.wait() == 0
    return rest


@asynccontextmanager
async def serving(*args: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, int]]:
    """``prefix-router serve ARGS``, killed at the end if a test did not stop it."""
    proc, port = await spawn_router(*args)
    try:
        yield proc, port
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def serve_exit(*args: str, within: float = 20.0) -> tuple[int | None, bytes]:
    """Run ``prefix-router serve ARGS`` expecting it to exit by itself: its code and
    stderr (killed, and its code None, if it is still there ``within`` seconds on)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admin", "serve", "--access-log", "off", "--no-health-checks",
        *args,
        cwd=ROOT, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        async with asyncio.timeout(within):
            _, err = await proc.communicate()
    finally:
        if proc.returncode is None:  # it did not exit: a failure, and nothing left running
            proc.kill()
            await proc.wait()
    return proc.returncode, err
