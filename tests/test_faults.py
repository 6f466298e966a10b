"""Reliability under faults: dying instances, broken links, hostile clients, secrets.

What tests/test_router_client.py, test_router_exchange.py and test_router_upstream.py
already show (hangs before the first byte and between chunks, refused connections,
resets, garbage, framing attacks, limits)
is not repeated here; RELIABILITY.md maps every fault to the test that shows it.

- Backend faults: a real ``loadtests.simserver`` process SIGKILLed (or
  SIGTERMed) mid-stream; instances behind ``loadtests.faultproxy`` cutting,
  delaying, stalling and splitting the links at random byte offsets.
- Client side: slow heads and slow bodies do not starve other clients; tenant
  keys; large, deep, empty and badly encoded OpenAI bodies.
- Secrets: the admin token and ``Proxy-*`` credentials never reach a backend;
  no token, tenant key or query string appears in a log line or error body
  (the real router process, its stderr and access log captured).

Every wait is bounded (``WAIT``); the only sleeps play a slow peer and say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtests import fleet
from loadtests.faultproxy import Fault, FaultProxy, RandomFaults
from loadtests.simserver.model import filler_pieces
from router.app import Router
from tests.harness.backends import StartBackend
from tests.harness.http import COMPLETION, assert_error, connect, quiet, req
from tests.harness.routers import FAST_HEALTH, SimFleet, StartRouter

WAIT = 5.0  # seconds: the bound on every wait in this file
TENANT_HEADER = b"X-Amzn-SageMaker-Prefix-Aware-Id"


# -- fixtures ------------------------------------------------------------------------


@pytest.fixture
async def children() -> AsyncIterator[list[fleet.Child]]:
    """Processes this test starts; each is stopped (by its own PID) at teardown."""
    started: list[fleet.Child] = []
    try:
        yield started
    finally:
        for child in started:
            await child.stop()


def chat_body(system: str, question: str = "q", **fields: Any) -> bytes:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 4,
        **fields,
    }
    return json.dumps(body).encode()


async def healthy_is(router: Router, name: str, healthy: bool) -> None:
    backend = router.fleet.backends[name]
    async with asyncio.timeout(WAIT):
        await router.health.wait(lambda: backend.healthy == healthy)


# -- an instance killed mid-stream --------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
async def test_an_instance_killed_mid_stream_truncates_it_visibly_and_traffic_moves_on(
    sig: signal.Signals, children: list[fleet.Child], start_router: StartRouter
) -> None:
    flags = ("--time-scale", "0.001", "--extra-token-ms", "20")
    started = await asyncio.gather(
        *(fleet.start_sims(children, 1, *flags, name=f"proc-{i}") for i in range(2))
    )
    by_name = {name: child for child, sims in started for name in sims}
    router = await start_router(
        [(name, url) for _, sims in started for name, url in sims.items()], health=FAST_HEALTH
    )
    body = chat_body("Kill me softly. " * 50, max_tokens=200, stream=True)
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions", body=body))
        head = await client.head()
        assert (head.status, head.value("transfer-encoding")) == (200, b"chunked")
        victim = (head.value("x-sim-instance") or b"").decode()
        assert (await client.chunk()).startswith(b"data: ")  # the stream is under way
        assert router.fleet.loads.get(victim) == 1
        killed_at = time.perf_counter()
        by_name[victim].proc.send_signal(sig)  # a PID we started
        rest = await client.rest()  # returns once the router closes the connection
        cut_after = time.perf_counter() - killed_at
    assert b"[DONE]" not in rest  # the stream never looks finished ...
    assert not rest.endswith(b"0\r\n\r\n")  # ... not even at the HTTP level
    await quiet(router)  # the lease is free

    survivor = next(name for name in by_name if name != victim)
    question = chat_body("Kill me softly. " * 50, "again")
    # Once the process is gone its listener is too. Before that, the kernel may
    # still accept a connection on it while it tears the process down and then
    # reset it after the request went out: a 502, as nginx answers a POST.
    await by_name[victim].proc.wait()
    async with connect(router) as client:  # at once: refused connects are retried elsewhere
        await client.send(req(b"POST", b"/v1/chat/completions", body=question))
        resp = await client.response()
    assert (resp.status, resp.value("x-sim-instance")) == (200, survivor.encode())
    await healthy_is(router, victim, False)
    down_after = time.perf_counter() - killed_at
    print(
        f"\n{sig.name}: stream cut after {cut_after * 1000:.0f} ms, down after {down_after:.2f} s"
    )
    errors = router.fleet.backends[victim].errors
    async with connect(router) as client:
        for i in range(10):
            await client.send(req(b"POST", b"/v1/chat/completions", body=chat_body(f"p{i}" * 99)))
            resp = await client.response()
            assert (resp.status, resp.value("x-sim-instance")) == (200, survivor.encode())
    assert router.fleet.backends[victim].errors == errors  # no more attempts on it
    await quiet(router)


# -- a faulty link between router and instances ----------------------------------------


def expected_text(max_tokens: int) -> str:
    return "".join(filler_pieces(max_tokens))


class Outcomes:
    """Every request ends in exactly one of these; ``violations`` must stay empty."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.violations: list[str] = []

    def ok(self) -> None:
        self.counts["complete and correct"] += 1

    def visible(self, what: str) -> None:
        self.counts[what] += 1

    def violation(self, what: str) -> None:
        self.counts["VIOLATION"] += 1
        self.violations.append(what)


