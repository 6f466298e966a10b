"""Explain a routing decision without making it: the admin API's dry run.

Contract:
- ``explain(router, request, k)`` reads a request as a client would send it
  to the data port (``DryRequest``: method, path, headers, body) and says
  where the router would send it now and why (``Explanation``).  It runs
  the data path's own pieces in the data path's order (``exchange.py``
  then ``routing.py``): ``heads.read_request`` (kind, refusals, tenant and
  session headers), ``extract`` (``decode_openai``, ``prompt_key``,
  ``model_name``, ``conversation_id``), the session rule
  (``router.sessions``: ``openai_source``, ``header_key``,
  ``conversation_key``), ``hashring`` (``tenant_seed``, ``hash_key``,
  ``PrefixHasher``), the model pool, the Responses API id, then the
  admission queue's tests (``AdmissionQueue.busy``,
  ``Balancer.saturated``, ``AdmissionQueue.full``) and ``Balancer.peek``: no
  second parser.  The key's ``source`` is the access log's ``key_source`` and
  its digest the access log's ``prefix_hash`` (``accesslog.prefix_hash``).
- This module is the request's side: reading it, its key (``KeyView``), the
  model pool and the Responses API holder.  The routing side, from the A/B
  arm to ``Balancer.peek``, and the answer's types are
  ``router.explainreport``'s (``Answer``); ``Explanation``, ``KeyView``,
  ``WalkStep``, ``EngineView`` and ``HotKey`` are re-exported here, their
  import path.
- Nothing changes: nothing is sent to a backend, no lease is taken, no
  counter moves, no TRAFFIC placement is made or refreshed
  (``Placement.peek``), no random draw is consumed, no response id is made
  more recent.  The answer is the next request's decision if it came next
  to this process; with ``--workers N`` a worker answers, having just read
  every worker's in-flight row (``router.supervisor``).
- A request the data port would refuse (a 4xx or 5xx of its own, before any
  backend: malformed head, bad JSON or field types, an invalid tenant key,
  a body over ``max_body_bytes``) raises ``Refused`` with the data path's
  status and message; the admin API answers it 400.  What the router would
  answer itself on routing (an unknown model: 404; no backend available:
  503; ``GET /v1/models`` of a fleet that declares models: 200; the
  admission queue full: 429) is an explanation with ``router_answer`` set
  and no backend.  Engine signals, the admission queue's "wait" and an A/B
  experiment's arm: see ``router.explainreport``.
- Framing is the body's: ``Content-Length`` is set from the body (any
  ``Content-Length`` or ``Transfer-Encoding`` given is dropped), and a
  ``Host`` is added if none is given, as every HTTP/1.1 client sends one.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import TYPE_CHECKING, Literal, cast

import msgspec

from hashring import PrefixHasher, TenantKeyError, hash_key, tenant_seed

from .accesslog import prefix_hash
from .exchange import _lists_models  # the data path's own test
from .explainreport import (
    Answer,
    Content,
    EngineView,
    Explanation,
    HotKey,
    KeyView,
    Source,
    WalkStep,
)
from .extract import (
    BadRequest,
    conversation_id,
    decode_openai,
    key_source,
    model_name,
    prompt_key,
)
from .heads import TENANT_HEADER, Kind, read_request
from .responses import response_id_of
from .sessions import CONVERSATION, HEADER, PREFIX, PROMPT_CACHE_KEY, conversation_key, header_key

if TYPE_CHECKING:
    from .app import Router

__all__ = [
    "DEFAULT_K",
    "MAX_K",
    "DryRequest",
    "EngineView",
    "Explanation",
    "HotKey",
    "KeyView",
    "Refused",
    "WalkStep",
    "explain",
]

DEFAULT_K = 3  # backends of the walk shown: the primary and two overflows
MAX_K = 64

# An HTTP method token (RFC 9110 5.6.2, as llhttp accepts them: upper case).
_METHOD = re.compile(r"^[A-Z][A-Z_-]{0,31}$")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_FRAMING = frozenset({b"content-length", b"transfer-encoding"})


class Refused(Exception):
    """The data port would refuse the request itself with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(f"the data port would answer {status}: {message}")
        self.status = status
        self.param = param


