"""TLS on the client listener, with a certificate made at test time."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import aiohttp
import pytest
import trustme

from admin.cli import main
from tests.harness.http import WAIT
from tests.harness.routers import SimFleet, StartRouter


async def test_clients_speak_tls_to_the_router_and_backends_see_https(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    seen: list[str] = []
    sims = await sim_fleet(1)
    router = await start_router(sims, tls=server_context)

    async with aiohttp.ClientSession() as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        url = f"https://127.0.0.1:{router.port}/v1/chat/completions"
        async with http.post(url, json=body, ssl=client_context) as resp:
            assert resp.status == 200
            assert (await resp.json())["usage"]["completion_tokens"] == 2
        # Plain HTTP on the TLS port is refused, not served.
        with pytest.raises(aiohttp.ClientError):
            async with http.post(url.replace("https", "http"), json=body) as resp:
                seen.append(str(resp.status))
    assert seen == []


async def test_backends_are_told_the_original_scheme(start_router: StartRouter) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    heads: list[bytes] = []

    async def backend(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(backend, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        router = await start_router([("raw", f"http://127.0.0.1:{port}")], tls=server_context)
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"https://127.0.0.1:{router.port}/v1/models", ssl=client_context) as resp,
        ):
            assert (resp.status, await resp.read()) == (200, b"ok")
    finally:
        server.close()
        await server.wait_closed()
    assert b"x-forwarded-proto: https\r\n" in heads[0].lower()


async def test_failed_handshakes_are_not_counted_against_the_connection_cap(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    """asyncio tells the protocol nothing of a connection whose TLS handshake
    fails; before, each stayed counted against the connection cap for good, and
    a TCP health check that connects and closes, or plain HTTP on the TLS port,
    filled it over time until every client got a 503.  Now one is uncounted
    once its handshake deadline (``client_header``) is past; those made are
    counted exactly as before."""
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    sims = await sim_fleet(1)
    router = await start_router(sims, tls=server_context, timeouts={"client_header": 0.5})
    admission = router.admission
    for plain in (True, False, True):
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        if plain:  # plain HTTP on the TLS port: the handshake fails, then an EOF
            writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
            async with asyncio.timeout(WAIT):
                assert await reader.read() == b""
        writer.close()  # else: a TCP health check, connect and close
        await writer.wait_closed()
    async with asyncio.timeout(30):  # 0.5 s, the margin (1 s) and a sweep (2 s): 3.5 s
        while admission.clients or admission.handshaking:  # noqa: ASYNC110 - no event for it
            await asyncio.sleep(0.05)
    async with aiohttp.ClientSession() as http:
        url = f"https://127.0.0.1:{router.port}/health"
        async with http.get(url, ssl=client_context) as resp:
            assert resp.status == 200
            assert (admission.clients, admission.handshaking) == (1, {})
    async with asyncio.timeout(WAIT):
        while admission.clients:  # noqa: ASYNC110 - connection_lost has no event to wait on
            await asyncio.sleep(0.01)


def test_unusable_tls_files_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope.pem")
    assert (
        main(["serve", "--tls-cert", missing, "--tls-key", missing, "--admin-listen", "off"]) == 2
    )
    assert "cannot load tls_cert/tls_key" in capsys.readouterr().err
    assert main(["serve", "--tls-cert", missing, "--admin-listen", "off"]) == 2
    assert "give both or neither" in capsys.readouterr().err
