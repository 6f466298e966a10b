"""Routers that share their state (``hashring.shared``, ``loadtests/offline.py`` share_period).

The mechanics first (``SharedLoads`` folds, ``PlacementLog`` conflicts), then
the simulation: one router with sharing is the plain run, R routers sharing
exactly (period 0) route as one router, and a period longer than the run is
the uncoordinated run. Short, deterministic simulations: every figure
compared here is exact.
"""

from __future__ import annotations

import functools

import pytest

from hashring import Lease, LoadTracker, Placement, Ring, bounded
from hashring.placement import SCAN_REPLICAS
from hashring.shared import STALE_SCAN_REPLICAS, PlacementLog, SharedLoads
from loadtests import offline, report, workloads
from loadtests.offline import Outcome, simulate
from loadtests.workloads import FLEET, Request
from router.config import RoutingConfig, parse_routing

TRAFFIC_PREFILL = {"BalanceMode": "TRAFFIC", "ConcurrencyScope": "PREFILL"}
# The deterministic PREFIX_AWARE settings: SageMaker's in-flight threshold, with a
# BalanceFactor, and the default (TRAFFIC + PREFILL).
IN_FLIGHT = {"BalanceMode": "IN_FLIGHT", "ConcurrencyScope": "IN_FLIGHT"}
SETTINGS = [IN_FLIGHT, {**IN_FLIGHT, "BalanceFactor": 1.2}, TRAFFIC_PREFILL]
IDS = ["in-flight", "balance-factor", "traffic-prefill"]


def routing(**prefix: object) -> RoutingConfig:
    return parse_routing({"RoutingStrategy": "PREFIX_AWARE", "PrefixAwareRoutingConfig": prefix})


@functools.cache
def long_run() -> list[Request]:
    # Two minutes at the calibrated load of 4 instances: ~480 requests, enough
    # for overflow (BalanceFactor) and TRAFFIC's share bound to act.
    return workloads.build("long", seed=3, duration=120, rate=FLEET["long"].rate_for(4))


@functools.cache  # deterministic, and read only: the one-router runs serve several tests
def run(
    replicas: int,
    period: float | None,
    placement: str = "log",
    extrapolate: bool = True,
    spread: bool = True,
    **prefix: object,
) -> Outcome:
    return simulate(
        long_run(),
        routing(**prefix),
        instances=4,
        params=FLEET["long"],
        seed=1,
        replicas=replicas,
        share_period=period,
        share_placement=placement,
        share_extrapolate=extrapolate,
        spread_claims=spread,
    )


def figures(outcome: Outcome) -> tuple[list[report.Sample], float | None, list[float] | None]:
    return outcome.run.samples, outcome.run.hit_rate, outcome.run.utilisation


# -- SharedLoads ----------------------------------------------------------------


def test_shared_loads_folded_on_read_are_one_trackers_counts() -> None:
    one = LoadTracker()
    replicas = [SharedLoads(), SharedLoads()]
    idle: list[str] = []
    replicas[0].on_idle = idle.append
    leases: list[tuple[Lease, Lease]] = []
    # A fixed interleaving of acquires and releases over both replicas.
    steps = [(0, "a"), (1, "a"), (1, "b"), (0, "c"), (1, "a"), None, (0, "b"), None, None]
    for step in steps:
        if step is None:
            single, shared = leases.pop(0)
            assert single.release()
            assert shared.release()
            assert not shared.release()
        else:
            replica, member = step
            leases.append((one.acquire(member), replicas[replica].acquire(member)))
        for index, tracker in enumerate(replicas):
            tracker.fold([replicas[1 - index].own])
            assert dict(tracker.counts) == dict(one.counts)
            assert tracker.total == one.total
            assert all(tracker.get(m) == one.get(m) for m in "abcd")
        assert replicas[0].own_total + replicas[1].own_total == one.total
    # Replica 0's own "a" went to zero (the first release) while replica 1 held
    # two: on_idle follows the own row, which is what a drain waits on.
    assert idle == ["a"]
    assert dict(replicas[0].own) == {"b": 1, "c": 1}
    assert dict(replicas[0].others) == {"a": 1}


