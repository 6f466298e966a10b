"""``RouterControl`` (``router/control/live.py``): the admin interface over a live router.

Its contract: a change is written to the state file before it is applied, so a
failed write changes nothing (``NotSaved``); a drain waits for the backend's last
request, then removes it; a backend at one of the router's own listeners is
refused (by the admin API and at start-up).

The first tests drive ``RouterControl`` in-process; the storage-failure tests
run ``prefix-router serve`` as a real process (``spawn_router``) and break its
state file for real, in a way that stops root too (the tests run as root, where
permissions stop nothing): the state file's directory is moved away and a
regular file put in its place, so the next write fails with ENOTDIR.  The admin
REST API itself, over a fake control, is in ``tests/test_admin_api.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from admin import AdminServer
from router.app import Router
from router.config import BackendSpec
from router.control import BackendPatch, NotSaved
from router.control.live import RouterControl
from router.state import StateFile
from tests.harness.backends import Backend, Seen, StartBackend, echo, hold
from tests.harness.http import connect, req, still_serves
from tests.harness.processes import admin_call, serve_exit, serving, stop
from tests.harness.routers import StartRouter

WAIT = 10.0


async def state_of(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process, name: str) -> Any:
    return (await admin_call(http, proc, "GET", f"/admin/backends/{name}"))[1]["state"]


@contextmanager
def broken(directory: Path) -> Iterator[None]:
    """While inside, ``directory`` is a regular file: nothing can be written in it."""
    aside = directory.with_name(directory.name + ".aside")
    directory.rename(aside)
    directory.write_text("not a directory\n")
    try:
        yield
    finally:
        directory.unlink()
        aside.rename(directory)


# -- changes, in-process ---------------------------------------------------------------


async def test_a_change_is_saved_before_it_is_applied_and_a_failed_save_changes_nothing(
    backends: StartBackend, start_router: StartRouter, tmp_path: Path
) -> None:
    first, second = await backends(), await backends()
    router = await start_router([first.spec], health={"active": False})
    directory = tmp_path / "state"
    directory.mkdir()
    state = StateFile(directory / "state.json")
    control = RouterControl(router, state)
    try:
        view = await control.add_backend(BackendSpec(second.name, second.url))
        assert (view.name, view.state) == (second.name, "active")
        saved = state.load()
        assert saved is not None
        assert [b.name for b in saved.backends] == [first.name, second.name]
        with broken(directory):
            with pytest.raises(NotSaved, match="state"):
                await control.add_backend(BackendSpec("third", "http://127.0.0.1:9"))
            with pytest.raises(NotSaved):
                await control.update_backend(second.name, BackendPatch(weight=5))
            with pytest.raises(NotSaved):
                await control.remove_backend(second.name, timeout=WAIT, wait=True)
        # Nothing of the three changes was made.
        assert sorted(router.fleet.backends) == sorted([first.name, second.name])
        assert router.fleet.backends[second.name].weight == 1
        assert router.fleet.backends[second.name].available
        saved = state.load()
        assert saved is not None
        assert [(b.name, b.weight, b.state) for b in saved.backends] == [
            (first.name, 1, "active"),
            (second.name, 1, "active"),
        ]
    finally:
        await control.close()


async def test_a_drain_waits_for_the_last_request_then_removes_the_backend(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend, other = await backends(hold), await backends()
    router = await start_router([backend.spec], health={"active": False})
    control = RouterControl(router)
    try:
        async with connect(router) as client:
            await client.send(req(b"GET", b"/held"))
            await backend.wait_for(lambda: len(backend.requests) == 1)
            await control.add_backend(BackendSpec(other.name, other.url))
            view = await control.remove_backend(backend.name, timeout=WAIT, wait=False)
            assert (view.state, view.in_flight) == ("draining", 1)
            removed = asyncio.create_task(
                control.remove_backend(backend.name, timeout=WAIT, wait=True)
            )
            # A whole request through the router meanwhile (to the other backend:
            # a draining one gets none) gives the drain every chance to end early.
            await still_serves(router, other)
            assert backend.name in router.fleet.backends  # the held request keeps it
            assert not router.fleet.backends[backend.name].available
            backend.release.set()
            assert (await client.response()).status == 200
            async with asyncio.timeout(WAIT):
                done = await removed
        assert (done.state, done.forced) == ("removed", False)
        assert backend.name not in router.fleet.backends
    finally:
        await control.close()


# -- when the state file cannot be written: a real process -----------------------------


async def test_a_state_file_write_failing_as_a_drain_ends_is_reported_and_shutdown_is_clean(
    backends: Callable[..., Awaitable[Backend]], tmp_path: Path
) -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def held(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        started.set()
        await release.wait()
        return await echo(backend, seen, writer)

    backend = await backends(held)
    directory = tmp_path / "state"
    directory.mkdir()
    state = directory / "state.json"
    flags = ("--state-file", str(state), "--no-health-checks", "--backend", f"b={backend.url}")
    async with serving(*flags) as (proc, port):
        async with aiohttp.ClientSession() as http:
            request = asyncio.create_task(
                http.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "x"})
            )
            async with asyncio.timeout(WAIT):
                await started.wait()  # in flight at b: the drain waits for it
            # The DELETE that starts the drain waits for its end.
            waiting = asyncio.create_task(
                admin_call(http, proc, "DELETE", "/admin/backends/b?wait=true")
            )
            async with asyncio.timeout(WAIT):
                # Each GET is a round trip; "draining" once the file says so, and
                # then the DELETE is waiting (nothing awaits between the two).
                while await state_of(http, proc, "b") != "draining":
                    pass
            assert b'"draining"' in state.read_bytes()
            with broken(directory):
                release.set()  # the drain ends, and its write fails
                async with asyncio.timeout(WAIT):
                    status, body = await waiting
                    resp = await request
                    assert resp.status == 200
                    resp.release()
                assert status == 500, body
                message = body["error"]["message"]  # type: ignore[index]
                assert str(state) in message
                assert "not a directory" in message
                assert "stays draining" in message
                # Consistent: the file (untouched) and the router both say draining.
                assert await state_of(http, proc, "b") == "draining"
                # A new drain cannot even start while the file cannot be written.
                status, body = await admin_call(http, proc, "DELETE", "/admin/backends/b?wait=true")
                assert status == 500
                assert str(state) in body["error"]["message"]  # type: ignore[index]
            assert b'"draining"' in state.read_bytes()
            # Storage back: a DELETE retries the removal, and it goes through.
            status, body = await admin_call(http, proc, "DELETE", "/admin/backends/b?wait=true")
            assert (status, body["state"]) == (200, "removed")
            assert b'"b"' not in state.read_bytes()
        rest = await stop(proc)  # exit 0
        assert b"Traceback" not in rest


async def test_a_symlinked_state_file_is_written_through_to_its_target(
    backends: Callable[..., Awaitable[Backend]], tmp_path: Path
) -> None:
    backend = await backends()
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "state.json"
    link = tmp_path / "state.json"
    link.symlink_to(target)  # dangling until the first save
    async with serving("--state-file", str(link), "--no-health-checks") as (proc, _):
        async with aiohttp.ClientSession() as http:
            for name in ("a", "b"):
                status, _ = await admin_call(
                    http, proc, "POST", "/admin/backends", {"name": name, "url": backend.url}
                )
                assert status == 201
        assert link.is_symlink()
        assert b'"b"' in target.read_bytes()
        assert os.listdir(target.parent) == ["state.json"]  # no temporary file left
        await stop(proc)


async def test_a_missing_state_directory_is_named_at_start_up_and_by_the_admin_api(
    backends: Callable[..., Awaitable[Backend]], tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere" / "state.json"
    code, err = await serve_exit("--listen", "127.0.0.1:0", "--admin-listen", "off",
                                 "--state-file", str(missing))  # fmt: skip
    assert code == 2, err
    assert f"its directory {missing.parent} does not exist".encode() in err

    # Gone after start-up: the admin change fails with a 500 that says so, and
    # nothing changes.
    backend = await backends()
    directory = tmp_path / "state"
    directory.mkdir()
    flags = ("--state-file", str(directory / "state.json"), "--no-health-checks")
    async with serving(*flags) as (proc, _):
        async with aiohttp.ClientSession() as http:
            directory.rmdir()
            body: Any
            status, body = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": "a", "url": backend.url}
            )
            assert status == 500
            assert body["error"] == {
                "message": f"cannot write state file {directory / 'state.json'}: its directory"
                f" {directory} does not exist",
                "type": "internal_error",
            }
            status, body = await admin_call(http, proc, "GET", "/admin/backends")
            assert (status, body) == (200, [])
        await stop(proc)


# -- a backend that is the router itself --------------------------------------------


@pytest.fixture
async def own_admin(start_router: StartRouter) -> AsyncIterator[tuple[Router, int, str]]:
    """A router on 127.0.0.1 with its admin API (both on ephemeral ports): the
    router, its admin port and the admin base URL."""
    router = await start_router([], health={"active": False})
    control = RouterControl(router)
    server = AdminServer(control, token=None)
    await server.start("127.0.0.1", 0)
    control.admin_listeners = server.listeners
    try:
        yield router, server.port, f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()
        await control.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    ("url", "listener"),
    [
        ("http://127.0.0.1:{router}", "client listener 127.0.0.1:{router}"),
        ("http://localhost:{router}/", "client listener 127.0.0.1:{router}"),
        ("http://[::ffff:127.0.0.1]:{router}", "client listener 127.0.0.1:{router}"),
        ("http://0.0.0.0:{router}", "client listener 127.0.0.1:{router}"),
        ("http://127.0.0.1:{admin}", "admin listener 127.0.0.1:{admin}"),
        ("http://LOCALHOST:{admin}", "admin listener 127.0.0.1:{admin}"),
    ],
)
async def test_a_backend_at_one_of_the_routers_own_listeners_is_refused(
    own_admin: tuple[Router, int, str], url: str, listener: str
) -> None:
    router, admin, base = own_admin
    ports = {"router": router.port, "admin": admin}
    spec = {"name": "me", "url": url.format(**ports)}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{base}/admin/backends", json=spec) as resp,
    ):
        assert resp.status == 422
        error = (await resp.json())["error"]
    assert error["type"] == "validation_error"
    assert error["fields"][0]["path"] == "$.url"
    assert (
        f"backend 'me' ({spec['url']}) is this router's own {listener.format(**ports)}"
        in (error["message"])
    )
    assert router.fleet.backends == {}


async def test_other_ports_and_other_loopback_addresses_are_not_the_router(
    own_admin: tuple[Router, int, str],
) -> None:
    router, _, base = own_admin
    others = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.2:{router.port}"]
    async with aiohttp.ClientSession() as http:
        for i, url in enumerate(others):
            spec = {"name": f"other-{i}", "url": url}
            async with http.post(f"{base}/admin/backends", json=spec) as resp:
                assert resp.status == 201, await resp.text()
    assert sorted(router.fleet.backends) == ["other-0", "other-1"]


async def test_a_url_another_backend_has_is_added_with_a_warning_naming_it(
    own_admin: tuple[Router, int, str],
) -> None:
    # Not refused: tests and benchmarks (bench_stall's adds) put many names in front
    # of one server on purpose.  Told apart by host and port, as the fleet holds them.
    router, _, base = own_admin
    port = free_port()
    specs = [
        {"name": "a", "url": f"http://127.0.0.1:{port}"},
        {"name": "b", "url": f"http://127.0.0.1:{port}/"},
        {"name": "c", "url": f"http://127.0.0.1:{port + 1 if port < 65535 else port - 1}"},
    ]
    with capture_logs() as logs:
        async with aiohttp.ClientSession() as http:
            for spec in specs:
                async with http.post(f"{base}/admin/backends", json=spec) as resp:
                    assert resp.status == 201, await resp.text()
    warnings = [e for e in logs if e["event"] == "backend url already used"]
    assert warnings == [
        {
            "event": "backend url already used",
            "log_level": "warning",
            "component": "admin",
            "backend": "b",
            "url": f"http://127.0.0.1:{port}/",
            "by": ["a"],
        }
    ]
    assert sorted(router.fleet.backends) == ["a", "b", "c"]


def reserved_port() -> socket.socket:
    """A socket holding a 127.0.0.1 port without listening: SO_REUSEADDR lets the
    router bind and listen on the same port, and no one else can take it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


