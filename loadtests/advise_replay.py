"""The advisor's replay (``prefix-router advise``): a sample at each PrefixLength, and the pick.

``advise`` replays the requests of a sample (``loadtests.advise_sample``:
``Sampled``, by arrival) through the offline simulator at each candidate
PrefixLength and recommends one; ``table`` is its markdown.  Nothing is
printed but ``advise``'s progress, on stderr.

Contract
--------
- The prediction: each candidate PrefixLength is replayed through the
  offline simulator (``loadtests.offline.simulate``: the router's own
  ``Balancer`` under the RoutingConfig with that PrefixLength, the
  simulated engines' prefix caches) with each request's routing hash taken
  from its digest at that length (``digest << 16``: the real hash with its
  low 16 bits cleared), or its session's hash.  The engines need tokens, not
  digests, so each request gets synthetic text (``Sampled.prompt_text``,
  4 characters a token as the simulator's tokenizer): the characters between
  two logged lengths are a pattern drawn from the digest at the longer one,
  and past the last logged length a pattern of the request's own.  Two
  requests thus share, in the replay, the prefix up to the longest logged
  length where their digests agree: a lower bound of what they really share
  (the truth lies between that length and the next logged one, or the end
  of the shorter key).  ``--lower-bound`` replays exactly that.
- The estimate (the default) closes part of that gap: where a key matches,
  at every logged length below its end, the most recent key that ended
  between the same two logged lengths (a whole key), it is taken to extend
  it, the shorter of the two being a prefix of the longer (``link``): the
  next turn of a conversation, the next question after the same document.
  Exact when a request is the one before it plus more (chats, agents);
  high by the earlier key's last part otherwise (two questions after one
  document share the document, not the questions: ~1 % of a ``long``
  prompt); low where the most recent whole key is another conversation's
  (first turns shorter than the first logged length: they share only what
  the digests show).  A session's request (``key_source`` header or
  conversation) is known to continue its own session: it extends that
  session's most recent whole key only, and a request without a session
  never extends a session's.  Every candidate is replayed on the same synthetic
  text, so the comparison between candidates is fair either way; what
  differs between them is the routing alone.
- The recommendation: the candidates whose predicted hit rate is within
  ``--tolerance`` points (0.5) of the best are as good; of those, the
  current length if it is one (no change for nothing), else the lowest
  predicted P90 TTFT, then the shortest length.  Its reason says which.
- Groups (``groups``): a session's requests (``key_source`` header or
  conversation); else the requests that share their key up to the logged
  length just past the deepest *branch point* of their key, the first
  candidate length (1,024) when there is none.  A branch point is a prefix
  (a digest) that two or more lines continue past the next logged length, a
  line being a longer prefix that two or more requests share: a prefix
  every conversation or task starts with (an agent's tool catalogue, a long
  system prompt, a tenant's seed), not a document whose questions cross a
  logged length (each question's own).  Grouped below it, an
  agent's tasks are told apart, a conversation's turns stay together, and a
  document's questions (which end right after it: no key continues) stay
  one group.  Turns that end between the same two logged lengths after a
  branch point cannot be tied together by the digests: each is its own
  group.  "Keys per group" is the mean number of distinct routing keys in
  the groups of two or more requests: 1.00 means each group goes to one
  backend's cache.
"""

from __future__ import annotations

import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgspec

from router.config import RoutingConfig

from . import report
from .advise_sample import Pieces, Sampled
from .offline import simulate
from .workloads import FleetParams

__all__ = [
    "MAX_PREFIX_LENGTH",
    "MIN_PREFIX_LENGTH",
    "Advice",
    "Group",
    "Row",
    "advise",
    "groups",
    "link",
    "recommend",
    "table",
]

MIN_PREFIX_LENGTH, MAX_PREFIX_LENGTH = 1024, 65_536  # PrefixLength's range (router.routingconfig)
MAX_PIECES = 16  # a chain of extensions longer than this is cut (the estimate errs low)


def _cut(pieces: Pieces, chars: int) -> Pieces:
    """The first ``chars`` characters of ``pieces``."""
    out = []
    for source, length in pieces:
        if chars <= 0:
            break
        out.append((source, min(length, chars)))
        chars -= length
    return tuple(out)


