"""Session keys (issue 14 §2): the affinity key's sources, their precedence, their counts.

The real daemon (``python -m admin serve``) in front of simulated instances, driven
by the official ``openai`` client (``extra_headers`` for the session header,
``extra_body`` for ``prompt_cache_key`` and ``conversation``); which instance
answered is its ``x-sim-instance`` header.  The access log (a file, flushed when
the router stops) and ``/metrics`` show each request's source.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.etcd import EtcdServer
from tests.harness.processes import ADMIN_PORTS, ROOT, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet

pytestmark = pytest.mark.timeout(120)

MODEL = "sim-llama-3.1-70b"
PROMPTS = [f"Question {i}: what does a rocket of class {i} carry?" for i in range(10)]


def fleet_flags(sims: list[Any], *extra: str) -> list[str]:
    flags = ["--no-health-checks", "--seed", "1", *extra]
    for sim in sims:
        flags += ["--backend", f"{sim.name}={sim.url}"]
    return flags


def client(port: int, **options: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, **options
    )


async def chat(
    via: openai.AsyncOpenAI,
    prompt: str,
    headers: dict[str, str] | None = None,
    body: dict[str, Any] | None = None,
) -> Any:
    """One chat completion; its raw response (``x-sim-instance``, ``x-request-id``)."""
    return await via.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=2,
        extra_headers=headers,
        extra_body=body,
    )


async def respond(
    via: openai.AsyncOpenAI,
    prompt: str,
    headers: dict[str, str] | None = None,
    body: dict[str, Any] | None = None,
) -> Any:
    return await via.responses.with_raw_response.create(
        model=MODEL, input=prompt, max_output_tokens=2, extra_headers=headers, extra_body=body
    )


async def key_sources(http: aiohttp.ClientSession, proc: Any) -> dict[str, float]:
    """``prefix_router_routing_key_source_total`` by source, from the admin API's /metrics."""
    async with http.get(f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    counts = {}
    for family in text_string_to_metric_families(text):
        if family.name == "prefix_router_routing_key_source":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["source"]] = sample.value
    return counts


