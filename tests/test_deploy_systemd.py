"""The systemd unit (``deploy/systemd/``), checked offline and run as systemd would run it.

- ``systemd-analyze verify`` accepts the unit without a warning (a misspelt key or
  one in the wrong section is a warning), and ``systemd-analyze security
  --offline`` rates its exposure at most ``MAX_EXPOSURE`` (skipped, with the
  reason, where systemd-analyze is not installed).
- What the unit says of the router holds: ExecStart is ``prefix-router serve``
  with the shipped config (a valid one) and a state file inside the unit's
  StateDirectory; ExecReload sends SIGHUP and KillSignal is SIGTERM (the router's
  reload and drain); TimeoutStopSec outlasts the drain; the descriptor limit is set;
  Type=notify with NotifyAccess=all and a handover socket in its RuntimeDirectory
  (SIGUSR2 upgrades in place: tests/test_handover.py).
- ExecStart's flags, run as a real process (paths moved to a temporary
  directory, listeners on ephemeral loopback ports): it serves, a backend added
  through the admin API survives the reload signal and the stop signal, and the
  next start takes it from the state file.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import aiohttp
import pytest

from router.config import build_config, load_toml
from tests.harness.processes import ROOT, admin_call, spawn_router, stop

UNIT = ROOT / "deploy" / "systemd" / "prefix-router.service"
CONFIG = ROOT / "deploy" / "systemd" / "config.toml"
BINARY = "/opt/prefix-router/bin/prefix-router"
MAX_EXPOSURE = 2.0  # systemd's scale: 0 (locked down) .. 10 (unprotected)


def directives() -> dict[str, list[str]]:
    """``Section.Key`` -> its values in order (systemd keys may repeat)."""
    found: dict[str, list[str]] = {}
    section = ""
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.setdefault(f"{section}.{key}", []).append(value)
    return found


def the(key: str) -> str:
    (value,) = directives()[key]
    return value


def exec_start() -> list[str]:
    return shlex.split(the("Service.ExecStart"))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def analyzable(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's command (verify wants it to exist)."""
    command = shutil.which("prefix-router") or str(Path(ROOT / ".venv" / "bin" / "prefix-router"))
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(BINARY, command))
    return unit


def names(backends: object) -> list[str]:
    assert isinstance(backends, list)
    return [backend["name"] for backend in backends]


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    return found


def test_systemd_analyze_verifies_the_unit_without_a_warning(tmp_path: Path) -> None:
    done = subprocess.run(
        [systemd_analyze(), "verify", str(analyzable(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr


def test_the_unit_is_hardened(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            systemd_analyze(),
            "security",
            "--offline=true",
            f"--threshold={int(MAX_EXPOSURE * 10)}",
            "--no-pager",
            str(analyzable(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
    assert "Overall exposure level" in done.stdout


def test_the_unit_runs_serve_with_the_shipped_config_and_a_state_file_it_may_write() -> None:
    argv = exec_start()
    assert argv[:2] == [BINARY, "serve"]
    assert flag(argv, "--config") == "/etc/prefix-router/" + CONFIG.name
    assert the("Service.ConfigurationDirectory") == "prefix-router"
    # ProtectSystem=strict leaves only the StateDirectory writable.
    assert the("Service.ProtectSystem") == "strict"
    state = Path(flag(argv, "--state-file"))
    assert state.parent == Path("/var/lib") / the("Service.StateDirectory")
    config = build_config(load_toml(CONFIG))
    assert config.routing.strategy.value == "PREFIX_AWARE"
    assert [backend.name for backend in config.backends] == ["vllm-0", "vllm-1"]


def test_reload_stop_restart_and_limits_match_the_router() -> None:
    assert the("Service.ExecReload") == "/bin/kill -HUP $MAINPID"
    # Ready once it listens; an upgrade's new process (SIGUSR2) becomes the main one.
    assert (the("Service.Type"), the("Service.NotifyAccess")) == ("notify", "all")
    handover = Path(flag(exec_start(), "--handover-socket"))
    assert handover.parent == Path("/run") / the("Service.RuntimeDirectory")
    assert the("Service.KillSignal") == "SIGTERM"
    assert the("Service.Restart") == "on-failure"
    config = build_config(load_toml(CONFIG))
    assert float(the("Service.TimeoutStopSec")) > config.timeouts.shutdown_grace
    assert int(the("Service.LimitNOFILE")) >= 65536
    assert the("Service.NoNewPrivileges") == "yes"
    assert the("Service.DynamicUser") == "yes"


async def test_exec_start_serves_reloads_stops_and_restarts_from_its_state_file(
    tmp_path: Path,
) -> None:
    config = tmp_path / CONFIG.name
    # The shipped config's backends are examples on a private network: keep the
    # rest of the file, start with none.
    text = CONFIG.read_text()
    start, end = text.index("backends = ["), text.index("]\n", text.index("backends = [")) + 2
    config.write_text(text[:start] + "backends = []\n" + text[end:])
    state = tmp_path / "state.json"
    argv = exec_start()
    argv[argv.index("--config") + 1] = str(config)
    argv[argv.index("--state-file") + 1] = str(state)
    argv[argv.index("--handover-socket") + 1] = str(tmp_path / "handover.sock")
    flags = argv[2:]
    backend = {"name": "gpu-0", "url": "http://127.0.0.1:9/"}

    async with aiohttp.ClientSession() as http:
        proc, _ = await spawn_router(*flags)
        try:
            status, _ = await admin_call(http, proc, "POST", "/admin/backends", backend)
            assert status == 201
            proc.send_signal(signal.SIGHUP)  # systemctl reload
            assert proc.stderr is not None
            async with asyncio.timeout(20):
                while b'"config reloaded"' not in (line := await proc.stderr.readline()):
                    assert line, "the router exited on SIGHUP"
            status, _ = await admin_call(http, proc, "GET", "/healthz")
            assert status == 200
            status, listed = await admin_call(http, proc, "GET", "/admin/backends")
            assert status == 200
            assert names(listed) == ["gpu-0"]
        finally:
            await stop(proc)  # systemctl stop: SIGTERM, exit 0
        assert state.exists()

        proc, _ = await spawn_router(*flags)  # Restart= or the next boot
        try:
            status, listed = await admin_call(http, proc, "GET", "/admin/backends")
            assert names(listed) == ["gpu-0"]
        finally:
            await stop(proc)
