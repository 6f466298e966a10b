"""``--workers N``: the supervisor keeps every worker's listening sockets
(``router.sockets.deal``), so the connections waiting in the accept queue of a
worker that dies are served by its successor instead of being reset.

A stopped worker (SIGSTOP) accepts nothing: the connections the kernel hashes to
its socket wait in that socket's queue, which ``/proc/net/tcp`` shows as the
listening socket's receive queue.  The worker is then killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from tests.harness.backends import StartBackend, echo
from tests.harness.http import post_generate as post
from tests.harness.http import until
from tests.harness.processes import RESTART_WAIT, admin_call, spawn_router, stop

pytestmark = pytest.mark.timeout(120)

# 2^-39 is the chance that 40 connections all hash to the socket of the running worker.
CONNECTIONS = 40


def queued(port: int) -> int:
    """Connections waiting to be accepted on ``port``'s listening sockets (IPv4)."""
    waiting = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, state, queues = fields[1], fields[3], fields[4]
        if state == "0A" and int(local.rpartition(":")[2], 16) == port:  # LISTEN
            waiting += int(queues.partition(":")[2], 16)
    return waiting


async def test_connections_queued_for_a_worker_that_dies_are_served_by_its_successor(
    backends: StartBackend,
) -> None:
    backend = await backends(echo)
    proc, port = await spawn_router("--workers", "2", f"--backend={backend.name}={backend.url}")
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await admin_call(http, proc, "GET", "/admin/stats")
            assert status == 200
            pids = [w["pid"] for w in body["workers"]]  # type: ignore[attr-defined]
            os.kill(pids[0], signal.SIGSTOP)
            try:
                sent = [
                    asyncio.create_task(post(http, port, f"request {i}"))
                    for i in range(CONNECTIONS)
                ]
                # The running worker answers its share; the rest wait for the stopped one.
                await until(lambda: queued(port) > 0)
            finally:
                os.kill(pids[0], signal.SIGKILL)  # (a stopped process dies of it too)
            async with asyncio.timeout(RESTART_WAIT):
                statuses = await asyncio.gather(*sent, return_exceptions=True)
            assert statuses == [200] * CONNECTIONS
            assert len(backend.requests) == CONNECTIONS
    finally:
        await stop(proc)