def access_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_a_session_pins_its_requests_and_sources_follow_the_precedence(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    sims = await sim_fleet(4)
    log = tmp_path / "access.jsonl"
    proc, port = await spawn_router(*fleet_flags(sims, "--access-log", str(log)))
    sent: list[tuple[str, str]] = []  # (label, expected source) of each request, in order

    async def send(label: str, source: str, call: Any) -> Any:
        raw = await call
        sent.append((label, source))
        return raw

    try:
        async with client(port) as via, aiohttp.ClientSession() as http:
            # Eight sessions, turns interleaved as users' are, each turn another
            # prompt: every session stays on one instance.  (One session alone
            # carrying all the traffic would be a hot key in TRAFFIC mode and get
            # replicas: bounded loads still apply.)
            where: dict[str, set[str]] = {f"user-{n}": set() for n in range(8)}
            for turn, prompt in enumerate(PROMPTS[:5]):
                for session, seen in where.items():
                    headers = {"X-Session-Id": session}
                    raw = await send(
                        session, "header", chat(via, f"{prompt} ({turn})", headers=headers)
                    )
                    seen.add(raw.headers["x-sim-instance"])
            assert all(len(seen) == 1 for seen in where.values()), where
            assert len({next(iter(seen)) for seen in where.values()}) > 1  # sessions spread
            # Without the header the same prompts are as many keys.
            for prompt in PROMPTS[:5]:
                await send(prompt, "prefix", chat(via, f"{prompt} (0)"))

            # Precedence (the default): prompt_cache_key > header > conversation > prefix.
            both = {"X-Session-Id": "session-2"}
            pck = {"prompt_cache_key": "tenant-1"}
            await send("pck", "prompt_cache_key", chat(via, "a", headers=both, body=pck))
            conv_1 = {"conversation": "conv_1"}
            await send("s2", "header", respond(via, "b", headers=both, body=conv_1))
            conv_1_object = {"conversation": {"id": "conv_1"}}
            await send("conv_1", "conversation", respond(via, "c", body=conv_1_object))
            await send("d", "prefix", respond(via, "d"))
            conv_2 = {"conversation": "conv_2"}
            await send("s2", "header", respond(via, "e", headers=both, body=conv_2))

            # Conversation first (admin API, live): the conversation decides.
            routing = {"PrefixAwareRoutingConfig": {"SessionKeys": ["conversation", "prefix"]}}
            status, _ = await admin_call(http, proc, "PUT", "/admin/routing", routing)
            assert status == 200
            await send("conv_1", "conversation", respond(via, "f", headers=both, body=conv_1))
            await send("conv_2", "conversation", respond(via, "g", headers=both, body=conv_2))
            await send("conv_2", "conversation", respond(via, "h", body=conv_2))
            await send("i", "prefix", chat(via, "i", headers=both))  # no source now

            counts = await key_sources(http, proc)
            sources = [source for _, source in sent]
            assert counts == {
                source: sources.count(source)
                for source in ("prompt_cache_key", "header", "conversation", "prefix")
            }
    finally:
        await stop(proc)
    lines = [line for line in access_lines(log) if line["event"] == "access"]
    assert [line["key_source"] for line in lines] == [source for _, source in sent]
    keys: dict[str, set[str]] = {}
    for (label, _), line in zip(sent, lines, strict=True):
        keys.setdefault(label, set()).add(line["prefix_hash"])
    assert all(len(hashes) == 1 for hashes in keys.values()), keys  # one key per label
    assert len({next(iter(hashes)) for hashes in keys.values()}) == len(keys)  # all distinct


async def test_two_workers_send_a_session_to_one_backend(sim_fleet: SimFleet) -> None:
    """Stateless hashing: each worker computes the same key for a session id.

    IN_FLIGHT mode, so the ring walk alone decides (TRAFFIC placements converge
    through the shared placement log, ``tests/test_workers.py``).  A connection per
    request spreads requests over both workers (``x-request-id``'s prefix tells
    which answered).
    """
    sims = await sim_fleet(4)
    flags = fleet_flags(sims, "--workers", "2", "--balance-mode", "IN_FLIGHT")
    proc, port = await spawn_router(*flags)
    sessions = [f"user-{n}" for n in range(6)]
    try:
        async with (
            client(port, default_headers={"Connection": "close"}) as via,
            aiohttp.ClientSession() as http,
        ):
            where: dict[str, set[str]] = {s: set() for s in sessions}
            workers: dict[str, set[str]] = {s: set() for s in sessions}
            for round_ in range(8):
                for session in sessions:
                    raw = await chat(
                        via, f"{session} asks {round_}", headers={"X-Session-Id": session}
                    )
                    where[session].add(raw.headers["x-sim-instance"])
                    workers[session].add(raw.headers["x-request-id"].partition("-")[0])
            assert all(len(instances) == 1 for instances in where.values()), where
            # 48 connections over two workers: every session crossing none is 2^-42.
            assert any(len(seen) == 2 for seen in workers.values()), workers
            assert len({next(iter(i)) for i in where.values()}) > 1  # sessions do spread
            counts = await key_sources(http, proc)  # the workers' counts, added up
            assert counts["header"] == 8 * len(sessions)
            assert counts["prefix"] == counts["conversation"] == 0
    finally:
        await stop(proc)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--session-keys", "header,conversation"], "must end with prefix"),
        (["--session-keys", "header,user,prefix"], "Invalid enum value 'user'"),
        (["--session-header", "Content-Length"], "a header the router reads or sets"),
        (["--session-header", "X Session"], "SessionHeader"),
    ],
)
async def test_an_invalid_session_config_is_refused_at_start(flags: list[str], words: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "admin",
        "serve",
        "--backend",
        "a=http://127.0.0.1:9",
        *flags,
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(20):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert words in err.decode()


async def test_check_config_names_the_session_field(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(
        '[RoutingConfig]\nPrefixAwareRoutingConfig = {SessionKeys = ["prefix", "header"]}\n'
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admin", "check-config", str(path), cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(20):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert "SessionKeys must end with prefix" in err.decode()
    assert "$.RoutingConfig.PrefixAwareRoutingConfig" in err.decode()


async def logged(proc: asyncio.subprocess.Process, event: str) -> dict[str, Any]:
    """Read the daemon's log until ``event``."""
    assert proc.stderr is not None
    async with asyncio.timeout(20):
        while True:
            line = await proc.stderr.readline()
            assert line, f"router exited before logging {event!r}"
            record: dict[str, Any] = json.loads(line)
            if record["event"] == event:
                return record


async def test_a_reload_applies_session_keys_and_refuses_bad_ones(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    (sim,) = await sim_fleet(1)
    config = tmp_path / "router.toml"

    def write(inner: str, salt: str = "") -> None:
        config.write_text(
            f'{salt}[[backends]]\nname = "{sim.name}"\nurl = "{sim.url}"\n'
            f"[RoutingConfig.PrefixAwareRoutingConfig]\n{inner}\n"
        )

    write('SessionKeys = ["header", "prefix"]')
    proc, _ = await spawn_router("--config", str(config), "--no-health-checks")
    try:
        async with aiohttp.ClientSession() as http:
            write('SessionKeys = ["header"]')
            proc.send_signal(signal.SIGHUP)
            refused = await logged(proc, "config not reloaded")
            assert "SessionKeys must end with prefix" in refused["reason"]
            assert "$.RoutingConfig.PrefixAwareRoutingConfig" in refused["reason"]
            _, body = await admin_call(http, proc, "GET", "/admin/routing")
            inner = body["RoutingConfig"]["PrefixAwareRoutingConfig"]  # type: ignore[index]
            assert inner["SessionKeys"] == ["header", "prefix"]  # unchanged

            secret = tmp_path / "secret"
            secret.write_bytes(b"s" * 16)
            salt = f'[cache_salt]\nenabled = true\nsecret_file = "{secret}"\n'
            write('SessionKeys = ["conversation", "prefix"]\nSessionHeader = "X-Thread"', salt)
            proc.send_signal(signal.SIGHUP)
            restart = await logged(proc, "config fields need a restart")
            assert restart["fields"] == ["cache_salt"]
            await logged(proc, "config reloaded")
            _, body = await admin_call(http, proc, "GET", "/admin/routing")
            inner = body["RoutingConfig"]["PrefixAwareRoutingConfig"]  # type: ignore[index]
            assert inner["SessionKeys"] == ["conversation", "prefix"]
            assert inner["SessionHeader"] == "X-Thread"
    finally:
        await stop(proc)


# -- several replicas sharing one etcd -----------------------------------------------------


async def test_replicas_send_a_session_to_one_backend_and_share_its_config(
    sim_fleet: SimFleet, etcd: EtcdServer
) -> None:
    """Two replicas (``--etcd``): one session through either lands on one backend, and a
    SessionKeys change made through one replica's admin API reaches the other."""
    sims = await sim_fleet(4)
    routers = []
    for i in range(2):
        flags = ["--etcd", etcd.url, "--etcd-prefix", "/sessions/", "--replica-id", f"r{i}"]
        flags += ["--balance-mode", "IN_FLIGHT"]  # the ring's promise, as test_replicas
        routers.append(await spawn_router(*fleet_flags(sims if i == 0 else [], *flags)))
    try:
        async with aiohttp.ClientSession() as http:
            for proc, _ in routers:  # the second replica learns the fleet from etcd

                async def ready(proc: Any = proc) -> bool:
                    _, body = await admin_call(http, proc, "GET", "/admin/backends")
                    return isinstance(body, list) and len(body) == len(sims)

                await until(ready)
            where: dict[str, set[str]] = {f"user-{n}": set() for n in range(6)}
            for turn in range(4):
                for n, (session, seen) in enumerate(where.items()):
                    _, port = routers[(turn + n) % 2]  # each session through both
                    async with client(port) as via:
                        raw = await chat(via, f"turn {turn}", headers={"X-Session-Id": session})
                    seen.add(raw.headers["x-sim-instance"])
            assert all(len(seen) == 1 for seen in where.values()), where
            assert len({next(iter(seen)) for seen in where.values()}) > 1

            first, second = routers[0][0], routers[1][0]
            routing = {"PrefixAwareRoutingConfig": {"SessionHeader": "X-Thread"}}
            assert (await admin_call(http, first, "PUT", "/admin/routing", routing))[0] == 200

            async def applied() -> bool:
                _, body = await admin_call(http, second, "GET", "/admin/routing")
                inner = body["RoutingConfig"]["PrefixAwareRoutingConfig"]  # type: ignore[index]
                return bool(inner["SessionHeader"] == "X-Thread")

            await until(applied)
            async with client(routers[1][1]) as via:
                await chat(via, "x", headers={"X-Thread": "t-1"})
                await chat(via, "y", headers={"X-Session-Id": "t-1"})  # the old name: none
            counts = await key_sources(http, second)
            assert (counts["header"], counts["prefix"]) == (12 + 1, 1)
    finally:
        for proc, _ in routers:
            await stop(proc)


async def until(check: Any) -> None:
    """Poll ``await check()``: state in another process has no event to await here."""
    async with asyncio.timeout(20):
        while True:
            if await check():
                return
            await asyncio.sleep(0.02)
