"""Engine signals as tie-breaks (router.signals), in process: the rank, the tie rules
of the walk and of a hot key's replicas (hashring), the simulated engine's gauges, and
vLLM's and SGLang's gauges read by the real ``Router``'s scrape rounds.

The daemon, its workers and replicas: ``tests/test_signals_live.py``.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from admin.cli import main
from admin.reload import RESTART_FIELDS
from hashring import Decision, LoadBound, Placement, Ring, pick
from hashring.bounded import Pick, Ranked
from loadtests.simserver import Engine, KVCache, Timing, tokenize
from router.config import build_config
from router.control.live import RouterControl
from router.signals import KV_STEP, rank
from tests.harness.backends import Backend, Seen, StartBackend
from tests.harness.fallback import expected_fallback
from tests.harness.http import WAIT, response
from tests.harness.routers import FAST_HEALTH, SimFleet, StartRouter

MEMBERS = {"a": 1, "b": 2, "c": 1, "d": 1, "e": 3}
NAMES = sorted(MEMBERS)


def test_rank_counts_waiting_first_then_kv_use_in_steps() -> None:
    assert rank(None, None) == rank(0, 0) == 0  # no figures ranks as an idle engine
    assert rank(0, KV_STEP * 0.99) == 0  # under a step: a few short requests, noise
    assert rank(0, KV_STEP) == 1
    assert rank(0, 0.999) == 19
    assert rank(0, 1.0) == rank(0, 7.0) == 20  # full, or a figure above it
    assert rank(1, 0) > rank(0, 1.0)  # one request queued outweighs a full cache
    assert rank(2, 0.3) > rank(2, 0.1) > rank(1, 0.9)
    assert [rank(0, step / 100) for step in (15, 30, 35, 70)] == [3, 6, 7, 14]  # not 2.999..
    assert rank(math.nan, math.inf) == rank(-3, -0.5) == 0  # nonsense says nothing


# -- hashring: a rank breaks ties and nothing else -------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    key=st.integers(0, 2**64 - 1),
    loads=st.dictionaries(st.sampled_from(NAMES), st.integers(0, 4)),
    ranks=st.dictionaries(st.sampled_from(NAMES), st.integers(0, 3)),
    threshold=st.integers(1, 4),
    balance=st.sampled_from([None, 1.25]),
    avoid=st.sets(st.sampled_from(NAMES), max_size=2),
)
def test_ranks_never_move_an_eligible_pick_and_only_break_fallback_ties(
    key: int,
    loads: dict[str, int],
    ranks: dict[str, int],
    threshold: int,
    balance: float | None,
    avoid: set[str],
) -> None:
    ring = Ring(MEMBERS, vnodes=8)
    bound = LoadBound(threshold, balance)
    plain = pick(ring, key, loads, bound, avoid=frozenset(avoid))
    ranked = pick(ring, key, loads, bound, avoid=frozenset(avoid), ranks=ranks)
    if plain is None:
        assert ranked is None
        return
    assert ranked is not None
    if plain.decision is not Decision.FALLBACK:  # the prefix rule: the same pick, unranked
        assert ranked == plain
        assert type(ranked) is Pick
        return
    assert ranked.decision is Decision.FALLBACK
    walk = [m for m in ring.walk(key) if m not in avoid]
    assert ranked.member == expected_fallback(walk, loads, threshold, ranks=ranks)
    assert walk[ranked.position] == ranked.member
    assert plain.member == expected_fallback(walk, loads, threshold)  # a tie, never a load
    assert (type(ranked) is Ranked) == (ranked.member != plain.member)


def hot_placement(ring: Ring, key: int) -> Placement:
    """A placement where ``key`` carries every decision: hot, served by every member."""
    placement = Placement(1.05)
    for _ in range(50):
        placement.route(ring, key, {}, threshold=1000)
    assert placement.hot_share(key, len(ring)) >= len(ring) - 1
    return placement


def test_a_hot_keys_replicas_tied_on_load_go_to_the_lowest_rank_before_the_fewest_recent() -> None:
    ring = Ring({"a": 1, "b": 1, "c": 1}, vnodes=32)
    key = 0x5EED
    placement = hot_placement(ring, key)
    home = placement.home(key)
    assert home is not None
    others = [m for m in ring.walk(key) if m != home]
    in_flight = {home: 2, others[0]: 1, others[1]: 1}
    # Without ranks the fewest recent requests break the tie; make that others[0].
    before = {m: placement.share(m) for m in ring.members}
    plain = placement.peek(ring, key, {}, 10, fallback_loads=in_flight)
    assert plain is not None
    assert plain.member in others
    favoured = others[1] if plain.member == others[0] else others[0]
    ranks = {plain.member: 3}  # its engine has a queue; the other ranks 0
    chosen = placement.route(ring, key, {}, 10, fallback_loads=in_flight, ranks=ranks)
    assert chosen is not None
    assert chosen.member == favoured
    assert type(chosen) is Ranked
    assert chosen.decision is Decision.OVERFLOW
    # A load is never outweighed: the home with one more in flight loses to both.
    ranks = {others[0]: 60, others[1]: 60}
    assert placement.peek(ring, key, {}, 10, fallback_loads=in_flight, ranks=ranks) == plain
    assert before[plain.member] <= before[favoured]
    # Equal ranks: the plain order, and not marked.
    even = placement.peek(ring, key, {}, 10, fallback_loads=in_flight, ranks={})
    assert even == plain
    assert type(even) is Pick


def test_a_key_with_a_home_below_its_threshold_stays_whatever_its_engine_says() -> None:
    ring = Ring(MEMBERS, vnodes=16)
    placement = Placement(1.05)
    first = placement.route(ring, 42, {}, threshold=2)
    assert first is not None
    ranks = {first.member: 1000}  # a deep queue on its engine
    again = placement.route(ring, 42, {first.member: 1}, threshold=2, ranks=ranks)
    assert again == (first.member, Decision.PRIMARY, 0)
    # At its threshold: the next of the walk below it, in walk order, ranks or not.
    walk = list(ring.walk(42))
    loads = {first.member: 2}
    ranks = {walk[1]: 1000}
    over = placement.route(ring, 42, loads, threshold=2, ranks=ranks)
    assert over == (walk[1], Decision.OVERFLOW, 1)


# -- the simulated engine's gauges, as vLLM V1's scheduler reports them ----------------


def test_a_request_behind_a_long_prefill_is_waiting_and_holds_no_kv_until_it_starts() -> None:
    engine = Engine(
        Timing(prefill_tokens_per_s=1000, request_overhead_s=0), KVCache(16, capacity_blocks=1000)
    )
    long = engine.submit(tokenize("L" * 4 * 1600), 4, now=0.0)  # 1.6 s of prefill, 100 blocks
    short = engine.submit(tokenize("s" * 4 * 160), 4, now=0.0)  # 10 blocks, behind it
    assert long.plan is not None
    assert short.plan is not None
    assert short.plan.prefill_start == long.plan.first_token_at == 1.6
    assert (engine.running, engine.waiting) == (2, 0)  # both admitted: max_num_seqs 256
    assert engine.gauges(0.5) == (1, 1, 0.1)  # as vLLM counts: the short one waits
    assert engine.gauges(1.6) == (2, 0, 0.11)
    engine.finish(long, 1.7)
    assert engine.gauges(1.7) == (1, 0, 0.01)


def test_blocks_two_running_requests_share_count_once() -> None:
    engine = Engine(Timing(request_overhead_s=0), KVCache(16, capacity_blocks=100))
    shared = "system prompt " * 64  # 896 bytes: 224 tokens, 14 full blocks
    engine.submit(tokenize(shared + "one"), 2, now=0.0)
    engine.submit(tokenize(shared + "two"), 2, now=0.0)
    running, waiting, usage = engine.gauges(10.0)
    assert (running, waiting) == (2, 0)
    assert usage == 0.14


# -- vLLM's and SGLang's gauges through the Router's scrape rounds ---------------------


class SGLangGauges:
    """SGLang's /metrics with two data-parallel ranks behind one URL."""

    async def __call__(self, backend: Backend, seen: Seen, writer: asyncio.StreamWriter) -> bool:
        body = (
            b"# TYPE sglang:num_queue_reqs gauge\n"
            b'sglang:num_queue_reqs{model_name="m",dp_rank="0"} 2.0\n'
            b'sglang:num_queue_reqs{model_name="m",dp_rank="1"} 1.0\n'
            b"# TYPE sglang:token_usage gauge\n"
            b'sglang:token_usage{model_name="m",dp_rank="0"} 0.5\n'
            b'sglang:token_usage{model_name="m",dp_rank="1"} 0.3\n'
            b"# TYPE sglang:num_running_reqs gauge\n"
            b'sglang:num_running_reqs{model_name="m",dp_rank="0"} 7.0\n'
        )
        writer.write(response(200, body, [(b"Content-Type", b"text/plain")]))
        return True