def sse_text(payload: bytes, kind: str) -> tuple[str, bool]:
    """The text a stream carried, and whether it ended with its end marker."""
    events = [line[6:] for line in payload.split(b"\n") if line.startswith(b"data: ")]
    done = bool(events) and events[-1] == b"[DONE]"
    text, final = [], False
    for event in events:
        if event == b"[DONE]":
            continue
        data = json.loads(event)
        if kind == "native":
            text.append(data["token"]["text"])
            final = data["generated_text"] is not None
        elif kind == "chat":
            text += [c["delta"].get("content") or "" for c in data["choices"]]
        else:
            text += [c["text"] for c in data["choices"]]
    return "".join(text), done or (kind == "native" and final)


async def one_checked_request(
    http: aiohttp.ClientSession, base: str, i: int, outcomes: Outcomes
) -> None:
    """One request of a mixed workload, classified; never raises."""
    kind = ("chat", "completion", "native", "models")[i % 4]
    stream = i % 3 == 0
    max_tokens = 3 + i % 7
    doc = f"Shared document {i % 9}. " * (20 + i % 50)
    if kind == "chat":
        path, body = "/v1/chat/completions", json.loads(chat_body(doc, f"q{i}"))
        body.update(max_tokens=max_tokens, stream=stream)
    elif kind == "completion":
        path = "/v1/completions"
        body = {"model": "m", "prompt": doc, "max_tokens": max_tokens, "stream": stream}
    else:
        path = "/invocations"
        body = {"inputs": doc, "parameters": {"max_new_tokens": max_tokens}, "stream": stream}
    try:
        async with asyncio.timeout(20):  # far past every router timeout: a hang is a violation
            if kind == "models":
                async with http.get(base + "/v1/models") as resp:
                    payload = await resp.read()
                    if resp.status == 200:
                        assert json.loads(payload)["data"], payload
                        outcomes.ok()
                    else:
                        error = json.loads(payload)["error"]
                        assert error["code"] == resp.status
                        outcomes.visible(f"HTTP {resp.status}")
                    return
            async with http.post(base + path, json=body) as resp:
                payload = await resp.read()  # raises if the framing is cut short
                if resp.status != 200:
                    error = json.loads(payload)["error"]
                    assert error["code"] == resp.status, payload
                    outcomes.visible(f"HTTP {resp.status}")
                    return
                if stream:
                    text, ended = sse_text(payload, kind)
                    if not ended:
                        outcomes.violation(f"{i}: complete HTTP, unfinished stream: {payload!r}")
                        return
                else:
                    data = json.loads(payload)
                    if kind == "native":
                        text = data["generated_text"]
                    elif kind == "chat":
                        text = data["choices"][0]["message"]["content"]
                    else:
                        text = data["choices"][0]["text"]
                if text != expected_text(max_tokens):
                    outcomes.violation(f"{i}: wrong text {text!r}")
                else:
                    outcomes.ok()
    except aiohttp.ClientPayloadError:
        outcomes.visible("truncated body")
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        outcomes.visible("connection closed before a response")
    except TimeoutError:
        outcomes.violation(f"{i}: no end within 20 s")
    except (AssertionError, ValueError, KeyError, TypeError) as exc:
        outcomes.violation(f"{i}: malformed answer: {exc!r}")


