"""``https://`` backends (``router/backendtls.py``): requests, health checks and
mutual TLS to a backend served with a certificate made at test time (trustme)."""

from __future__ import annotations

import os
import ssl
from pathlib import Path

import aiohttp
import pytest
import trustme

from admin.cli import main
from router import backendtls
from router.config import BackendSpec
from router.control.live import RouterControl
from router.discovery import Reconciler
from router.discovery.dns import DnsSource
from tests.harness.backends import StartBackend
from tests.harness.http import WAIT, connect, quiet, req, until
from tests.harness.processes import spawn_router, stop
from tests.harness.routers import FAST_HEALTH, StartRouter

pytestmark = pytest.mark.timeout(90)

COMPLETION = b'{"model": "m", "prompt": "hello over TLS"}'


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def server_context(ca: trustme.CA, *, client_certs: bool = False) -> ssl.SSLContext:
    """A backend's: a certificate for 127.0.0.1 from ``ca``; with ``client_certs``,
    it asks for the client's and checks it chains to ``ca`` too (mutual TLS)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    if client_certs:
        context.verify_mode = ssl.CERT_REQUIRED
        ca.configure_trust(context)
    return context


def ca_file(ca: trustme.CA, tmp_path: Path) -> str:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return str(path)


async def statuses(router_port: int, count: int) -> list[int]:
    """``count`` requests on one client connection: their statuses."""
    answers = []
    async with aiohttp.ClientSession() as http:
        for _ in range(count):
            url = f"http://127.0.0.1:{router_port}/v1/completions"
            async with http.post(url, data=COMPLETION) as resp:
                await resp.read()
                answers.append(resp.status)
    return answers


async def test_an_https_backend_is_spoken_to_over_tls_pooled_and_health_checked(
    backends: StartBackend, start_router: StartRouter, ca: trustme.CA, tmp_path: Path
) -> None:
    backend = await backends(tls=server_context(ca))
    assert backend.url.startswith("https://")
    router = await start_router(
        [backend.spec], health=FAST_HEALTH, backend_tls={"ca_file": ca_file(ca, tmp_path)}
    )
    async with connect(router) as client:
        for _ in range(3):
            await client.send(req(b"POST", b"/v1/completions", body=COMPLETION))
            assert (await client.response()).status == 200
    completions = [s for s in backend.requests if s.target == b"/v1/completions"]
    assert [s.body for s in completions] == [COMPLETION] * 3
    # One TLS connection carried the three (pooled), besides the health checks' own.
    assert len({s.connection for s in completions}) == 1
    # The health checks speak TLS too: four checks received, the first three judged,
    # and the backend is still up (three failures would have marked it down).
    await backend.wait_for(lambda: sum(s.target == b"/health" for s in backend.requests) >= 4)
    assert router.fleet.backends[backend.name].healthy
    await quiet(router)


async def test_an_untrusted_certificate_is_refused_unless_verify_is_off(
    backends: StartBackend, start_router: StartRouter, ca: trustme.CA
) -> None:
    backend = await backends(tls=server_context(ca))  # a CA the system does not trust
    strict = await start_router([backend.spec], health={"active": False})
    assert await statuses(strict.port, 1) == [502]
    assert not backend.requests  # nothing was sent: the handshake failed first
    assert strict.fleet.backends[backend.name].errors == 1
    lax = await start_router([backend.spec], backend_tls={"verify": False})
    assert await statuses(lax.port, 2) == [200, 200]


async def test_mutual_tls_sends_the_routers_certificate(
    backends: StartBackend, start_router: StartRouter, ca: trustme.CA, tmp_path: Path
) -> None:
    backend = await backends(tls=server_context(ca, client_certs=True))
    trust = ca_file(ca, tmp_path)
    client = ca.issue_cert("prefix-router.test")
    cert, key = tmp_path / "router.pem", tmp_path / "router.key"
    client.cert_chain_pems[0].write_to_path(str(cert))
    client.private_key_pem.write_to_path(str(key))
    with_cert = await start_router(
        [backend.spec],
        health={"active": False},
        backend_tls={"ca_file": trust, "cert_file": str(cert), "key_file": str(key)},
    )
    assert await statuses(with_cert.port, 2) == [200, 200]
    without = await start_router(
        [backend.spec], health={"active": False}, backend_tls={"ca_file": trust}
    )
    assert await statuses(without.port, 1) == [502]


def test_https_urls_and_backend_tls_files_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert BackendSpec(name="a", url="https://gpu-0.example").address() == ("gpu-0.example", 443)
    assert BackendSpec(name="a", url="HTTPS://gpu-0.example:8443").tls
    assert not BackendSpec(name="a", url="http://gpu-0.example").tls
    config = tmp_path / "router.toml"
    missing = tmp_path / "missing-ca.pem"
    config.write_text(
        'backends = [{name = "a", url = "https://127.0.0.1:9"}]\n'
        f'[backend_tls]\nca_file = "{missing}"\n'
    )
    assert main(["check-config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "cannot load backend_tls files" in err
    assert "No such file" in err


async def test_with_two_workers_each_speaks_tls_to_the_backend(
    backends: StartBackend, ca: trustme.CA, tmp_path: Path
) -> None:
    backend = await backends(tls=server_context(ca))
    config = tmp_path / "router.toml"
    config.write_text(f'[backend_tls]\nca_file = "{ca_file(ca, tmp_path)}"\n')
    proc, port = await spawn_router(
        "--config", str(config), "--workers", "2", "--no-health-checks",
        "--backend", f"{backend.name}={backend.url}",
    )  # fmt: skip
    try:
        workers: set[str] = set()
        async with aiohttp.ClientSession() as http:
            for _ in range(200):  # a connection each: the kernel spreads them
                url = f"http://127.0.0.1:{port}/v1/completions"
                headers = {"Connection": "close"}
                async with http.post(url, data=COMPLETION, headers=headers) as resp:
                    assert resp.status == 200
                    workers.add(resp.headers["x-request-id"].partition("-")[0])
                if len(workers) == 2:
                    break
        assert len(workers) == 2  # 200 requests on one worker in a row: 2^-199
    finally:
        await stop(proc)


async def test_backend_tls_files_gone_at_first_use_are_the_routers_fault(
    backends: StartBackend,
    start_router: StartRouter,
    ca: trustme.CA,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CA file removed after start-up: the context cannot be built. A 503 that
    blames no backend (its health and error count untouched), then, the file back,
    the next try after RETRY_SECONDS (0 here) serves."""
    monkeypatch.setattr(backendtls, "RETRY_SECONDS", 0.0)
    backend = await backends(tls=server_context(ca))
    trust = ca_file(ca, tmp_path)
    router = await start_router(
        [backend.spec], health={"active": False}, backend_tls={"ca_file": trust}
    )
    os.rename(trust, trust + ".away")
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{router.port}/v1/completions"
        async with http.post(url, data=COMPLETION) as resp:
            assert resp.status == 503
            assert "backend_tls" in (await resp.json())["error"]["message"]
    served = router.fleet.backends[backend.name]
    assert (served.errors, served.healthy) == (0, True)
    os.rename(trust + ".away", trust)
    assert await statuses(router.port, 2) == [200, 200]


