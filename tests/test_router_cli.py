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

from router.cli import config_from_args, main
from router.config import ConfigError, Strategy
from tests.conftest import SimFleet

ROOT = Path(__file__).resolve().parent.parent


async def spawn_router(*args: str) -> tuple[asyncio.subprocess.Process, int]:
    """Start ``python -m router serve ARGS`` and return it with its port."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--access-log",
        "off",
        *args,
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stderr is not None
    async with asyncio.timeout(20):
        while True:
            line = await proc.stderr.readline()
            assert line, "router exited before listening"
            event = json.loads(line)
            if event["event"] == "listening":
                return proc, int(event["address"].rpartition(":")[2])


def parse(argv: list[str]):  # type: ignore[no-untyped-def]
    import argparse

    from router.cli import _serve_parser

    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="command"))
    return config_from_args(parser.parse_args(["serve", *argv]))


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--prefix-length", "100"], "PrefixLength"),
        (["--concurrency-threshold", "0"], "ConcurrencyThreshold"),
        (["--concurrency-threshold", "2000"], "ConcurrencyThreshold"),
        (["--balance-factor", "0.5"], "BalanceFactor"),
        (["--strategy", "ROUND_ROBIN"], "RoutingStrategy"),
        (["--backend", "a=https://x:1"], "backends[0]"),
        (["--backend", "bad name=http://x:1"], "backends[0].name"),
        (["--listen", "nowhere"], "listen"),
        (["--routing-config", '{"RoutingConfig": {"Typo": 1}}'], "Typo"),
    ],
)
def test_bad_settings_exit_2_naming_the_field(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err
    assert field in err


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
