"""Unit tests of the simulated engine (loadtests/simserver/model.py): pure, no I/O."""

from __future__ import annotations

import subprocess
import sys
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtests.simserver.model import (
    Engine,
    Histogram,
    KVCache,
    Timing,
    filler_pieces,
    tokenize,
    tokens_from_ids,
)

BS = 16  # block size used throughout


def toks(start: int, count: int) -> array[int]:
    """``count`` distinct token ids from ``start``: prompts with known block boundaries."""
    return array("I", range(start, start + count))


def cat(*parts: array[int]) -> array[int]:
    out = array("I")
    for part in parts:
        out.extend(part)
    return out


# ---------------------------------------------------------------- tokenizer


def test_tokenize_is_four_bytes_per_token_little_endian() -> None:
    assert list(tokenize("abcd")) == [int.from_bytes(b"abcd", "little")]
    assert list(tokenize("abcde")) == [int.from_bytes(b"abcd", "little"), ord("e")]
    assert len(tokenize("é" * 10)) == 5  # 20 UTF-8 bytes
    assert len(tokenize("")) == 0


def test_tokenize_is_the_same_in_another_process() -> None:
    text = "Système: réponds brièvement. " * 20
    code = (
        "import sys; from loadtests.simserver.model import tokenize; "
        "print(list(tokenize(sys.argv[1])))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, text], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    assert out.strip() == str(list(tokenize(text)))


@given(st.text(), st.text(), st.text())
def test_shared_byte_prefix_gives_shared_token_prefix(prefix: str, a: str, b: str) -> None:
    shared = len(prefix.encode()) // 4
    assert tokenize(prefix + a)[:shared] == tokenize(prefix + b)[:shared]


def test_tokens_from_ids_validates() -> None:
    assert list(tokens_from_ids([0, 5, 2**32 - 1])) == [0, 5, 2**32 - 1]
    for bad in ([-1], [2**32], [1.0], [True], ["1"]):
        with pytest.raises(ValueError, match="token ids"):
            tokens_from_ids(bad)


def test_filler_pieces_are_one_token_each() -> None:
    pieces = filler_pieces(40)
    assert len(pieces) == 40
    assert all(len(tokenize(piece)) == 1 for piece in pieces)
    assert filler_pieces(40) == pieces


# ---------------------------------------------------------------- block keys


def test_block_keys_are_chained() -> None:
    cache = KVCache(BS, 100)
    prefix = toks(0, 3 * BS)
    one = cache.block_keys(cat(prefix, toks(1000, 2 * BS)))
    two = cache.block_keys(cat(prefix, toks(2000, 2 * BS)))
    assert one[:3] == two[:3]  # same prefix, same first blocks
    assert set(one[3:]).isdisjoint(two[3:])
    # Same tokens in block 1 after a different block 0: a different key, because the
    # key names the whole prefix, not the block alone.
    shifted = cache.block_keys(cat(toks(500, BS), toks(BS, BS)))
    assert shifted[1] != one[1]


def test_only_full_blocks_have_keys() -> None:
    cache = KVCache(BS, 100)
    assert len(cache.block_keys(toks(0, BS - 1))) == 0
    assert len(cache.block_keys(toks(0, 3 * BS + 5))) == 3


# ---------------------------------------------------------------- lookup and stats


def test_lookup_counts_tokens_and_keeps_the_last_token_uncached() -> None:
    cache = KVCache(BS, 100)
    prompt = toks(0, 2 * BS)
    assert cache.lookup(prompt) == 0
    cache.release(cache.allocate(prompt))
    # All 32 tokens are resident, but the last token must be recomputed, so only the
    # first block (16 tokens) counts, as in vLLM (max_cache_hit_length = n - 1).
    assert cache.lookup(prompt) == BS
    assert cache.lookup(cat(prompt, toks(99, 1))) == 2 * BS
    assert cache.lookup(toks(7, 40)) == 0
    assert (cache.queries, cache.hits) == (32 + 32 + 33 + 40, 16 + 32)
    assert cache.peek(cat(prompt, toks(99, 1))) == 2 * BS
    assert cache.queries == 137  # peek counts nothing


def test_admit_counts_and_pins() -> None:
    cache = KVCache(BS, 100)
    first = cache.admit(toks(0, 5 * BS))
    assert (first.cached_tokens, len(first.keys)) == (0, 5)
    second = cache.admit(cat(toks(0, 3 * BS), toks(900, 10)))
    assert second.cached_tokens == 3 * BS
    assert cache.pinned_blocks == 5  # the 3 shared blocks are pinned twice, not copied
    assert cache.usage == 5 / 100
    cache.release(first)
    assert cache.pinned_blocks == 3
    cache.release(second)
    cache.release(second)  # idempotent
    assert (cache.pinned_blocks, cache.resident_blocks) == (0, 5)
    assert (cache.queries, cache.hits) == (5 * BS + 3 * BS + 10, 3 * BS)


# ---------------------------------------------------------------- eviction


def test_lru_evicts_least_recently_used_prefix_first() -> None:
    cache = KVCache(BS, 4)
    a, b, c = toks(0, 2 * BS + 1), toks(100, 2 * BS + 1), toks(200, 2 * BS + 1)
    cache.release(cache.allocate(a))
    cache.release(cache.allocate(b))
    cache.release(cache.allocate(a))  # a is now more recently used than b
    cache.release(cache.allocate(c))  # needs two blocks: b's go
    assert cache.peek(a) == 2 * BS
    assert cache.peek(b) == 0
    assert cache.peek(c) == 2 * BS
    assert cache.resident_blocks == 4


def test_a_released_prompt_loses_its_tail_before_its_head() -> None:
    cache = KVCache(BS, 4)
    a = toks(0, 4 * BS + 1)
    cache.release(cache.allocate(a))
    cache.release(cache.allocate(toks(500, 2 * BS)))  # evicts two of a's blocks
    assert cache.peek(a) == 2 * BS  # blocks 0 and 1 survived, 2 and 3 went


def test_capacity_pressure_evicts_the_whole_first_prefix() -> None:
    cache = KVCache(BS, 4)
    a = toks(0, 4 * BS + 1)
    cache.release(cache.allocate(a))
    cache.release(cache.allocate(toks(500, 4 * BS + 1)))
    assert cache.peek(a) == 0
    assert cache.lookup(a) == 0


def test_pinned_blocks_are_never_evicted_and_allocation_degrades() -> None:
    cache = KVCache(BS, 4)
    a = toks(0, 3 * BS + 1)
    held = cache.allocate(a)
    other = cache.allocate(toks(500, 3 * BS + 1))  # only one block is free
    assert len(other.keys) == 1
    assert cache.peek(a) == 3 * BS
    assert cache.pinned_blocks == 4
    third = cache.allocate(toks(900, 2 * BS + 1))  # nothing free, nothing evictable
    assert third.keys == ()
    assert cache.reset() is False  # refused while pinned
    for allocation in (held, other, third):
        cache.release(allocation)
    assert cache.reset() is True
    assert (cache.resident_blocks, cache.queries, cache.hits) == (0, 0, 0)


def test_zero_capacity_caches_nothing() -> None:
    cache = KVCache(BS, 0)
    prompt = toks(0, 3 * BS)
    cache.release(cache.admit(prompt))
    assert cache.admit(prompt).cached_tokens == 0
    assert cache.usage == 0.0


# ---------------------------------------------------------------- timing and engine

TIMING = Timing(
    prefill_tokens_per_s=1000.0, request_overhead_s=0.010, decode_s_per_token=0.002, max_num_seqs=2
)


def test_timing_validates() -> None:
    for bad in (
        {"prefill_tokens_per_s": 0},
        {"max_num_seqs": 0},
        {"time_scale": 0},
        {"decode_s_per_token": -1},
    ):
        with pytest.raises(ValueError, match="must be"):
            Timing(**bad)
    assert Timing().prefill_s(10_000) == pytest.approx(1.020)


def test_idle_engine_ttft_is_overhead_plus_uncached_prefill() -> None:
    engine = Engine(TIMING, KVCache(BS, 100))
    first = engine.submit(toks(0, 1000), 4, now=0.0)
    assert first.plan is not None
    assert first.plan.ttft == pytest.approx(0.010 + 1.000)
    assert first.plan.finish_at == pytest.approx(1.010 + 3 * 0.002)
    engine.finish(first, now=2.0)
    again = engine.submit(cat(toks(0, 1000), toks(5000, 50)), 4, now=3.0)
    assert again.plan is not None
    cached = (1000 // BS) * BS
    assert again.plan.cached_tokens == cached
    assert again.plan.ttft == pytest.approx(0.010 + (1050 - cached) / 1000)


def test_prefills_are_serialised_and_excess_requests_wait_fifo() -> None:
    engine = Engine(TIMING, KVCache(BS, 1000))
    a = engine.submit(toks(0, 100), 2, now=0.0)
    b = engine.submit(toks(1000, 200), 2, now=0.0)
    c = engine.submit(toks(2000, 300), 2, now=0.05)
    assert (engine.running, engine.waiting) == (2, 1)
    assert a.plan is not None
    assert b.plan is not None
    assert c.plan is None
    # b is admitted at once but its prefill starts when a's ends.
    assert b.plan.prefill_start == pytest.approx(a.plan.first_token_at)
    assert b.plan.ttft == pytest.approx((0.010 + 0.100) + (0.010 + 0.200))
    admitted = engine.finish(a, now=0.5)
    assert admitted == [c]
    assert c.plan is not None
    # c waited 0.45 s for a slot; b's prefill was over by then (0.33 s).
    assert c.plan.queue_s == pytest.approx(0.45)
    assert c.plan.ttft == pytest.approx(0.45 + 0.010 + 0.300)
    assert engine.finish(b, now=0.6) == []
    engine.finish(c, now=1.0)
    assert (engine.running, engine.waiting, engine.cache.pinned_blocks) == (0, 0, 0)
    assert engine.stats.finished == 3
    assert engine.stats.generation_tokens == 6
    assert engine.stats.prompt_tokens == 600
    assert engine.stats.ttft.count == 3


def test_abort_frees_a_waiting_or_running_ticket_once() -> None:
    engine = Engine(TIMING, KVCache(BS, 1000))
    a = engine.submit(toks(0, 100), 10, now=0.0)
    b = engine.submit(toks(1000, 100), 10, now=0.0)
    c = engine.submit(toks(2000, 100), 10, now=0.0)
    assert engine.abort(c, now=0.01) == []  # waiting: just leaves the queue
    assert (engine.running, engine.waiting) == (2, 0)
    assert a.plan is not None
    # a's first token at 0.11 s, then one every 2 ms: 3 tokens by 0.115 s.
    assert a.plan.tokens_by(0.115) == 3
    engine.abort(a, now=0.115)
    assert engine.abort(a, now=0.2) == []  # no-op once done
    assert engine.stats.generation_tokens == 3
    assert engine.stats.aborted == 2
    assert engine.stats.ttft.count == 1  # c never produced a token
    with pytest.raises(ValueError, match="cannot finish"):
        engine.finish(c, now=0.3)
    engine.finish(b, now=1.0)
    assert engine.cache.pinned_blocks == 0


def test_engine_reset_clears_counters_only_when_idle() -> None:
    engine = Engine(TIMING, KVCache(BS, 1000))
    ticket = engine.submit(toks(0, 100), 1, now=0.0)
    assert engine.reset() is False
    engine.finish(ticket, now=1.0)
    assert engine.reset() is True
    assert engine.stats.finished == 0
    assert engine.cache.peek(toks(0, 100)) == 0


def test_histogram_buckets_are_cumulative_and_inclusive() -> None:
    histogram = Histogram([0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    assert histogram.cumulative() == [("0.1", 2), ("1.0", 3), ("+Inf", 4)]
    assert histogram.total == pytest.approx(3.65)
    assert histogram.count == 4


# ---------------------------------------------------------------- cache_salt


def test_cache_salt_enters_the_first_block_so_salts_share_nothing() -> None:
    cache = KVCache(BS, 1000)
    prompt = toks(0, 10 * BS + 1)
    assert cache.block_keys(prompt) == cache.block_keys(prompt, b"")  # no salt: as before
    salted = cache.block_keys(prompt, b"tenant-a")
    assert not set(salted) & set(cache.block_keys(prompt))
    assert not set(salted) & set(cache.block_keys(prompt, b"tenant-b"))
    cache.release(cache.admit(prompt, b"tenant-a"))
    assert cache.peek(prompt, b"tenant-a") == 10 * BS  # one salt: cached as usual
    assert cache.peek(prompt, b"tenant-b") == 0  # another: nothing
    assert cache.peek(prompt) == 0


def test_engine_admits_with_the_ticket_salt() -> None:
    engine = Engine(Timing(), KVCache(BS, 1000))
    prompt = toks(0, 4 * BS + 1)
    first = engine.submit(prompt, 1, 0.0, b"a")
    engine.finish(first, 1.0)
    same = engine.submit(prompt, 1, 2.0, b"a")
    other = engine.submit(prompt, 1, 2.0, b"b")
    assert same.plan is not None
    assert other.plan is not None
    assert (same.plan.cached_tokens, other.plan.cached_tokens) == (4 * BS, 0)
