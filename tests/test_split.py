"""Split BACKENDS without a router: the partition's promises and the arms' routing.

``router/split.py`` held to its contract: each arm's size is the largest
remainder of its weight's share (one backend at least), the partition is a
function of the names alone (not their order, nor the arms'), the arms'
backends are disjoint and cover the fleet, two arms trade at most one backend
when one is added or removed (hypothesis), and with fewer backends than arms
it is suspended.  A balancer's arms route only over their own backends, of
the fleet and of a model's pool, spill over to the pool when none of theirs
is available, and an arm's TRAFFIC placement travels between processes on its
own ring.  The same through the real daemon, workers and replicas:
``tests/test_split_live.py``.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hashring import hash_key
from router.balancer import Balancer
from router.config import BackendSpec, ConfigError, parse_routing
from router.fleet import Fleet
from router.split import FLEET_PART, Part, owners, quotas

KEYS = [hash_key(b"conversation %d" % i) for i in range(4000)]


def experiment(*arms: tuple[str, float, dict[str, Any]], split: str = "BACKENDS") -> Any:
    return {
        "Experiment": "e1",
        "Split": split,
        "Arms": [
            {"Name": arm, "Weight": weight, "RoutingConfig": routing}
            for arm, weight, routing in arms
        ],
    }


HALVES = experiment(("control", 50, {"RoutingStrategy": "RANDOM"}), ("prefix", 50, {}))


def fleet(n: int = 8, models: dict[int, tuple[str, ...]] | None = None) -> Fleet:
    models = models or {}
    return Fleet(
        BackendSpec(name=f"b{i}", url=f"http://10.0.0.{i + 1}:8000", models=models.get(i, ()))
        for i in range(n)
    )


# -- the config --------------------------------------------------------------------------


def test_split_is_written_only_when_it_is_backends() -> None:
    routing = parse_routing(HALVES)
    assert routing.split == "BACKENDS"
    inner = routing.document()["RoutingConfig"]
    assert inner["Split"] == "BACKENDS"
    assert parse_routing(routing.document()) == routing
    shared = parse_routing(experiment(("a", 1, {}), ("b", 1, {}), split="KEYS"))
    assert "Split" not in shared.document()["RoutingConfig"]  # the default, as before


@pytest.mark.parametrize(
    ("routing", "words"),
    [
        ({"Split": "BACKENDS"}, "Split divides an experiment's Arms"),
        ({**HALVES, "Split": "MODELS"}, "Split"),
    ],
)
def test_a_bad_split_is_refused_naming_it(routing: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        parse_routing(routing)


# -- the partition -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("weights", "n", "sizes"),
    [
        ([("control", 50), ("prefix", 50)], 8, {"control": 4, "prefix": 4}),
        ([("control", 90), ("prefix", 10)], 8, {"control": 7, "prefix": 1}),
        ([("control", 90), ("prefix", 10)], 4, {"control": 3, "prefix": 1}),  # one at least
        ([("control", 95), ("prefix", 5)], 2, {"control": 1, "prefix": 1}),
        ([("a", 1), ("b", 1), ("c", 1)], 8, {"a": 3, "b": 3, "c": 2}),  # ties: by name
        ([("a", 1), ("b", 0), ("c", 1)], 5, {"a": 3, "b": 0, "c": 2}),  # weight 0: none
        ([("a", 1), ("b", 1), ("c", 1)], 2, None),  # fewer backends than arms
    ],
)
def test_quotas_are_the_largest_remainders_with_one_at_least(
    weights: list[tuple[str, float]], n: int, sizes: dict[str, int] | None
) -> None:
    assert quotas(weights, n) == sizes


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(0, 100), min_size=2, max_size=6),
    n=st.integers(1, 30),
    seed=st.integers(0, 1000),
)
def test_the_partition_is_the_names_and_weights_alone_disjoint_and_whole(
    weights: list[int], n: int, seed: int
) -> None:
    arms = [(f"arm{i}", float(w)) for i, w in enumerate(weights)]
    names = [f"sim-{i}" for i in range(n)]
    active = sum(1 for w in weights if w > 0)
    if active == 0:
        return  # a config refuses it: at least one arm needs a Weight above 0
    owned = owners("e1", arms, names)
    if n < active:
        assert owned is None
        return
    assert owned is not None
    shuffled, arms_shuffled = names[:], arms[:]
    random.Random(seed).shuffle(shuffled)
    random.Random(seed).shuffle(arms_shuffled)
    assert owners("e1", arms_shuffled, shuffled) == owned  # no order matters
    everyone = [name for part in owned.values() for name in part]
    assert sorted(everyone) == sorted(names)  # disjoint, and every backend owned
    sizes = quotas(arms, n)
    assert sizes is not None
    for name, weight in arms:
        assert len(owned[name]) == sizes[name]
        assert (len(owned[name]) >= 1) == (weight > 0)


@settings(max_examples=80, deadline=None)
@given(
    weight=st.integers(1, 99),
    n=st.integers(2, 40),
    new=st.integers(0, 10**6),
    experiment_id=st.sampled_from(["e1", "rollout-2"]),
)
def test_two_arms_trade_at_most_one_backend_when_one_joins_or_leaves(
    weight: int, n: int, new: int, experiment_id: str
) -> None:
    arms = [("control", float(100 - weight)), ("prefix", float(weight))]
    names = [f"sim-{i}" for i in range(n)]
    before = owners(experiment_id, arms, names)
    after = owners(experiment_id, arms, [*names, f"new-{new}"])
    assert before is not None
    assert after is not None

    def arm_of(owned: dict[str, tuple[str, ...]]) -> dict[str, str]:
        return {backend: arm for arm, part in owned.items() for backend in part}

    was, now = arm_of(before), arm_of(after)
    assert sum(was[name] != now[name] for name in names) <= 1  # removing it: the same pairs


def test_a_new_experiment_id_draws_the_backends_afresh() -> None:
    arms = [("a", 1.0), ("b", 1.0)]
    names = [f"sim-{i}" for i in range(32)]
    draws = {tuple(owners(e, arms, names)["a"]) for e in ("e1", "e2", "e3")}  # type: ignore[index]
    assert len(draws) == 3


# -- the arms' routing -------------------------------------------------------------------


def owned_all(owned: Any) -> list[str]:
    return [name for part in owned.values() for name in part]


def routed(balancer: Balancer, keys: list[int], **choose: Any) -> dict[str, Counter[str]]:
    """Each arm's backends for ``keys`` (every lease released)."""
    experiment_ = balancer.arms
    assert experiment_ is not None
    seen: dict[str, Counter[str]] = {arm.name: Counter() for arm in experiment_.arms}
    for key in keys:
        arm = experiment_.assign(key)
        choice = arm.balancer.choose(key, **choose)
        assert choice is not None
        seen[arm.name][choice.backend.name] += 1
        choice.release()
    return seen


