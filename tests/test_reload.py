"""Config operations: ``prefix-router check-config FILE`` and SIGHUP reloads.

The reload tests run the real daemon with ``--config FILE``, rewrite the file
and send SIGHUP, as an operator does, while clients keep sending requests.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec
import pytest

from admin.reload import Reloads
from router.config import Config
from router.control.configview import ConfigSource
from tests.harness.backends import Backend, StartBackend, echo, hold
from tests.harness.http import WAIT
from tests.harness.processes import ADMIN_PORTS, ROOT, admin_call, spawn_router, stop

pytestmark = pytest.mark.timeout(120)


def toml(*backends: Backend, threshold: int = 10, first_byte: float = 300.0) -> str:
    lines = [
        "[timeouts]",
        f"first_byte = {first_byte}",
        "[health]",
        "active = false",
        "passive_failures = 100",  # the 504s below must not mark the silent one down
        "[RoutingConfig]",
        'RoutingStrategy = "PREFIX_AWARE"',
        "[RoutingConfig.PrefixAwareRoutingConfig]",
        f"ConcurrencyThreshold = {threshold}",
    ]
    for backend in backends:
        lines += ["[[backends]]", f'name = "{backend.name}"', f'url = "{backend.url}"']
    return "\n".join(lines) + "\n"


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "admin", "check-config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- check-config --------------------------------------------------------------------


def test_check_config_accepts_a_valid_file_and_names_the_field_of_an_invalid_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "router.toml"
    path.write_text(
        '[[backends]]\nname = "a"\nurl = "http://127.0.0.1:8000"\n'
        '[RoutingConfig]\nRoutingStrategy = "PREFIX_AWARE"\n'
    )
    done = check_config(path)
    assert (done.returncode, done.stderr) == (0, "")
    assert "ok: 1 backends, PREFIX_AWARE" in done.stdout

    path.write_text('[timeouts]\nconnect = "soon"\n')
    done = check_config(path)
    assert done.returncode == 2
    assert "$.timeouts.connect" in done.stderr  # the field path

    path.write_text("[RoutingConfig.PrefixAwareRoutingConfig]\nConcurrencyThreshold = 0\n")
    done = check_config(path)
    assert done.returncode == 2
    assert "$.RoutingConfig.PrefixAwareRoutingConfig.ConcurrencyThreshold" in done.stderr

    path.write_text('listen = "nowhere"\n')
    assert check_config(path).returncode == 2
    path.write_text("not = [toml\n")
    assert check_config(path).returncode == 2
    assert check_config(tmp_path / "missing.toml").returncode == 2


# -- SIGHUP ----------------------------------------------------------------------------


async def logged(proc: asyncio.subprocess.Process, event: str) -> dict[str, object]:
    """Read the daemon's log until ``event`` (the reload's own report of its end)."""
    assert proc.stderr is not None
    async with asyncio.timeout(WAIT):
        while True:
            line = await proc.stderr.readline()
            assert line, f"router exited before logging {event!r}"
            record = json.loads(line)
            if record["event"] == event:
                return record  # type: ignore[no-any-return]


@pytest.mark.parametrize("workers", [1, 2])
async def test_sighup_reloads_backends_routing_and_timeouts_under_load_without_a_failure(
    backends: StartBackend, tmp_path: Path, workers: int
) -> None:
    a, b, c = await backends(echo), await backends(echo), await backends(echo)
    slow = await backends(hold)  # never answers until released: shows first_byte
    config = tmp_path / "router.toml"
    config.write_text(toml(a, b, slow))
    proc, port = await spawn_router("--config", str(config), "--workers", str(workers))
    statuses: list[int] = []
    stopping = asyncio.Event()
    waiting: list[tuple[int, asyncio.Future[None]]] = []

    def answered(count: int) -> asyncio.Future[None]:
        """Done once the load has had ``count`` answers."""
        future = asyncio.get_running_loop().create_future()
        waiting.append((count, future))
        return future

    async def load(http: aiohttp.ClientSession, worker: int) -> None:
        i = 0
        while not stopping.is_set():
            i += 1
            body = f"prompt {worker} {i % 50}"
            async with http.post(f"http://127.0.0.1:{port}/generate", data=body) as resp:
                await resp.read()
                statuses.append(resp.status)
            for count, future in waiting:
                if len(statuses) >= count and not future.done():
                    future.set_result(None)

    try:
        async with aiohttp.ClientSession() as http:
            status, _ = await admin_call(http, proc, "PATCH", f"/admin/backends/{slow.name}",
                                         {"state": "draining"})  # fmt: skip
            assert status == 200  # the load must not reach it: it answers nobody
            loaders = [asyncio.create_task(load(http, i)) for i in range(4)]
            await answered(200)  # traffic on the old config first

            # b goes, c comes, a lower threshold, a short first_byte.
            config.write_text(toml(a, c, slow, threshold=3, first_byte=1.0))
            proc.send_signal(signal.SIGHUP)
            reloaded = await logged(proc, "config reloaded")
            assert reloaded["membership_from_file"] is True
            await answered(len(statuses) + 200)  # and on the new one
            stopping.set()
            await asyncio.gather(*loaders)

            assert set(statuses) == {200}  # not one request failed across the reload
            served_c = len(c.requests)
            assert served_c > 0
            _, routing = await admin_call(http, proc, "GET", "/admin/routing")
            prefix = routing["RoutingConfig"]["PrefixAwareRoutingConfig"]  # type: ignore[index]
            assert prefix["ConcurrencyThreshold"] == 3
            _, views = await admin_call(http, proc, "GET", "/admin/backends")
            states = {v["name"]: v["state"] for v in views}  # type: ignore[union-attr, index]
            assert b.name not in states or states[b.name] == "draining"

            # The new first_byte, in every worker: a request to the silent backend is
            # a 504 after 1 s, not after 300.
            _, _ = await admin_call(http, proc, "PATCH", f"/admin/backends/{slow.name}",
                                    {"state": "active"})  # fmt: skip
            for name in (a.name, c.name):
                await admin_call(http, proc, "PATCH", f"/admin/backends/{name}",
                                 {"state": "draining"})  # fmt: skip
            for i in range(2 * workers):  # connections of their own: each worker's turn
                async with http.post(
                    f"http://127.0.0.1:{port}/generate",
                    data=f"late {i}",
                    headers={"Connection": "close"},
                ) as resp:
                    assert resp.status == 504, await resp.text()
    finally:
        slow.release.set()
        await stop(proc)


async def test_an_invalid_file_changes_nothing_and_a_state_file_keeps_the_backends(
    backends: StartBackend, tmp_path: Path
) -> None:
    a, b = await backends(echo), await backends(echo)
    config = tmp_path / "router.toml"
    config.write_text(toml(a))
    state = tmp_path / "state.json"
    proc, port = await spawn_router("--config", str(config), "--state-file", str(state))
    try:
        async with aiohttp.ClientSession() as http:
            status, _ = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": b.name, "url": b.url}
            )
            assert status == 201

            config.write_text("[timeouts]\nconnect = -1\n")
            proc.send_signal(signal.SIGHUP)
            refused = await logged(proc, "config not reloaded")
            assert "$.timeouts.connect" in str(refused["reason"])

            # The admin API owns the backends when there is a state file (a restart
            # would take them from it too): a reload leaves them, and says what needs
            # a restart.
            config.write_text("vnodes = 512\n" + toml(a, threshold=4))
            proc.send_signal(signal.SIGHUP)
            restart = await logged(proc, "config fields need a restart")
            assert restart["fields"] == ["vnodes"]
            reloaded = await logged(proc, "config reloaded")
            assert reloaded["membership_from_file"] is False
            _, views = await admin_call(http, proc, "GET", "/admin/backends")
            assert sorted(v["name"] for v in views) == [a.name, b.name]  # type: ignore[index, union-attr]
            async with http.post(f"http://127.0.0.1:{port}/generate", data="x") as resp:
                assert resp.status == 200
    finally:
        await stop(proc)


async def log_until(proc: asyncio.subprocess.Process, event: str) -> list[dict[str, object]]:
    """The daemon's log records up to and including ``event``."""
    assert proc.stderr is not None
    records: list[dict[str, object]] = []
    async with asyncio.timeout(WAIT):
        while not records or records[-1]["event"] != event:
            line = await proc.stderr.readline()
            assert line, f"router exited before logging {event!r}"
            records.append(json.loads(line))
    return records


