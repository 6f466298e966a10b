"""``router.shares``: who is under its share of the requests (pure: the tests pass the clock)."""

from __future__ import annotations

import math

from router.shares import MAX_TENANTS, Shares


def admit(shares: Shares, key: str, times: list[float]) -> None:
    """Requests of ``key`` at ``times`` (the clock never goes back)."""
    for now in times:
        shares.asked(key, now)


def test_a_tenant_alone_is_not_under_its_share_and_a_new_one_beside_it_is() -> None:
    shares = Shares({}, window=10.0)
    assert not shares.under("a", 0.0)  # nobody at all
    admit(shares, "a", [0.0, 0.1, 0.2])
    assert not shares.under("a", 0.3)  # alone: nobody to compare with
    assert shares.under("b", 0.3)  # new beside "a"
    admit(shares, "b", [0.3])
    assert shares.under("b", 0.4)  # 1 of 4 admissions, its share is 1 of 2
    assert not shares.under("a", 0.4)


def test_equal_counts_are_at_the_share_and_recent_ones_weigh_more() -> None:
    shares = Shares({}, window=10.0)
    admit(shares, "a", [0.0])
    admit(shares, "b", [5.0])
    # One each, but a's has decayed for 5 s: b is over, a under.
    assert shares.under("a", 5.0)
    assert not shares.under("b", 5.0)


def test_weights_set_the_share() -> None:
    shares = Shares({"gold": 3.0}, window=10.0)
    admit(shares, "gold", [0.0, 0.0, 0.0, 0.0, 0.0])  # 5 of 8: under its 3/4
    admit(shares, "basic", [0.0, 0.0, 0.0])  # 3 of 8: over its 1/4
    assert shares.under("gold", 0.0)
    assert not shares.under("basic", 0.0)


def test_a_tenant_leaves_the_window_and_the_others_are_alone_again() -> None:
    shares = Shares({}, window=1.0)
    admit(shares, "heavy", [0.0, 0.5])
    admit(shares, "light", [0.6])
    admit(shares, "heavy", [1.0, 1.5])
    assert shares.under("light", 1.5)
    assert shares.next_expiry() == 1.6  # light, the least recently active
    assert len(shares) == 2
    assert not shares.under("heavy", 1.7)  # light left: heavy is alone
    assert len(shares) == 1
    assert shares.next_expiry() == 2.5
    assert not shares.under("heavy", 2.6)  # nobody
    assert len(shares) == 0
    assert shares.next_expiry() is None


def test_memory_is_the_tenants_of_one_window_and_at_most_max_tenants() -> None:
    shares = Shares({}, window=1.0)
    for i in range(10_000):
        shares.asked(f"t{i}", i * 0.01)  # 100 new tenants a second
    assert len(shares) <= 101
    flood = Shares({}, window=10.0)
    for i in range(MAX_TENANTS + 5_000):  # new keys faster than a window lets go
        flood.asked(f"k{i}", 0.0)
    assert len(flood) == MAX_TENANTS
    assert flood.under("k0", 0.0)  # forgotten: new again
    flood.asked("heavy", 0.0)
    flood.asked("heavy", 0.0)
    assert not flood.under("heavy", 0.0)


def test_usages_stay_finite_for_any_run_time() -> None:
    """Usages are scaled by exp(t / window); the scale moves forward as time does."""
    shares = Shares({}, window=1.0)
    now = 0.0
    for _ in range(20_000):  # 1,000 windows
        now += 0.05
        shares.asked("heavy" if int(now * 20) % 4 else "light", now)
    assert shares.under("light", now)
    assert not shares.under("heavy", now)
    assert all(math.isfinite(u.value) for u in shares._tenants.values())
    assert shares._epoch > 0
