"""``prefix-router serve --discover ...`` as an operator runs it: a real process.

Kubernetes: ``--workers 2`` with a kubeconfig (CA file and token) pointing at the
fake API server (``tests/harness/fakek8s.py``, TLS on 127.0.0.1); the admin API
refuses membership writes with 409.  DNS: ``--discover dns:localhost:PORT`` through
the system resolver.  Configuration errors exit 2 naming the problem.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from admin.cli import main
from tests.harness.backends import Backend, StartBackend, echo
from tests.harness.fakek8s import FakeKube, endpoint_entry, slice_object
from tests.harness.http import WAIT, post_generate
from tests.harness.processes import admin_call, spawn_router, stop


def port_of(backend: Backend) -> int:
    return int(backend.url.rpartition(":")[2])


def slice_for(name: str, backend: Backend, **conditions: Any) -> dict[str, Any]:
    ports = [{"name": "http", "protocol": "TCP", "port": port_of(backend)}]
    return slice_object(name, "vllm", [endpoint_entry("127.0.0.1", **conditions)], ports)


@pytest.fixture
async def kube(tmp_path: Path) -> AsyncIterator[tuple[FakeKube, Path]]:
    """The fake API server and a kubeconfig (JSON: CA file, token) that reaches it."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    fake = FakeKube(tls=server_ctx)
    await fake.start()
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "fake",
        "clusters": [
            {"name": "fake", "cluster": {"server": fake.server, "certificate-authority": "ca.crt"}}
        ],
        "contexts": [
            {"name": "fake", "context": {"cluster": "fake", "user": "me", "namespace": "default"}}
        ],
        "users": [{"name": "me", "user": {"token": fake.token}}],
    }
    (tmp_path / "kubeconfig").write_text(json.dumps(config))
    try:
        yield fake, tmp_path / "kubeconfig"
    finally:
        await fake.stop()


async def backends_of(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> dict:  # type: ignore[type-arg]
    status, body = await admin_call(http, proc, "GET", "/admin/backends")
    assert status == 200, body
    return {b["name"]: b["state"] for b in body}  # type: ignore[attr-defined]


async def until_backends(http, proc, wanted: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """Poll the admin API (another process: no event to await), bounded by WAIT."""
    async with asyncio.timeout(WAIT):
        while True:
            if await backends_of(http, proc) == wanted:
                return
            await asyncio.sleep(0.02)


async def test_serve_with_two_workers_follows_the_service_and_refuses_admin_membership_writes(
    kube: tuple[FakeKube, Path], backends: StartBackend
) -> None:
    fake, kubeconfig = kube
    a, b = await backends(echo), await backends(echo)
    fake.put_slice(slice_for("vllm-a", a))
    proc, port = await spawn_router(
        "--discover", "k8s", "--kubeconfig", str(kubeconfig), "--k8s-service", "vllm",
        "--k8s-port-name", "http", "--workers", "2", "--no-health-checks",
    )  # fmt: skip
    na, nb = f"127.0.0.1:{port_of(a)}", f"127.0.0.1:{port_of(b)}"
    try:
        async with aiohttp.ClientSession() as http:
            # Start-up waited for the first list: the fleet is there when it listens.
            assert await backends_of(http, proc) == {na: "active"}
            status, _ = await admin_call(http, proc, "GET", "/readyz")
            assert status == 200
            for i in range(4):
                assert await post_generate(http, port, f"key {i}") == 200
            assert len(a.requests) == 4

            # Membership belongs to discovery: POST, DELETE and a state PATCH are 409.
            status, body = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": "x", "url": b.url}
            )
            assert status == 409
            assert "discovery" in body["error"]["message"]  # type: ignore[index]
            status, _ = await admin_call(http, proc, "DELETE", f"/admin/backends/{na}")
            assert status == 409
            path = f"/admin/backends/{na}"
            status, _ = await admin_call(http, proc, "PATCH", path, {"state": "draining"})
            assert status == 409
            status, body = await admin_call(http, proc, "PATCH", path, {"weight": 3})
            assert status == 200
            assert body["weight"] == 3

            # b becomes ready and a terminates: both workers route to b only.
            fake.put_slice(slice_for("vllm-b", b))
            fake.put_slice(slice_for("vllm-a", a, ready=False, serving=True, terminating=True))
            await until_backends(http, proc, {na: "draining", nb: "active"})
            for i in range(8):
                assert await post_generate(http, port, f"after {i}") == 200
            assert len(a.requests) == 4
            assert len(b.requests) == 8

            # a's slice goes: drained out and removed.
            fake.delete_slice("vllm-a")
            await until_backends(http, proc, {nb: "active"})
    finally:
        await stop(proc)


async def test_serve_dns_discovery_through_the_system_resolver(backends: StartBackend) -> None:
    a = await backends(echo)
    proc, port = await spawn_router(
        "--discover", f"dns:localhost:{port_of(a)}", "--discover-interval", "0.2",
        "--no-health-checks", "--retries", "2",
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            found = await backends_of(http, proc)
            # localhost is 127.0.0.1 here (and may be ::1 too elsewhere).
            assert found[f"127.0.0.1:{port_of(a)}"] == "active"
            assert set(found) <= {f"127.0.0.1:{port_of(a)}", f"0::1:{port_of(a)}"}
            assert await post_generate(http, port, "hello") == 200
    finally:
        await stop(proc)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--discover", "k8s"], "exactly one of service and selector"),
        (
            ["--discover", "k8s", "--k8s-service", "a", "--k8s-selector", "app=a"],
            "exactly one of service and selector",
        ),
        (["--discover", "dns:nohost"], "dns:NAME:PORT"),
        (["--discover", "consul"], "must be k8s or dns:NAME:PORT"),
        (["--discover", "dns:a:80", "--k8s-service", "x"], "takes no k8s field: service"),
        (
            ["--discover", "dns:a:80", "--backend", "x=http://127.0.0.1:1"],
            "backends come from discovery",
        ),
    ],
)
def test_bad_discovery_flags_exit_2_naming_the_problem(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--admin-listen", "off", *flags]) == 2
    assert message in capsys.readouterr().err