FAULTY_REQUESTS = int(os.environ.get("FAULTY_REQUESTS", "240"))


async def test_random_link_faults_give_complete_answers_or_visible_errors_and_leak_nothing(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(3)
    proxies = [
        FaultProxy(
            ("127.0.0.1", sim.port),
            RandomFaults(rate=0.8, seed=100 + n, max_offset=6000, delay=(0.01, 0.8)),
            seed=n,
        )
        for n, sim in enumerate(sims)
    ]
    try:
        for proxy in proxies:
            await proxy.start()
        router = await start_router(
            [(sim.name, proxy.url) for sim, proxy in zip(sims, proxies, strict=True)],
            # Short upstream keep-alive: pooled connections are replaced, and each new
            # one draws a new fault.
            timeouts={"connect": 1.0, "first_byte": 0.5, "idle": 0.5, "upstream_keepalive": 0.3},
            health={**FAST_HEALTH, "interval": 0.2},
        )
        base = f"http://127.0.0.1:{router.port}"
        outcomes = Outcomes()
        gate = asyncio.Semaphore(12)
        # A fresh client connection per request: a closed connection is the router's doing.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def one(i: int) -> None:
                async with gate:
                    await one_checked_request(http, base, i, outcomes)

            await asyncio.gather(*(one(i) for i in range(FAULTY_REQUESTS)))
        await quiet(router)
        fired = Counter({k: v for k, v in sum((p.stats for p in proxies), Counter()).items()})
        print(f"\nfaulty links: {dict(outcomes.counts)}; proxies: {dict(fired)}")
        assert outcomes.violations == []
        assert sum(outcomes.counts.values()) == FAULTY_REQUESTS
        assert outcomes.counts["complete and correct"] > FAULTY_REQUESTS // 2
        # The run exercised the faults it claims to. The plan is seeded, but a
        # planned fault fires only if its link carries enough bytes, and health
        # checks take their share of links: each kind fires 3-7 times, none
        # every time (a kind's own effect is pinned by
        # test_the_fault_proxy_acts_at_its_offset).
        kinds = ("reset", "close", "delay", "stall", "split")
        assert sum(fired["fired " + kind] > 0 for kind in kinds) >= 4, fired
        assert router.fleet.loads.total == 0
    finally:
        for proxy in proxies:
            await proxy.close()


# -- slow clients do not starve the others ---------------------------------------------


async def test_slow_heads_and_slow_bodies_do_not_starve_other_clients(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    # No health checks: the counts of heads and requests below are the clients' alone.
    router = await start_router([backend.spec], health={"active": False})
    body = COMPLETION
    native = b"n" * 6000  # past PrefixLength: routed and streaming while the client dawdles
    async with contextlib.AsyncExitStack() as stack:
        heads, bodies, streams = [], [], []
        for _ in range(150):  # slowloris: half a head each
            client = await stack.enter_async_context(connect(router))
            await client.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            heads.append(client)
        for _ in range(50):  # slow OpenAI bodies: head and half the body
            client = await stack.enter_async_context(connect(router))
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
            await client.send(head % len(body), body[:100])
            bodies.append(client)
        for _ in range(5):  # slow native bodies: these hold a backend connection and a lease
            client = await stack.enter_async_context(connect(router))
            head = b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
            await client.send(head % (len(native) * 2), native)
            streams.append(client)
        await backend.wait_for(lambda: len(backend.heads) == 5)
        # While all of them hold their connections, everyone else is served.
        for i in range(50):
            async with connect(router) as other:
                await other.send(req(b"POST", b"/v1/completions", body=COMPLETION))
                assert (await other.response()).status == 200, i
        assert router.fleet.loads.total == 5
        # And the slow ones, once they finish, are served too.
        for client in heads:
            await client.send(b"ngth: %d\r\n\r\n" % len(body) + body)
        for client in bodies:
            await client.send(body[100:])
        for client in streams:
            await client.send(native)
        for client in heads + bodies + streams:
            assert (await client.response()).status == 200
    await quiet(router)
    assert len(backend.requests) == 50 + 150 + 50 + 5


async def test_a_steadily_trickled_head_is_cut_at_client_header_all_the_same(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec], timeouts={"client_header": 0.5})
    async with connect(router) as client:
        await client.send(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                while True:
                    await client.send(b"a")
                    await asyncio.sleep(0.02)  # plays a slowloris client: a byte every 20 ms

        task = asyncio.create_task(trickle())
        try:
            # Had each byte extended the deadline, no answer would come within WAIT.
            resp = await client.response()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert_error(resp, 408)
    await quiet(router)


# -- tenant keys ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "status"),
    [
        (b"k" * 64, 200),
        (b"k" * 65, 400),
        (b"caf\xc3\xa9", 400),  # UTF-8
        (b"caf\xe9", 400),  # Latin-1
        (b"", 200),  # empty: no tenant
    ],
    ids=["64-ascii", "65-ascii", "utf8", "latin1", "empty"],
)
async def test_tenant_keys_in_the_header_are_64_ascii_characters_at_most(
    key: bytes, status: int, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        headers = TENANT_HEADER + b": " + key + b"\r\n"
        await client.send(req(b"POST", b"/invocations", body=b"{}", headers=headers))
        resp = await client.response()
    assert resp.status == status, resp.body
    if status == 400:
        error = assert_error(resp, 400, "invalid_request_error")
        assert "x-amzn-sagemaker-prefix-aware-id" in error["message"]
        assert key.decode("latin-1") not in error["message"]  # never echoed
        assert backend.heads == []
    else:
        assert backend.requests[0].value(TENANT_HEADER.decode()) == key  # forwarded as is
    await quiet(router)


@pytest.mark.parametrize(
    ("key", "status"),
    [("k" * 64, 200), ("k" * 65, 400), ("café", 400), ("\u65e5\u672c", 400), ("", 200)],
    ids=["64-ascii", "65-ascii", "latin", "cjk", "empty"],
)
async def test_prompt_cache_keys_are_64_ascii_characters_at_most(
    key: str, status: int, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    body = chat_body("hello", prompt_cache_key=key)
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/chat/completions", body=body))
        resp = await client.response()
    assert resp.status == status, resp.body
    if status == 400:
        error = assert_error(resp, 400, "invalid_request_error")
        assert error["param"] == "prompt_cache_key"
        assert key not in error["message"]
        assert backend.heads == []
    else:
        assert backend.requests[0].body == body  # forwarded byte for byte
    await quiet(router)


async def test_the_tenant_header_salts_openai_requests_without_prompt_cache_key(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(4)
    router = await start_router(sims)
    async with connect(router) as client:
        placements = []
        for tenant in range(20):
            by_key = chat_body("Same prompt for all", prompt_cache_key=f"t-{tenant}")
            await client.send(req(b"POST", b"/v1/chat/completions", body=by_key))
            keyed = (await client.response()).value("x-sim-instance")
            header = TENANT_HEADER + b": t-%d\r\n" % tenant
            by_header = chat_body("Same prompt for all")
            await client.send(req(b"POST", b"/v1/chat/completions", body=by_header, headers=header))
            placements.append((keyed, (await client.response()).value("x-sim-instance")))
        too_long = TENANT_HEADER + b": " + b"x" * 65 + b"\r\n"
        await client.send(req(b"POST", b"/v1/chat/completions", body=by_header, headers=too_long))
        bad = await client.response()
    await quiet(router)
    assert [k for k, _ in placements] == [h for _, h in placements]
    assert bad.status == 400


# -- large, deep, empty and badly encoded OpenAI bodies ----------------------------------------


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("name", "body", "needle"),
    [
        ("deep unknown field", b'{"x": ' + nested(100_000) + b', "prompt": "a"}', "too deep"),
        ("deep tools", b'{"tools": [' + nested(100_000) + b'], "prompt": "a"}', "too deep"),
        (
            "deep content",
            b'{"messages": [{"role": "user", "content": ' + nested(100_000) + b"}]}",
            "too deep",  # over 64 KiB: the one-pass reader meets the depth first
        ),
        ("invalid UTF-8 in the prompt", b'{"prompt": "caf\xe9"}', "Invalid UTF-8"),
        ("lone surrogate escape", b'{"prompt": "\\ud800"}', "not valid JSON"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else "",
)
async def test_unreadable_bodies_get_a_clear_400(
    name: str, body: bytes, needle: str, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        await client.send(req(b"POST", b"/v1/completions", body=body))
        error = assert_error(await client.response(), 400, "invalid_request_error")
    assert needle in error["message"], error
    assert backend.heads == []
    await quiet(router)


@pytest.mark.parametrize(
    ("name", "body"),
    [
        (
            "100,000 messages",
            json.dumps({"messages": [{"role": "user", "content": "x"}] * 100_000}).encode(),
        ),
        ("empty prompt", b'{"prompt": ""}'),
        ("empty messages", b'{"messages": []}'),
        ("no prompt at all", b"{}"),
        ("invalid UTF-8 in a field routing skips", b'{"model": "caf\xe9", "prompt": "a"}'),
        ("deep nesting under the limit", b'{"x": ' + nested(500) + b', "prompt": "a"}'),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
async def test_bodies_routing_can_read_are_forwarded_byte_for_byte(
    name: str, body: bytes, backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    async with connect(router) as client:
        started = time.perf_counter()
        await client.send(req(b"POST", b"/v1/chat/completions", body=body))
        assert (await client.response()).status == 200
        took = time.perf_counter() - started
    assert backend.requests[0].body == body  # the backend judges it
    print(f"\n{name}: {len(body):,} bytes forwarded in {took * 1000:.1f} ms")
    await quiet(router)


# -- secrets -------------------------------------------------------------------------------

ADMIN_TOKEN = "admin-SECRET-7c41d09e"
CLIENT_KEY = "sk-client-SECRET-55aa"  # the client's own API key: forwarded on purpose
PROXY_CRED = "proxy-SECRET-b0b"
TENANT_H = "tenant-header-SECRET-01"
TENANT_PCK = "tenant-pck-SECRET-02"
QUERY = "query-SECRET-03"
BAD_TENANT = "bad-tenant-SECRET-" + "x" * 60  # over 64 characters
WRONG_ADMIN = "wrong-admin-SECRET-04"


async def raw_exchange(host: str, port: int, data: bytes) -> bytes:
    """Send ``data`` on a fresh connection; everything the server says until it closes."""
    async with asyncio.timeout(WAIT):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(data)
            pieces = []
            with contextlib.suppress(ConnectionResetError):
                while chunk := await reader.read(65536):
                    pieces.append(chunk)
            return b"".join(pieces)
        finally:
            writer.close()


async def test_no_secret_reaches_a_backend_a_log_line_or_an_error_body(
    tmp_path: Path, backends: StartBackend, children: list[fleet.Child]
) -> None:
    backend = await backends()
    token_file = tmp_path / "token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    access_log = tmp_path / "access.log"
    router, url, admin_url = await fleet.start_router(
        children,
        {backend.name: backend.url},
        "--admin-token-file", str(token_file),
        "--access-log", str(access_log),
    )  # fmt: skip
    host, port = url.removeprefix("http://").rsplit(":", 1)
    admin_host, admin_port = admin_url.removeprefix("http://").rsplit(":", 1)

    def close(method: str, target: str, headers: str = "", body: bytes = b"") -> bytes:
        head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}"
        return head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body

    data_plane = [
        close(
            "POST",
            f"/v1/chat/completions?api_key={QUERY}",
            f"Authorization: Bearer {CLIENT_KEY}\r\nProxy-Authorization: Basic {PROXY_CRED}\r\n"
            "Proxy-Connection: keep-alive\r\n",
            chat_body("hi", prompt_cache_key=TENANT_PCK),
        ),
        close(
            "POST",
            f"/invocations?api_key={QUERY}",
            f"{TENANT_HEADER.decode()}: {TENANT_H}\r\nAuthorization: Bearer {CLIENT_KEY}\r\n",
            b'{"inputs": "hi"}',
        ),
        close("POST", "/invocations", f"{TENANT_HEADER.decode()}: {BAD_TENANT}\r\n", b"{}"),
        close("POST", "/v1/chat/completions", "", chat_body("hi", prompt_cache_key=BAD_TENANT)),
        close("GET", "/v1/models", f"Authorization: Bearer {ADMIN_TOKEN}\x01\r\n"),  # malformed
        close("GET", "/v1/models", f"X-Big: {ADMIN_TOKEN * 2000}\r\n"),  # 431
        close("GET", "/admin/stats"),  # the admin API is not on the data plane
    ]
    answers = [await raw_exchange(host, int(port), data) for data in data_plane]
    statuses = [int(answer.split(b" ", 2)[1]) for answer in answers]
    assert statuses == [200, 200, 400, 400, 400, 431, 200], answers
    assert json.loads(answers[-1].partition(b"\r\n\r\n")[2])["target"] == "/admin/stats"

    admin_calls = [
        close("GET", "/admin/stats", f"Authorization: Bearer {ADMIN_TOKEN}\r\n"),
        close("GET", "/admin/stats", f"Authorization: Bearer {WRONG_ADMIN}\r\n"),
        close("GET", "/admin/stats", f"X-Note: {QUERY}\x01\r\n"),  # logged? (see below)
    ]
    admin_answers = [await raw_exchange(admin_host, int(admin_port), d) for d in admin_calls]
    assert [int(a.split(b" ", 2)[1]) for a in admin_answers] == [200, 401, 400], admin_answers
    assert b'"in_flight":0' in admin_answers[0].replace(b" ", b"")
    await fleet.stop_checked(router)  # SIGTERM: the access log is flushed

    log_lines = []
    while (line := router.lines.get_nowait()) is not None:
        log_lines.append(line)
    access = access_log.read_text().splitlines()
    records = [json.loads(line) for line in access]
    # One line each; the malformed and oversized heads never became requests.
    assert [(r["event"], r["status"]) for r in records] == [
        ("access", 200), ("access", 200), ("access", 400), ("access", 400),
        ("refused", 400), ("refused", 431), ("access", 200),
    ]  # fmt: skip
    assert [r["tenant"] for r in records[:2]] == [True, True]
    assert {r["client"] for r in records} == {"127.0.0.1"}  # refusals included
    for line in log_lines + access:
        assert "SECRET" not in line, line
        assert ADMIN_TOKEN not in line, line
    # The admin API's own 400 for a malformed head quotes the bad line back to its
    # sender (test_the_admin_api_never_echoes_a_malformed_header_line); not checked here.
    for answer in answers[2:] + admin_answers[1:2]:  # error bodies
        assert b"SECRET" not in answer, answer
    for answer in answers[:2]:
        assert ADMIN_TOKEN.encode() not in answer
    for seen in backend.heads:
        everything = b"".join(n + b": " + v for n, v in seen.headers) + seen.target + seen.body
        assert ADMIN_TOKEN.encode() not in everything
        assert PROXY_CRED.encode() not in everything
        assert seen.values("proxy-authorization") == seen.values("proxy-connection") == []
    assert backend.heads[0].value("authorization") == f"Bearer {CLIENT_KEY}".encode()


async def test_the_admin_api_never_echoes_a_malformed_header_line(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    from admin import AdminServer
    from router.control.live import RouterControl

    router = await start_router(await sim_fleet(1))
    control = RouterControl(router)
    server = AdminServer(control, token=ADMIN_TOKEN)
    await server.start("127.0.0.1", 0)
    try:
        bad = f"GET /admin/stats HTTP/1.1\r\nAuthorization: Bearer {ADMIN_TOKEN}\x01\r\n\r\n"
        answer = await raw_exchange("127.0.0.1", server.port, bad.encode())
    finally:
        await server.close()
        await control.close()
    assert answer.startswith(b"HTTP/1.1 400") or answer.startswith(b"HTTP/1.0 400"), answer
    assert ADMIN_TOKEN.encode() not in answer


async def test_no_proxy_header_reaches_a_backend(
    backends: StartBackend, start_router: StartRouter
) -> None:
    backend = await backends()
    router = await start_router([backend.spec])
    headers = (
        b"Proxy-Authorization: Basic c2VjcmV0\r\nProxy-Connection: keep-alive\r\n"
        b"Proxy-Authenticate: Basic\r\nProxy-Status: upstream\r\nProxy-Agent: x\r\n"
        b"Proxy: http://203.0.113.9:3128\r\n"  # httpoxy: a CGI backend would read HTTP_PROXY
    )
    async with connect(router) as client:
        await client.send(req(b"GET", b"/v1/models", headers=headers))
        assert (await client.response()).status == 200
    await quiet(router)
    forwarded = [name.lower() for name, _ in backend.requests[0].headers]
    assert [n for n in forwarded if n.startswith(b"proxy")] == []


# -- the fault proxy itself -----------------------------------------------------------------

PAYLOAD = bytes(range(256)) * 4  # 1,024 bytes the upstream sends once it has read 5


async def read_all(reader: asyncio.StreamReader) -> tuple[bytes, int, bool]:
    """(bytes, number of reads, reset?) until EOF or a reset."""
    pieces = []
    try:
        async with asyncio.timeout(WAIT):
            while data := await reader.read(65536):
                pieces.append(data)
    except ConnectionResetError:
        return b"".join(pieces), len(pieces), True
    return b"".join(pieces), len(pieces), False


@pytest.mark.parametrize(
    ("fault", "got", "reset"),
    [
        (Fault(), PAYLOAD, False),
        (Fault("close", "down", 300), PAYLOAD[:300], False),
        (Fault("reset", "down", 300), None, True),
        (Fault("stall", "down", 300), PAYLOAD[:300], False),
        (Fault("delay", "down", 300, 0.05), PAYLOAD, False),
        (Fault("split", "down", 10), PAYLOAD, False),
        (Fault("close", "up", 3), b"", False),
    ],
    ids=["pass", "close", "reset", "stall", "delay", "split", "close-up"],
)
async def test_the_fault_proxy_acts_at_its_offset(
    fault: Fault, got: bytes | None, reset: bool
) -> None:
    received = bytearray()

    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            received.extend(await reader.readexactly(5))
            writer.write(PAYLOAD)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    proxy = FaultProxy(("127.0.0.1", server.sockets[0].getsockname()[1]), lambda n: fault)
    try:
        await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"HELLO")
        data, _reads, was_reset = await read_all(reader)
        writer.close()
        assert was_reset == reset
        if got is not None:
            assert data == got
        if fault.kind == "split":
            assert proxy.stats["split pieces"] >= (len(PAYLOAD) - 10) // 7
        if fault.direction == "up":
            assert bytes(received) == b""  # three bytes went up, never five
        if fault.kind != "pass":
            assert proxy.stats["fired " + fault.kind] == 1
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()


async def test_a_killed_proxy_resets_its_links_refuses_connects_and_comes_back() -> None:
    async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(100):
                writer.write(data)
        writer.close()

    server = await asyncio.start_server(upstream, "127.0.0.1", 0)
    proxy = FaultProxy(("127.0.0.1", server.sockets[0].getsockname()[1]))
    try:
        await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        proxy.kill()
        _, _, was_reset = await read_all(reader)
        assert was_reset
        writer.close()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", proxy.port)
        await proxy.start()  # the same port
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(b"pong")
        assert await reader.readexactly(4) == b"pong"
        writer.close()
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()
