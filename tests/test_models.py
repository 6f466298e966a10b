"""Several models, one router: backends list their models, a request's ``model`` picks the pool.

The routing core is driven directly (``Fleet``, ``Balancer``: pools, their rings,
their placements); the rest runs the real daemon (``prefix-router serve``, one
process or a supervisor and two workers) in front of simulated instances that
answer 404 to a request for a model they do not serve (``strict_model``, as vLLM
does), with the official ``openai`` client.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest

from hashring import hash_key
from hashring.shared import Record
from loadtests.simserver import SimServer
from router.balancer import Balancer
from router.config import BackendSpec, backend_flag, build_config, parse_routing
from router.fleet import ANY_MODEL, Fleet
from router.replicas import Row
from router.state import SavedBackend, State, StateFile
from tests.harness.processes import ROOT, admin_call, spawn_router, stop
from tests.harness.routers import SimFleet, StartRouter, sagemaker

pytestmark = pytest.mark.timeout(60)

KEYS = [hash_key(f"conversation {i}".encode()) for i in range(2000)]


def spec(name: str, *models: str, weight: int = 1) -> BackendSpec:
    port = 10_000 + sum(map(ord, name))
    return BackendSpec(name, f"http://127.0.0.1:{port}", weight=weight, models=models)


def balancer(fleet: Fleet, **prefix_aware: object) -> Balancer:
    routing = {"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": prefix_aware}
    return Balancer(fleet, parse_routing(routing), seed=1)


def routed(chooser: Balancer, model: str, keys: list[int] = KEYS) -> list[str]:
    """Where each key goes for ``model`` (each lease given back at once)."""
    members = chooser.fleet.members_for(model)
    out = []
    for key in keys:
        choice = chooser.choose(key, members=members)
        assert choice is not None
        choice.release()
        out.append(choice.backend.name)
    return out


# -- the routing core ------------------------------------------------------------------


def test_a_fleet_that_declares_no_model_is_one_pool_as_before() -> None:
    fleet = Fleet([spec("a"), spec("b")])
    assert fleet.pools == {}
    assert fleet.any_model is None
    assert fleet.members_for("anything") is fleet


def test_a_pool_is_its_backends_and_those_that_declare_none() -> None:
    fleet = Fleet([spec("a0", "model-a"), spec("ab", "model-a", "model-b"), spec("any")])
    assert {model: pool.members for model, pool in fleet.pools.items()} == {
        "model-a": ("a0", "ab", "any"),
        "model-b": ("ab", "any"),
    }
    assert fleet.any_model is not None
    assert fleet.any_model.members == ("any",)
    assert fleet.members_for("model-c") is fleet.any_model  # only "any" serves it
    assert set(routed(balancer(fleet), "model-b")) == {"ab", "any"}
    assert set(routed(balancer(fleet), "model-c")) == {"any"}

    # A ring is a function of its members: pools with the same ones share it.
    shared = Fleet([spec("x0", "base", "lora-1"), spec("x1", "base", "lora-1")])
    assert shared.pools["base"].ring is shared.pools["lora-1"].ring is shared.ring

    strict = Fleet([spec("a0", "model-a"), spec("b0", "model-b")])
    assert strict.any_model is None
    assert strict.members_for("model-c") is None  # unknown: 404


@pytest.mark.parametrize("mode", ["IN_FLIGHT", "TRAFFIC"])
def test_each_model_keeps_its_own_ring_and_a_new_backend_of_b_moves_no_key_of_a(
    mode: str,
) -> None:
    fleet = Fleet([spec("a0", "model-a"), spec("a1", "model-a"), spec("b0", "model-b")])
    chooser = balancer(fleet, BalanceMode=mode, ConcurrencyScope="IN_FLIGHT")
    before = routed(chooser, "model-a")
    assert set(before) == {"a0", "a1"}
    assert set(routed(chooser, "model-b")) == {"b0"}

    ring_a = fleet.pools["model-a"].ring
    fleet.add(spec("b1", "model-b"))  # no loop: the rings are built before it returns
    assert fleet.pools["model-a"].ring is ring_a  # untouched, not merely equal
    assert routed(chooser, "model-a") == before
    fresh = [hash_key(f"another conversation {i}".encode()) for i in range(200)]
    assert "b1" in routed(chooser, "model-b", fresh)  # TRAFFIC: homes stick, new keys move

    fleet.add(spec("a2", "model-a"))  # one of model A's own moves only its keys
    after = routed(chooser, "model-a")
    moved = [(old, new) for old, new in zip(before, after, strict=True) if old != new]
    if mode == "IN_FLIGHT":  # the plain ring: ~1/3 of the keys, all to the newcomer
        assert 0.2 < len(moved) / len(KEYS) < 0.45
    assert {new for _, new in moved} <= {"a2"}  # TRAFFIC: homes stick, new keys only


def test_the_same_key_goes_to_each_models_own_backends() -> None:
    fleet = Fleet([spec("a0", "model-a"), spec("a1", "model-a"), spec("b0", "model-b")])
    chooser = balancer(fleet)
    assert set(routed(chooser, "model-a", KEYS[:50])) <= {"a0", "a1"}
    assert routed(chooser, "model-b", KEYS[:50]) == ["b0"] * 50


def test_balance_factor_bounds_a_pool_by_its_own_load() -> None:
    # Ten requests in flight on model B's backend must not loosen model A's bound:
    # with A's total (1 in flight, 2 backends) the key's primary is at its bound.
    fleet = Fleet([spec("a0", "model-a"), spec("a1", "model-a"), spec("b0", "model-b")])
    chooser = balancer(
        fleet, BalanceMode="IN_FLIGHT", ConcurrencyScope="IN_FLIGHT", BalanceFactor=1.0
    )
    pool = fleet.pools["model-a"]
    key = KEYS[0]
    primary = pool.ring.primary(key)
    held = [fleet.loads.acquire("b0") for _ in range(10)]
    held.append(fleet.loads.acquire(primary))  # type: ignore[arg-type]
    choice = chooser.choose(key, members=pool)
    assert choice is not None
    assert choice.backend.name != primary
    assert choice.decision == "overflow"
    choice.release()
    for lease in held:
        lease.release()


def test_traffic_placements_are_per_pool_and_shared_between_processes() -> None:
    specs = [spec("a0", "model-a"), spec("a1", "model-a"), spec("b0", "model-b")]
    one, two = balancer(Fleet(specs)), balancer(Fleet(specs))
    one.share_placement(1)
    two.share_placement(2)
    # The key's ring primary in model A's pool drains in the first process while it
    # places the key: its home is the other backend, which the second must follow.
    pool = one.fleet.pools["model-a"]
    key = KEYS[0]
    primary = pool.ring.primary(key)
    other = ({"a0", "a1"} - {primary}).pop()
    one.fleet.set_healthy(primary, False)  # type: ignore[arg-type]
    assert routed(one, "model-a", [key]) == [other]
    assert routed(one, "model-b", [key]) == ["b0"]  # the same key, its own pool
    one.fleet.set_healthy(primary, True)  # type: ignore[arg-type]

    records = one.publish_records()
    assert {r.pool for r in records} == {"model-a", "model-b"}
    two.apply_records(records)
    assert routed(two, "model-a", [key]) == [other]
    assert routed(one, "model-a", [key]) == [other]


def test_replica_rows_carry_pool_records_beside_the_fleets_in_the_older_shape() -> None:
    fleet_record = Record((1.5, 2), 7, "a0", "a0")
    pool_record = Record((1.5, 2), 7, "b0", "b0", "model-b")
    row = Row(applied=3).with_records([fleet_record, pool_record], [])
    encoded = msgspec.json.encode(row)

    class OlderRow(msgspec.Struct):  # a replica of the version before model pools
        applied: int
        records: list[tuple[tuple[float, int], int, str | None, str | None]] = []

    assert msgspec.json.decode(encoded, type=OlderRow).records == [((1.5, 2), 7, "a0", "a0")]
    assert msgspec.json.decode(encoded, type=Row).placements() == [fleet_record, pool_record]


def test_any_model_pool_has_its_own_placement() -> None:
    fleet = Fleet([spec("a0", "model-a"), spec("x0"), spec("x1")])
    chooser = balancer(fleet)
    chooser.share_placement(1)
    assert set(routed(chooser, "unlisted", KEYS[:100])) <= {"x0", "x1"}
    assert {r.pool for r in chooser.publish_records()} == {ANY_MODEL}


# -- configuration -------------------------------------------------------------------


def test_models_come_from_the_flag_the_file_and_the_state_file_alike(tmp_path: Path) -> None:
    flag = backend_flag("gpu-0=http://10.0.0.1:8000,weight=2,model=meta/llama-3,model=m2")
    config = build_config(
        {"backends": [flag, {"name": "gpu-1", "url": "http://10.0.0.2:8000", "models": ["m2"]}]}
    )
    assert [b.models for b in config.backends] == [("meta/llama-3", "m2"), ("m2",)]
    assert config.backends[0].weight == 2
    saved = SavedBackend.of(config.backends[0], "draining")
    assert saved.spec() == config.backends[0]
    state_file = StateFile(tmp_path / "state.json")
    state_file.save(State(version=1, backends=[saved], routing=config.routing))
    loaded = state_file.load()
    assert loaded is not None
    assert loaded.backends == [saved]
    with pytest.raises(ValueError, match="lists a model twice"):
        build_config({"backends": [backend_flag("g=http://h:1,model=x,model=x")]})
    with pytest.raises(ValueError, match="must look like"):
        backend_flag("g=http://h:1,models=x")


def test_the_benchmark_runs_and_prints_its_tables() -> None:
    """``python -m loadtests.bench_models``, tiny: it runs and prints both tables (no timing)."""
    tiny = ["--pairs", "1", "--requests", "20", "--members", "32"]
    done = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_models", *tiny],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 32 | TRAFFIC |" in done.stdout
    assert "| 32 |" in done.stdout.split("filtered walk")[1]


async def test_what_the_router_answers_itself_about_models(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sims = await sim_fleet(1, name="a", model="model-a", strict_model=True)
    router = await start_router([{"name": "a-0", "url": sims[0].url, "models": ["model-a"]}])
    base = f"http://127.0.0.1:{router.port}"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with aiohttp.ClientSession() as http:
        async with http.post(
            f"{base}/v1/chat/completions", json={**chat, "model": "m" * 5000}
        ) as r:
            error = (await r.json())["error"]
        assert r.status == 404
        assert error["code"] == "model_not_found"
        assert error["type"] == "invalid_request_error"
        assert len(error["message"]) < 300  # the name quoted, cut at a model name's length
        async with http.post(f"{base}/v1/chat/completions", json={**chat, "model": 7}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["param"] == "model"
        async with http.post(f"{base}/v1/chat/completions", json=chat) as r:
            assert r.status == 200  # no model: the whole fleet, the backend's default
        async with http.get(f"{base}/v1/models/model-b") as r:
            assert r.status == 404
            assert "`model-b`" in (await r.json())["error"]["message"]
        async with http.get(f"{base}/v1/models") as r:
            assert r.headers.get("Connection") != "close"  # answered at the request's end
            listed = await r.json()
        assert [m["id"] for m in listed["data"]] == ["model-a"]
        assert listed["data"][0]["owned_by"] == "prefix-router"
        async with http.post(f"{base}/v1/chat/completions", json={**chat, "model": "model-a"}) as r:
            assert r.status == 200
    assert b'prefix_router_model_requests_total{model="model-a"} 1.0' in router.collector.render()


# -- the daemon ------------------------------------------------------------------------


def flags(*pools: tuple[str, list[SimServer]]) -> list[str]:
    out = ["--strategy", "prefix"]
    for model, sims in pools:
        for sim in sims:
            out += ["--backend", f"{sim.name}={sim.url},model={model}"]
    return out


def client(port: int) -> openai.AsyncOpenAI:
    # One connection per request, so that with --workers 2 both workers take some.
    return openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1",
        api_key="unused",
        max_retries=0,
        default_headers={"Connection": "close"},
    )


async def served_by(via: openai.AsyncOpenAI, model: str, prompt: str) -> str:
    """The simulated instance that answered (its name is in the completion's id)."""
    reply = await via.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=2
    )
    assert reply.model == model
    return reply.id.removeprefix("chatcmpl-").rpartition("-")[0]