async def reload(
    proc: asyncio.subprocess.Process, config: Path, text: str
) -> list[dict[str, object]]:
    await asyncio.to_thread(config.write_text, text)
    proc.send_signal(signal.SIGHUP)
    return await log_until(proc, "config reloaded")


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_backend_back_in_the_file_while_its_drain_waits_is_active_again(
    backends: StartBackend, tmp_path: Path, workers: int
) -> None:
    a, b = await backends(echo), await backends(hold)
    config = tmp_path / "router.toml"
    config.write_text(toml(a, b))
    proc, port = await spawn_router("--config", str(config), "--workers", str(workers))
    requests: list[asyncio.Task[int]] = []
    try:
        async with aiohttp.ClientSession() as http:

            async def view() -> dict[str, object]:
                status, body = await admin_call(http, proc, "GET", f"/admin/backends/{b.name}")
                assert status == 200, body
                return body

            async def held() -> int:
                async with http.post(f"http://127.0.0.1:{port}/generate", data="held") as resp:
                    await resp.read()
                    return resp.status

            await admin_call(
                http, proc, "PATCH", f"/admin/backends/{a.name}", {"state": "draining"}
            )
            request = asyncio.create_task(held())  # to b, the one active backend
            requests.append(request)
            await b.wait_for(lambda: len(b.requests) == 1)
            await admin_call(http, proc, "PATCH", f"/admin/backends/{a.name}", {"state": "active"})

            await reload(proc, config, toml(a))  # b gone from the file: its drain waits
            assert (await view())["state"] == "draining"
            assert (await view())["in_flight"] == 1

            await reload(proc, config, toml(a, b))  # and back: the drain is cancelled
            assert (await view())["state"] == "active"
            b.release.set()
            assert await request == 200
            assert (await view())["state"] == "active"  # the cancelled drain removed nothing
    finally:
        b.release.set()
        await stop(proc)
        await asyncio.gather(*requests, return_exceptions=True)  # ended, failed or not