async def test_vllm_and_sglang_gauges_become_ranks_after_a_round(
    backends: StartBackend, sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    sglang = await backends(SGLangGauges(), name="sglang")
    plain = await backends(name="plain")  # no Prometheus text: its scrape fails
    (sim,) = await sim_fleet(1, name="vllm")
    router = await start_router(
        [(sglang.name, sglang.url), (plain.name, plain.url), sim],
        health={**FAST_HEALTH, "scrape_interval": 0.05},  # scrape_metrics not set: implied
        engine_signals={"enabled": True},
    )
    signals = router.signals
    assert signals is not None
    health = router.health
    async with asyncio.timeout(WAIT):
        await health.wait(lambda: health.rounds >= 1)
    figures = signals.figures
    assert set(figures) == {sglang.name, sim.name}  # the failed scrape has none
    # Queues add up over the ranks, KV use is their mean.
    assert (figures[sglang.name].waiting, figures[sglang.name].kv_usage) == (3.0, 0.4)
    assert (figures[sim.name].waiting, figures[sim.name].kv_usage) == (0.0, 0.0)
    assert router.balancer.engine_ranks == {sglang.name: rank(3, 0.4)}
    views = {b.name: b for b in (await RouterControl(router).stats()).backends}
    assert views[sglang.name].engine_rank == 3 * 21 + 8
    assert views[plain.name].engine_rank == views[sim.name].engine_rank == 0
    assert views[sglang.name].num_requests_running == 7.0
    assert views[sglang.name].engine_tie_breaks == 0


async def test_signals_off_reads_nothing_and_shows_nothing(
    sim_fleet: SimFleet, start_router: StartRouter
) -> None:
    (sim,) = await sim_fleet(1)
    router = await start_router([sim], health=FAST_HEALTH)
    assert router.signals is None
    assert router.balancer.engine_ranks is None
    assert not router.health.config.scrape_metrics
    (view,) = (await RouterControl(router).stats()).backends
    assert (view.engine_rank, view.engine_tie_breaks) == (None, None)


# -- configuration --------------------------------------------------------------------


def test_the_flag_and_the_table_turn_it_on_and_a_typo_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert not build_config({}).engine_signals.enabled  # off by default
    assert build_config({"engine_signals": {"enabled": True}}).engine_signals.enabled
    config = tmp_path / "router.toml"
    config.write_text("[engine_signals]\nenabled = true\n\n[health]\nscrape_interval = 1.0\n")
    assert main(["check-config", str(config)]) == 0
    config.write_text("[engine_signals]\nenable = true\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "engine_signals" in capsys.readouterr().err
    assert "engine_signals" in RESTART_FIELDS  # resolved once at start-up
