"""``prefix-router serve`` as users run it: a real process, flags, config file, signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from structlog.testing import capture_logs

from admin.cli import config_from_args, main
from router.config import ConfigError, Strategy
from router.log import configure, get_logger
from tests.harness.processes import ROOT, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet


def parse(argv: list[str]):  # type: ignore[no-untyped-def]
    import argparse

    from admin.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(["serve", *argv]))


HANDOVER_ETCD = ["--handover-socket", "/tmp/h.sock", "--etcd", "http://127.0.0.1:2379"]


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--prefix-length", "100"], "PrefixLength"),
        (["--concurrency-threshold", "0"], "ConcurrencyThreshold"),
        (["--concurrency-threshold", "2000"], "ConcurrencyThreshold"),
        (["--balance-factor", "0.5"], "BalanceFactor"),
        (["--strategy", "ROUND_ROBIN"], "RoutingStrategy"),
        (["--backend", "a=ftp://x:1"], "backends[0]"),
        (["--backend", "bad name=http://x:1"], "backends[0].name"),
        (["--backend", "a=http://x:0"], "port from 1 to 65535"),
        (["--backend", "a=http://user:pw@x:1"], "credentials"),
        (["--backend", "a=http://x y:1"], "spaces"),
        (["--listen", "nowhere"], "listen"),
        (["--routing-config", '{"RoutingConfig": {"Typo": 1}}'], "Typo"),
        (["--backend", "a=http://x:1,model=m,model=m"], "lists a model twice"),
        (["--backend", "a=http://x:1,model=a b"], "backends[0].models[0]"),
        (["--discover", "dns:vllm:80", "--k8s-model-label", "model"], "model_label"),
        # Checked back to back (~900 checks a second per backend): a floor of 0.05 s.
        (["--health-interval", "1e-9"], ">= 0.05 - at `$.health.interval`"),
        (["--health-interval", "0.049"], ">= 0.05 - at `$.health.interval`"),
        (["--scrape-interval", "0.001"], ">= 0.05 - at `$.health.scrape_interval`"),
        # The other loops' periods: 0.01 s.
        (["--discover", "dns:vllm:80", "--discover-interval", "1e-9"], "$.discover.interval"),
        # A handover: the UDP rows' port is not passed on; one etcd row for two processes.
        ([*HANDOVER_ETCD, "--replica-listen", "127.0.0.1:7946"], "with replica_listen"),
        ([*HANDOVER_ETCD, "--replica-id", "r1"], "handover_socket with a fixed replica_id"),
    ],
)
def test_bad_settings_exit_2_naming_the_field(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err
    assert field in err


@pytest.mark.parametrize("where", ["missing/dir/access.log", "."])
def test_an_access_log_that_cannot_be_opened_exits_2_naming_it(
    tmp_path: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, a Python traceback from deep in the start-up and exit 1.
    target = str(tmp_path / where)
    assert main(["serve", "--backend", "a=http://127.0.0.1:9", "--access-log", target]) == 2
    err = capsys.readouterr().err
    assert f"invalid configuration: cannot open access_log {target!r}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("toml", "field", "floor"),
    [
        # The health checks' period and timeout: 0.05 s.
        ("[health]\ntimeout = 0.001", "$.health.timeout", "0.05"),
        ("[health]\ninterval = 0", "$.health.interval", "0.05"),
        ('backends = [{name = "a", url = "http://x:1", health = {interval = 1e-9}}]',
         "$.backends[0].health.interval", "0.05"),
        ('backends = [{name = "a", url = "http://x:1", health = {timeout = 0.01}}]',
         "$.backends[0].health.timeout", "0.05"),
        # The other loops' periods: 0.01 s.
        ("[health]\nbackoff_initial = 1e-9", "$.health.backoff_initial", "0.01"),
        ("[health]\nbackoff_max = 0.001", "$.health.backoff_max", "0.01"),
        ('[otel]\nendpoint = "http://127.0.0.1:4318"\nexport_interval = 1e-9',
         "$.otel.export_interval", "0.01"),
    ],
)  # fmt: skip
def test_periods_below_their_floor_exit_2_naming_the_field(
    tmp_path: Path, toml: str, field: str, floor: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "router.toml"
    config.write_text(toml + "\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert f">= {floor} - at `{field}`" in capsys.readouterr().err


def test_health_periods_at_the_floor_are_taken() -> None:
    config = parse(["--health-interval", "0.05", "--scrape-interval", "0.05"])
    assert (config.health.interval, config.health.scrape_interval) == (0.05, 0.05)


def test_models_from_the_backend_and_discovery_flags() -> None:
    config = parse(["--backend", "a=http://x:1,weight=3,model=org/m-1,model=m-2"])
    assert (config.backends[0].weight, config.backends[0].models) == (3, ("org/m-1", "m-2"))
    k8s = ["--discover", "k8s", "--k8s-selector", "app=llm", "--k8s-model-label", "model"]
    config = parse([*k8s, "--discover-model", "m-1", "--discover-model", "m-2"])
    assert config.discover is not None
    assert (config.discover.models, config.discover.model_label) == (("m-1", "m-2"), "model")


def test_config_file_then_flags(tmp_path: Path) -> None:
    config = tmp_path / "router.toml"
    config.write_text(
        """