def test_fold_replaces_the_others_and_keeps_the_own_row() -> None:
    loads = SharedLoads()
    lease = loads.acquire("a")
    loads.fold([{"a": 2, "b": 1}, {"b": 3, "c": 0}])
    assert dict(loads.counts) == {"a": 3, "b": 4}
    assert loads.total == 7
    loads.fold([{"c": 1}])  # a later publication replaces, it does not add
    assert dict(loads.counts) == {"a": 1, "c": 1}
    lease.release()
    assert dict(loads.counts) == {"c": 1}
    assert loads.total == 1
    assert loads.own_total == 0
    assert not loads.own


def test_extrapolating_adds_per_other_row_what_the_own_row_gained_since_it_came() -> None:
    loads = SharedLoads(extrapolate=True)
    held = loads.acquire("a")
    first, second = {"a": 2}, {"b": 1}
    loads.fold([first, second])  # two new rows: both based on own {"a": 1}
    assert dict(loads.counts) == {"a": 3, "b": 1}
    leases = [loads.acquire("a"), loads.acquire("b")]  # each: 1 own + 1 per other row
    assert dict(loads.counts) == {"a": 6, "b": 4}
    assert loads.total == sum(loads.counts.values()) == 10
    assert loads.own_total == 3
    loads.fold([first, {"b": 2}])  # the second row is new: its base is the own row now
    assert dict(loads.counts) == {"a": 2 + 2 + 1, "b": 2 + 1 + 1}
    # Own "a" back at the first row's base, below the second's: a loss counts as none.
    held.release()
    assert dict(loads.counts) == {"a": 2 + 1, "b": 4}
    for lease in leases:
        lease.release()
    assert dict(loads.counts) == {"a": 2, "b": 2}  # the rows as published
    assert loads.total == sum(loads.counts.values()) == 4
    assert loads.own_total == 0
    assert not loads.own


def test_without_extrapolating_a_row_folded_again_changes_nothing() -> None:
    loads = SharedLoads()
    row = {"a": 2}
    loads.fold([row])
    lease = loads.acquire("a")
    loads.fold([row])
    assert dict(loads.counts) == {"a": 3}
    lease.release()
    assert dict(loads.counts) == {"a": 2}


def sagemaker_run(workload: str, duration: float, replicas: int, **shared: bool) -> Outcome:
    """``workload`` under SageMaker's semantics on 7 instances, R routers sharing
    every 0.1 s (``shared``: how, as ``simulate`` takes it)."""
    requests = workloads.build(
        workload, seed=1, duration=duration, rate=FLEET[workload].rate_for(7)
    )
    return simulate(
        requests,
        routing(**IN_FLIGHT),
        instances=7,
        params=FLEET[workload],
        seed=1,
        replicas=replicas,
        share_period=0.1 if replicas > 1 else None,
        **shared,
    )


@functools.cache
def sysprompt(replicas: int, extrapolate: bool, spread: bool = False) -> Outcome:
    return sagemaker_run(
        "sysprompt", 60, replicas, share_extrapolate=extrapolate, spread_claims=spread
    )


def test_the_estimate_keeps_four_routers_on_one_hot_prompt_from_herding() -> None:
    # SageMaker's semantics, one prompt for every request: the walk fills one
    # instance to the threshold, then the next.  With rows 0-0.1 s old every
    # router sees the same members below it and adds its own requests on top.
    one = report.summarize(sysprompt(1, extrapolate=False).run)
    stale = report.summarize(sysprompt(4, extrapolate=False).run)
    estimated = report.summarize(sysprompt(4, extrapolate=True).run)
    assert stale["ttft_p90"] > 1.1 * one["ttft_p90"]
    assert estimated["ttft_p90"] < 1.1 * one["ttft_p90"]
    assert one["min_share"] - estimated["min_share"] < one["min_share"] - stale["min_share"]


def test_spreading_claims_gives_four_routers_one_routers_share_range() -> None:
    # What the estimate leaves: a place freed on the walk's first members is seen
    # by every router at once and claimed up to four times, so overflow reaches
    # the last members less and fallback is rarer than one router's.  At this
    # rate (20/s, two decisions a period) each router spreads over c = 2.
    one = report.summarize(sysprompt(1, extrapolate=True).run)
    herded = report.summarize(sysprompt(4, extrapolate=True).run)
    spread = report.summarize(sysprompt(4, extrapolate=True, spread=True).run)
    print(
        f"\nleast loaded: one {one['min_share']:.3f}, herded {herded['min_share']:.3f}, "
        f"spread {spread['min_share']:.3f}"
    )
    assert abs(one["min_share"] - spread["min_share"]) < one["min_share"] - herded["min_share"]
    assert abs(one["min_share"] - spread["min_share"]) <= 0.01
    assert spread["ttft_p90"] < 1.1 * one["ttft_p90"]
    assert spread["hit_rate"] > one["hit_rate"] - 0.01


