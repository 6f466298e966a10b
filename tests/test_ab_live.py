"""A/B on live traffic, driven as an operator would: the real router process (two
workers; then two ``--etcd`` replicas), a simulated fleet, the official ``openai``
client, the experiment set with ``PUT /admin/routing``, each key's arm read with the
dry run (``POST /admin/route``), the figures read from ``/admin/ab``, ``/metrics``
and ``prefix-router ab-report``.

The arms differ in strategy: ``control`` is RANDOM, ``prefix`` is PREFIX_AWARE on the
ring's walk alone (BalanceMode IN_FLIGHT: a key stays on its instance while it is
below its threshold, whatever worker or replica routes it).  So every document of
the prefix arm is answered by one instance and the control's documents are spread:
each request went by its arm's config.  Every request comes on a connection of its
own, so SO_REUSEPORT spreads them over both workers, whose counts the supervisor adds
up.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.arms import arm_seed, rendezvous
from tests.harness.ab import ask, body, client, document, put_everywhere, two_replicas
from tests.harness.etcd import EtcdServer
from tests.harness.http import WAIT
from tests.harness.processes import ADMIN_PORTS, ROOT, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet

pytestmark = pytest.mark.timeout(120)

DOCS = 12
ROUNDS = 6  # requests per document


def experiment(control: float, prefix: float) -> dict[str, Any]:
    return {
        "RoutingConfig": {
            "RoutingStrategy": "PREFIX_AWARE",
            "Experiment": "rollout-1",
            "Arms": [
                {
                    "Name": "control",
                    "Weight": control,
                    "RoutingConfig": {"RoutingStrategy": "RANDOM"},
                },
                {
                    "Name": "prefix",
                    "Weight": prefix,
                    "RoutingConfig": {"PrefixAwareRoutingConfig": {"BalanceMode": "IN_FLIGHT"}},
                },
            ],
        }
    }


async def arm_of(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process, doc: str) -> str:
    """The dry run's arm for ``doc``, checked against the assignment rule itself."""
    dry = {"method": "POST", "path": "/v1/chat/completions", "body": body(doc)}
    status, answer = await admin_call(http, proc, "POST", "/admin/route", dry)
    assert status == 200, answer
    status, routing = await admin_call(http, proc, "GET", "/admin/routing")
    arms = routing["RoutingConfig"]["Arms"]  # type: ignore[index]
    names = [arm["Name"] for arm in arms]
    seeds = [arm_seed("rollout-1", name) for name in names]
    digest = int(answer["key"]["digest"], 16)  # type: ignore[index]
    assert answer["arm"] == names[rendezvous(digest, seeds, [arm["Weight"] for arm in arms])]
    assert answer["strategy"] == ("RANDOM" if answer["arm"] == "control" else "PREFIX_AWARE")
    return str(answer["arm"])


async def digest_of(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process, doc: str) -> str:
    dry = {"method": "POST", "path": "/v1/chat/completions", "body": body(doc)}
    _, answer = await admin_call(http, proc, "POST", "/admin/route", dry)
    return str(answer["key"]["digest"])  # type: ignore[index]


