"""The control plane when its storage fails, and what it refuses to be told.

Each test runs ``prefix-router serve`` as a real process (``spawn_router``) and
breaks its state file for real, in a way that stops root too (the tests run as
root, where permissions stop nothing): the state file's directory is moved away
and a regular file put in its place, so the next write fails with ENOTDIR.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from tests.test_router_cli import ROOT, admin_call, spawn_router, stop
from tests.test_router_http import Backend, Seen, echo

WAIT = 10.0


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
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "serve", "--listen", "127.0.0.1:0",
        "--admin-listen", "off", "--state-file", str(missing),
        cwd=ROOT, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    async with asyncio.timeout(WAIT):
        _, err = await proc.communicate()
    assert proc.returncode == 2
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
