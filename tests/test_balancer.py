"""The routing strategies (``router/balancer.py``) on a ``Fleet``, without a router.

``Balancer.choose`` picks a backend and takes its lease in the same step, so the
next choice already sees it; requests without a key go least-outstanding
whatever the strategy; ``avoid`` and unavailable backends are skipped.  The same
strategies through a running router, with real simulated instances, are in
``tests/test_router_routing.py``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from hashring import hash_key
from router.balancer import SATURATED, Balancer, Choice
from router.config import BackendSpec, PrefixAwareRoutingConfig, RoutingConfig, Strategy
from router.fleet import AdminState, Fleet

KEY = hash_key(b"You are a helpful assistant. " * 20)


def fleet(**weights: int) -> Fleet:
    specs = [
        BackendSpec(name, f"http://127.0.0.1:{9000 + i}", weight)
        for i, (name, weight) in enumerate(weights.items())
    ]
    return Fleet(specs)  # no running loop: the ring is built before this returns


def balancer(members: Fleet, strategy: Strategy = Strategy.PREFIX_AWARE, **prefix: Any) -> Balancer:
    config = RoutingConfig(strategy, PrefixAwareRoutingConfig(**prefix))
    return Balancer(members, config, seed=1)


def take(chooser: Balancer, key: int | None, count: int) -> list[Choice]:
    choices = [chooser.choose(key) for _ in range(count)]
    assert None not in choices
    return [c for c in choices if c is not None]


@pytest.mark.parametrize("strategy", list(Strategy))
def test_each_choice_takes_its_lease_so_the_next_one_sees_it(strategy: Strategy) -> None:
    members = fleet(a=1, b=1, c=2)
    chooser = balancer(members, strategy)
    # Keyless: least outstanding per unit of weight, whatever the strategy.
    choices = take(chooser, None, 8)
    assert {c.decision for c in choices} == {"passthrough"}
    assert dict(members.loads.counts) == {"a": 2, "b": 2, "c": 4}
    assert [members.backends[n].requests for n in "abc"] == [2, 2, 4]
    for choice in choices:
        choice.release()
    assert members.loads.total == 0


def test_least_outstanding_fills_by_weight_with_keys_too() -> None:
    members = fleet(a=1, b=3)
    choices = take(balancer(members, Strategy.LEAST_OUTSTANDING_REQUESTS), KEY, 8)
    assert {c.decision for c in choices} == {"least_outstanding"}
    assert dict(members.loads.counts) == {"a": 2, "b": 6}


def test_prefix_aware_walks_the_ring_past_the_threshold_then_falls_back() -> None:
    members = fleet(a=1, b=1, c=1)
    walk = list(members.ring.walk(KEY))
    choices = take(balancer(members, concurrency_threshold=2), KEY, 7)
    assert [(c.backend.name, c.decision, c.position) for c in choices[:6]] == [
        (walk[0], "primary", 0),
        (walk[0], "primary", 0),
        (walk[1], "overflow", 1),
        (walk[1], "overflow", 1),
        (walk[2], "overflow", 2),
        (walk[2], "overflow", 2),
    ]
    # Every member of the walk at its threshold: the least busy overall.
    assert choices[6].decision == "fallback"
    assert members.backends[walk[1]].overflow == 2
    assert sum(b.fallback for b in members.backends.values()) == 1


@pytest.mark.parametrize("scope", ["IN_FLIGHT", "PREFILL"])
def test_a_spread_claim_takes_a_free_place_with_probability_free_over_spread(scope: str) -> None:
    members = fleet(a=1, b=1, c=1)
    first, second, _ = members.ring.walk(KEY)
    lanes = {"balance_mode": "IN_FLIGHT", "concurrency_scope": scope}
    chooser = balancer(members, concurrency_threshold=4, **lanes)
    held = take(chooser, KEY, 3)  # the first member: one place left of four
    assert {c.backend.name for c in held} == {first}
    chooser.set_claim_spread(2)
    assert chooser.claim_spread == 2
    landed = Counter()
    for _ in range(400):  # seeded: the same draws every run
        choice = chooser.choose(KEY)
        assert choice is not None
        landed[choice.backend.name, choice.decision] += 1
        choice.release()  # the walk sees the same loads each time
    # One place free over a spread of 2: half the claims take it, the rest go on.
    assert landed.keys() == {(first, "primary"), (second, "overflow")}
    assert 150 < landed[first, "primary"] < 250
    # Two places free: every claim takes one (min(f, c) / c).
    held.pop().release()
    for _ in range(100):
        choice = chooser.choose(KEY)
        assert choice is not None
        assert choice.backend.name == first
        choice.release()
    chooser.set_claim_spread(1)  # off: the exact walk
    for choice in held:
        choice.release()
    assert [c.backend.name for c in take(chooser, KEY, 4)] == [first] * 4
    with pytest.raises(ValueError, match="at least 1"):
        chooser.set_claim_spread(0)


def test_a_spread_claim_is_never_read_as_a_saturated_fleet() -> None:
    members = fleet(a=1, b=1)
    first, second = members.ring.walk(KEY)
    chooser = balancer(members, concurrency_threshold=2, balance_mode="IN_FLIGHT")
    held = take(chooser, KEY, 3)  # the first member full, one place left on the second
    assert [c.backend.name for c in held] == [first, first, second]
    chooser.set_claim_spread(2)
    drawn = 0
    for _ in range(200):  # seeded: the same draws every run
        alone = chooser.peek(KEY)  # the draw the next choice makes, without the queue
        assert alone is not None
        drawn += alone[1] == "fallback"
        assert not chooser.saturated(KEY)
        peeked = chooser.peek(KEY, queue=True)
        choice = chooser.choose(KEY, queue=True)
        assert isinstance(choice, Choice)
        assert peeked is not None
        assert (choice.backend.name, choice.decision) == (second, "overflow")
        assert (peeked[0].name, peeked[1]) == (second, "overflow")
        choice.release()
    assert 0 < drawn < 200  # the draw did fall back, and the queue walked again
    held.append(chooser.choose(KEY))  # type: ignore[arg-type]
    assert chooser.saturated(KEY)
    assert chooser.choose(KEY, queue=True) is SATURATED  # both full now: saturated for real


def test_the_spread_that_applies_is_at_most_the_threshold_and_none_under_traffic() -> None:
    members = fleet(a=1, b=1, c=1)
    in_flight = balancer(members, concurrency_threshold=3, balance_mode="IN_FLIGHT")
    in_flight.set_claim_spread(5)
    assert in_flight.claim_spread == 3  # a draw past the threshold only falls back
    traffic = balancer(members, balance_mode="TRAFFIC")
    traffic.set_claim_spread(2)
    assert traffic.claim_spread == 1  # TRAFFIC's placement reads no drawn threshold
    random = balancer(members, Strategy.RANDOM)
    random.set_claim_spread(2)
    assert random.claim_spread == 1


def test_avoided_and_unavailable_backends_are_never_chosen() -> None:
    members = fleet(a=1, b=1, c=1)
    primary = members.ring.primary(KEY)
    assert primary is not None
    for strategy in Strategy:
        chooser = balancer(members, strategy)
        for key in (KEY, None):
            for _ in range(20):
                choice = chooser.choose(key, avoid={primary})
                assert choice is not None
                assert choice.backend.name != primary
                choice.release()
            assert chooser.choose(key, avoid={"a", "b", "c"}) is None
    members.set_state(primary, AdminState.DRAINING)
    others = set("abc") - {primary}
    for name in others:
        members.set_healthy(name, False)
    for strategy in Strategy:
        assert balancer(members, strategy).choose(KEY) is None
    members.set_healthy(others.pop(), True)
    for strategy in Strategy:
        choice = balancer(members, strategy).choose(KEY)
        assert choice is not None
        assert choice.backend.available
        choice.release()
    assert members.loads.total == 0


def test_random_is_weighted_and_replayed_by_its_seed() -> None:
    members = fleet(a=1, b=3)
    picks = [c.backend.name for c in take(balancer(members, Strategy.RANDOM), KEY, 4000)]
    again = [c.backend.name for c in take(balancer(members, Strategy.RANDOM), KEY, 4000)]
    assert picks == again  # the same seed, the same picks
    share = Counter(picks)["b"] / len(picks)
    assert 0.70 < share < 0.80, share  # weight 3 of 4; seeded, so not by chance


def test_prefill_scope_stops_counting_a_request_once_it_is_answered() -> None:
    members = fleet(a=1, b=1)
    chooser = balancer(members, concurrency_threshold=1, concurrency_scope="PREFILL")
    first = chooser.choose(KEY)
    assert first is not None
    assert (members.waiting.total, members.loads.total) == (1, 1)
    first.first_byte()  # the backend answered: its prefill is done
    assert (members.waiting.total, members.loads.total) == (0, 1)
    second = chooser.choose(KEY)
    assert second is not None
    assert second.backend is first.backend  # the threshold counts only the unanswered
    assert second.decision == "primary"
    first.release()
    second.release()
    assert (members.waiting.total, members.loads.total) == (0, 0)


def _counters(members: Fleet) -> list[tuple[str, int, int, int, int]]:
    return [
        (b.name, b.requests, b.overflow, b.fallback, members.loads.get(b.name))
        for b in members.backends.values()
    ]


@pytest.mark.parametrize(
    ("strategy", "prefix"),
    [
        (Strategy.RANDOM, {}),
        (Strategy.LEAST_OUTSTANDING_REQUESTS, {}),
        (Strategy.PREFIX_AWARE, {"concurrency_threshold": 2}),  # TRAFFIC + PREFILL
        (
            Strategy.PREFIX_AWARE,
            {
                "concurrency_threshold": 3,
                "balance_factor": 1.2,
                "balance_mode": "IN_FLIGHT",
                "concurrency_scope": "IN_FLIGHT",
            },
        ),
        (Strategy.PREFIX_AWARE, {"concurrency_threshold": 2, "balance_mode": "IN_FLIGHT"}),
    ],
)
def test_peek_is_the_next_choice_and_changes_nothing(
    strategy: Strategy, prefix: dict[str, Any]
) -> None:
    # The admin dry run (router.explain): before every real choice, peek twice (the
    # second answer proves the first consumed no draw and placed nothing), then
    # choose: the same backend, decision and position; no counter moved by the peeks.
    members = fleet(a=1, b=1, c=2)
    chooser = balancer(members, strategy, **prefix)
    held = []
    keys = [KEY, hash_key(b"other"), None, KEY, KEY, hash_key(b"third"), KEY, KEY, KEY]
    for key in keys:
        before = _counters(members)
        peeked = chooser.peek(key)
        assert chooser.peek(key) == peeked
        assert _counters(members) == before
        choice = chooser.choose(key)
        assert choice is not None
        assert peeked is not None
        assert (choice.backend, choice.decision, choice.position) == peeked
        held.append(choice)  # kept in flight: later picks overflow and fall back
    for choice in held:
        choice.release()
