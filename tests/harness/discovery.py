"""What the discovery tests share: waiting for a ``Reconciler`` and reading the fleet.

``converged(reconciler, predicate)`` waits, without polling, until ``predicate()``
holds once every snapshot received so far is applied; ``states(router)`` is the
fleet as ``{name: "active" | "draining"}``; ``post(router, key)`` sends one native
request through the router and returns its status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from tests.harness.http import WAIT, connect, req

if TYPE_CHECKING:
    from router.app import Router
    from router.discovery import Reconciler

__all__ = ["converged", "post", "states"]


async def converged(reconciler: Reconciler, predicate: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT):
        while True:
            # Read once: a snapshot that comes during the check is the one awaited next.
            seen = reconciler.published
            await reconciler.wait_applied(seen)
            if predicate():
                return
            await reconciler.wait_applied(seen + 1)


async def post(router: Router, key: bytes) -> int:
    async with connect(router) as client:
        await client.send(req(b"POST", b"/generate", body=key))
        return (await client.response()).status


def states(router: Router) -> dict[str, str]:
    return {name: b.state.value for name, b in router.fleet.backends.items()}
