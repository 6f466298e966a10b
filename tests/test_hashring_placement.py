"""Sticky placement bounded by traffic share (BalanceMode TRAFFIC)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hashring import Decision, Placement, Ring

MEMBERS = {"a": 1, "b": 1, "c": 2, "d": 1}


def test_a_key_sticks_to_its_home_and_overflows_without_moving() -> None:
    ring = Ring(MEMBERS, vnodes=32)
    placement = Placement(1.05)
    first = placement.route(ring, 42, {}, threshold=2)
    assert first is not None
    home = first.member
    assert placement.home(42) == home
    again = placement.route(ring, 42, {}, threshold=2)
    assert again == (home, Decision.PRIMARY, 0)
    busy = placement.route(ring, 42, {home: 2}, threshold=2)
    assert busy is not None
    assert busy.member != home
    assert busy.decision is Decision.OVERFLOW
    assert placement.home(42) == home  # overflow does not move the key


def test_fallback_takes_the_least_loaded_by_the_fallback_counts() -> None:
    # ConcurrencyScope PREFILL: the threshold counts waiting requests, the fallback
    # every request in flight, so a member full of decoding streams loses it.
    ring = Ring(MEMBERS, vnodes=32)
    walk = list(ring.walk(7))
    waiting = dict.fromkeys(MEMBERS, 3)
    waiting[walk[0]] = 2  # the fewest waiting ...
    in_flight = dict.fromkeys(MEMBERS, 5)
    in_flight[walk[0]] = 40  # ... but the busiest overall
    in_flight[walk[2]] = 1
    chosen = Placement(1.05).route(ring, 7, waiting, threshold=2, fallback_loads=in_flight)
    assert chosen == (walk[2], Decision.FALLBACK, 2)
    alone = Placement(1.05).route(ring, 7, waiting, threshold=2)
    assert alone == (walk[0], Decision.FALLBACK, 0)


def test_new_keys_avoid_members_over_their_share_of_recent_traffic() -> None:
    ring = Ring(MEMBERS, vnodes=32)
    placement = Placement(1.05)
    rng = random.Random(5)
    hot = rng.getrandbits(64)
    for _ in range(600):  # one hot key: its home carries most recent traffic
        placement.route(ring, hot, {}, threshold=1000)
    home = placement.home(hot)
    assert home is not None
    newcomers = [placement.route(ring, rng.getrandbits(64), {}, threshold=1000) for _ in range(50)]
    assert all(p is not None and p.member != home for p in newcomers)


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=400), st.sampled_from([1.0, 1.05, 1.5])
)
def test_placing_new_keys_keeps_every_share_within_its_bound(
    keys: list[int], factor: float
) -> None:
    ring = Ring(MEMBERS, vnodes=16)
    placement = Placement(factor)
    total_weight = sum(MEMBERS.values())
    for key in keys:
        fresh = placement.home(key) is None
        window = len(placement._recent)
        before = {m: placement.share(m) for m in MEMBERS}
        chosen = placement.route(ring, key, {}, threshold=1000)
        assert chosen is not None
        if fresh:
            # Below its bound when placed, unless every member was at its bound.
            bound = {m: factor * (window + 1) * w / total_weight for m, w in MEMBERS.items()}
            assert before[chosen.member] < bound[chosen.member] or all(
                before[m] >= bound[m] for m in MEMBERS
            )


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**64 - 1), st.sets(st.sampled_from(sorted(MEMBERS))))
def test_avoided_members_are_never_chosen(key: int, avoid: set[str]) -> None:
    ring = Ring(MEMBERS, vnodes=16)
    placement = Placement(1.05)
    placement.route(ring, key, {}, threshold=10)  # give it a home first
    chosen = placement.route(
        ring, key, {m: 3 for m in MEMBERS}, threshold=2, avoid=frozenset(avoid)
    )
    if avoid == set(MEMBERS):
        assert chosen is None
    else:
        assert chosen is not None
        assert chosen.member not in avoid


def test_the_table_forgets_least_recently_used_keys_beyond_capacity() -> None:
    ring = Ring(MEMBERS, vnodes=16)
    placement = Placement(1.05, capacity=3)
    for key in range(5):
        placement.route(ring, key, {}, threshold=10)
    assert len(placement) == 3
    assert placement.home(0) is None
    assert placement.home(4) is not None


def test_factor_below_one_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"at least 1\.0"):
        Placement(0.9)