# -- server_name: a certificate that names a service, not the backend's address ------------


def named_context(ca: trustme.CA, name: str, seen: list[str | None]) -> ssl.SSLContext:
    """A backend's certificate for ``name`` only (not 127.0.0.1); the server names
    its clients sent (SNI) are appended to ``seen``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(context)
    context.sni_callback = lambda _sock, server_name, _ctx: seen.append(server_name)  # type: ignore[assignment, misc]
    return context


async def test_server_name_is_sent_and_checked_instead_of_the_address(
    backends: StartBackend, start_router: StartRouter, ca: trustme.CA, tmp_path: Path
) -> None:
    seen: list[str | None] = []
    backend = await backends(tls=named_context(ca, "vllm.internal", seen))
    tls = {"ca_file": ca_file(ca, tmp_path)}
    named = {"name": "named", "url": backend.url, "server_name": "vllm.internal"}
    router = await start_router([named], health=FAST_HEALTH, backend_tls=tls)
    assert await statuses(router.port, 2) == [200, 200]
    # The health checks speak to it by that name too: it stays up.
    await backend.wait_for(lambda: sum(s.target == b"/health" for s in backend.requests) >= 4)
    assert router.fleet.backends["named"].healthy
    assert set(seen) == {"vllm.internal"}
    view = (await RouterControl(router).backend("named")).server_name
    assert view == "vllm.internal"

    # Without it the certificate is checked for 127.0.0.1, which it does not name.
    plain = await start_router(
        [("plain", backend.url)], health={"active": False}, backend_tls=tls, retries=0
    )
    assert await statuses(plain.port, 1) == [502]


def test_server_name_needs_https_and_a_host_name() -> None:
    from router.config import ConfigError, build_config

    http = {"name": "b", "url": "http://127.0.0.1:1", "server_name": "vllm.internal"}
    with pytest.raises(ConfigError, match="server_name needs an https:// url"):
        build_config({"backends": [http]})
    for bad in ("10.0.0.1:80", "vllm internal", "-x", "vllm.internal."):
        spec = {"name": "b", "url": "https://127.0.0.1:1", "server_name": bad}
        with pytest.raises(ConfigError, match="is not a host name"):
            build_config({"backends": [spec]})
    with pytest.raises(ConfigError, match='server_name needs scheme = "https"'):
        build_config({"discover": {"source": "dns:vllm:8000", "server_name": "vllm.internal"}})


async def test_discovered_backends_are_spoken_to_over_tls_by_the_configured_name(
    backends: StartBackend, start_router: StartRouter, ca: trustme.CA, tmp_path: Path
) -> None:
    seen: list[str | None] = []
    backend = await backends(tls=named_context(ca, "vllm.internal", seen))
    port = int(backend.url.rpartition(":")[2])
    router = await start_router(
        [], health={"active": False}, backend_tls={"ca_file": ca_file(ca, tmp_path)}
    )
    control = RouterControl(router)

    async def resolve(name: str, _port: int) -> list[str]:
        return ["127.0.0.1"]

    reconciler = Reconciler(
        control, scheme="https", server_name="vllm.internal", resync_interval=0.05
    )
    source = DnsSource("vllm.test", port, interval=0.05, resolve=resolve)
    reconciler.start(source)
    try:
        assert await reconciler.wait_synced(WAIT)
        (discovered,) = router.fleet.backends.values()
        assert discovered.url == f"https://127.0.0.1:{port}"
        assert discovered.spec.server_name == "vllm.internal"
        assert await statuses(router.port, 2) == [200, 200]
        assert set(seen) == {"vllm.internal"}
        # Looked up and applied again (resync): the same backend, not replaced.
        lookups = source.lookups
        await until(lambda: source.lookups >= lookups + 3)
        assert list(router.fleet.backends.values()) == [discovered]
        assert discovered.state.value == "active"
    finally:
        await reconciler.close()
        await control.close()