async def test_a_backend_at_one_of_the_routers_own_listeners_stops_start_up(
    tmp_path: Path,
) -> None:
    with reserved_port() as client, reserved_port() as admin:
        listen = f"127.0.0.1:{client.getsockname()[1]}"
        admin_listen = f"127.0.0.1:{admin.getsockname()[1]}"
        flags = ("--listen", listen, "--admin-listen", admin_listen)
        code, err = await serve_exit(
            *flags, "--backend", f"loop=http://localhost:{client.getsockname()[1]}"
        )
        assert code == 2, err
        assert b"invalid configuration: backend 'loop'" in err
        assert f"own client listener {listen}".encode() in err
        code, err = await serve_exit(*flags, "--backend", f"adm=http://{admin_listen}")
        assert code == 2, err
        assert f"backend 'adm' (http://{admin_listen}) is this router's own admin".encode() in err
        # From the state file, which wins over the flags: it is named.
        state = tmp_path / "state.json"
        state.write_text(
            json.dumps(
                {
                    "version": 1,
                    "backends": [{"name": "saved", "url": f"http://{listen}"}],
                    "RoutingConfig": {},
                }
            )
        )
        code, err = await serve_exit(*flags, "--state-file", str(state))
        assert code == 2, err
        assert b"backend 'saved'" in err
        assert f"backends come from the state file {state}".encode() in err
        assert b"Traceback" not in err
