"""router.cachecheck: the repeated-key table and the verdict rule, pure (no I/O).

Each round is what ``router.health`` does: counts read, then the scrape's figures.
"""

from __future__ import annotations

from typing import Any

import pytest
from structlog.testing import capture_logs

from hashring import hash_key
from router.cachecheck import MIN_REPEATS, SLOTS, CacheCheck, Repeats
from router.config import BackendSpec
from router.fleet import Backend
from router.health import Scraped


def backend(name: str = "gpu-0") -> Backend:
    return Backend(BackendSpec(name=name, url="http://127.0.0.1:9"))


def scraped(hits: float | None, queries: float | None) -> Scraped:
    figures = Scraped()
    figures.hits, figures.queries = hits, queries
    return figures


class Rounds:
    """Drive one backend's check as the scrape rounds do."""

    def __init__(self) -> None:
        self.check = CacheCheck(enabled=True)
        self.backend = backend()
        self.hits = 0.0
        self.queries = 0.0

    def round(self, *, repeats: int = 0, hit_tokens: float = 0.0, queries: float = 0.0) -> str:
        """``repeats`` sent and answered since the last round; the engine's counters
        rose by ``hit_tokens`` and ``queries``; returns the status after it."""
        b = self.backend
        b.repeats_sent += repeats
        b.repeats_answered += repeats
        self.hits += hit_tokens
        self.queries += queries
        self.check.judge(b, b.repeats_sent, b.repeats_answered, scraped(self.hits, self.queries))
        return self.check.status(b.name)


def warnings(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["log_level"] == "warning"]


def test_repeats_count_a_key_sent_again_to_the_same_backend_only() -> None:
    repeats = Repeats()
    a, b = backend("a"), backend("b")
    assert not repeats.sent(1234, a)
    assert not repeats.sent(1234, b)  # another backend: its first sighting there
    assert repeats.sent(1234, a)
    assert repeats.sent(1234, b)
    assert not repeats.sent(5678, a)
    assert (a.repeats_sent, b.repeats_sent) == (1, 1)


def test_repeats_table_is_bounded_and_forgets_rather_than_invents() -> None:
    repeats = Repeats()
    a = backend("a")
    keys = [hash_key(b"%d" % i) for i in range(2 * SLOTS)]  # twice the slots
    for key in keys:
        repeats.sent(key, a)
    assert a.repeats_sent == 0  # nothing seen once counts as a repeat
    found = sum(repeats.sent(key, a) for key in keys)
    assert 0 < found < len(keys) // 2  # some still remembered, never more than fit


def test_no_counters_is_unknown() -> None:
    check = CacheCheck(enabled=True)
    b = backend()
    check.judge(b, 100, 100, scraped(None, None))
    view = check.view(b)
    assert (view.status, view.reason) == ("unknown", "no prefix-cache counters in /metrics")


def test_scraping_off_is_unknown() -> None:
    view = CacheCheck(enabled=False).view(backend())
    assert view.status == "unknown"
    assert "scraping off" in view.reason


def test_flat_hits_under_repeated_keys_is_suspect_and_warned_once() -> None:
    rounds = Rounds()
    with capture_logs() as logs:
        assert rounds.round() == "unknown"  # the window's first scrape
        assert rounds.round() == "unknown"  # its sent count
        assert rounds.round(repeats=MIN_REPEATS - 1) == "unknown"  # not enough yet
        assert rounds.check.view(rounds.backend).evidence == MIN_REPEATS - 1
        assert rounds.round(repeats=1) == "suspect_off"  # vLLM off: queries flat too
        for _ in range(6):  # it stays so: no second warning
            assert rounds.round(repeats=MIN_REPEATS) == "suspect_off"
    (warning,) = warnings(logs)
    assert warning["event"] == "prefix cache suspect off"
    assert (warning["backend"], warning["repeats"], warning["hit_tokens"]) == ("gpu-0", 20, 0)
    view = rounds.check.view(rounds.backend)
    assert (view.status, view.evidence, view.hit_tokens) == ("suspect_off", MIN_REPEATS, 0)
    assert "--enable-prefix-caching" in view.reason


def test_near_zero_hits_is_suspect_too() -> None:
    # A cache that found one block for one repeat in 40: fewer hit tokens than repeats.
    rounds = Rounds()
    rounds.round()
    rounds.round()
    assert rounds.round(repeats=40, hit_tokens=16, queries=40 * 3000) == "suspect_off"


def test_hits_rising_with_the_repeats_is_ok() -> None:
    rounds = Rounds()
    with capture_logs() as logs:
        rounds.round()
        rounds.round()
        # Half the repeats evicted before reuse: still well above 1 token a repeat.
        assert rounds.round(repeats=MIN_REPEATS, hit_tokens=10 * 48) == "ok"
    assert not warnings(logs)
    assert [e["status"] for e in logs] == ["ok"]


def test_repeats_sent_before_the_window_are_not_evidence() -> None:
    # Requests in an engine queue when the window opened: sent (counted) before its
    # second round, answered after. Their hits may precede the window: not evidence.
    rounds = Rounds()
    rounds.round()
    b = rounds.backend
    b.repeats_sent += 50  # sent, not answered yet
    rounds.round()
    b.repeats_answered += 50  # they end now, with hits counted before the window
    assert rounds.round() == "unknown"
    assert rounds.check.view(b).evidence == 0


def test_recovery_then_regression_warns_again() -> None:
    rounds = Rounds()
    with capture_logs() as logs:
        rounds.round()
        rounds.round()
        assert rounds.round(repeats=MIN_REPEATS) == "suspect_off"
        rounds.round()
        assert rounds.round(repeats=MIN_REPEATS, hit_tokens=1000) == "ok"  # restarted with it on
        rounds.round()
        assert rounds.round(repeats=MIN_REPEATS) == "suspect_off"
    assert len(warnings(logs)) == 2
    assert [e["status"] for e in logs] == ["suspect_off", "ok", "suspect_off"]


def test_a_counter_reset_or_a_failed_scrape_restarts_the_window() -> None:
    rounds = Rounds()
    rounds.round(hit_tokens=5000, queries=9000)
    rounds.round()
    rounds.round(repeats=MIN_REPEATS - 1)
    # The engine restarted: its counters start again from 0 (a drop, not a rise).
    rounds.hits = rounds.queries = 0.0
    assert rounds.round(repeats=5) == "unknown"
    assert rounds.check.view(rounds.backend).reason == "gathering evidence"
    b = rounds.backend
    rounds.check.judge(b, b.repeats_sent, b.repeats_answered, None)  # a scrape failed
    assert rounds.round(repeats=MIN_REPEATS) == "unknown"  # the window's first scrape again


@pytest.mark.parametrize("evidence", [MIN_REPEATS, 3 * MIN_REPEATS])
def test_the_rule_is_one_hit_token_per_repeat(evidence: int) -> None:
    for hit_tokens, status in ((evidence - 1, "suspect_off"), (evidence, "ok")):
        rounds = Rounds()
        rounds.round()
        rounds.round()
        assert rounds.round(repeats=evidence, hit_tokens=hit_tokens) == status