async def ab(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> dict[str, Any]:
    status, view = await admin_call(http, proc, "GET", "/admin/ab")
    assert status == 200, view
    return view


async def report(*procs: asyncio.subprocess.Process) -> dict[str, Any]:
    """``prefix-router ab-report --json`` over these routers' admin APIs."""
    admins = [arg for p in procs for arg in ("--admin", f"http://127.0.0.1:{ADMIN_PORTS[p.pid]}")]
    command = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admin", "ab-report", *admins, "--bootstrap", "200", "--json",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await command.communicate()
    assert command.returncode == 0, err
    return dict(json.loads(out))


async def test_two_workers_route_each_key_by_its_arm_and_count_it_there(
    sim_fleet: SimFleet, tmp_path: Path
) -> None:
    """~9 s: one daemon with two workers serves the whole operator's session (a bad
    PUT, the experiment, 72 requests, every read, the report, a weight change)."""
    sims = await sim_fleet(3)
    access = tmp_path / "access.log"
    proc, port = await spawn_router(
        *("--workers", "2", "--scrape-metrics", "--scrape-interval", "0.1"),
        *("--access-log", str(access)),
        *(arg for s in sims for arg in ("--backend", f"{s.name}={s.url}")),
    )
    openai = client(port)
    try:
        async with aiohttp.ClientSession() as http:
            # A bad experiment: 422 naming the fault, and nothing changes.
            bad = experiment(50, 50)
            bad["RoutingConfig"]["Arms"][1]["RoutingConfig"] = {
                "PrefixAwareRoutingConfig": {"PrefixLength": 2048}
            }
            status, error = await admin_call(http, proc, "PUT", "/admin/routing", bad)
            assert status == 422, error
            assert "PrefixLength is the experiment's" in error["error"]["message"]  # type: ignore[index]
            status, before = await admin_call(http, proc, "GET", "/admin/routing")
            assert "Arms" not in before["RoutingConfig"]  # type: ignore[operator]
            status, _ = await admin_call(http, proc, "GET", "/admin/ab")
            assert status == 404

            status, applied = await admin_call(
                http, proc, "PUT", "/admin/routing", experiment(50, 50)
            )
            assert status == 200, applied
            docs = [document(i) for i in range(DOCS)]
            arms = {doc: await arm_of(http, proc, doc) for doc in docs}
            assert set(arms.values()) == {"control", "prefix"}, arms
            digests = {await digest_of(http, proc, doc): arms[doc] for doc in docs}

            answered: dict[str, Counter[str]] = {doc: Counter() for doc in docs}
            for _ in range(ROUNDS):
                for doc in docs:
                    answered[doc][await ask(openai, doc)] += 1
            for doc in docs:
                if arms[doc] == "prefix":  # the ring's walk: one instance
                    assert len(answered[doc]) == 1, answered[doc]
            # RANDOM: a document's 6 requests on one instance has odds of 1/243, every
            # control document's (7 of these 12) 1/243^7.
            control = [answered[doc] for doc in docs if arms[doc] == "control"]
            assert any(len(instances) > 1 for instances in control), control

            expected = Counter(arms[doc] for doc in docs for _ in range(ROUNDS))
            view = await ab(http, proc)
            got = {arm["name"]: arm for arm in view["arms"]}
            for name in ("control", "prefix"):
                assert got[name]["requests"] == expected[name]
                assert got[name]["errors"] == 0
                assert sum(got[name]["backends"].values()) == expected[name]
                assert len(got[name]["sample"]) == got[name]["ttft_samples"] == expected[name]
                assert got[name]["ttft_p90_ms"] > 0
            (comparison,) = view["comparisons"]
            assert comparison["arm"] == "prefix"
            assert comparison["baseline"] == "control"
            assert "Mann-Whitney" in view["test"]
            status, stats = await admin_call(http, proc, "GET", "/admin/stats")
            shown = {arm["name"]: arm["requests"] for arm in stats["experiment"]["arms"]}  # type: ignore[index]
            assert shown == dict(expected)
            async with http.get(f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}/metrics") as resp:
                text = await resp.text()
            for name, count in expected.items():
                assert f'prefix_router_arm_requests_total{{arm="{name}"}} {float(count)}' in text
            # The scrape rounds give the hit-rate fit its cells (the fit's accuracy:
            # tests/test_arms.py; a live measurement: loadtests/RESULTS.md).
            async with asyncio.timeout(WAIT):
                while True:
                    if (await ab(http, proc))["attribution"]["cells"]:
                        break
                    await asyncio.sleep(0.1)  # polled: each a real read, rounds every 0.1 s

            merged = await report(proc)
            assert [arm["requests"] for arm in merged["arms"]] == [
                expected["control"],
                expected["prefix"],
            ]
            interval = merged["comparisons"][0]["p90_difference_ms"]
            assert interval is not None
            assert interval[0] <= interval[1]

            # A weight change moves keys only towards the arm that gained, and the
            # experiment's counts go on.
            status, _ = await admin_call(http, proc, "PUT", "/admin/routing", experiment(20, 80))
            assert status == 200
            moved = {doc: await arm_of(http, proc, doc) for doc in docs}
            assert all(moved[doc] == "prefix" for doc in docs if arms[doc] == "prefix")
            assert any(moved[doc] != arms[doc] for doc in docs)  # 3 of these 12 move
            view = await ab(http, proc)
            assert sum(arm["requests"] for arm in view["arms"]) == DOCS * ROUNDS
    finally:
        await openai.close()
        await stop(proc)
    # Every request's access line names the arm the dry run gave its key (both workers').
    lines = [json.loads(line) for line in access.read_text().splitlines()]
    logged = Counter((digests[line["prefix_hash"]], line["arm"]) for line in lines)
    assert set(logged) == {("control", "control"), ("prefix", "prefix")}
    assert logged.total() == DOCS * ROUNDS


async def test_replicas_assign_a_key_to_one_arm_and_the_report_adds_them_up(
    etcd: EtcdServer, sim_fleet: SimFleet
) -> None:
    """~12 s: etcd and two replicas (each a supervisor and a worker) start, one after
    the other, as every replica test's do."""
    replicas = await two_replicas(etcd, await sim_fleet(3), "/ab/")
    clients = [client(port) for _, port in replicas]
    (first, _), (second, _) = replicas
    try:
        async with aiohttp.ClientSession() as http:
            await put_everywhere(http, first, second, experiment(50, 50))
            docs = [document(i) for i in range(DOCS)]
            arms = {}
            for doc in docs:
                arms[doc] = await arm_of(http, first, doc)
                assert await arm_of(http, second, doc) == arms[doc]
            assert set(arms.values()) == {"control", "prefix"}
            answered: dict[str, set[str]] = {doc: set() for doc in docs}
            for n in range(4):
                for doc in docs:
                    answered[doc].add(await ask(clients[n % 2], doc))
            assert all(len(answered[doc]) == 1 for doc in docs if arms[doc] == "prefix")

            each = [await ab(http, proc) for proc, _ in replicas]
            assert all(sum(a["requests"] for a in view["arms"]) == DOCS * 2 for view in each)
            merged = await report(first, second)
            assert merged["replicas"] == 2
            expected = Counter(arms[doc] for doc in docs for _ in range(4))
            assert {arm["name"]: arm["requests"] for arm in merged["arms"]} == dict(expected)
            assert all(arm["ttft_samples"] == expected[arm["name"]] for arm in merged["arms"])
    finally:
        for openai in clients:
            await openai.close()
        for proc, _ in replicas:
            await stop(proc)
