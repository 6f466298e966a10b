"""Sticky placement bounded by traffic share (BalanceMode TRAFFIC)."""

from __future__ import annotations

import random
from collections import Counter, deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hashring import Decision, Pick, Placement, Ring

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


SEVEN = {f"m{i}": 1 for i in range(7)}


def route_with_leases(
    placement: Placement, ring: Ring, keys: list[int], in_flight: int, avoid: frozenset[str]
) -> list[Pick]:
    """Route ``keys`` in turn, each request held in flight for the next ``in_flight``
    routings (a steady concurrency), as the balancer's leases would be."""
    loads: Counter[str] = Counter()
    held: deque[str] = deque()
    picks = []
    for key in keys:
        chosen = placement.route(ring, key, loads, threshold=1000, avoid=avoid)
        assert chosen is not None
        picks.append(chosen)
        loads[chosen.member] += 1
        held.append(chosen.member)
        if len(held) > in_flight:
            loads[held.popleft()] -= 1
    return picks


@pytest.mark.parametrize("avoid", [frozenset(), frozenset({"m3"})])
def test_a_hot_key_is_served_by_replicas_and_keeps_its_home(avoid: frozenset[str]) -> None:
    # One shared prefix carries all traffic (the sysprompt workload): on its home
    # alone it would be a hot spot.  Once its share of the window passes 1.5
    # members' shares it spreads over ceil(share) replicas, the least loaded first.
    ring = Ring(SEVEN, vnodes=64)
    placement = Placement(1.05)
    hot = 0x5EED
    picks = route_with_leases(placement, ring, [hot] * 4000, in_flight=14, avoid=avoid)
    home = placement.home(hot)
    assert home is not None
    assert home not in avoid
    steady = Counter(p.member for p in picks[2000:])
    members = set(SEVEN) - avoid
    assert set(steady) == members  # every member available serves it ...
    fair = 2000 / len(members)
    assert all(0.95 * fair <= n <= 1.05 * fair for n in steady.values()), steady  # ... evenly
    assert all(p.decision is Decision.PRIMARY for p in picks[2000:] if p.member == home)
    assert all(p.decision is Decision.OVERFLOW for p in picks[2000:] if p.member != home)
    assert placement.home(hot) == home  # replicas do not move the key


@pytest.mark.parametrize("avoid_second", [False, True])
def test_a_hot_key_takes_ceil_share_replicas_and_an_avoided_one_is_replaced(
    avoid_second: bool,
) -> None:
    # Every third request is the hot key: 2.33 members' shares, three replicas.
    ring = Ring(SEVEN, vnodes=64)
    hot = 0xC0FFEE
    order = [m for m in ring.walk(hot)]
    placement = Placement(1.05)
    placement.route(ring, hot, {}, threshold=1000)  # its home, before any avoid
    home = placement.home(hot)
    assert home is not None
    others = [m for m in order if m != home]
    avoid = frozenset({others[0]}) if avoid_second else frozenset()
    keys = [hot if i % 3 == 0 else 10_000 + i for i in range(6000)]
    picks = route_with_leases(placement, ring, keys, in_flight=14, avoid=avoid)
    served = {p.member for key, p in list(zip(keys, picks, strict=True))[3000:] if key == hot}
    usable = [m for m in others if m not in avoid]
    assert served == {home, usable[0], usable[1]}
    assert placement.home(hot) == home


def test_an_avoided_home_is_passed_by_and_kept() -> None:
    ring = Ring(SEVEN, vnodes=64)
    placement = Placement(1.05)
    first = placement.route(ring, 5, {}, threshold=10)
    assert first is not None
    home = first.member
    # Down, draining or already tried by this request: the walk passes it by.
    detour = placement.route(ring, 5, {}, threshold=10, avoid=frozenset({home}))
    assert detour is not None
    assert detour.member != home
    assert detour.decision is Decision.OVERFLOW
    assert placement.home(5) == home  # and the key goes back when it returns
    assert placement.route(ring, 5, {}, threshold=10) == (home, Decision.PRIMARY, 0)


def test_past_eight_replicas_a_request_compares_two() -> None:
    members = {f"m{i}": 1 for i in range(16)}
    ring = Ring(members, vnodes=16)
    placement = Placement(1.05)
    for _ in range(3000):  # all traffic: 16 replicas
        placement.route(ring, 3, {}, threshold=1000)
    idle = "m7"
    loads = {m: 0 if m == idle else 5 for m in members}
    chosen = [placement.route(ring, 3, {}, threshold=1000, fallback_loads=loads) for _ in range(16)]
    # A full scan would send all sixteen to the one idle replica; two choices in
    # rotation find it only when it is one of the two.
    assert 1 <= sum(p is not None and p.member == idle for p in chosen) < 16


