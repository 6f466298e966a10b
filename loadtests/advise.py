"""``prefix-router advise`` (``python -m loadtests.advise``): which PrefixLength fits this traffic.

    prefix-router advise access.log [access-2.log ...] [--config router.toml]
        [--lengths 1024,2048,...] [--instances N | --backends NAME,...]
        [--fleet NAME | --capacity-blocks N ...]
        [--time-scale S] [--json]
    prefix-router advise --bodies sample.jsonl [...]

Contract
--------
- Input: access-log lines of a router that ran with ``[advisor] key_digests``
  (``router.keydigests``): any number of files, every worker's and replica's,
  in any order (lines are sorted by arrival).  A line counts when it has
  ``key_digests``, a backend and a 2xx status; others are counted and named
  in the output (a 4xx never reached an engine; a line without digests was
  written before the option was on, or is a body keyed by the helper
  process).  ``--backends NAME,...``: only the lines those backends
  answered, replayed on them: a fleet that declares models routes each
  model over its own pool and the log does not name the model, so give one
  pool's backends a run.  Lines logged at different lengths (a replica at
  another PrefixLength, whose lengths include it; ``[advisor] lengths``
  changed) are read at the lengths every line has (``project``).  Or
  ``--bodies``: JSON lines ``{"ts": unix s, "path": ...,
  "headers": {...}, "body": text | "body_base64": ...}`` (the admin dry
  run's request shape plus its time; ``"output_tokens"`` optional), keyed
  here by the router's own code (``heads.read_request``, ``extract``,
  ``sessions``, ``keydigests``): the digests the access log would hold.
  Neither holds prompt text once read; nothing here prints any.
- The sample: per request its start (``ts`` - ``total_ms``), its key's
  digests at every logged length and its length (else ``bytes_in``), its
  ``key_source`` (a session's ``prefix_hash`` routes it whatever the
  length), its output tokens (decode time ``total_ms - ttft_ms`` over the
  fleet model's time a token; an answer whose first byte came with its end
  counts its whole time) and nothing else.
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
- Candidates: the logged lengths from 1,024 to 65,536 (``--lengths`` picks
  some).  The current PrefixLength is ``--prefix-length``, else the
  config file's, else the logged length whose digest equals the lines'
  ``prefix_hash`` most often (a cut key's digests only: a whole key's
  digest is its key at every longer length too, so it names no length).
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
- The fleet model: ``--instances`` (default: the backends named in the
  sample, by their names, weight 1 each) of the simulated engine with the
  timing and KV cache of ``--fleet NAME`` (``loadtests.workloads.FLEET``;
  default the 70B fleet every workload uses) or the ``simserver`` flags
  given (``--capacity-blocks``, ``--prefill-tokens-per-s``, ...); set them
  to your engines' to predict their hit rates.  ``--time-scale S``: the
  sample came from a simulated fleet running S wall seconds a model second.
- Output: the table and the recommendation on stdout (``--json``: one JSON
  document instead); progress on stderr.  Exit 2 on unusable input (no
  line with digests, fewer than two requests, an unknown length).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from admin.cli import prefix_aware_flags
from hashring import hash_key, tenant_seed
from router.config import ConfigError, RoutingConfig, build_config, load_toml, parse_routing
from router.extract import BadRequest, conversation_id, decode_openai, prompt_key
from router.heads import Kind, read_request
from router.keydigests import DEFAULT_LENGTHS, KeyDigests, NativeDigests, openai_digests
from router.sessions import CONVERSATION, HEADER, SessionRule, conversation_key, header_key

from . import report
from .offline import simulate
from .workloads import FLEET, FleetParams, Request

__all__ = [
    "Advice",
    "Row",
    "Sampled",
    "advise",
    "from_bodies",
    "from_log",
    "main",
    "sample_request",
]

MIN_PREFIX_LENGTH, MAX_PREFIX_LENGTH = 1024, 65_536  # PrefixLength's range (router.config)
SESSION_SOURCES = (HEADER, CONVERSATION)  # a key that is not the prompt's prefix
_SHIFT = 16  # digests are a routing hash's top 48 bits
_MIX = 0x9E3779B97F4A7C15  # an odd constant: serial -> serial * _MIX mod 2**64 is one-to-one
NON_STREAMING_MS = 1.0  # first byte within this of the end: the answer came whole


@dataclass(frozen=True, slots=True)
class Sampled(Request):
    """A logged request as the offline simulator serves it (``workloads.Request``)."""

    lengths: tuple[int, ...] = ()
    digests: tuple[str, ...] = ()
    size: int = 0  # the prompt's characters (4 a token)
    whole: bool = False  # the last digest holds the whole key (the list stopped)
    session: int | None = None  # a session key's routing hash: it routes at any length
    serial: int = 0  # unique in the sample: the pattern past the last digest
    # Per logged length, where ``link`` found the request extends an earlier key:
    # the pieces (pattern, characters) its text between that length and the one
    # before starts with; None: its own pattern only.
    extends: tuple[Pieces | None, ...] = ()

    def key_at(self, length: int) -> int:
        """The routing hash at PrefixLength ``length`` (a logged length)."""
        if self.session is not None:
            return self.session
        index = self.lengths.index(length)
        digest = self.digests[min(index, len(self.digests) - 1)]
        return int(digest, 16) << _SHIFT

    def prompt_text(self) -> str:
        """Synthetic text sharing with another request's exactly the prefix up to the
        longest logged length where both have one digest (see the module contract)."""
        parts = []
        done = 0
        for level, (length, digest) in enumerate(zip(self.lengths, self.digests, strict=False)):
            end = min(length, self.size)
            if end > done:
                for source, chars in (self.extends[level] or ()) if self.extends else ():
                    parts.append(_pattern(source, chars))
                    done += chars
                parts.append(_pattern(digest, end - done))
                done = end
        if done < self.size:
            # Its own: "~" is no digest's, and the mixed serial makes the next
            # characters differ from any other request's (by the 16th at the latest).
            own = f"~{self.serial * _MIX % (1 << 64):016x}"
            parts.append(_pattern(own, self.size - done))
        return "".join(parts)

    def cut(self) -> int:
        """How many of its digests are of a cut key (all but a whole key's last)."""
        return len(self.digests) - 1 if self.whole else len(self.digests)


def _pattern(digest: str, chars: int) -> str:
    return (digest * (chars // len(digest) + 1))[:chars]


Pieces = tuple[tuple[str, int], ...]
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


@dataclass
class Sample:
    requests: list[Sampled]
    backends: list[str]  # named in the sample, sorted
    lengths: tuple[int, ...]  # logged on every line
    current: int | None  # the PrefixLength the lines were routed at, when inferable
    skipped: Counter[str]
    files: int


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class Reading:
    """How to read times and sizes: the fleet model's time a token, the time scale."""

    decode_s: float = 0.025
    time_scale: float = 1.0
    default_output_tokens: int = 128


def _lines(paths: Sequence[str]) -> Iterator[tuple[str, str]]:
    for path in paths:
        if path == "-":
            for line in sys.stdin:
                yield path, line
            continue
        with open(path, encoding="utf-8", errors="replace") as file:
            for line in file:
                yield path, line


def _size(digests: KeyDigests, bytes_in: int) -> int:
    if digests.length is not None:
        return digests.length
    if len(digests.digests) < len(digests.lengths):
        return bytes_in  # a native body that had not ended: what arrived of it
    return max(bytes_in, digests.lengths[-1] + 1)


def sample_request(
    serial: int,
    start: float,
    digests: KeyDigests,
    output_tokens: int,
    *,
    key_source: str | None,
    prefix_hash: str | None,
    bytes_in: int,
    group: str = "",
) -> Sampled:
    """One request of a sample (``start`` in model seconds)."""
    session = None
    if key_source in SESSION_SOURCES and prefix_hash is not None:
        session = int(prefix_hash, 16)
    return Sampled(
        at=start,
        group=group,
        messages=(),
        max_tokens=max(1, output_tokens),
        lengths=tuple(digests.lengths),
        digests=tuple(digests.digests),
        size=_size(digests, bytes_in),
        whole=digests.length is not None and digests.length <= digests.lengths[-1],
        session=session,
        serial=serial,
    )


class _Line(msgspec.Struct):
    event: str = ""
    ts: float = 0.0
    status: int = 0
    backend: str | None = None
    total_ms: float = 0.0
    ttft_ms: float | None = None
    bytes_in: int = 0
    key_source: str | None = None
    prefix_hash: str | None = None
    key_digests: KeyDigests | None = None


_line = msgspec.json.Decoder(_Line)


def from_log(paths: Sequence[str], reading: Reading, pool: Sequence[str] | None = None) -> Sample:
    """The sample in access-log files (see the module contract); ``pool``: only the
    lines those backends answered (one model's pool of a fleet that declares models)."""
    only = None if pool is None else frozenset(pool)
    skipped: Counter[str] = Counter()
    rows: list[tuple[float, _Line]] = []
    for _, text in _lines(paths):
        if not text.strip():
            continue
        try:
            line = _line.decode(text)
        except msgspec.MsgspecError:
            skipped["not an access line"] += 1
            continue
        if line.event != "access":
            skipped["not an access line"] += 1
        elif line.key_digests is None or not (
            line.key_digests.digests or line.key_source in SESSION_SOURCES
        ):
            # None at all (or none yet: a body whose first bytes never came)
            skipped["no key_digests"] += 1
        elif line.backend is None or not 200 <= line.status < 300:
            skipped["not answered 2xx by a backend"] += 1
        elif only is not None and line.backend not in only:
            skipped["answered by a backend not in --backends"] += 1
        else:
            rows.append((line.ts - line.total_ms / 1000, line))
    rows.sort(key=lambda row: row[0])
    requests = []
    backends: set[str] = set()
    votes: Counter[int] = Counter()
    first = rows[0][0] if rows else 0.0
    for serial, (start, line) in enumerate(rows):
        digests = line.key_digests
        assert digests is not None
        assert line.backend is not None
        backends.add(line.backend)
        ttft = line.ttft_ms if line.ttft_ms is not None else line.total_ms
        decode_ms = line.total_ms - ttft
        if decode_ms < NON_STREAMING_MS:
            decode_ms = line.total_ms  # answered whole: in flight all along
        tokens = round(decode_ms / 1000 / reading.time_scale / reading.decode_s)
        requests.append(
            sample_request(
                serial,
                (start - first) / reading.time_scale,
                digests,
                tokens,
                key_source=line.key_source,
                prefix_hash=line.prefix_hash,
                bytes_in=line.bytes_in,
            )
        )
        if line.key_source not in SESSION_SOURCES and line.prefix_hash is not None:
            # The key's whole digest (a list that stopped) is its key at every longer
            # length as well: it names no PrefixLength, only a bound.  A cut key's does.
            cut = digests.digests[:-1] if requests[-1].whole else digests.digests
            matches = [
                g
                for g, d in zip(digests.lengths, cut, strict=False)
                if line.prefix_hash.startswith(d)
            ]
            if len(matches) == 1:
                votes[matches[0]] += 1
    common = _common_lengths(requests)
    return Sample(
        [project(request, common) for request in requests],
        sorted(backends),
        common,
        votes.most_common(1)[0][0] if votes else None,
        skipped,
        len(paths),
    )


def _common_lengths(requests: Sequence[Sampled]) -> tuple[int, ...]:
    if not requests:
        return ()
    common = set(requests[0].lengths)
    for request in requests:
        common &= set(request.lengths)
    return tuple(sorted(common))


def project(request: Sampled, lengths: tuple[int, ...]) -> Sampled:
    """``request`` with its digests at ``lengths`` only (each one of its own lengths).

    Lines logged with other lengths (a replica at another PrefixLength, whose
    lengths include it; ``[advisor] lengths`` changed during the sample) must
    meet at the same lengths: the synthetic text between two lengths and
    ``link``'s levels are drawn from the digests at those lengths, so two equal
    keys logged with different lengths would otherwise share only up to the
    first length where the lists differ."""
    if request.lengths == lengths:
        return request
    digests = []
    last = len(request.digests) - 1
    for g in lengths:
        index = request.lengths.index(g)
        if index >= last:
            if index == last or request.whole:
                # At or past the length holding the whole key: that key (the list stops).
                digests.append(request.digests[last])
            break  # else a native body not ended: nothing known past its last digest
        digests.append(request.digests[index])
    return replace(
        request,
        lengths=lengths,
        digests=tuple(digests),
        whole=request.whole and request.size <= lengths[-1],
    )


class _Body(msgspec.Struct):
    ts: float
    path: str
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    method: str = "POST"
    body: str | None = None
    body_base64: str | None = None
    output_tokens: int | None = None


_body = msgspec.json.Decoder(_Body)


def key_body(
    path: str,
    headers: dict[str, str],
    body: bytes,
    routing: RoutingConfig,
    lengths: tuple[int, ...],
) -> tuple[str, str, KeyDigests]:
    """What the access log would say of a request: key_source, prefix_hash, key_digests.

    The data path's pieces in its order (``router/exchange.py``); BadRequest for
    what the data port would refuse.
    """
    rule = SessionRule(routing.prefix_aware)
    head = read_request(
        b"POST",
        path.encode("latin-1"),
        [
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
            *(() if any(k.lower() == "host" for k in headers) else ((b"host", b"advise"),)),
        ],
        http10=False,
        via_name=b"prefix-router-advise",
        session_header=rule.header,
    )
    if head.refusal is not None:
        raise BadRequest(head.refusal[1])
    limit = routing.prefix_aware.prefix_length
    lengths = tuple(sorted({*lengths, limit}))
    if head.kind is Kind.OPENAI:
        request = decode_openai(body, limit)
        conversation = conversation_id(request.conversation)
        source = rule.openai_source(request.prompt_cache_key, head.session, conversation)
        tenant = request.prompt_cache_key if request.prompt_cache_key is not None else head.tenant
        seed = tenant_seed(tenant)
        key = prompt_key(request, limit)
        digests = openai_digests(request, key, limit, seed, lengths)
        if source == HEADER:
            assert head.session is not None
            key = header_key(head.session)
        elif source == CONVERSATION:
            assert conversation is not None
            key = conversation_key(conversation)
        return source, f"{hash_key(key, seed):016x}", digests
    if head.kind is not Kind.NATIVE:
        raise BadRequest(f"{path} is not routed by a key")
    seed = tenant_seed(head.tenant)
    native = NativeDigests(lengths, seed)
    native.feed(body)
    native.ended()
    if head.session and rule.native_header:
        return HEADER, f"{hash_key(header_key(head.session), seed):016x}", native.field()
    return "prefix", f"{hash_key(memoryview(body)[:limit], seed):016x}", native.field()


def from_bodies(
    path: str, routing: RoutingConfig, lengths: tuple[int, ...], reading: Reading
) -> Sample:
    """The sample in a captured body file (see the module contract)."""
    skipped: Counter[str] = Counter()
    entries = []
    for _, text in _lines([path]):
        if not text.strip():
            continue
        try:
            entry = _body.decode(text)
            data = (
                base64.b64decode(entry.body_base64, validate=True)
                if entry.body_base64 is not None
                else (entry.body or "").encode()
            )
            keyed = key_body(entry.path, entry.headers, data, routing, lengths)
            entries.append((entry, len(data), *keyed))
        except (msgspec.MsgspecError, ValueError) as exc:  # BadRequest, base64, tenant keys
            skipped[f"unusable: {str(exc).split(':')[0]}"] += 1
            continue
    entries.sort(key=lambda e: e[0].ts)
    first = entries[0][0].ts if entries else 0.0
    requests = [
        sample_request(
            serial,
            (entry.ts - first) / reading.time_scale,
            digests,
            entry.output_tokens or reading.default_output_tokens,
            key_source=source,
            prefix_hash=digest,
            bytes_in=size,  # as the access log's bytes_in: a bound on a long key's length
        )
        for serial, (entry, size, source, digest, digests) in enumerate(entries)
    ]
    return Sample(
        requests,
        [],
        _common_lengths(requests),
        routing.prefix_aware.prefix_length,
        skipped,
        1,
    )


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


# ---------------------------------------------------------------- CLI


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="prefix-router advise",
        description="Predict the hit rate of each PrefixLength from a traffic sample"
        " (access logs with [advisor] key_digests, or --bodies) and recommend one.",
    )
    p.add_argument("logs", nargs="*", metavar="ACCESS_LOG", help="access-log files ('-': stdin)")
    p.add_argument("--bodies", metavar="FILE", help="a captured body sample (JSON lines)")
    p.add_argument("--config", metavar="FILE", help="the router's TOML: RoutingConfig, [advisor]")
    p.add_argument(
        "--lengths", metavar="N,N,...", help="candidates (default: every logged length in range)"
    )
    p.add_argument("--prefix-length", type=int, metavar="N", help="the current PrefixLength")
    p.add_argument("--concurrency-threshold", type=int, metavar="N")
    p.add_argument("--balance-factor", type=float, metavar="C")
    p.add_argument("--balance-mode", choices=("IN_FLIGHT", "TRAFFIC"))
    p.add_argument("--concurrency-scope", choices=("IN_FLIGHT", "PREFILL"))
    p.add_argument("--tolerance", type=float, default=0.5, help="points of hit rate (0.5)")
    p.add_argument(
        "--instances", type=int, metavar="N", help="backends (default: those in the sample)"
    )
    p.add_argument(
        "--backends",
        metavar="NAME,...",
        help="only the lines these backends answered, replayed on them (one model's pool)",
    )
    p.add_argument(
        "--fleet", choices=sorted(FLEET), help="a simulated fleet's model (default: long's)"
    )
    for flag, what in (
        ("--capacity-blocks", "KV cache blocks an instance"),
        ("--block-size", "tokens a block"),
        ("--max-num-seqs", "sequences an instance runs at once"),
        ("--default-max-tokens", "output tokens of a body without output_tokens"),
    ):
        p.add_argument(flag, type=int, metavar="N", help=what)
    for flag, what in (
        ("--prefill-tokens-per-s", "prefill speed"),
        ("--overhead-ms", "fixed cost a request"),
        ("--decode-ms", "time an output token"),
    ):
        p.add_argument(flag, type=float, metavar="X", help=what)
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds a model second of the fleet that served the sample (simulated fleets)",
    )
    p.add_argument(
        "--lower-bound",
        action="store_true",
        help="share only what the digests show (no estimate of the rest)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    return p.parse_args(argv)


def fleet_params(args: argparse.Namespace) -> FleetParams:
    params = FLEET[args.fleet or "long"]
    overrides: dict[str, Any] = {}
    for flag, field, scale in (
        ("capacity_blocks", "capacity_blocks", 1),
        ("block_size", "block_size", 1),
        ("max_num_seqs", "max_num_seqs", 1),
        ("default_max_tokens", "default_max_tokens", 1),
        ("prefill_tokens_per_s", "prefill_tokens_per_s", 1),
        ("overhead_ms", "request_overhead_s", 1000),
        ("decode_ms", "decode_s_per_token", 1000),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[field] = value / scale if scale != 1 else value
    return replace(params, **overrides)


def _routing(args: argparse.Namespace) -> tuple[RoutingConfig, tuple[int, ...], int | None]:
    """The RoutingConfig (file, then flags), the [advisor] lengths, the file's PrefixLength."""
    data = load_toml(args.config) if args.config else {}
    routing = dict(data.get("RoutingConfig", {}))
    file_length = routing.get("PrefixAwareRoutingConfig", {}).get("PrefixLength")
    inner = {**routing.get("PrefixAwareRoutingConfig", {}), **prefix_aware_flags(args)}
    routing["PrefixAwareRoutingConfig"] = inner
    config = parse_routing(routing)
    lengths = build_config({"advisor": data.get("advisor", {})}).advisor.lengths
    return config, tuple(lengths) if args.config else DEFAULT_LENGTHS, file_length


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if bool(args.logs) == bool(args.bodies):
        print("advise: give access-log files or --bodies FILE (one of them)", file=sys.stderr)
        return 2
    backends = None
    if args.backends is not None:
        backends = sorted({name.strip() for name in args.backends.split(",") if name.strip()})
        if not backends or args.bodies:
            print("advise: --backends NAME,... reads access logs (their backend)", file=sys.stderr)
            return 2
    try:
        routing, logged, file_length = _routing(args)
        params = fleet_params(args)
        reading = Reading(params.decode_s_per_token, args.time_scale, params.default_max_tokens)
        if args.bodies:
            sample = from_bodies(args.bodies, routing, logged, reading)
        else:
            sample = from_log(args.logs, reading, backends)
    except (ConfigError, OSError) as exc:
        print(f"advise: {exc}", file=sys.stderr)
        return 2
    if len(sample.requests) < 2:
        why = ", ".join(f"{n} {what}" for what, n in sample.skipped.items()) or "no lines"
        print(f"advise: fewer than two usable requests in the sample ({why})", file=sys.stderr)
        return 2
    in_range = [g for g in sample.lengths if MIN_PREFIX_LENGTH <= g <= MAX_PREFIX_LENGTH]
    if args.lengths:
        try:
            wanted = [int(x) for x in args.lengths.split(",") if x.strip()]
        except ValueError:
            print(f"advise: --lengths {args.lengths!r} is not N,N,...", file=sys.stderr)
            return 2
        missing = sorted(set(wanted) - set(in_range))
        if missing:
            print(
                f"advise: no digests at {missing} in the sample (logged: {list(sample.lengths)})",
                file=sys.stderr,
            )
            return 2
        in_range = wanted
    current = args.prefix_length or file_length or sample.current or 4096
    if current not in sample.lengths:
        print(
            f"advise: the current PrefixLength {current} is not among the logged lengths"
            f" {list(sample.lengths)}",
            file=sys.stderr,
        )
        return 2
    names = sample.backends if backends is None else backends
    if args.instances is not None or not names:
        names = [f"sim-{i}" for i in range(args.instances or params.instances)]
    print(
        f"advise: {len(sample.requests):,} requests over"
        f" {sample.requests[-1].at - sample.requests[0].at:,.0f} s, {len(names)} instances,"
        f" replaying {len(set(in_range) | {current})} PrefixLengths",
        file=sys.stderr,
        flush=True,
    )
    advice = advise(
        sample.requests,
        routing,
        in_range,
        current,
        instances=names,
        params=params,
        tolerance=args.tolerance,
        seed=args.seed,
        lower_bound=args.lower_bound,
    )
    if args.json:
        out = {
            "recommended": advice.recommended,
            "reason": advice.reason,
            "current": advice.current,
            "hit_rates": "lower bound" if args.lower_bound else "estimate",
            "requests": advice.requests,
            "span_s": advice.span_s,
            "instances": advice.instances,
            "skipped": dict(sample.skipped),
            "rows": [vars(r) for r in advice.rows],
        }
        print(json.dumps(out, indent=1))
        return 0
    print(_heading(advice, sample, args.lower_bound))
    print()
    print(table(advice))
    print()
    print(f"recommendation: PrefixLength {advice.recommended}")
    print(f"  why: {advice.reason}")
    return 0


def _heading(advice: Advice, sample: Sample, lower_bound: bool) -> str:
    text = (
        f"{advice.requests:,} requests over {advice.span_s:,.0f} s"
        f" from {sample.files} file{'s' if sample.files != 1 else ''},"
        f" {len(advice.instances)} instances; current PrefixLength {advice.current};"
        f" {advice.groups:,} groups of 2+ requests"
    )
    if sample.skipped:
        text += "\nskipped: " + ", ".join(f"{n:,} {what}" for what, n in sample.skipped.items())
    if lower_bound:
        text += "\nhit rates: lower bounds (requests share what their digests show, no more)"
    return text


if __name__ == "__main__":
    sys.exit(main())
