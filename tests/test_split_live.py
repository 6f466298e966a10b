"""Split BACKENDS driven as an operator would: the real router process (two workers;
then two ``--etcd`` replicas), a simulated fleet, the official ``openai`` client, the
experiment set with ``PUT /admin/routing``, each arm's backends read from
``/admin/stats`` and the dry run, and the instance that answered each request read
from its ``x-sim-instance`` header.

Every request comes on a connection of its own, so SO_REUSEPORT spreads them over
both workers: that each one is answered by a backend of its key's arm shows every
worker (and replica) draws the partition the supervisor reports, the rule's
(``router.split.owners``), before and after a backend is added.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import aiohttp
import pytest

from router.split import owners
from tests.harness.ab import ask, body, client, document, put_everywhere, two_replicas
from tests.harness.etcd import EtcdServer
from tests.harness.processes import ADMIN_PORTS, ROOT, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet

pytestmark = pytest.mark.timeout(120)

DOCS = 12
WEIGHTS = [("control", 50.0), ("prefix", 50.0)]


def split(*weights: tuple[str, float]) -> dict[str, Any]:
    return {
        "RoutingConfig": {
            "RoutingStrategy": "PREFIX_AWARE",
            "Experiment": "rollout-1",
            "Split": "BACKENDS",
            "Arms": [
                {
                    "Name": name,
                    "Weight": weight,
                    "RoutingConfig": {"RoutingStrategy": "RANDOM"} if name == "control" else {},
                }
                for name, weight in weights
            ],
        }
    }


async def owned(http: aiohttp.ClientSession, proc: asyncio.subprocess.Process) -> dict[str, Any]:
    """Each arm's backends as ``/admin/stats`` says."""
    status, stats = await admin_call(http, proc, "GET", "/admin/stats")
    assert status == 200, stats
    experiment = stats["experiment"]
    assert experiment["split"] == "BACKENDS"  # type: ignore[index]
    assert not experiment["split_suspended"]  # type: ignore[index]
    return {arm["name"]: tuple(arm["owns"]) for arm in experiment["arms"]}  # type: ignore[index]


async def dry_run(
    http: aiohttp.ClientSession, proc: asyncio.subprocess.Process, doc: str
) -> dict[str, Any]:
    dry = {"method": "POST", "path": "/v1/chat/completions", "body": body(doc)}
    status, answer = await admin_call(http, proc, "POST", "/admin/route", dry)
    assert status == 200, answer
    return answer


async def report_text(proc: asyncio.subprocess.Process) -> str:
    """``prefix-router ab-report``'s text over ``proc``'s admin API."""
    admin = f"http://127.0.0.1:{ADMIN_PORTS[proc.pid]}"
    command = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "admin", "ab-report", "--admin", admin, "--bootstrap", "50",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await command.communicate()
    assert command.returncode == 0, err
    return out.decode()


async def test_two_workers_route_each_arm_over_its_own_backends_as_the_rule_says(
    sim_fleet: SimFleet,
) -> None:
    """~6 s: a refused PUT, the split, 48 requests, a backend added, 24 more."""
    sims = await sim_fleet(5)
    proc, port = await spawn_router(
        "--workers",
        "2",
        *(arg for s in sims[:4] for arg in ("--backend", f"{s.name}={s.url}")),
    )
    openai = client(port)
    names = [s.name for s in sims[:4]]
    try:
        async with aiohttp.ClientSession() as http:
            # Five arms cannot each own one of four backends: 400, and nothing changes.
            five = split(*((f"arm{i}", 1.0) for i in range(5)))
            status, error = await admin_call(http, proc, "PUT", "/admin/routing", five)
            assert status == 400, error
            assert error["error"]["message"] == (  # type: ignore[index]
                "Split BACKENDS gives each arm with a Weight above 0 backends of its own:"
                " 5 arms need 5 backends, the fleet has 4"
            )
            status, routing = await admin_call(http, proc, "GET", "/admin/routing")
            assert "Arms" not in routing["RoutingConfig"]  # type: ignore[operator]

            status, applied = await admin_call(http, proc, "PUT", "/admin/routing", split(*WEIGHTS))
            assert status == 200, applied
            assert applied["RoutingConfig"]["Split"] == "BACKENDS"  # type: ignore[index]
            parts = await owned(http, proc)
            assert parts == owners("rollout-1", WEIGHTS, names)
            assert [len(part) for part in parts.values()] == [2, 2]

            docs = [document(i) for i in range(DOCS)]
            arms = {}
            for doc in docs:
                answer = await dry_run(http, proc, doc)
                arms[doc] = answer["arm"]
                assert answer["arm_backends"] == list(parts[answer["arm"]])
                assert answer["backend"] in parts[answer["arm"]]
            assert set(arms.values()) == {"control", "prefix"}, arms

            for _ in range(4):
                for doc in docs:
                    assert await ask(openai, doc) in parts[arms[doc]]
            status, stats = await admin_call(http, proc, "GET", "/admin/stats")
            for arm in stats["experiment"]["arms"]:  # type: ignore[index]
                assert set(arm["backends"]) <= set(parts[arm["name"]])  # both workers' counts
                assert arm["requests"] == 4 * sum(a == arm["name"] for a in arms.values())

            # A backend joins: the partition is the rule's for the new membership, in
            # every worker (the add returns once each has the new ring).
            new = {"name": sims[4].name, "url": sims[4].url}
            status, added = await admin_call(http, proc, "POST", "/admin/backends", new)
            assert status == 201, added
            after = await owned(http, proc)
            assert after == owners("rollout-1", WEIGHTS, [*names, sims[4].name])
            arm_of = {b: arm for arm, part in parts.items() for b in part}
            arm_after = {b: arm for arm, part in after.items() for b in part}
            assert sum(arm_of[b] != arm_after[b] for b in names) <= 1  # two arms: one at most
            for _ in range(2):
                for doc in docs:
                    assert await ask(openai, doc) in after[arms[doc]]
            shown = "; ".join(f"{arm} {', '.join(part)}" for arm, part in after.items())
            assert f"Split BACKENDS, each arm on its own: {shown}\n" in await report_text(proc)
    finally:
        await openai.close()
        await stop(proc)


async def test_replicas_draw_one_partition(etcd: EtcdServer, sim_fleet: SimFleet) -> None:
    """~12 s: etcd and two replicas (each a supervisor and a worker) start, one after
    the other, as every replica test's do."""
    sims = await sim_fleet(4)
    replicas = await two_replicas(etcd, sims, "/split/")
    clients = [client(port) for _, port in replicas]
    (first, _), (second, _) = replicas
    try:
        async with aiohttp.ClientSession() as http:
            await put_everywhere(http, first, second, split(*WEIGHTS))
            parts = await owned(http, first)
            assert await owned(http, second) == parts
            assert parts == owners("rollout-1", WEIGHTS, [s.name for s in sims])
            docs = [document(i) for i in range(DOCS)]
            for doc in docs:
                arm = (await dry_run(http, first, doc))["arm"]
                assert (await dry_run(http, second, doc))["arm"] == arm
                for n in range(2):
                    assert await ask(clients[n], doc) in parts[arm]
    finally:
        for openai in clients:
            await openai.close()
        for proc, _ in replicas:
            await stop(proc)