listen = "127.0.0.1:9000"
retries = 1
backends = [
  {name = "a", url = "http://127.0.0.1:8001", weight = 2},
  {name = "b", url = "http://127.0.0.1:8002"},
]

[RoutingConfig]
RoutingStrategy = "PREFIX_AWARE"
PrefixAwareRoutingConfig = {PrefixLength = 8192, ConcurrencyThreshold = 4}

[timeouts]
first_byte = 60
"""
    )
    from_file = parse(["--config", str(config)])
    assert from_file.listen == "127.0.0.1:9000"
    assert [(b.name, b.weight) for b in from_file.backends] == [("a", 2), ("b", 1)]
    assert from_file.routing.prefix_aware.prefix_length == 8192
    assert from_file.timeouts.first_byte == 60
    overridden = parse(
        ["--config", str(config), "--concurrency-threshold", "7", "--strategy", "least"]
    )
    assert overridden.routing.prefix_aware.concurrency_threshold == 7
    assert overridden.routing.prefix_aware.prefix_length == 8192  # kept from the file
    assert overridden.routing.strategy is Strategy.LEAST_OUTSTANDING_REQUESTS
    extended = parse(
        ["--config", str(config), "--balance-mode", "TRAFFIC", "--concurrency-scope", "PREFILL"]
    )
    assert extended.routing.prefix_aware.balance_mode == "TRAFFIC"
    assert extended.routing.prefix_aware.concurrency_scope == "PREFILL"
    inline = parse(
        [
            "--routing-config",
            '{"RoutingConfig": {"RoutingStrategy": "RANDOM"}}',
            "--prefix-length",
            "2048",
        ]
    )
    assert inline.routing.strategy is Strategy.RANDOM
    assert inline.routing.prefix_aware.prefix_length == 2048
    config.write_text("listen = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse(["--config", str(config)])


async def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0(sim_fleet: SimFleet) -> None:
    sims = await sim_fleet(1, extra_token_s=0.02)
    proc, port = await spawn_router("--backend", f"{sims[0].name}={sims[0].url}")
    try:
        async with aiohttp.ClientSession() as http:
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": "tell me a story"}],
                "stream": True,
                "max_tokens": 40,
            }
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                first = await resp.content.readline()
                assert first.startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                rest = await resp.content.read()
            assert rest.rstrip().endswith(b"data: [DONE]")  # finished, not cut
            async with asyncio.timeout(20):
                assert await proc.wait() == 0
            with pytest.raises(aiohttp.ClientConnectorError):
                await http.get(f"http://127.0.0.1:{port}/v1/models")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_the_state_file_brings_back_membership_and_routing_after_a_restart(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    sims = await sim_fleet(3)
    state = tmp_path / "state.json"
    flags = ["--state-file", str(state), "--no-health-checks"]
    proc, _ = await spawn_router(
        *flags, "--backend", f"sim-0={sims[0].url}", "--backend", f"sim-1={sims[1].url}"
    )
    try:
        async with aiohttp.ClientSession() as http:
            status, _ = await admin_call(
                http, proc, "POST", "/admin/backends", {"name": "sim-2", "url": sims[2].url}
            )
            assert status == 201
            assert state.exists()  # written before the 201
            status, _ = await admin_call(
                http, proc, "PATCH", "/admin/backends/sim-0", {"weight": 2}
            )
            assert status == 200
            status, _ = await admin_call(
                http, proc, "PATCH", "/admin/backends/sim-1", {"state": "draining"}
            )
            assert status == 200
            routing = {
                "RoutingConfig": {
                    "RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS",
                    "PrefixAwareRoutingConfig": {"PrefixLength": 8192, "ConcurrencyThreshold": 5},
                }
            }
            status, _ = await admin_call(http, proc, "PUT", "/admin/routing", routing)
            assert status == 200
        await stop(proc)
        # Restarted with other flags: the state file wins for backends and routing.
        proc, port = await spawn_router(
            *flags, "--backend", f"other={sims[0].url}", "--strategy", "random"
        )
        async with aiohttp.ClientSession() as http:
            status, backends = await admin_call(http, proc, "GET", "/admin/backends")
            assert status == 200
            assert [(b["name"], b["weight"], b["state"]) for b in backends] == [  # type: ignore[attr-defined]
                ("sim-0", 2, "active"),
                ("sim-1", 1, "draining"),
                ("sim-2", 1, "active"),
            ]
            status, saved_routing = await admin_call(http, proc, "GET", "/admin/routing")
            assert saved_routing["RoutingConfig"]["RoutingStrategy"] == "LEAST_OUTSTANDING_REQUESTS"  # type: ignore[index]
            assert (
                saved_routing["RoutingConfig"]["PrefixAwareRoutingConfig"]["ConcurrencyThreshold"]
                == 5
            )  # type: ignore[index]
            async with http.post(
                f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 1}
            ) as resp:
                assert resp.status == 200
                assert resp.headers["x-sim-instance"] in ("sim-0", "sim-2")  # not the draining one
    finally:
        if proc.returncode is None:
            await stop(proc)


async def test_a_corrupt_state_file_stops_start_up_and_is_left_alone(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_bytes(b'{"version": 1, "backends": [{"name": "a"')
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admin", "serve", "--listen", "127.0.0.1:0",
        "--admin-listen", "off", "--state-file", str(state),
        cwd=ROOT, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    async with asyncio.timeout(20):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"corrupt" in err
    assert str(state).encode() in err
    assert state.read_bytes() == b'{"version": 1, "backends": [{"name": "a"'


def test_the_admin_api_off_loopback_needs_a_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFIX_ROUTER_ADMIN_TOKEN", raising=False)
    assert main(["serve", "--admin-listen", "0.0.0.0:9091"]) == 2
    assert "not on loopback: give it a token" in capsys.readouterr().err


async def test_admin_token_is_required_and_never_logged(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    sims = await sim_fleet(1)
    token = "tok-" + os.urandom(8).hex()
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    proc, _ = await spawn_router(
        "--admin-token-file", str(token_file), "--backend", f"sim-0={sims[0].url}"
    )
    try:
        async with aiohttp.ClientSession() as http:
            status, body = await admin_call(http, proc, "GET", "/admin/backends")
            assert status == 401
            status, body = await admin_call(http, proc, "GET", "/admin/backends", token="wrong")
            assert status == 401
            assert token not in str(body)
            status, _ = await admin_call(http, proc, "GET", "/admin/backends", token=token)
            assert status == 200
            status, _ = await admin_call(
                http,
                proc,
                "POST",
                "/admin/backends",
                {"name": "x", "url": "http://127.0.0.1:9"},
                token=token,
            )
            assert status == 201
    finally:
        logged = await stop(proc)
    assert token.encode() not in logged


async def test_seed_replays_the_random_strategy_picks(sim_fleet: SimFleet, tmp_path: Path) -> None:
    """--seed makes RANDOM reproducible: what lets a benchmark's live run and the
    offline simulator see the same draws."""
    sims = await sim_fleet(3)
    backends = [arg for sim in sims for arg in ("--backend", f"{sim.name}={sim.url}")]

    async def picks(seed: str, run: str) -> list[str]:
        log = tmp_path / f"access-{run}.log"
        flags = ["--strategy", "random", "--seed", seed, "--no-health-checks"]
        proc, port = await spawn_router(*backends, *flags, "--access-log", str(log))
        url = f"http://127.0.0.1:{port}/v1/completions"
        try:
            async with aiohttp.ClientSession() as http:
                for i in range(40):
                    body = {"prompt": f"request {i}", "max_tokens": 1}
                    async with http.post(url, json=body) as resp:
                        assert resp.status == 200
                        await resp.read()
        finally:
            await stop(proc)
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        return [line["backend"] for line in lines if line["event"] == "access"]

    first = await picks("7", "a")
    assert len(first) == 40
    assert len(set(first)) == 3
    assert await picks("7", "b") == first
    assert await picks("8", "c") != first


def test_logging_is_configured_once_so_log_capture_sees_every_logger() -> None:
    # main() configures logging; run twice in one process (as this suite does), a
    # second configure gave structlog a new processor list and the loggers cached
    # under the first were lost to capture_logs (two tests failed by xdist order).
    log = get_logger("cli-test")
    configure()
    log.info("cached now")
    configure()
    with capture_logs() as logs:
        log.warning("seen")
    assert [e["event"] for e in logs] == ["seen"]