async def test_a_changed_health_override_is_refused_by_a_reload_with_a_warning(
    backends: StartBackend, tmp_path: Path
) -> None:
    a, b = await backends(echo), await backends(echo)
    config = tmp_path / "router.toml"

    def with_health(path: str, weight: int = 1) -> str:
        return toml(a, b) + f'weight = {weight}\nhealth = {{ path = "{path}" }}\n'  # b's

    config.write_text(with_health("/ready"))
    proc, _ = await spawn_router("--config", str(config))
    try:
        records = await reload(proc, config, with_health("/live", weight=3))
        warnings = [r for r in records if r["level"] == "warning"]
        assert len(warnings) == 1, records
        assert warnings[0]["event"] == (
            "backend URL, models or health not changed by a reload: remove it and add a new name"
        )
        warning: Any = warnings[0]
        assert warning["backend"] == b.name
        assert (warning["health"]["path"], warning["file_health"]["path"]) == ("/ready", "/live")
        async with aiohttp.ClientSession() as http:
            _, view = await admin_call(http, proc, "GET", f"/admin/backends/{b.name}")
            assert view["weight"] == 1  # none of the refused entry applies

            records = await reload(proc, config, with_health("/ready", weight=3))
            assert [r for r in records if r["level"] == "warning"] == []
            _, view = await admin_call(http, proc, "GET", f"/admin/backends/{b.name}")
            assert view["weight"] == 3
    finally:
        await stop(proc)