PROMPTS = [f"Document {i}: " + "the contract says " * 40 + f"question {i}" for i in range(8)]


@pytest.mark.parametrize("workers", [1, 2])
async def test_two_models_behind_one_router_with_the_openai_client(
    workers: int, sim_fleet: SimFleet
) -> None:
    pool_a = await sim_fleet(2, name="a", model="model-a", strict_model=True)
    pool_b = await sim_fleet(2, name="b", model="model-b", strict_model=True)
    names_a, names_b = {s.name for s in pool_a}, {s.name for s in pool_b}
    proc, port = await spawn_router(
        *flags(("model-a", pool_a), ("model-b", pool_b)), "--workers", str(workers)
    )
    try:
        async with client(port) as via, aiohttp.ClientSession() as http:
            listed = await via.models.list()
            assert sorted(m.id for m in listed.data) == ["model-a", "model-b"]
            assert {m.object for m in listed.data} == {"model"}
            assert (await via.models.retrieve("model-b")).id == "model-b"

            with pytest.raises(openai.NotFoundError) as unknown:
                await served_by(via, "model-c", PROMPTS[0])
            assert unknown.value.status_code == 404
            assert "The model `model-c` does not exist." in str(unknown.value)
            assert unknown.value.code == "model_not_found"

            # Every prompt once per model, then a barrier: answering /admin/stats,
            # every worker has sent its placements and received the others'.
            first = {
                (model, prompt): await served_by(via, model, prompt)
                for model in ("model-a", "model-b")
                for prompt in PROMPTS
            }
            status, stats = await admin_call(http, proc, "GET", "/admin/stats")
            assert status == 200
            assert {(m["id"], m["requests"]) for m in stats["models"]} == {
                ("model-a", len(PROMPTS)),
                ("model-b", len(PROMPTS)),
            }
            assert {b["name"]: b["models"] for b in stats["backends"]} == {
                b.name: [b.instance.config.model] for b in pool_a + pool_b
            }
            for (model, _), name in first.items():
                assert name in (names_a if model == "model-a" else names_b)

            # A model-b backend joins: no model-a key moves.
            extra = await sim_fleet(1, name="b-new", model="model-b", strict_model=True)
            body = {"name": extra[0].name, "url": extra[0].url, "models": ["model-b"]}
            status, added = await admin_call(http, proc, "POST", "/admin/backends", body)
            assert status == 201, added
            assert added["models"] == ["model-b"]
            for _ in range(2):  # one at a time: no home is ever at its threshold
                for prompt in PROMPTS:
                    assert await served_by(via, "model-a", prompt) == first["model-a", prompt]
                    assert await served_by(via, "model-b", prompt) in names_b | {extra[0].name}
    finally:
        await stop(proc)