def link(requests: Sequence[Sampled]) -> list[Sampled]:
    """The estimate's extensions (see the module contract): ``requests`` (by arrival)
    with ``extends`` set where a key is longer than the most recent whole key that
    it matches at every logged length below that key's end."""
    # (session, level, digest below it) -> the most recent key whole at that level:
    # its size and its digest there.  A session's request extends its own session's
    # keys only (its conversation is known); the others, any key but a session's.
    whole_at: dict[tuple[int | None, int, str], tuple[int, str]] = {}
    # A key's text between two logged lengths is decided once, by its first request.
    nodes: dict[tuple[int, str], Pieces] = {}  # (level, digest) -> pieces of its text
    out = []
    for request in requests:
        extends: list[Pieces | None] = []
        below = ""
        for level, digest in enumerate(request.digests):
            start = request.lengths[level - 1] if level else 0
            node = (level, digest)
            pieces = nodes.get(node)
            if pieces is None:
                pieces = ()
                earlier = whole_at.get((request.session, level, below))
                if earlier is not None and earlier[1] != digest:
                    size, other = earlier
                    prefix = nodes.get((level, other), ())
                    if len(prefix) < MAX_PIECES:
                        own = size - start - sum(chars for _, chars in prefix)
                        # Shared: the shorter of the two, within this segment.
                        end = min(size, request.size, request.lengths[level]) - start
                        pieces = _cut((*prefix, (other, own)), end)
                nodes[node] = pieces
            extends.append(pieces or None)
            if request.whole and level == len(request.digests) - 1:
                whole_at[request.session, level, below] = (request.size, digest)
            below = digest
        out.append(replace(request, extends=tuple(extends)))
    return out


# ---------------------------------------------------------------- the replay


@dataclass
class Row:
    length: int
    keys: int  # distinct routing keys
    keys_per_group: float | None
    hit_rate: float
    ttft_p50: float
    ttft_p90: float
    min_share: float
    max_share: float
    current: bool = False


@dataclass
class Advice:
    rows: list[Row]
    recommended: int
    reason: str
    requests: int
    span_s: float
    instances: list[str]
    current: int
    groups: int


Group = int | tuple[int, str]  # a session's hash, or a prefix: (level, its digest)


def groups(requests: Sequence[Sampled]) -> list[Group]:
    """Each request's group (see the module contract): two passes, the first
    finding the branch points."""
    if not requests:
        return []
    lengths = requests[0].lengths
    start = next((i for i, g in enumerate(lengths) if g >= MIN_PREFIX_LENGTH), len(lengths) - 1)
    root = (start - 1, "")
    children: defaultdict[tuple[int, str], Counter[str]] = defaultdict(Counter)
    for request in requests:
        if request.session is None:
            parent = root
            digests = request.digests
            for level in range(start, request.cut()):
                children[parent][digests[level]] += 1
                parent = (level, digests[level])
    branches = {
        node for node, seen in children.items() if sum(1 for n in seen.values() if n >= 2) >= 2
    }
    out: list[Group] = []
    for request in requests:
        if request.session is not None:
            out.append(request.session)
            continue
        digests = request.digests
        level = min(start, len(digests) - 1)  # no branch point: the first candidate's
        parent = root
        for below in range(start, len(digests)):
            if parent in branches:
                level = below
            parent = (below, digests[below])
        out.append((level, digests[level]))
    return out


def _keys_per_group(
    requests: Sequence[Sampled], grouped: Sequence[Group], length: int
) -> tuple[float | None, int]:
    keys: defaultdict[Group, set[int]] = defaultdict(set)
    sizes: Counter[Group] = Counter()
    for request, group in zip(requests, grouped, strict=True):
        keys[group].add(request.key_at(length))
        sizes[group] += 1
    counted = [len(k) for group, k in keys.items() if sizes[group] >= 2]
    return (sum(counted) / len(counted) if counted else None), len(counted)