@pytest.mark.parametrize("workers", [1, 2])
async def test_admin_config_shows_the_running_config_its_reloads_and_what_waits_for_a_restart(
    backends: StartBackend, tmp_path: Path, workers: int
) -> None:
    a = await backends(echo)
    config = tmp_path / "router.toml"
    secret = "label-key-that-must-not-leak"
    tenants = f'[tenants]\nlabel_key = "{secret}"\n'
    config.write_text(tenants + toml(a, first_byte=300.0))
    proc, _ = await spawn_router("--config", str(config), "--workers", str(workers))
    try:
        async with aiohttp.ClientSession() as http:

            async def shown() -> dict[str, Any]:
                url = f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/admin/config"
                async with http.get(url) as resp:
                    assert resp.status == 200
                    text = await resp.text()
                assert secret not in text
                return json.loads(text)  # type: ignore[no-any-return]

            view = await shown()
            assert view["file"] == str(config)
            assert view["membership"] == "config"
            assert (view["reloads"], view["last_reload"], view["restart_pending"]) == (0, None, [])
            running = view["config"]
            assert "backends" not in running  # those are /admin/backends
            assert running["tenants"]["label_key"] == "<redacted>"
            assert running["timeouts"]["first_byte"] == 300.0
            assert running["workers"] == workers
            assert running["listen"] == "127.0.0.1:0"  # the flag, over the file
            threshold = running["RoutingConfig"]["PrefixAwareRoutingConfig"]
            assert threshold["ConcurrencyThreshold"] == 10

            # A reload: live fields apply, a listener-level one waits for a restart.
            await asyncio.to_thread(
                config.write_text,
                "vnodes = 512\n"
                + tenants
                + "[limits]\nlisten_backlog = 100\n"  # read at bind only
                + toml(a, threshold=4, first_byte=7.0),
            )
            proc.send_signal(signal.SIGHUP)
            await logged(proc, "config reloaded")
            view = await shown()
            assert view["reloads"] == 1
            assert view["last_reload"]["result"] == "applied"
            pending = ["vnodes", "limits.listen_backlog"]
            assert view["restart_pending"] == view["last_reload"]["restart_pending"] == pending
            running = view["config"]
            assert running["timeouts"]["first_byte"] == 7.0
            assert running["vnodes"] == 1024  # still the running value
            assert running["limits"]["listen_backlog"] == 4096
            assert running["RoutingConfig"]["PrefixAwareRoutingConfig"]["ConcurrencyThreshold"] == 4

            # The admin API changes the RoutingConfig: shown as it is in force.
            routing = {"RoutingConfig": {"PrefixAwareRoutingConfig": {"ConcurrencyThreshold": 6}}}
            status, _ = await admin_call(http, proc, "PUT", "/admin/routing", routing)
            assert status == 200
            running = (await shown())["config"]
            assert running["RoutingConfig"]["PrefixAwareRoutingConfig"]["ConcurrencyThreshold"] == 6

            # An invalid file: recorded with its reason, nothing else changes.
            await asyncio.to_thread(config.write_text, "[timeouts]\nconnect = -1\n")
            proc.send_signal(signal.SIGHUP)
            await logged(proc, "config not reloaded")
            view = await shown()
            assert view["reloads"] == 2
            assert view["last_reload"]["result"] == "invalid"
            assert "$.timeouts.connect" in view["last_reload"]["reason"]
            assert view["restart_pending"] == pending
            assert view["config"]["timeouts"]["first_byte"] == 7.0
    finally:
        await stop(proc)


async def test_a_reload_that_fails_while_applying_still_names_what_waits_for_a_restart() -> None:
    """The file was read and valid, then applying it raised (a bug): its restart
    fields wait all the same, in ``restart_pending`` and the failed reload's view."""

    class Control:
        source = ConfigSource(None, "config", 0.0)

        async def set_settings(self, *_: object) -> None:
            raise RuntimeError("a bug while applying")

    old = Config()
    new = msgspec.structs.replace(
        old, vnodes=512, timeouts=msgspec.structs.replace(old.timeouts, first_byte=7.0)
    )
    control = Control()
    reloads = Reloads(lambda: new, control, SimpleNamespace(config=old), owns_membership=False)  # type: ignore[arg-type]
    reloads.request()
    assert reloads._running is not None
    await reloads._running
    last = control.source.last_reload
    assert last is not None
    assert (last.result, last.restart_pending) == ("failed", ["vnodes"])
    assert control.source.restart_pending == ["vnodes"]