async def test_without_declared_models_v1_models_is_the_backends_and_any_model_is_forwarded(
    sim_fleet: SimFleet,
) -> None:
    sims = await sim_fleet(2, name="s", model="model-s")
    proc, port = await spawn_router(
        "--strategy", "prefix", *(f"--backend={s.name}={s.url}" for s in sims)
    )
    try:
        async with client(port) as via:
            listed = await via.models.list()
            assert [m.id for m in listed.data] == ["model-s"]  # a backend's own answer
            assert await served_by(via, "model-s", PROMPTS[0]) in {s.name for s in sims}
    finally:
        await stop(proc)


async def test_in_flight_mode_pools_route_by_their_own_rings(sim_fleet: SimFleet) -> None:
    pool_a = await sim_fleet(2, name="a", model="model-a", strict_model=True)
    pool_b = await sim_fleet(1, name="b", model="model-b", strict_model=True)
    routing = json.dumps({"RoutingConfig": sagemaker()})
    proc, port = await spawn_router(
        *flags(("model-a", pool_a), ("model-b", pool_b)), "--routing-config", routing
    )
    try:
        async with client(port) as via:
            ring = (
                Fleet([BackendSpec(s.name, s.url, models=("model-a",)) for s in pool_a])
                .pools["model-a"]
                .ring
            )
            for prompt in PROMPTS:
                name = await served_by(via, "model-a", prompt)
                assert name == ring.primary(hash_key(("\x1euser\x1f" + prompt).encode()))
                assert await served_by(via, "model-b", prompt) == "b-0"
    finally:
        await stop(proc)


