"""``[limits] client_connections``: what one client address may hold open
(``router/admission.py``), over real loopback sockets.

One address past its limit gets a 429 with ``Retry-After`` and its connection
closed, while its open connections and every other address are served; a
place frees when one of its connections closes.  With ``--workers N`` each
worker counts its own: one address holds between the limit and N times it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path

import aiohttp
import pytest

from router.admission import client_key
from tests.harness.backends import StartBackend
from tests.harness.http import WAIT, Client, assert_error, connect, req, until
from tests.harness.processes import ADMIN_PORTS, admin_call, spawn_router, stop
from tests.harness.routers import StartRouter

pytestmark = pytest.mark.timeout(90)


async def served(client: Client) -> int:
    """One request on ``client``'s connection: the answer's status."""
    await client.send(req(b"GET", b"/health"))
    return (await client.response()).status


async def test_an_address_past_its_limit_gets_a_429_and_the_others_are_served(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], limits={"client_connections": 2})
    async with connect(router) as first:
        async with connect(router) as second:
            assert await served(first) == 200
            assert await served(second) == 200
            async with connect(router) as third:
                # Answered at once, before it sends anything, then closed.
                resp = await third.response()
                error = assert_error(resp, 429)
                assert "[limits] client_connections" in error["message"]
                assert resp.value("retry-after") == b"1"
                assert resp.value("connection") == b"close"
                async with asyncio.timeout(WAIT):
                    assert await third.reader.read() == b""
            assert router.recorder.refused[429] == 1
            # Another address (any of 127.0.0.0/8 is this host) has its own count.
            async with connect(router, source="127.0.0.2") as elsewhere:
                assert await served(elsewhere) == 200
            assert await served(first) == 200  # the open ones keep being served
        # The second one left: its place is free again.
        await until(lambda: router.admission.by_address == {b"127.0.0.1": 1})
        async with connect(router) as again:
            assert await served(again) == 200
    await until(lambda: not router.admission.by_address)
    assert router.recorder.refused[429] == 1


async def test_without_a_limit_an_address_is_not_counted(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(connect(router)) for _ in range(20)]
        assert [await served(client) for client in clients] == [200] * 20
        assert router.admission.by_address == {}


async def test_with_two_workers_an_address_holds_between_the_limit_and_twice_it(
    backends: StartBackend, tmp_path: Path
) -> None:
    limit, workers, tries = 2, 2, 8
    backend = await backends()
    config = tmp_path / "router.toml"
    config.write_text(f"[limits]\nclient_connections = {limit}\n")
    proc, port = await spawn_router(
        "--config", str(config), "--workers", str(workers), "--no-health-checks",
        "--backend", f"{backend.name}={backend.url}",
    )  # fmt: skip
    try:
        statuses: list[int] = []
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(tries):  # each held open, kept alive, while the next connects
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                stack.callback(writer.close)
                client = Client(reader, writer)
                statuses.append(await served(client))
        assert set(statuses) <= {200, 429}, statuses
        accepted = statuses.count(200)
        # The kernel spreads the connections over the workers, each counting its own.
        assert limit <= accepted <= workers * limit, statuses
        assert statuses[:limit] == [200] * limit  # no worker can be full before that
    finally:
        await stop(proc)


async def test_open_and_accepted_connections_are_counted_refusals_included(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], limits={"client_connections": 2})
    async with connect(router) as first, connect(router) as second:
        assert [await served(first), await served(second)] == [200, 200]
        async with connect(router) as third:
            assert_error(await third.response(), 429)
            assert router.client_connections() == (3, 3)  # the refusal is open until it closes
        text = (await router.collector.render_async()).decode()
        assert "prefix_router_client_connections_accepted_total 3.0" in text
    await until(lambda: router.client_connections() == (0, 3))


async def test_with_two_workers_the_connection_counts_are_the_workers_sum(
    backends: StartBackend,
) -> None:
    backend = await backends()
    proc, port = await spawn_router(
        "--workers", "2", "--no-health-checks", "--backend", f"{backend.name}={backend.url}"
    )
    try:
        async with aiohttp.ClientSession() as http:

            async def counted() -> tuple[int, int]:
                _, stats = await admin_call(http, proc, "GET", "/admin/stats")
                async with http.get(f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics") as resp:
                    text = await resp.text()
                accepted = re.search(
                    r"^prefix_router_client_connections_accepted_total (\S+)$", text, re.M
                )
                assert accepted is not None
                return stats["totals"]["connections"], int(float(accepted[1]))  # type: ignore[index, call-overload]

            async with contextlib.AsyncExitStack() as stack:
                for _ in range(6):  # each served and held open: on either worker
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                    stack.callback(writer.close)
                    assert await served(Client(reader, writer)) == 200
                assert await counted() == (6, 6)
            async with asyncio.timeout(WAIT):
                while await counted() != (0, 6):  # noqa: ASYNC110 - the workers see the closes
                    await asyncio.sleep(0.02)
    finally:
        await stop(proc)


@pytest.mark.parametrize(
    ("address", "prefix", "key"),
    [
        (b"203.0.113.7", 64, b"203.0.113.7"),
        (b"2001:db8:1:2:3:4:5:6", 64, b"2001:db8:1:2::/64"),
        (b"2001:db8:1:2::9", 64, b"2001:db8:1:2::/64"),
        (b"2001:db8:1:2::9", 48, b"2001:db8:1::/48"),
        (b"2001:db8:1:2::9", 128, b"2001:db8:1:2::9"),
        (b"::ffff:203.0.113.7", 64, b"203.0.113.7"),  # a dual-stack listener's IPv4 client
        (b"::ffff:203.0.113.7", 128, b"203.0.113.7"),
        (b"fe80::1%eth0", 64, b"fe80::1%eth0"),  # a scope id: as given
    ],
)
def test_what_an_address_counts_under(address: bytes, prefix: int, key: bytes) -> None:
    assert client_key(address, prefix) == key


def proxied(source: str) -> bytes:
    """A PROXY protocol v1 line from ``source`` (``proxy_protocol = true``)."""
    family = b"TCP6" if ":" in source else b"TCP4"
    target = b"::1" if ":" in source else b"127.0.0.1"
    return b"PROXY %s %s %s 1 2\r\n" % (family, source.encode(), target)


async def test_ipv6_clients_count_per_64_and_mapped_ones_as_ipv4(
    backends: StartBackend, start_router: StartRouter
) -> None:
    """The sources are named by PROXY headers: loopback has one IPv6 address."""
    backend = await backends()
    limits = {"client_connections": 1}
    router = await start_router([backend.spec], limits=limits, proxy_protocol=True)
    async with contextlib.AsyncExitStack() as stack:

        async def from_(source: str) -> int:
            client = await stack.enter_async_context(connect(router))
            await client.send(proxied(source) + req(b"GET", b"/health"))
            return (await client.response()).status

        assert await from_("2001:db8:0:1::1") == 200
        assert await from_("2001:db8:0:1::2") == 429  # the same /64
        assert await from_("2001:db8:0:2::1") == 200  # the next /64
        assert await from_("203.0.113.7") == 200
        assert await from_("::ffff:203.0.113.7") == 429  # the same client, mapped
        assert router.admission.by_address == {
            b"2001:db8:0:1::/64": 1,
            b"2001:db8:0:2::/64": 1,
            b"203.0.113.7": 1,
        }
    await until(lambda: not router.admission.by_address)