@functools.cache
def balanced_prefill(replicas: int, fresh: bool) -> dict[str, float]:
    """``sysprompt`` under BalanceFactor 1.5 and ConcurrencyScope PREFILL, R routers
    folding each other's counts every 10 ms: the workers of one host."""
    requests = workloads.build(
        "sysprompt", seed=1, duration=60, rate=FLEET["sysprompt"].rate_for(7)
    )
    config = routing(**{**IN_FLIGHT, "ConcurrencyScope": "PREFILL", "BalanceFactor": 1.5})
    outcome = simulate(
        requests,
        config,
        instances=7,
        params=FLEET["sysprompt"],
        seed=1,
        replicas=replicas,
        share_period=0.01 if replicas > 1 else None,
        share_fresh=fresh,
    )
    return report.summarize(outcome.run)


def test_workers_that_read_the_chosen_member_again_route_as_one_process() -> None:
    # One prompt, every request below the balance bound of the first free member:
    # a place another worker took in the last 10 ms looks free, and a cached
    # prefill (~27 ms) that starts behind another's waits for it.  Reading the
    # chosen member's cells again (router.shared's refresh) closes that window.
    one = balanced_prefill(1, fresh=False)
    stale, fresh = balanced_prefill(4, fresh=False), balanced_prefill(4, fresh=True)
    print(
        f"\nP90 TTFT: one {one['ttft_p90'] * 1000:.1f} ms, four workers "
        f"{stale['ttft_p90'] * 1000:.1f} ms, reading again {fresh['ttft_p90'] * 1000:.1f} ms"
    )
    assert stale["ttft_p90"] > 1.2 * one["ttft_p90"]
    assert fresh["ttft_p90"] < 1.1 * one["ttft_p90"]
    assert abs(fresh["max_share"] - one["max_share"]) <= 0.01
    assert fresh["hit_rate"] > one["hit_rate"] - 0.01


def test_a_refreshed_member_is_the_others_count_now_until_the_next_fold() -> None:
    rows = [SharedLoads(), SharedLoads()]
    for router, tracker in enumerate(rows):
        tracker.read_from(lambda member, other=rows[1 - router]: other.own.get(member, 0))
    me, other = rows
    assert me.refreshes
    assert not LoadTracker.refreshes
    lease = other.acquire("a")
    assert dict(me.counts) == {}  # nothing folded yet
    assert me.refresh("a")
    assert not me.refresh("a")
    assert (dict(me.counts), me.total) == ({"a": 1}, 1)
    mine = me.acquire("a")
    lease.release()
    assert me.refresh("a")
    assert (dict(me.counts), me.total) == ({"a": 1}, 1)
    me.fold([{"b": 2}])  # a row replaces the whole others' part, refreshed or not
    assert (dict(me.counts), me.total) == ({"a": 1, "b": 2}, 3)
    mine.release()
    with pytest.raises(ValueError, match="extrapolates"):
        SharedLoads(extrapolate=True).read_from(me.own.get)


DURATION_SHORT = 240  # model s: the fleet queues past the threshold within ~30 s


def saturated(replicas: int) -> dict[str, float]:
    """``short`` under SageMaker's semantics: a fleet saturated from the first
    minute on, where (nearly) every request takes the fallback."""
    return report.summarize(sagemaker_run("short", DURATION_SHORT, replicas).run)


