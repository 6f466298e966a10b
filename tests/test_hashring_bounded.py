"""Bounded-load picks: the walk order, the bounds, fallback, avoid; and leases."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hashring import Decision, LoadBound, LoadTracker, Pick, Ring, pick
from hashring.bounded import fallback_ceiling
from tests.harness.fallback import expected_fallback

MEMBERS = {"a": 1, "b": 2, "c": 1, "d": 3, "e": 1}


def limits(ring: Ring, loads: dict[str, int], bound: LoadBound, avoid: set[str]) -> dict[str, int]:
    candidates = [m for m in ring.members if m not in avoid]
    total = sum(loads.get(m, 0) for m in candidates)
    total_weight = sum(ring.weight(m) for m in candidates)
    return {m: bound.limit(ring.weight(m), total, total_weight) for m in candidates}


operations = st.lists(
    st.one_of(
        st.tuples(st.just("assign"), st.integers(0, 2**64 - 1)),
        st.tuples(st.just("release"), st.integers(0, 10_000)),
    ),
    min_size=1,
    max_size=300,
)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.dictionaries(st.sampled_from("abcdefgh"), st.integers(1, 3), min_size=1),
    threshold=st.integers(1, 6),
    balance=st.one_of(st.none(), st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0, 3.0])),
    ops=operations,
    avoid=st.sets(st.sampled_from("abcdefgh"), max_size=2),
)
def test_assignments_never_exceed_a_bound_while_some_member_is_below_its_own(
    weights: dict[str, int],
    threshold: int,
    balance: float | None,
    ops: list[tuple[str, int]],
    avoid: set[str],
) -> None:
    ring = Ring(weights, vnodes=8)
    bound = LoadBound(threshold, balance)
    tracker = LoadTracker()
    held = []
    for op, value in ops:
        if op == "release":
            if held:
                held.pop(value % len(held)).release()
            continue
        before = dict(tracker.counts)
        allowed = limits(ring, before, bound, avoid)
        chosen = pick(
            ring, value, tracker.counts, bound, avoid=frozenset(avoid), total=tracker.total
        )
        if not allowed:  # every member avoided
            assert chosen is None
            continue
        assert chosen is not None
        assert chosen.member not in avoid
        walk = [m for m in ring.walk(value) if m not in avoid]
        assert walk[chosen.position] == chosen.member
        if chosen.decision is Decision.FALLBACK:
            # Only when nobody is below their bound, and then the least loaded (with
            # the tolerance of a queue past the threshold).
            assert all(before.get(m, 0) >= allowed[m] for m in allowed)
            assert chosen.member == expected_fallback(walk, before, threshold)
        else:
            # The first member of the walk that is below its bound.
            earlier = walk[: chosen.position]
            assert all(before.get(m, 0) >= allowed[m] for m in earlier)
            assert before.get(chosen.member, 0) < allowed[chosen.member]
            expected = Decision.PRIMARY if chosen.position == 0 else Decision.OVERFLOW
            assert chosen.decision is expected
        held.append(tracker.acquire(chosen.member))
        assert tracker.total == sum(tracker.counts.values()) == len(held)
    for lease in held:
        lease.release()
    assert tracker.total == 0
    assert dict(tracker.counts) == {}


@settings(max_examples=300, deadline=None)
@given(
    key=st.integers(0, 2**64 - 1),
    in_flight=st.dictionaries(st.sampled_from(sorted(MEMBERS)), st.integers(0, 12)),
    answered=st.dictionaries(st.sampled_from(sorted(MEMBERS)), st.integers(0, 12)),
    threshold=st.integers(1, 6),
    balance=st.one_of(st.none(), st.sampled_from([1.0, 1.25, 1.5, 2.0])),
    avoid=st.sets(st.sampled_from(sorted(MEMBERS)), max_size=2),
)
def test_the_threshold_and_the_balance_factor_can_count_different_loads(
    key: int,
    in_flight: dict[str, int],
    answered: dict[str, int],
    threshold: int,
    balance: float | None,
    avoid: set[str],
) -> None:
    # ConcurrencyScope PREFILL: the threshold reads the requests not answered yet,
    # the balance factor and the fallback read every request in flight.
    waiting = {m: n - min(n, answered.get(m, 0)) for m, n in in_flight.items()}
    ring = Ring(MEMBERS, vnodes=16)
    bound = LoadBound(threshold, balance)
    chosen = pick(
        ring,
        key,
        waiting,
        bound,
        avoid=frozenset(avoid),
        balance_loads=in_flight,
        balance_total=sum(in_flight.values()),
    )
    assert chosen is not None
    walk = [m for m in ring.walk(key) if m not in avoid]
    total = sum(in_flight.get(m, 0) for m in walk)
    total_weight = sum(ring.weight(m) for m in walk)
    share = {m: LoadBound(10**9, balance).limit(ring.weight(m), total, total_weight) for m in walk}

    def eligible(m: str) -> bool:
        return waiting.get(m, 0) < threshold and in_flight.get(m, 0) < share[m]

    assert walk[chosen.position] == chosen.member
    if chosen.decision is Decision.FALLBACK:
        assert not any(map(eligible, walk))
        assert chosen.member == expected_fallback(walk, in_flight, threshold, counted=waiting)
    else:
        assert eligible(chosen.member)
        assert not any(map(eligible, walk[: chosen.position]))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1), st.sets(st.sampled_from(sorted(MEMBERS))))
def test_avoided_members_are_never_picked(key: int, avoid: set[str]) -> None:
    ring = Ring(MEMBERS, vnodes=16)
    # Saturate everyone so that fallback, the last resort, is exercised too.
    loads = dict.fromkeys(MEMBERS, 3)
    for bound in (LoadBound(10), LoadBound(1)):
        chosen = pick(ring, key, loads, bound, avoid=frozenset(avoid))
        if avoid == set(MEMBERS):
            assert chosen is None
        else:
            assert chosen is not None
            assert chosen.member not in avoid


def test_overflow_goes_to_the_next_member_of_the_walk_every_time() -> None:
    ring = Ring(MEMBERS, vnodes=16)
    key = 0xDEADBEEF
    first, second, third = list(ring.walk(key))[:3]
    bound = LoadBound(threshold=2)
    tracker = LoadTracker()
    decisions = []
    for _ in range(6):
        chosen = pick(ring, key, tracker.counts, bound)
        assert chosen is not None
        tracker.acquire(chosen.member)
        decisions.append(chosen)
    assert decisions == [
        Pick(first, Decision.PRIMARY, 0),
        Pick(first, Decision.PRIMARY, 0),
        Pick(second, Decision.OVERFLOW, 1),
        Pick(second, Decision.OVERFLOW, 1),
        Pick(third, Decision.OVERFLOW, 2),
        Pick(third, Decision.OVERFLOW, 2),
    ]


def test_a_down_primary_hands_its_keys_to_the_next_member_as_primary() -> None:
    ring = Ring(MEMBERS, vnodes=16)
    key = 12345
    first, second = list(ring.walk(key))[:2]
    chosen = pick(ring, key, {}, LoadBound(4), avoid=frozenset({first}))
    assert chosen == Pick(second, Decision.PRIMARY, 0)


def test_fallback_takes_the_least_loaded_earliest_in_the_walk() -> None:
    ring = Ring({"a": 1, "b": 1, "c": 1}, vnodes=16)
    key = 99
    walk = list(ring.walk(key))
    loads = {walk[0]: 5, walk[1]: 4, walk[2]: 4}
    # Just past the threshold (a queue of 1 at most): the fewest, earliest on ties.
    assert pick(ring, key, loads, LoadBound(3)) == Pick(walk[1], Decision.FALLBACK, 1)
    assert pick(ring, key, loads | {walk[2]: 3}, LoadBound(3)).member == walk[2]


def test_deep_past_the_threshold_the_fallback_keeps_the_walk_order_within_its_tolerance() -> None:
    ring = Ring({"a": 1, "b": 1, "c": 1}, vnodes=16)
    key = 99
    walk = list(ring.walk(key))
    # Threshold 10, the least loaded queues 20 past it: up to 40 in flight count as least
    # loaded (FALLBACK_TOLERANCE 1/2), so the key's primary keeps it at 40, not at 41.
    assert fallback_ceiling(30, 30, 10) == 40
    loads = {walk[0]: 40, walk[1]: 35, walk[2]: 30}
    assert pick(ring, key, loads, LoadBound(10)) == Pick(walk[0], Decision.FALLBACK, 0)
    loads[walk[0]] = 41
    assert pick(ring, key, loads, LoadBound(10)) == Pick(walk[1], Decision.FALLBACK, 1)
    loads[walk[1]] = 41
    assert pick(ring, key, loads, LoadBound(10)) == Pick(walk[2], Decision.FALLBACK, 2)
    # The queue is counted from the threshold as configured, not as a draw lowered it
    # (from 5 the ceiling would be 42 and take walk[0]).
    assert pick(ring, key, loads, LoadBound(10), slack=5) == Pick(walk[2], Decision.FALLBACK, 2)


def test_balance_factor_caps_a_member_at_its_weighted_share() -> None:
    ring = Ring({"a": 1, "b": 1, "c": 1, "d": 1}, vnodes=16)
    bound = LoadBound(threshold=1000, balance=1.25)
    tracker = LoadTracker()
    key = 7
    for _ in range(40):
        chosen = pick(ring, key, tracker.counts, bound, total=tracker.total)
        assert chosen is not None
        tracker.acquire(chosen.member)
    # Everyone asks for the same key, yet nobody holds more than ceil(1.25 * 40 / 4) = 13.
    assert max(tracker.counts.values()) <= 13
    assert sum(tracker.counts.values()) == 40


def test_limit_arithmetic_is_exact() -> None:
    # 1.1 * 10 in floats is 11.000000000000002; the bound must be 11, not 12.
    assert LoadBound(100, 1.1).limit(weight=1, total=9, total_weight=1) == 11
    assert LoadBound(100, 1.25).limit(weight=1, total=7, total_weight=4) == 3  # ceil(2.5)
    assert LoadBound(2, 3.0).limit(weight=1, total=7, total_weight=4) == 2  # threshold wins
    assert LoadBound(5).limit(weight=1, total=1000, total_weight=1) == 5


@pytest.mark.parametrize(
    ("threshold", "balance", "message"),
    [(0, None, "threshold"), (1, 0.9, "balance factor")],
)
def test_bad_bounds_are_rejected(threshold: int, balance: float | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LoadBound(threshold, balance)


def test_empty_ring_picks_nothing() -> None:
    assert pick(Ring(), 1, {}, LoadBound(1)) is None


def test_a_lease_is_released_exactly_once() -> None:
    tracker = LoadTracker()
    lease = tracker.acquire("a")
    other = tracker.acquire("a")
    assert tracker.get("a") == 2
    assert lease.held
    assert lease.release() is True
    assert lease.release() is False
    assert not lease.held
    assert tracker.get("a") == 1
    assert tracker.total == 1
    assert other.release() is True
    assert other.release() is False
    assert tracker.total == 0
    assert "a" not in tracker.counts
    with pytest.raises(TypeError):
        tracker.counts["a"] = 1  # type: ignore[index]


def test_on_idle_fires_when_a_member_has_nothing_left_in_flight() -> None:
    tracker = LoadTracker()
    idle: list[str] = []
    tracker.on_idle = idle.append
    first, second = tracker.acquire("a"), tracker.acquire("a")
    first.release()
    assert idle == []
    second.release()
    second.release()
    assert idle == ["a"]
