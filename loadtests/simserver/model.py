"""The simulated inference engine: tokens, prefix cache, timing. Pure: no I/O, no asyncio.

Contract
--------
Everything here is deterministic and driven by the caller's clock: every method
that depends on time takes ``now`` (seconds of *model* time) as an argument and
nothing reads a clock. The same objects therefore serve the live simulated
server (which maps the event loop's clock onto model time, see ``app.py``) and
an offline discrete-event simulator (which owns a virtual clock).

Tokenizer
---------
``tokenize(text)`` encodes the text as UTF-8 and cuts the bytes into 4-byte
chunks; a token's id is its chunk read as a little-endian ``uint32`` (the last,
shorter chunk is zero-padded). That is 4 bytes per token, close to the ~4
characters per token that BPE tokenizers give on English, and it is exact,
collision-free and the same in every process. Prefix caching only ever compares
prefixes, so the one property that matters is kept: two texts that share their
first ``k`` bytes share their first ``k // 4`` tokens.

Prefix cache (vLLM's automatic prefix caching, V1)
--------------------------------------------------
- Only full blocks of ``block_size`` tokens are cached. A block's key is a
  128-bit MurmurHash3 of (parent block's key, the block's token ids), so a key
  names the whole prefix up to the end of its block.
- A request's ``cache_salt`` (vLLM's: bytes, empty for none) enters the first
  block's key, as vLLM adds it to the first block's extra keys: requests with
  different salts share no block, with one salt they share as without.
- A request's cached tokens are the longest run of resident blocks from the
  start, looked for only within its first ``prompt_tokens - 1`` tokens: like
  vLLM, the last prompt token is always recomputed to get logits.
- ``queries`` and ``hits`` count tokens, as vLLM's ``prefix_cache_queries`` and
  ``prefix_cache_hits`` do: queries += prompt tokens, hits += cached tokens.
- Blocks used by a running request are pinned (ref-counted). Unpinned blocks
  stay resident and are evicted least recently used first when a new block needs
  room. A request's blocks are released tail first, so that its later blocks are
  evicted before its earlier ones (vLLM frees in reverse order for that reason).
- If the cache is full of pinned blocks, a request caches what fits and runs
  anyway (vLLM would preempt instead; the simulator degrades instead).
- Simplifications: generated tokens and the partial last block are neither
  cached nor charged against capacity, so ``usage`` counts pinned prompt blocks.
- ``caching=False`` is vLLM without ``--enable-prefix-caching``: blocks are
  still pinned while a request runs (``usage``), nothing is ever served from
  cache, a released block is freed at once, and ``queries`` and ``hits`` stay
  0, as vLLM V1's counters do when it skips the lookup
  (``KVCacheManager.record_prefix_cache_stats``); ``prompt_tokens`` still grows.

Scheduling
----------
At most ``max_num_seqs`` requests run; the rest wait, FIFO. A request is admitted
(its blocks looked up, counted and pinned) when it gets a slot. Prefill is
compute-bound, so prefills are serialised, FIFO, one at a time per instance; a
prefill takes ``request_overhead_s + uncached_tokens / prefill_tokens_per_s`` and
produces the first output token. Each later output token takes
``decode_s_per_token``; decode of running sequences proceeds concurrently and
does not slow down with batch size. So TTFT = queue wait + wait for earlier
prefills + own prefill. Plans are fixed at admission: a request aborted before
its prefill does not give its reserved prefill time back.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import mmh3

# One histogram and one set of buckets (vLLM V1's for vllm:time_to_first_token_seconds)
# for the router and the engine: their /metrics line up bucket for bucket.
from router.metrics import TTFT_BUCKETS, Histogram

__all__ = [
    "TTFT_BUCKETS",
    "Allocation",
    "Engine",
    "EngineStats",
    "Histogram",
    "KVCache",
    "Plan",
    "Ticket",
    "Timing",
    "filler_pieces",
    "tokenize",
    "tokens_from_ids",
]

_TOKEN_BYTES = 4
_MAX_TOKEN_ID = 2**32 - 1


# ---------------------------------------------------------------- tokenizer


def tokenize(text: str) -> array[int]:
    """Token ids of ``text``: its UTF-8 bytes in 4-byte little-endian chunks."""
    data = text.encode("utf-8")
    pad = -len(data) % _TOKEN_BYTES
    tokens = array("I")
    tokens.frombytes(data + b"\0" * pad if pad else data)
    if sys.byteorder == "big":  # keep ids identical on every platform
        tokens.byteswap()
    return tokens


def tokens_from_ids(ids: Iterable[int]) -> array[int]:
    """Client-supplied token ids (``/v1/completions`` with a list prompt).

    Raises ``ValueError`` for anything that is not an int in [0, 2**32).
    """
    tokens = array("I")
    for token in ids:
        if type(token) is not int or not 0 <= token <= _MAX_TOKEN_ID:
            raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]")
        tokens.append(token)
    return tokens


# The filler answer: every piece is one token (at most 4 bytes), so the number of
# pieces streamed is the number of completion tokens reported.
_FILLER = (" the", " sim", " kv", " is", " a", " hot", " hit", " so", " we", " go", ".")


def filler_pieces(count: int) -> list[str]:
    """The deterministic text of ``count`` output tokens."""
    return [_FILLER[i % len(_FILLER)] for i in range(count)]


# ---------------------------------------------------------------- prefix cache


@dataclass(slots=True)
class Allocation:
    """The blocks one request pins, from ``KVCache.allocate``/``admit``."""

    keys: tuple[int, ...]
    prompt_tokens: int
    cached_tokens: int
    released: bool = False


class KVCache:
    """Block-level prefix cache with chained keys, pinning and LRU eviction."""

    def __init__(
        self, block_size: int = 16, capacity_blocks: int = 16_384, *, caching: bool = True
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self.caching = caching  # False: prefix caching off (see the contract)
        self._refs: dict[int, int] = {}  # resident key -> number of requests pinning it
        # Resident keys nobody pins, least recently used first: the eviction order.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    # -- queries

    def block_keys(self, tokens: array[int], salt: bytes = b"") -> list[int]:
        """Chained keys of the full blocks of ``tokens`` (``salt``: in the first one)."""
        raw = _le_bytes(tokens)
        step = self.block_size * _TOKEN_BYTES
        keys: list[int] = []
        parent = 0
        extra = salt
        for start in range(0, len(raw) - step + 1, step):
            parent = mmh3.hash128(parent.to_bytes(16, "little") + raw[start : start + step] + extra)
            extra = b""
            keys.append(parent)
        return keys

    def peek(self, tokens: array[int], salt: bytes = b"") -> int:
        """Tokens of ``tokens`` that would be served from cache; changes nothing."""
        return self._hit_tokens(self.block_keys(tokens, salt), len(tokens))

    def lookup(self, tokens: array[int], salt: bytes = b"") -> int:
        """Like ``peek``, and counts the query and its hits in tokens."""
        cached = self.peek(tokens, salt)
        if self.caching:
            self.queries += len(tokens)
            self.hits += cached
        return cached

    # -- pinning

    def allocate(self, tokens: array[int], salt: bytes = b"") -> Allocation:
        """Pin the blocks of ``tokens``, inserting missing ones; no stats."""
        keys = self.block_keys(tokens, salt)
        cached = self._hit_tokens(keys, len(tokens))
        return Allocation(self._pin(keys), len(tokens), cached)

    def admit(self, tokens: array[int], salt: bytes = b"") -> Allocation:
        """``lookup`` then ``allocate`` in one pass: what a scheduler does on admission."""
        keys = self.block_keys(tokens, salt)
        cached = self._hit_tokens(keys, len(tokens))
        if self.caching:
            self.queries += len(tokens)
            self.hits += cached
        return Allocation(self._pin(keys), len(tokens), cached)

    def release(self, allocation: Allocation) -> None:
        """Unpin an allocation's blocks; they stay cached until evicted. Idempotent."""
        if allocation.released:
            return
        allocation.released = True
        # Tail first: the earliest blocks become the most recently used, so a
        # prefix outlives its tails under pressure.
        for key in reversed(allocation.keys):
            refs = self._refs[key] - 1
            if refs:
                self._refs[key] = refs
            elif self.caching:
                self._refs[key] = 0
                self._lru[key] = None
            else:
                del self._refs[key]  # no cache: freed, never found again

    def reset(self) -> bool:
        """Drop every cached block and the counters, as vLLM's ``reset_prefix_cache``.

        Like vLLM it refuses (returns False, changes nothing) while any block is
        pinned, because running requests still use those blocks.
        """
        if self.pinned_blocks:
            return False
        self._refs.clear()
        self._lru.clear()
        self.queries = 0
        self.hits = 0
        return True

    # -- state

    @property
    def resident_blocks(self) -> int:
        return len(self._refs)

    @property
    def pinned_blocks(self) -> int:
        return len(self._refs) - len(self._lru)

    @property
    def usage(self) -> float:
        """Pinned share of capacity, 0..1, as vLLM's ``kv_cache_usage_perc``."""
        if self.capacity_blocks == 0:
            return 0.0
        return self.pinned_blocks / self.capacity_blocks

    def is_resident(self, key: int) -> bool:
        return key in self._refs

    # -- internals

    def _hit_tokens(self, keys: list[int], prompt_tokens: int) -> int:
        if not self.caching:
            return 0  # blocks pinned by a running request are not shared either
        limit = min(len(keys), (prompt_tokens - 1) // self.block_size)
        hit = 0
        while hit < limit and keys[hit] in self._refs:
            hit += 1
        return hit * self.block_size

    def _pin(self, keys: list[int]) -> tuple[int, ...]:
        pinned: list[int] = []
        for key in keys:
            refs = self._refs.get(key)
            if refs is None:
                if len(self._refs) >= self.capacity_blocks:
                    if not self._lru:
                        break  # everything is pinned: cache the prefix that fit
                    victim, _ = self._lru.popitem(last=False)
                    del self._refs[victim]
                refs = 0
            elif refs == 0:
                del self._lru[key]
            self._refs[key] = refs + 1
            pinned.append(key)
        return tuple(pinned)


def _le_bytes(tokens: array[int]) -> bytes:
    if sys.byteorder == "big":
        tokens = array("I", tokens)
        tokens.byteswap()
    return tokens.tobytes()


# ---------------------------------------------------------------- timing


@dataclass(frozen=True, slots=True)
class Timing:
    """Cost model of one instance, in model seconds.

    Defaults imitate Llama-3.1-70B (bf16) on one 8-GPU node with vLLM, rounded:
    - ``prefill_tokens_per_s`` 10,000: a forward pass costs ~2 x 70e9 = 140 GFLOP
      per token; eight H100s offer ~7.9 PFLOP/s of dense bf16, and prefill at
      long context reaches roughly a fifth to a third of that once attention and
      tensor-parallel all-reduces are paid, i.e. 10-20k tokens/s (8 x A100 is
      about a third of that). An 8,000-token prefix then costs 0.8 s of prefill,
      the scale of TTFT reductions the SageMaker comparison reports.
    - ``request_overhead_s`` 0.020: scheduling, the first decode step, sampling,
      detokenising and HTTP, per request, whatever the prompt.
    - ``decode_s_per_token`` 0.025: a 70B model at TP=8 decodes at 20-40 tokens/s
      per sequence under moderate batch.
    - ``max_num_seqs`` 256: vLLM's default batch limit.
    - ``time_scale`` 1.0: not used by the engine (it works in model seconds);
      the live server multiplies every delay by it, so 0.01 runs a scenario 100x
      faster with identical model-time results.
    These are stated assumptions, not measurements.
    """

    prefill_tokens_per_s: float = 10_000.0
    request_overhead_s: float = 0.020
    decode_s_per_token: float = 0.025
    max_num_seqs: int = 256
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError("prefill_tokens_per_s must be > 0")
        if not (self.request_overhead_s >= 0 and self.decode_s_per_token >= 0):
            raise ValueError("request_overhead_s and decode_s_per_token must be >= 0")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError("time_scale must be a finite number > 0")

    def prefill_s(self, uncached_tokens: int) -> float:
        return self.request_overhead_s + uncached_tokens / self.prefill_tokens_per_s


# ---------------------------------------------------------------- engine


@dataclass(frozen=True, slots=True)
class Plan:
    """When a request's events happen, in model seconds, fixed at admission."""

    arrival: float
    admitted_at: float
    prefill_start: float
    first_token_at: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    decode_s_per_token: float

    @property
    def ttft(self) -> float:
        return self.first_token_at - self.arrival

    @property
    def queue_s(self) -> float:
        return self.admitted_at - self.arrival

    def token_at(self, index: int) -> float:
        """Model time at which output token ``index`` (0-based) is produced."""
        return self.first_token_at + index * self.decode_s_per_token

    @property
    def finish_at(self) -> float:
        return self.token_at(self.output_tokens - 1)

    def tokens_by(self, now: float) -> int:
        """Output tokens produced by model time ``now``."""
        if now < self.first_token_at:
            return 0
        if self.decode_s_per_token == 0:
            return self.output_tokens
        done = int((now - self.first_token_at) / self.decode_s_per_token) + 1
        return min(done, self.output_tokens)


@dataclass(slots=True, eq=False)
class Ticket:
    """One request inside an ``Engine``: ``waiting`` -> ``running`` -> ``done``."""

    id: int
    tokens: array[int]
    max_tokens: int
    arrival: float
    state: str = "waiting"
    plan: Plan | None = None
    allocation: Allocation | None = None
    salt: bytes = b""  # cache_salt (KVCache.block_keys)


@dataclass(slots=True)
class EngineStats:
    """Counters since start or the last reset (vLLM's names in comments)."""

    prompt_tokens: int = 0  # vllm:prompt_tokens, counted at admission
    generation_tokens: int = 0  # vllm:generation_tokens
    finished: int = 0  # vllm:request_success{finished_reason="length"}
    aborted: int = 0  # vllm:request_success{finished_reason="abort"}
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))