def advise(
    requests: Sequence[Sampled],
    routing: RoutingConfig,
    candidates: Sequence[int],
    current: int,
    *,
    instances: Sequence[str],
    params: FleetParams,
    tolerance: float = 0.5,
    seed: int = 1,
    progress: bool = True,
    lower_bound: bool = False,
) -> Advice:
    """Replay ``requests`` at each candidate PrefixLength and recommend one
    (``lower_bound``: without ``link``'s extensions)."""
    if not lower_bound:
        requests = link(requests)
    rows = []
    grouped = groups(requests)
    count = 0
    for length in sorted({*candidates, current}):
        clock = time.perf_counter()
        config = msgspec.structs.replace(
            routing,
            prefix_aware_routing_config=msgspec.structs.replace(
                routing.prefix_aware, prefix_length=length
            ),
        )
        hashes = [request.key_at(length) for request in requests]
        outcome = simulate(
            requests, config, instances=instances, params=params, seed=seed, hashes=hashes
        )
        summary = report.summarize(outcome.run)
        per_group, count = _keys_per_group(requests, grouped, length)
        rows.append(
            Row(
                length,
                len(set(hashes)),
                per_group,
                outcome.run.hit_rate or 0.0,
                summary["ttft_p50"] or 0.0,
                summary["ttft_p90"] or 0.0,
                summary["min_share"] or 0.0,
                summary["max_share"] or 0.0,
                current=length == current,
            )
        )
        if progress:
            print(
                f"  PrefixLength {length}: replayed in {time.perf_counter() - clock:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    recommended, reason = recommend(rows, tolerance)
    span = requests[-1].at - requests[0].at if requests else 0.0
    return Advice(rows, recommended, reason, len(requests), span, list(instances), current, count)


def recommend(rows: Sequence[Row], tolerance: float = 0.5) -> tuple[int, str]:
    """The recommended length and its reason (see the module contract)."""
    best = max(rows, key=lambda r: (r.hit_rate, -r.ttft_p90, -r.length))
    near = [r for r in rows if r.hit_rate >= best.hit_rate - tolerance / 100]
    current = next((r for r in rows if r.current), None)
    if current is not None and current in near:
        if best is current:
            return current.length, (
                f"keep {current.length}: the highest predicted hit rate"
                f" ({_pct(current.hit_rate)}), P90 TTFT {_ms(current.ttft_p90)}"
            )
        return current.length, (
            f"keep {current.length}: no candidate predicts more than {tolerance:g} points"
            f" above it (best {best.length}: {_pct(best.hit_rate)} against"
            f" {_pct(current.hit_rate)})"
        )
    choice = min(near, key=lambda r: (r.ttft_p90, r.length))
    why = (
        "the highest predicted hit rate"
        if choice is best
        else (
            f"within {tolerance:g} points of the best ({best.length}: {_pct(best.hit_rate)})"
            " and the lowest predicted P90 TTFT of those"
        )
    )
    against = ""
    if current is not None:
        delta = (choice.hit_rate - current.hit_rate) * 100
        against = (
            f"; {_pct(choice.hit_rate)} against {_pct(current.hit_rate)} at the current"
            f" {current.length} ({delta:+.1f} points), P90 TTFT {_ms(choice.ttft_p90)} against"
            f" {_ms(current.ttft_p90)}"
        )
    return choice.length, f"{choice.length}: {why}{against}"


def _pct(x: float) -> str:
    return f"{x * 100:.1f} %"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms"


def table(advice: Advice) -> str:
    lines = [
        "| PrefixLength | distinct keys | keys per group | predicted hit rate"
        " | TTFT P50 / P90 | share range |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in advice.rows:
        name = f"{r.length:,}" + (" (current)" if r.current else "")
        name = f"**{name}**" if r.length == advice.recommended else name
        per_group = "-" if r.keys_per_group is None else f"{r.keys_per_group:.2f}"
        lines.append(
            f"| {name} | {r.keys:,} | {per_group} | {_pct(r.hit_rate)}"
            f" | {r.ttft_p50 * 1000:,.0f} / {r.ttft_p90 * 1000:,.0f} ms"
            f" | {r.min_share * 100:.1f}{report.EN_DASH}{r.max_share * 100:.1f} % |"
        )
    return "\n".join(lines)