class DryRequest(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A request as a client would send it to the data port."""

    method: str
    path: str  # the request target: origin form (with its query) or absolute form
    # {"name": "value"}, or [["name", "value"], ...] to repeat a name
    headers: dict[str, str] | list[tuple[str, str]] = {}
    body: str | None = None  # UTF-8 text
    body_base64: str | None = None  # or bytes, base64 (standard alphabet)


def explain(router: Router, dry: DryRequest, k: int = DEFAULT_K, view: str = "") -> Explanation:
    """Where ``dry`` would go now, and why; raises ``Refused`` (see the contract)."""
    config = router.config
    balancer = router.balancer
    fleet = router.fleet
    limit = balancer.config.prefix_aware.prefix_length
    body = _body(dry)
    headers = _headers(dry, len(body))
    request = read_request(
        dry.method.encode(),
        _target(dry.path),
        headers,
        http10=False,
        via_name=router.via_name,
        session_header=router.sessions.header,
    )
    if request.refusal is not None:
        raise Refused(*request.refusal)
    method, path = dry.method, request.path.decode("latin-1")
    tenant_key = _tenant_key(router, headers)  # who it is for (the admission queue)
    kind = request.kind
    key: KeyView | None = None
    key_hash: int | None = None
    model: str | None = None
    response_id: str | None = None
    responses = router.responses
    if responses.enabled and request.path.startswith(b"/v1/responses/"):
        response_id = response_id_of(request.path)  # routed by the id alone
        if response_id is not None:
            kind = Kind.PASSTHROUGH
    if kind is Kind.OPENAI:
        if len(body) > config.limits.max_body_bytes:
            raise Refused(413, f"request body is larger than {config.limits.max_body_bytes} bytes")
        try:
            decoded = decode_openai(body, limit)
            conversation = conversation_id(decoded.conversation)
            source = router.sessions.openai_source(
                decoded.prompt_cache_key, request.session, conversation
            )
            # As the data path: the prompt is rendered (and checked) only for the prefix.
            raw = b"" if source in (HEADER, CONVERSATION) else prompt_key(decoded, limit)
            if fleet.pools:
                model = model_name(decoded.model)
        except BadRequest as exc:
            raise Refused(400, str(exc), exc.param) from None
        if decoded.prompt_cache_key is not None:
            seed = _seed(decoded.prompt_cache_key, "prompt_cache_key")
            salt: Literal["prompt_cache_key", "header"] | None = "prompt_cache_key"
            if tenant_key is None:
                tenant_key = decoded.prompt_cache_key or None
        else:
            seed = _seed(request.tenant, None)
            salt = "header" if request.tenant else None
            if tenant_key is None:
                tenant_key = _latin1(request.tenant)
        if source == HEADER:
            assert request.session is not None
            key_hash = hash_key(header_key(request.session), seed)
            key = _session_key(HEADER, request.session, key_hash, seed, salt)
        elif source == CONVERSATION:
            assert conversation is not None
            key_hash = hash_key(conversation_key(conversation), seed)
            key = _session_key(CONVERSATION, conversation, key_hash, seed, salt)
        else:
            key_hash = hash_key(raw, seed)
            # prompt_cache_key or prefix: the prompt's prefix either way.
            keyed = PROMPT_CACHE_KEY if source == PROMPT_CACHE_KEY else PREFIX
            if key_source(decoded, limit) == "token ids":
                length, most = len(raw) // 4, limit // 4
                key = _key(keyed, "token ids", length, "token ids", most, key_hash, seed, salt)
            else:
                chars = len(raw.decode("utf-8", "surrogatepass"))
                key = _key(keyed, "prompt text", chars, "characters", limit, key_hash, seed, salt)
        if decoded.previous_response_id is not None and request.path == b"/v1/responses":
            response_id = decoded.previous_response_id
    elif kind is Kind.NATIVE:
        seed = _seed(request.tenant, None)
        if tenant_key is None:
            tenant_key = _latin1(request.tenant)
        salt = "header" if request.tenant is not None and seed else None
        if request.session and router.sessions.native_header:
            # The data path routes it at its head by the session; the body is not hashed.
            key_hash = hash_key(header_key(request.session), seed)
            key = _session_key(HEADER, request.session, key_hash, seed, salt)
        else:
            hasher = PrefixHasher(limit, seed)
            hasher.feed(body)
            key_hash = hasher.digest()
            length = min(len(body), limit)
            key = _key(PREFIX, "body bytes", length, "bytes", limit, key_hash, seed, salt)
    answer = Answer(router, k, view)
    answer.head(kind, method, path, key, model, response_id)
    answer.tenant_key = tenant_key
    if key is not None and key.session is not None:
        if key.source == HEADER:
            named = f"the {balancer.config.prefix_aware.session_header} header"
        else:
            named = "the Responses API conversation"
        answer.note = (
            f"keyed by its session ({named}, {key.session[:64]!r}: every request of it has"
            " this key, whatever its prompt); "
        )
    if fleet.pools and method == "GET" and _lists_models(request.path):
        return answer.answered(200, "the router answers GET /v1/models itself: the declared models")
    members = None if model is None else fleet.members_for(model)
    if model is not None:
        if members is None:
            return answer.answered(404, f"no backend serves the model `{model[:256]}`")
        answer.pool = sorted(members.ring.weights)
    if response_id is not None:
        holder = responses.holder(response_id)
        answer.response_backend = holder
        if holder is not None and (members is None or holder in members.ring):
            if balancer.pinnable(holder) is not None:
                return answer.chosen(
                    holder,
                    "response_id",
                    0,
                    f"a Responses API follow-up: {holder} answered {response_id} and holds its"
                    " state",
                )
            answer.note += f"{holder} holds {response_id} but is not available: "
        elif holder is None:
            answer.note += (
                f"{response_id} is not known here (with workers or replicas, the data path"
                " first waits a moment for it to be shared): "
            )
    return answer.route(key_hash, members)


def _key(
    source: str,
    content: Content,
    length: int,
    unit: Literal["bytes", "characters", "token ids"],
    most: int,
    key_hash: int,
    seed: int,
    tenant: Literal["prompt_cache_key", "header"] | None,
) -> KeyView:
    """A prompt's (or a native body's) prefix key; ``source``: router.sessions'."""
    return KeyView(
        source=cast(Source, source),
        content=content,
        session=None,
        length=length,
        unit=unit,
        prefix_length=most,
        cut=length >= most,
        digest=prefix_hash(key_hash),
        tenant_salted=seed != 0,
        tenant_source=tenant if seed != 0 else None,
    )