def test_a_saturated_fleet_keeps_one_routers_hits_across_four_routers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Saturated, the fallback decides: the earliest of the walk among the least
    # loaded.  With counts up to 0.1 s old exact ties break differently on each
    # router; the fallback's tolerance (hashring.bounded) makes the walk order,
    # which every router shares, decide instead.
    one, four = saturated(1), saturated(4)
    monkeypatch.setattr(bounded, "_TOLERANCE_NUM", 0)  # exact ties only, as before
    exact_one, exact_four = saturated(1), saturated(4)
    print(
        f"\nhit rate: tolerance one {one['hit_rate']:.3f} four {four['hit_rate']:.3f};"
        f" exact ties one {exact_one['hit_rate']:.3f} four {exact_four['hit_rate']:.3f}"
    )
    assert abs(one["hit_rate"] - four["hit_rate"]) <= 0.01
    assert four["ttft_p90"] < 1.1 * one["ttft_p90"]
    assert exact_one["hit_rate"] - exact_four["hit_rate"] > 0.01
    assert one["hit_rate"] > exact_one["hit_rate"] + 0.1


# -- PlacementLog ---------------------------------------------------------------


def placed_apart() -> tuple[Ring, int, list[PlacementLog], list[str]]:
    """Two replicas that place one new key on different members, replica 1 first."""
    ring = Ring({"m0": 1, "m1": 1, "m2": 1})
    key = 12345
    first, second = list(ring.walk(key))[:2]
    logs = [PlacementLog(Placement(1.05), r) for r in range(2)]
    # Replica 0 sees the key's first member at its threshold: the key goes on.
    chosen = [
        logs[0].placement.route(ring, key, {first: 1}, 1),
        logs[1].placement.route(ring, key, {}, 1),
    ]
    assert chosen[0] is not None
    assert chosen[1] is not None
    assert (chosen[0].member, chosen[1].member) == (second, first)
    logs[0].decided(key, chosen[0].member, None, now=2.0)
    logs[1].decided(key, chosen[1].member, None, now=1.0)
    return ring, key, logs, [first, second]


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["0-first", "1-first"])
def test_a_conflict_resolves_to_the_earliest_placement(order: tuple[int, int]) -> None:
    ring, key, logs, (first, _) = placed_apart()
    messages = [logs[0].publish(), logs[1].publish()]
    for sender in order:  # each message reaches the other replica
        logs[1 - sender].apply(ring, messages[sender])
    # Replica 1 placed it first (stamp 1.0 < 2.0): replica 0 re-homes.
    assert logs[0].placement.home(key) == logs[1].placement.home(key) == first
    # Replica 1 saw a later, losing placement and says its own again.
    again = logs[1].publish()
    assert [(r.key_hash, r.member, r.home, r.stamp) for r in again] == [
        (key, None, first, (1.0, 1))
    ]
    logs[0].apply(ring, again)  # nothing left to change
    assert logs[0].placement.home(key) == first
    assert not logs[0].publish()


def test_a_winner_that_never_routes_the_key_again_still_converts_the_loser() -> None:
    ring, key, logs, (first, _) = placed_apart()
    # Replica 1's message is lost to replica 0 (say it arrived before a restart);
    # replica 0's reaches replica 1, which answers with its earlier placement.
    logs[1].publish()
    logs[1].apply(ring, logs[0].publish())
    logs[0].apply(ring, logs[1].publish())
    assert logs[0].placement.home(key) == logs[1].placement.home(key) == first


def test_observed_requests_count_in_the_window() -> None:
    ring = Ring({"m0": 1, "m1": 1})
    sender, receiver = PlacementLog(Placement(1.05), 0), PlacementLog(Placement(1.05), 1)
    for key in range(5):
        chosen = sender.placement.route(ring, key, {}, 10)
        assert chosen is not None
        sender.decided(key, chosen.member, None, now=float(key))
    receiver.apply(ring, sender.publish())
    for member in ("m0", "m1"):
        assert receiver.placement.share(member) == sender.placement.share(member)
    assert all(receiver.placement.home(k) == sender.placement.home(k) for k in range(5))
    # New homes only: the table follows, the window does not.
    homes_only = PlacementLog(Placement(1.05), 2, decisions=False)
    other = PlacementLog(Placement(1.05), 3, decisions=False)
    chosen = other.placement.route(ring, 99, {}, 10)
    assert chosen is not None
    other.decided(99, chosen.member, None, now=0.0)
    other.decided(99, chosen.member, chosen.member, now=1.0)  # not new: no record
    records = other.publish()
    assert [r.member for r in records] == [None]
    homes_only.apply(ring, records)
    assert homes_only.placement.home(99) == chosen.member
    assert homes_only.placement.share(chosen.member) == 0


# -- the simulation -------------------------------------------------------------