def test_each_arm_routes_over_its_own_backends_only_and_passthroughs_over_all() -> None:
    members = fleet(8)
    balancer = Balancer(members, parse_routing(HALVES), seed=1)
    split = balancer.arms.split  # type: ignore[union-attr]
    assert split is not None
    owned = split.owned()
    assert owned == owners("e1", [("control", 50), ("prefix", 50)], members.backends)
    seen = routed(balancer, KEYS)
    for arm, counts in seen.items():
        assert set(counts) == set(owned[arm])  # RANDOM and the ring's walk alike: all four
    # A passthrough (no key) is no arm's: the least loaded of the whole fleet.
    held = [balancer.choose(None) for _ in range(16)]
    assert Counter(c.backend.name for c in held if c is not None) == dict.fromkeys(
        owned_all(owned), 2
    )
    for choice in held:
        assert choice is not None
        choice.release()
    view = balancer.arms.view()  # type: ignore[union-attr]
    assert view.split == "BACKENDS"
    assert not view.split_suspended
    assert {arm.name: arm.owns for arm in view.arms} == {k: list(v) for k, v in owned.items()}
    assert members.loads.total == 0


async def test_the_arms_rings_are_built_in_the_fleets_slices_not_on_a_request() -> None:
    """On a loop the fleet rebuilds its ring in slices; under Split BACKENDS it
    builds the arms' rings in the same slices (``Fleet.derive``), for the
    membership the experiment starts on and for every change after, so that no
    request builds one (a 128-backend arm's ring is ~100 ms of work)."""
    members = fleet(8, {i: ("small",) for i in range(4)})
    balancer = Balancer(members, parse_routing(HALVES), seed=1)
    split = balancer.arms.split  # type: ignore[union-attr]
    assert split is not None
    for change in range(3):
        await members.settled()
        owned = split.owned()
        assert owned is not None
        for arm in ("control", "prefix"):
            for pool in (members, members.pools["small"]):
                part = split.part(arm, pool)
                mine = {n: w for n, w in pool.ring.weights.items() if n in owned[arm]}
                assert isinstance(part, Part)
                assert part.ring is members.derived_ring(mine, {})  # the fleet's, published
        members.add(BackendSpec(name=f"new{change}", url=f"http://10.0.1.{change}:8000"))
    balancer.configure(parse_routing({"RoutingStrategy": "PREFIX_AWARE"}))
    assert members.derive is None  # the experiment is over: no arm's ring is built


