"""Is prefix caching on at all?  Repeated keys per backend against its scraped counters.

Contract:
- ``Repeats`` runs on the data plane, once per routed request.  A request
  whose key is at least ``MIN_KEY_BYTES`` long is a *repeat* on its backend
  when this process routed the same key to the same backend before: one
  lookup in a direct-mapped table of ``SLOTS`` 64-bit tags (the key hash
  xor the backend's tag), 512 KiB a process whatever the traffic.  A repeat
  counts on the backend when it is sent (``Backend.repeats_sent``) and when
  its 2xx response ended (``Backend.repeats_answered``).  Collisions only
  forget keys (a repeat taken for a first sighting), so counts err low.
- ``CacheCheck`` runs on the control side, once per scrape round of
  ``router.health``: it reads both counts (with ``--workers N``, summed over
  the workers by the supervisor's refresh just before the round) *before*
  the backend's ``/metrics`` is read, then judges each backend:

  * ``unknown``: no prefix-cache counters scraped (scraping off, or neither
    vLLM's nor SGLang's names), or no verdict yet.
  * a verdict once ``evidence >= MIN_REPEATS``, where evidence is the
    repeats answered by now minus every repeat sent before the window's
    first scrape (read on the round after it).  Each repeat in the evidence
    was therefore sent after the window's first scrape and had ended before
    its last: vLLM counts a hit at prefill and SGLang at the request's end,
    so both counted its hits inside the window, whatever the queueing.
  * ``suspect_off`` when the backend's hit tokens rose by less than one token
    per repeat in the evidence; ``ok`` otherwise.  Why: a repeat's key is at
    least 256 bytes, ~64 tokens, 3 or more full KV blocks of 16, so a cache
    that is on and keeps a repeat's prefix gives it at least 16 hit tokens.
    Fewer than 1 per repeat means at most 1 repeat in 16 found even one block:
    prefix caching off (vLLM then counts nothing at all, queries included) or
    a cache too small for the traffic routed to it.  With 20 repeats, a
    working cache that keeps even half of them passes with a probability of
    1 - 2e-5 (at most one hit in 20 draws of p = 0.5).
  * After a verdict the next window starts at that round.  A scrape that
    failed, or a counter that went down (engine restarted), restarts the
    window without a verdict.
- Logging: a warning when a backend becomes ``suspect_off`` (once; again
  only after an ``ok`` verdict in between), an info line on every other
  change of status.  ``view`` gives /admin/stats the status and its
  evidence; ``suspect`` the Prometheus gauge.
- Several replicas: each judges on its own, from its own repeats and the
  engine's counters (which other replicas' traffic only raises: never a
  false ``suspect_off``).  Keys first routed by another replica, or by
  another worker of the same host, count as first sightings: the evidence
  errs low, never high.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Literal

from .log import get_logger

if TYPE_CHECKING:
    from .control import PrefixCacheView
    from .fleet import Backend
    from .health import Scraped

__all__ = ["MIN_KEY_BYTES", "MIN_REPEATS", "CacheCheck", "Repeats", "Status"]

log = get_logger("cachecheck")

Status = Literal["ok", "suspect_off", "unknown"]

# ~64 tokens at ~4 bytes a token: at least 3 full vLLM blocks of 16 (the last
# prompt token is always recomputed); a shorter prompt may share no full block.
MIN_KEY_BYTES = 256
MIN_REPEATS = 20  # the evidence a verdict needs (see the contract for the odds)
SLOTS = 1 << 16  # as many keys as the TRAFFIC placement table remembers
_MASK = SLOTS - 1
_U64 = (1 << 64) - 1


def backend_tag(name: str) -> int:
    """A backend's 64-bit tag, xor-ed into its keys' (per process: ``hash`` is seeded)."""
    return (hash(name) * 0x9E3779B97F4A7C15) & _U64  # spread: names may hash alike


class Repeats:
    """Which (key, backend) pairs this process routed before (see the contract)."""

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table = array("Q", bytes(8 * SLOTS))

    def sent(self, key_hash: int, backend: Backend) -> bool:
        """Count a request routed to ``backend``; True if it repeats a key sent there."""
        tag = key_hash ^ backend.tag
        table = self._table
        slot = tag & _MASK
        if table[slot] == tag:
            backend.repeats_sent += 1
            return True
        table[slot] = tag
        return False


class _Window:
    __slots__ = (
        "base_hits",
        "base_queries",
        "base_sent",
        "evidence",
        "hits",
        "queries",
        "reason",
        "status",
        "verdicts",
        "warned",
    )

    def __init__(self) -> None:
        self.status: Status = "unknown"
        self.reason = "no scrape yet"
        self.verdicts = 0
        self.warned = False  # suspect_off logged and not followed by an ok verdict yet
        self.base_hits: float | None = None  # the window's first scrape; None: none yet
        self.base_queries = 0.0
        self.base_sent: int | None = None  # repeats sent, read on the round after it
        # The figures shown: the last verdict's window, or the current one's so far.
        self.evidence = 0
        self.hits = 0.0
        self.queries = 0.0


class CacheCheck:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # scraping is on: without it every backend is unknown
        self._windows: dict[str, _Window] = {}

    def forget(self, name: str) -> None:
        self._windows.pop(name, None)

    def judge(self, backend: Backend, sent: int, answered: int, scraped: Scraped | None) -> None:
        """One round: ``sent``/``answered`` read before the scrape; ``scraped`` its
        figures, None if this round's scrape failed."""
        window = self._windows.get(backend.name)
        if window is None:
            window = self._windows[backend.name] = _Window()
        if scraped is None:
            window.base_hits = None  # a gap: restart the window
            if window.status == "unknown":
                window.reason = "its /metrics could not be read"
            return
        hits, queries = scraped.hits, scraped.queries
        if hits is None:
            self._set(backend.name, window, "unknown", "no prefix-cache counters in /metrics")
            window.base_hits = None
            return
        queries = queries or 0.0
        base = window.base_hits
        if base is None or hits < base or queries < window.base_queries:
            window.base_hits, window.base_queries, window.base_sent = hits, queries, None
            if window.status == "unknown":
                window.reason = "gathering evidence"
            return
        if window.base_sent is None:
            window.base_sent = sent  # the first count read after the window's first scrape
            return
        evidence = answered - window.base_sent
        hit_tokens, query_tokens = hits - base, queries - window.base_queries
        if evidence < MIN_REPEATS:
            if window.status == "unknown":
                window.evidence, window.hits, window.queries = evidence, hit_tokens, query_tokens
                window.reason = f"gathering evidence: {max(evidence, 0)} of {MIN_REPEATS} repeats"
            return
        window.evidence, window.hits, window.queries = evidence, hit_tokens, query_tokens
        window.base_hits, window.base_queries, window.base_sent = hits, queries, None
        window.verdicts += 1
        if hit_tokens < evidence:
            reason = (
                f"{evidence} requests repeated keys already sent to it and its prefix-cache"
                f" hits rose by {hit_tokens:g} tokens: is --enable-prefix-caching on,"
                " is its KV cache large enough?"
            )
            self._set(backend.name, window, "suspect_off", reason)
        else:
            reason = f"{hit_tokens:g} hit tokens for {evidence} repeated keys"
            self._set(backend.name, window, "ok", reason)

    def _set(self, name: str, window: _Window, status: Status, reason: str) -> None:
        window.reason = reason
        if status == window.status:
            return
        window.status = status
        fields = {
            "backend": name,
            "status": status,
            "repeats": window.evidence,
            "hit_tokens": window.hits,
            "query_tokens": window.queries,
            "reason": reason,
        }
        if status == "suspect_off":
            if not window.warned:
                window.warned = True
                log.warning("prefix cache suspect off", **fields)
            return
        if status == "ok":
            window.warned = False
        log.info("prefix cache check", **fields)

    def status(self, name: str) -> Status:
        window = self._windows.get(name)
        return "unknown" if window is None else window.status

    def view(self, backend: Backend) -> PrefixCacheView:
        from .control import PrefixCacheView  # the view's home: the control interface

        window = self._windows.get(backend.name)
        if window is None:
            return PrefixCacheView(
                "unknown",
                "no scrape yet" if self.enabled else "scraping off (--scrape-metrics)",
                repeats_sent=backend.repeats_sent,
                repeats_answered=backend.repeats_answered,
            )
        return PrefixCacheView(
            window.status,
            window.reason,
            verdicts=window.verdicts,
            evidence=max(window.evidence, 0),
            hit_tokens=window.hits,
            query_tokens=window.queries,
            repeats_sent=backend.repeats_sent,
            repeats_answered=backend.repeats_answered,
        )