@pytest.mark.parametrize("prefix", SETTINGS, ids=IDS)
@pytest.mark.parametrize("period", [0.0, 0.1])
def test_one_router_with_sharing_is_the_plain_run(prefix: dict[str, object], period: float) -> None:
    plain = run(1, None, **prefix)
    shared = run(1, period, **prefix)
    assert figures(shared) == figures(plain)
    assert shared.run.notes == plain.run.notes
    assert isinstance(shared.fleet.loads, SharedLoads)


@pytest.mark.parametrize("prefix", SETTINGS, ids=IDS)
@pytest.mark.parametrize("replicas", [2, 4])
def test_routers_sharing_exactly_route_as_one_router(
    prefix: dict[str, object], replicas: int
) -> None:
    one = run(1, None, **prefix)
    shared = run(replicas, 0.0, **prefix)
    assert figures(shared) == figures(one)
    assert [s.decision for s in shared.run.samples] == [s.decision for s in one.run.samples]
    routed = [sum(b.requests for b in f.backends.values()) for f in shared.fleets]
    assert min(routed) > 0
    assert sum(routed) == len(long_run())
    for fleet in shared.fleets:  # every lease given back to the router that took it
        assert isinstance(fleet.loads, SharedLoads)
        assert isinstance(fleet.waiting, SharedLoads)
        assert fleet.loads.own_total == 0
        assert fleet.waiting.own_total == 0
    tables = [b._placement and dict(b._placement._table) for b in shared.balancers]
    assert all(table == tables[0] for table in tables)
    # Without sharing the same routers do not route as one (the baseline moves).
    assert figures(run(replicas, None, **prefix)) != figures(one)


@pytest.mark.parametrize(
    "prefix", [IN_FLIGHT, TRAFFIC_PREFILL], ids=["in-flight", "traffic-prefill"]
)
def test_a_period_longer_than_the_run_is_the_uncoordinated_run(prefix: dict[str, object]) -> None:
    # Router 0 publishes once, at 0, before any request; router 1 never does.
    # (With the estimate, router 1 would count router 0 as routing as it does;
    # with claim spreading, each would leave a place free to the other: 1e6 s
    # hold every decision of the run.)
    uncoordinated = run(2, 1e6, extrapolate=False, spread=False, **prefix)
    assert figures(uncoordinated) == figures(run(2, None, **prefix))
    shared = run(2, 0.1, **prefix)
    assert figures(shared) != figures(run(2, None, **prefix))
    # Loads seen late: hot keys compare two replicas; exact or alone: all of them.
    for outcome, scan in ((shared, STALE_SCAN_REPLICAS), (run(2, 0.0, **prefix), SCAN_REPLICAS)):
        for balancer in outcome.balancers:
            assert balancer._placement is None or balancer._placement.scan_replicas == scan
    for fleet in shared.fleets:  # the views keep the last rows published, the own are empty
        assert isinstance(fleet.loads, SharedLoads)
        assert isinstance(fleet.waiting, SharedLoads)
        assert fleet.loads.own_total == 0
        assert not fleet.loads.own
        assert fleet.waiting.own_total == 0
        assert not fleet.waiting.own


def test_homes_only_gives_every_router_the_same_homes_at_period_0() -> None:
    shared = run(2, 0.0, "homes", **TRAFFIC_PREFILL)
    tables = [b._placement and b._placement._table for b in shared.balancers]
    assert tables[0] is not None
    assert tables[1] is not None
    assert dict(tables[0]) == dict(tables[1])
    assert len(tables[0]) > 100


def test_cli_takes_a_share_period_and_refuses_a_negative_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--workload", "long", "--instances", "3", "--duration", "20", "--strategies", "prefix"]
    argv += ["--balance-mode", "TRAFFIC", "--replicas", "2"]
    assert offline.main([*argv, "--share-loads", "0.1", "--share-placement", "homes"]) == 0
    assert "2 routers, sharing state every 0.1 s (placement: homes)" in capsys.readouterr().out
    assert offline.main([*argv, "--share-loads", "-1"]) == 2
    assert "--share-loads" in capsys.readouterr().err
    with pytest.raises(ValueError, match="share period"):
        run(2, -0.5)
    with pytest.raises(ValueError, match="share placement"):
        run(2, 0.1, "everything")
