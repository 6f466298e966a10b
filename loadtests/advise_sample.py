"""The advisor's sample (``prefix-router advise``): requests by their key digests, no text.

What ``loadtests.advise`` replays, read from a router's access logs or from
captured bodies (``from_log``, ``from_bodies``), and the request type the
replay runs (``Sampled``, a ``workloads.Request``); ``loadtests.advise_replay``
replays it.

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
- Out: a ``Sample``: its requests by arrival, from 0 in model seconds, at
  the lengths every line has; the backends the lines name (none in a body
  sample); the PrefixLength the lines were routed at, when inferable; the
  lines skipped, by why.  A request's
  routing hash at a logged length is ``Sampled.key_at``, its synthetic text
  ``Sampled.prompt_text`` (see ``loadtests.advise_replay``: the prediction).
"""

from __future__ import annotations

import base64
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import msgspec

from hashring import hash_key, tenant_seed
from router.config import RoutingConfig
from router.extract import BadRequest, conversation_id, decode_openai, prompt_key
from router.heads import Kind, read_request
from router.keydigests import KeyDigests, NativeDigests, openai_digests
from router.sessions import CONVERSATION, HEADER, SessionRule, conversation_key, header_key

from .workloads import Request

__all__ = [
    "Pieces",
    "Reading",
    "Sample",
    "Sampled",
    "from_bodies",
    "from_log",
    "key_body",
    "project",
    "sample_request",
]

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
        longest logged length where both have one digest (see ``advise_replay``'s contract)."""
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