def test_a_hot_key_on_a_large_fleet_spreads_by_two_choices() -> None:
    # 64 members: past SCAN_REPLICAS each request compares two replicas in
    # rotation (O(1) per request), and the spread stays even.
    members = {f"m{i}": 1 for i in range(64)}
    ring = Ring(members, vnodes=16)
    placement = Placement(1.05)
    picks = route_with_leases(placement, ring, [7] * 40_000, in_flight=128, avoid=frozenset())
    steady = Counter(p.member for p in picks[20_000:])
    assert set(steady) == set(members)
    fair = 20_000 / 64
    assert all(0.9 * fair <= n <= 1.1 * fair for n in steady.values()), steady
    # A new ring (a member removed) gets a new replica list: the gone one is never chosen.
    smaller = ring.without_member("m5")
    later = route_with_leases(placement, smaller, [7] * 2000, in_flight=128, avoid=frozenset())
    assert "m5" not in {p.member for p in later}


def test_the_former_rule_turns_a_key_hot_past_one_and_a_half_shares_of_the_full_window() -> None:
    # hot_evidence=None: shares count against the full window (the rule before the
    # evidence test), so a cold start calls nothing hot for 220 decisions.
    ring = Ring(SEVEN, vnodes=64)
    placement = Placement(1.05, hot_evidence=None)
    key = 99
    for _ in range(219):  # 219 * 7 / 1024 window = 1.497 members' shares: not hot
        placement.route(ring, key, {}, threshold=1000)
    home = placement.home(key)
    assert home is not None
    busy_home = {home: 5}  # the home is the busiest; a replica would be chosen if hot
    assert placement.route(ring, key, {}, threshold=1000, fallback_loads=busy_home) == (
        home,
        Decision.PRIMARY,
        0,
    )
    # Now 220 in the window: 1.504 shares, two replicas, the home and the next
    # member of its walk; the idle one takes it.
    chosen = placement.route(ring, key, {}, threshold=1000, fallback_loads=busy_home)
    assert chosen is not None
    assert chosen.decision is Decision.OVERFLOW
    assert chosen.position == 1
    assert chosen.member == next(m for m in ring.walk(key) if m != home)


def test_a_key_in_every_request_is_hot_after_four_decisions_on_seven_members() -> None:
    # A fresh start: the evidence test needs 4 decisions, not 1.5 shares of 1,024.
    # Three all-one-key decisions on 7 members are 7**-3 = 2.9e-3 likely for a key
    # of one fair share, not below 1e-3; four are 4.2e-4.
    ring = Ring(SEVEN, vnodes=64)
    placement = Placement(1.05)
    key = 0xD0C
    for _ in range(3):
        placement.route(ring, key, {}, threshold=1000)
    home = placement.home(key)
    assert home is not None
    assert placement.hot_share(key, 7) == 0.0
    busy_home = {home: 5}
    assert placement.route(ring, key, {}, threshold=1000, fallback_loads=busy_home) == (
        home,
        Decision.PRIMARY,
        0,
    )
    # Four decisions, all this key: hot, at 7 shares (every member a replica).
    assert placement.hot_share(key, 7) == 7.0
    chosen = placement.route(ring, key, {}, threshold=1000, fallback_loads=busy_home)
    assert chosen is not None
    assert chosen.member != home
    assert chosen.decision is Decision.OVERFLOW
    assert placement.home(key) == home


def test_a_key_in_eleven_of_the_first_twenty_two_decisions_is_hot() -> None:
    # The case: a few documents carry most of the first requests.  Nine of
    # twenty is 3.15 shares but not yet the evidence (Chernoff: e**-5.45 > 1e-3),
    # nor ten of twenty-one (e**-6.63); eleven of twenty-two is (e**-7.85).
    ring = Ring(SEVEN, vnodes=64)
    placement = Placement(1.05)
    hot = 0xF00D
    others = iter(range(1, 100))
    for i in range(20):
        placement.route(ring, hot if i % 2 and i < 19 else next(others), {}, threshold=1000)
    assert Counter(k for _, k in placement._recent)[hot] == 9
    assert placement.hot_share(hot, 7) == 0.0
    placement.route(ring, hot, {}, threshold=1000)
    assert placement.hot_share(hot, 7) == 0.0  # 10 of 21
    placement.route(ring, hot, {}, threshold=1000)
    assert placement.hot_share(hot, 7) == pytest.approx(11 * 7 / 22)