async def test_a_pools_placement_made_in_one_worker_is_followed_by_every_worker(
    sim_fleet: SimFleet,
) -> None:
    # As tests/test_workers.py does for the whole fleet, in model A's pool: the key's
    # first choice drains while its first request is placed, so its home is the
    # second; a worker that did not learn of it would place the key on the first.
    pool_a = await sim_fleet(3, name="a", model="model-a", strict_model=True)
    pool_b = await sim_fleet(1, name="b", model="model-b", strict_model=True)
    ring = Fleet([spec(s.name, "model-a") for s in pool_a]).pools["model-a"].ring
    prompt = PROMPTS[0]
    first, second, _ = ring.walk(hash_key(("\x1euser\x1f" + prompt).encode()))
    proc, port = await spawn_router(
        *flags(("model-a", pool_a), ("model-b", pool_b)), "--workers", "2"
    )
    try:
        async with client(port) as via, aiohttp.ClientSession() as http:
            path = f"/admin/backends/{first}"
            assert (await admin_call(http, proc, "PATCH", path, {"state": "draining"}))[0] == 200
            assert await served_by(via, "model-a", prompt) == second
            assert (await admin_call(http, proc, "PATCH", path, {"state": "active"}))[0] == 200
            await admin_call(http, proc, "GET", "/admin/stats")  # every worker has it now
            for i in range(6):
                assert await served_by(via, "model-a", prompt) == second
                for other in PROMPTS[1:4]:  # other keys between: this one stays not hot
                    await served_by(via, "model-a", f"{other} {i}")
    finally:
        await stop(proc)