def _session_key(
    source: str,
    session: bytes | str,
    key_hash: int,
    seed: int,
    tenant: Literal["prompt_cache_key", "header"] | None,
) -> KeyView:
    """A session key (router.sessions' HEADER or CONVERSATION): the whole value
    counts, no prefix cut."""
    if isinstance(session, bytes):
        shown, length, unit = session.decode("latin-1"), len(session), "bytes"
    else:
        shown, length, unit = session, len(session), "characters"
    return KeyView(
        source=cast(Source, source),
        content="session header" if source == HEADER else "conversation id",
        session=shown,
        length=length,
        unit=unit,  # type: ignore[arg-type]  # one of the Literal's
        prefix_length=None,
        cut=False,
        digest=prefix_hash(key_hash),
        tenant_salted=seed != 0,
        tenant_source=tenant if seed != 0 else None,
    )


def _tenant_key(router: Router, headers: list[tuple[bytes, bytes]]) -> str | None:
    """The ``[tenants] header``'s value when configured and sent (``Exchange``)."""
    wanted = router.tenant_header
    if wanted is not None:
        for name, value in headers:
            if name.lower() == wanted:
                return value.decode("latin-1")
    return None


def _latin1(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value else None


def _seed(tenant_key: str | bytes | None, field: str | None) -> int:
    """The data path's tenant seed and its 400 (``Exchange._seed``)."""
    try:
        return tenant_seed(tenant_key)
    except TenantKeyError as exc:
        if field is None:
            raise Refused(400, f"invalid {TENANT_HEADER.decode()} header: {exc}") from None
        raise Refused(400, f"invalid {field}: {exc}", field) from None


def _body(dry: DryRequest) -> bytes:
    if dry.body is not None and dry.body_base64 is not None:
        raise Refused(400, "give body or body_base64, not both")
    if dry.body_base64 is not None:
        try:
            return base64.b64decode(dry.body_base64, validate=True)
        except (binascii.Error, ValueError):
            raise Refused(400, "body_base64 is not valid base64") from None
    return b"" if dry.body is None else dry.body.encode("utf-8", "surrogatepass")


def _target(path: str) -> bytes:
    if not path or any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in path):
        raise Refused(400, "the path must be a request target without spaces or controls")
    if not (path.startswith("/") or path.startswith(("http://", "https://")) or path == "*"):
        raise Refused(400, "the path must start with / (or be an absolute http:// URL)")
    try:
        return path.encode("ascii")
    except UnicodeEncodeError:
        raise Refused(400, "the path must be ASCII (percent-encode the rest)") from None


def _headers(dry: DryRequest, length: int) -> list[tuple[bytes, bytes]]:
    if not _METHOD.match(dry.method):
        raise Refused(400, "the method must be an upper-case HTTP method such as POST")
    if dry.method == "CONNECT":
        raise Refused(405, "CONNECT is not supported")
    pairs = dry.headers.items() if isinstance(dry.headers, dict) else dry.headers
    headers: list[tuple[bytes, bytes]] = []
    host = False
    for name, value in pairs:
        if not _TOKEN.match(name):
            raise Refused(400, f"invalid header name {name[:64]!r}")
        if any(c in value for c in "\r\n\0"):
            raise Refused(400, f"the value of header {name!r} contains CR, LF or NUL")
        try:
            field = (name.encode("ascii"), value.strip(" \t").encode("latin-1"))
        except UnicodeEncodeError:
            raise Refused(400, f"the value of header {name!r} is not Latin-1") from None
        lower = field[0].lower()
        if lower in _FRAMING:
            continue  # framing is the body's (see the contract)
        host = host or lower == b"host"
        headers.append(field)
    if not host:
        headers.append((b"host", b"prefix-router.dry-run"))
    if length or dry.method in ("POST", "PUT", "PATCH"):
        headers.append((b"content-length", str(length).encode()))
    return headers