class Engine:
    """FIFO admission up to ``max_num_seqs``, serialised prefill, fixed-rate decode.

    Drive it with ``submit`` on arrival and exactly one of ``finish`` (all output
    produced) or ``abort`` (client gone) per ticket. Both return the tickets
    admitted as a consequence, whose ``plan`` is now set.
    """

    def __init__(self, timing: Timing, cache: KVCache) -> None:
        self.timing = timing
        self.cache = cache
        self.stats = EngineStats()
        self._waiting: deque[Ticket] = deque()
        self._running: set[Ticket] = set()
        self._prefill_free_at = -math.inf
        self._next_id = 0

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def gauges(self, now: float) -> tuple[int, int, float]:
        """vLLM's scheduler gauges at model time ``now``: requests running and
        waiting, and the share of the KV cache in use (0..1).

        As vLLM V1's scheduler counts them: a request waits until its prefill is
        first scheduled, and its KV blocks are in use from then on (vLLM allocates
        them chunk by chunk as the prefill runs; cached blocks no running request
        holds are free).  Here a request waits in the FIFO beyond ``max_num_seqs``
        and, once admitted, behind the prefills before it (``prefill_start``: the
        serialised prefill is a token budget a long prefill takes whole); from its
        prefill's start its blocks count, a block shared by several requests once.
        """
        blocks: set[int] = set()
        started = 0
        for ticket in self._running:
            assert ticket.plan is not None
            assert ticket.allocation is not None
            if ticket.plan.prefill_start <= now:
                started += 1
                blocks.update(ticket.allocation.keys)
        waiting = len(self._waiting) + len(self._running) - started
        capacity = self.cache.capacity_blocks
        return started, waiting, len(blocks) / capacity if capacity else 0.0

    def submit(self, tokens: array[int], max_tokens: int, now: float, salt: bytes = b"") -> Ticket:
        """A request arrives; it is admitted at once if a slot is free."""
        if len(tokens) == 0:
            raise ValueError("a request needs at least one prompt token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self._next_id += 1
        ticket = Ticket(self._next_id, tokens, max_tokens, now, salt=salt)
        if not self._waiting and len(self._running) < self.timing.max_num_seqs:
            self._admit(ticket, now)
        else:
            self._waiting.append(ticket)
        return ticket

    def finish(self, ticket: Ticket, now: float) -> list[Ticket]:
        """The ticket produced all its tokens."""
        if ticket.state != "running":
            raise ValueError(f"cannot finish a {ticket.state} ticket")
        assert ticket.plan is not None
        self.stats.finished += 1
        self.stats.generation_tokens += ticket.plan.output_tokens
        self.stats.ttft.observe(ticket.plan.ttft)
        return self._retire(ticket, now)

    def abort(self, ticket: Ticket, now: float) -> list[Ticket]:
        """The client went away; free what the ticket holds. No-op once done."""
        if ticket.state == "done":
            return []
        self.stats.aborted += 1
        if ticket.state == "waiting":
            self._waiting.remove(ticket)
            ticket.state = "done"
            return []
        assert ticket.plan is not None
        produced = ticket.plan.tokens_by(now)
        self.stats.generation_tokens += produced
        if produced:
            self.stats.ttft.observe(ticket.plan.ttft)
        return self._retire(ticket, now)

    def reset(self) -> bool:
        """Clear the prefix cache and the counters; refused while blocks are pinned."""
        if not self.cache.reset():
            return False
        self.stats = EngineStats()
        return True

    def _retire(self, ticket: Ticket, now: float) -> list[Ticket]:
        self._running.discard(ticket)
        ticket.state = "done"
        if ticket.allocation is not None:
            self.cache.release(ticket.allocation)
        admitted: list[Ticket] = []
        while self._waiting and len(self._running) < self.timing.max_num_seqs:
            nxt = self._waiting.popleft()
            self._admit(nxt, now)
            admitted.append(nxt)
        return admitted

    def _admit(self, ticket: Ticket, now: float) -> None:
        allocation = self.cache.admit(ticket.tokens, ticket.salt)
        uncached = allocation.prompt_tokens - allocation.cached_tokens
        prefill_start = max(now, self._prefill_free_at)
        first_token_at = prefill_start + self.timing.prefill_s(uncached)
        self._prefill_free_at = first_token_at
        ticket.allocation = allocation
        ticket.plan = Plan(
            arrival=ticket.arrival,
            admitted_at=now,
            prefill_start=prefill_start,
            first_token_at=first_token_at,
            prompt_tokens=allocation.prompt_tokens,
            cached_tokens=allocation.cached_tokens,
            output_tokens=ticket.max_tokens,
            decode_s_per_token=self.timing.decode_s_per_token,
        )
        ticket.state = "running"
        self._running.add(ticket)
        self.stats.prompt_tokens += allocation.prompt_tokens