def test_in_a_full_window_one_and_a_half_shares_is_hot_as_before() -> None:
    # In a full window (1,024 decisions on 7 members) the evidence test always
    # passes at 1.5 shares, so the rule is the plain share test: 219 of 1,024 is
    # 1.497 shares (not hot), 220 is 1.504 (hot).
    ring = Ring(SEVEN, vnodes=64)
    placement = Placement(1.05)
    key = 77
    for _ in range(220):  # hot from the fifth on (four decisions of evidence)
        placement.route(ring, key, {}, threshold=1000)
    for i in range(1024 - 220):  # then others fill the window
        placement.route(ring, 10_000 + i, {}, threshold=1000)
    assert placement.window == len(placement._recent) == 1024
    assert placement.hot_share(key, 7) == pytest.approx(220 * 7 / 1024)
    placement.route(ring, 90_000, {}, threshold=1000)  # the oldest decision, the key's, leaves
    assert Counter(k for _, k in placement._recent)[key] == 219
    assert placement.hot_share(key, 7) == 0.0


@pytest.mark.parametrize(("members", "keys"), [(7, 7), (7, 70), (2, 2), (3, 9)])
def test_no_key_is_called_hot_in_a_uniform_stream(members: int, keys: int) -> None:
    # Keys of one fair share each (the hardest case: every key as big as a member's
    # share) or smaller, drawn uniformly, seeded; tested on every decision.
    ring = Ring({f"m{i}": 1 for i in range(members)}, vnodes=64)
    placement = Placement(1.05)
    rng = random.Random(f"uniform:{members}:{keys}")
    pool = [rng.getrandbits(64) for _ in range(keys)]
    for _ in range(3000):
        key = pool[rng.randrange(keys)]
        assert placement.hot_share(key, members) == 0.0
        home = placement.home(key)
        chosen = placement.route(ring, key, {}, threshold=1000)
        assert chosen is not None
        if home is not None:  # no replica: every placed key goes to its home
            assert chosen == (home, Decision.PRIMARY, 0)


def test_hot_evidence_out_of_range_is_rejected() -> None:
    for bad in (0.0, 1.0, 2.0, -1e-3):
        with pytest.raises(ValueError, match=r"hot_evidence must be in \(0, 1\)"):
            Placement(1.05, hot_evidence=bad)


def test_keys_below_the_hot_share_stay_on_their_homes() -> None:
    # Seven keys of one member's share each: placement spreads them, none is hot,
    # every request goes to its key's home.
    ring = Ring(SEVEN, vnodes=64)
    placement = Placement(1.05)
    keys = [1000 + k for k in range(7)] * 600
    picks = route_with_leases(placement, ring, keys, in_flight=14, avoid=frozenset())
    for key, chosen in list(zip(keys, picks, strict=True))[7:]:  # each placed once, then:
        assert chosen == (placement.home(key), Decision.PRIMARY, 0)


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


def _state(placement: Placement) -> tuple[object, ...]:
    """Everything ``route`` may change, in comparable form."""
    return (
        list(placement._table.items()),  # order too: least recently used first
        list(placement._recent),
        placement._recent.maxlen,
        dict(placement._counts),
        dict(placement._key_counts),
        placement._tick,
        {key: list(replicas) for key, replicas in placement._replicas.items()},
        placement._replica_ring,
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.just(0), st.integers(0, 11)),  # few keys, key 0 turns hot
            st.dictionaries(st.sampled_from(sorted(MEMBERS)), st.integers(0, 3)),
            st.frozensets(st.sampled_from(sorted(MEMBERS)), max_size=2),
            st.booleans(),  # a member joins (more members: a larger window) before it
        ),
        min_size=1,
        max_size=120,
    ),
    st.integers(1, 3),
    st.integers(2, 20),
)
def test_peek_answers_what_route_would_and_changes_nothing(
    steps: list[tuple[int, dict[str, int], frozenset[str], bool]],
    threshold: int,
    scan: int,
) -> None:
    # The dry run (router.explain) relies on it: same answer from the same state,
    # hot-key replicas, rotation past scan_replicas, avoided members and a window
    # route would refit first (a new member) included.
    members = dict(MEMBERS)
    ring = Ring(members, vnodes=16)
    placement = Placement(1.05)
    placement.scan_replicas = scan
    for key, loads, avoid, grow in steps:
        if grow and len(members) < 16:
            members[f"m{len(members)}"] = 1
            ring = Ring(members, vnodes=16)
        key_hash = key * 0x9E3779B97F4A7C15 % 2**64
        before = _state(placement)
        peeked = placement.peek(ring, key_hash, loads, threshold, avoid=avoid)
        assert _state(placement) == before
        assert placement.peek(ring, key_hash, loads, threshold, avoid=avoid) == peeked
        routed = placement.route(ring, key_hash, loads, threshold, avoid=avoid)
        assert peeked == routed