def test_an_arm_routes_a_model_over_its_own_backends_of_that_models_pool() -> None:
    # b0-b3 serve "small", b4-b7 "large": each arm owns some of each? Not necessarily;
    # where it owns none of a pool, it routes over the whole pool.
    members = fleet(8, {i: ("small",) if i < 4 else ("large",) for i in range(8)})
    balancer = Balancer(members, parse_routing(HALVES), seed=1)
    owned = balancer.arms.split.owned()  # type: ignore[union-attr]
    assert owned is not None
    for model in ("small", "large"):
        pool = members.members_for(model)
        assert pool is not None
        seen = routed(balancer, KEYS[:1000], members=pool)
        for arm, counts in seen.items():
            mine = set(owned[arm]) & set(pool.members)
            assert set(counts) == (mine or set(pool.members))


def test_an_arm_without_an_available_backend_spills_over_and_a_small_fleet_suspends() -> None:
    members = fleet(4)
    balancer = Balancer(members, parse_routing(HALVES), seed=1)
    experiment_ = balancer.arms
    assert experiment_ is not None
    split = experiment_.split
    assert split is not None
    owned = split.owned()
    assert owned is not None
    prefix = experiment_.arms[1].balancer
    assert isinstance(prefix.members(), Part)
    assert prefix.members().model == FLEET_PART
    for name in owned["prefix"]:
        members.set_healthy(name, False)
    # None of its own is up: the fleet's available backends serve it (the control's).
    assert prefix.members() is members
    assert set(routed(balancer, KEYS[:400])["prefix"]) == set(owned["control"])
    members.set_healthy(owned["prefix"][0], True)
    assert set(routed(balancer, KEYS[:400])["prefix"]) == {owned["prefix"][0]}
    # Below two backends for two arms: suspended, both arms route over the fleet.
    for name in sorted(members.backends)[1:]:
        members.remove(name)
    assert split.owned() is None
    view = experiment_.view()
    assert view.split_suspended
    assert [arm.owns for arm in view.arms] == [None, None]
    assert prefix.members() is members
    members.add(BackendSpec(name="b9", url="http://10.0.0.9:8000"))
    assert split.owned() is not None  # enough again: resumed
    assert members.loads.total == 0


def test_an_arms_placement_travels_between_processes_on_its_own_ring() -> None:
    """Two processes with the same split: a new key placed by one's TRAFFIC arm on its
    own backends reaches the other's same arm (tagged ``arm prefix ,``)."""
    routing = parse_routing(HALVES)
    one, two = (Balancer(fleet(8), routing, seed=i) for i in (1, 2))
    one.share_placement(1)
    two.share_placement(2)
    assert one.arms is not None
    assert two.arms is not None
    key = next(k for k in KEYS if one.arms.assign(k).name == "prefix")
    choice = one.arms.arms[1].balancer.choose(key)
    assert choice is not None
    records = one.publish_records()
    assert {record.pool for record in records} == {f"arm prefix {FLEET_PART}"}
    two.apply_records(records)
    other = two.arms.arms[1].balancer
    placement = other.placement_of(other.members())
    assert placement is not None
    assert placement.home(key) == choice.backend.name
    choice.release()
