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
  and no backend.  With engine signals on (``router.signals``) each backend
  of the walk shows its engine's figures and rank, and a decision that a rank
  settled (a tie on in flight) says so, with the backend it would be without
  them (``without_engine_signals``: ``Balancer.peek(..., signals=False)``).
  With the admission queue on, a keyed request that would
  wait in it (every backend of its walk at its bound, or others of its pool
  waiting already) has ``admission`` "wait" and no backend: where it then
  goes depends on what frees up first.
- An A/B experiment (``router.arms``): a keyed request's ``arm`` is the one
  its key is assigned to (``Experiment.assign``, as the data path), and the
  rest of the answer is that arm's balancer's (its strategy, walk, bounds;
  under Split BACKENDS its walk is on the ring of its own backends, named
  in ``arm_backends``).
- Framing is the body's: ``Content-Length`` is set from the body (any
  ``Content-Length`` or ``Transfer-Encoding`` given is dropped), and a
  ``Host`` is added if none is given, as every HTTP/1.1 client sends one.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import time
from fractions import Fraction
from typing import TYPE_CHECKING, Literal, cast

import msgspec

from hashring import PrefixHasher, TenantKeyError, hash_key, tenant_seed
from hashring.bounded import FALLBACK_TOLERANCE, exact_factor

from .accesslog import prefix_hash
from .balancer import decision_label
from .config import Strategy
from .exchange import _lists_models  # the data path's own test
from .extract import (
    BadRequest,
    conversation_id,
    decode_openai,
    key_source,
    model_name,
    prompt_key,
)
from .fleet import AdminState
from .heads import TENANT_HEADER, Kind, read_request
from .responses import response_id_of
from .sessions import CONVERSATION, HEADER, PREFIX, PROMPT_CACHE_KEY, conversation_key, header_key
from .split import Part, Split

if TYPE_CHECKING:
    from hashring import Placement

    from .app import Router
    from .balancer import Members
    from .fleet import ModelPool
    from .queue import AdmissionQueue
    from .signals import Signal

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


Source = Literal["prompt_cache_key", "header", "conversation", "prefix"]
Content = Literal["body bytes", "prompt text", "token ids", "session header", "conversation id"]


class KeyView(msgspec.Struct, frozen=True):
    source: Source  # the access log's key_source (router.sessions: the first one present)
    content: Content  # what was hashed
    session: str | None  # header: the session header's value; conversation: the id
    length: int  # in ``unit``, as hashed (a prefix: at most ``prefix_length``)
    unit: Literal["bytes", "characters", "token ids"]
    prefix_length: int | None  # PrefixLength, in ``unit`` (token ids: / 4); None: a session
    cut: bool  # the key reached PrefixLength: what follows does not count
    digest: str  # the access log's prefix_hash
    tenant_salted: bool  # the access log's tenant
    tenant_source: Literal["prompt_cache_key", "header"] | None


class EngineView(msgspec.Struct, frozen=True):
    """A backend's engine as the last scrape round read it (router.signals)."""

    waiting: float | None  # requests queued in the engine (None: not exposed, or no scrape)
    kv_cache_usage: float | None  # share of its KV cache in use, 0..1
    rank: int  # lower first: waiting, then KV use in 5 % steps; 0 without figures
    age_s: float | None  # seconds since that round read it


class WalkStep(msgspec.Struct, frozen=True):
    """One backend of the key's walk (its ring preference list), in order."""

    backend: str
    position: int | None  # the N of "overflow N"; None: skipped (down or draining)
    state: Literal["available", "down", "draining"]
    weight: int
    in_flight: int
    waiting: int | None  # ConcurrencyScope PREFILL: not yet answered (what the threshold counts)
    threshold: int  # ConcurrencyThreshold
    balance_bound: int | None  # BalanceMode IN_FLIGHT with BalanceFactor: ceil(c (total+1) w / W)
    recent: int | None  # BalanceMode TRAFFIC: its requests among the last ``window``
    share_bound: int | None  # TRAFFIC: a new key is placed here only while recent < it
    eligible: bool  # below its threshold (and balance bound): takes the request at its turn
    engine: EngineView | None = None  # engine signals on: what breaks its ties


class HotKey(msgspec.Struct, frozen=True):
    share: float  # the key's share of recent traffic, in average backends' shares
    replicas: list[str]  # its home, then the next backends of its walk


class Explanation(msgspec.Struct, frozen=True):
    kind: Literal["openai", "native", "passthrough"]
    method: str
    path: str  # as the backend's framework will route on it
    key: KeyView | None  # None: no routing key (passthrough)
    model: str | None  # the body's, where the fleet declares models
    pool: list[str] | None  # the backends of its model pool; None: the whole fleet
    response_id: str | None  # a Responses API follow-up's id
    response_backend: str | None  # the backend known to hold it (None: unknown here)
    strategy: Literal["RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE"]
    home: str | None  # BalanceMode TRAFFIC: the key's home now (None: a new key)
    hot_key: HotKey | None
    walk: list[WalkStep]  # the first k backends of the key's walk (PREFIX_AWARE)
    backend: str | None  # where it would go
    decision: str | None  # the access log's decision ("primary", "overflow 1", ...)
    router_answer: int | None  # the router would answer itself, with this status
    reason: str
    # The admission queue (on): "wait" (it would queue), "full" (429); None: routed now.
    admission: Literal["wait", "full"] | None = None
    view: str = "this process"  # whose counts these are
    # Engine signals broke a tie: where it would go without them (None: nowhere else).
    without_engine_signals: str | None = None
    # An A/B experiment (router.arms): the arm the key falls in, whose RoutingConfig
    # decides (``strategy`` is the arm's); None: no experiment, or no key.
    arm: str | None = None
    # Split BACKENDS (router.split): the backends the arm owns, the only ones it routes
    # over (``walk`` is on their ring); None: it shares the fleet.
    arm_backends: list[str] | None = None
    # Claim spreading (router.balancer): the walk's threshold lowered by a draw in
    # 0..claim_spread-1 (BalanceMode IN_FLIGHT); 1: the exact walk.
    claim_spread: int = 1


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
    answer = _Answer(router, k, view)
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


class _Answer:
    """An explanation being assembled: the request's facts, then the decision."""

    def __init__(self, router: Router, k: int, view: str):
        self.router = router
        self.k = k
        self.view = view or "this process"
        self.note = ""  # said before the reason
        self.pool: list[str] | None = None
        self.response_backend: str | None = None
        self.walk: list[WalkStep] = []
        self.home: str | None = None
        self.hot: HotKey | None = None
        self.tenant_key: str | None = None  # the admission queue's tenant
        self.unsignalled: str | None = None  # the backend without engine signals, if another
        self.balancer = router.balancer  # an experiment's arm's, once the key is known
        self.arm: str | None = None
        self.arm_backends: list[str] | None = None

    def head(
        self,
        kind: Kind,
        method: str,
        path: str,
        key: KeyView | None,
        model: str | None,
        response_id: str | None,
    ) -> None:
        self.kind, self.method, self.path = kind, method, path
        self.key, self.model, self.response_id = key, model, response_id

    def _done(
        self,
        backend: str | None,
        decision: str | None,
        answer: int | None,
        reason: str,
        admission: Literal["wait", "full"] | None = None,
    ) -> Explanation:
        return Explanation(
            kind=self.kind.value,
            method=self.method,
            path=self.path,
            key=self.key,
            model=self.model,
            pool=self.pool,
            response_id=self.response_id,
            response_backend=self.response_backend,
            strategy=self.balancer.config.strategy.value,
            home=self.home,
            hot_key=self.hot,
            walk=self.walk,
            backend=backend,
            decision=decision,
            router_answer=answer,
            reason=self.note + reason,
            view=self.view,
            admission=admission,
            without_engine_signals=self.unsignalled if backend is not None else None,
            arm=self.arm,
            arm_backends=self.arm_backends,
            claim_spread=self.balancer.claim_spread,
        )

    def answered(self, status: int, reason: str) -> Explanation:
        return self._done(None, None, status, reason)

    def chosen(self, backend: str, decision: str, position: int, reason: str) -> Explanation:
        return self._done(backend, decision_label(decision, position), None, reason)

    def route(self, key_hash: int | None, members: Members | None) -> Explanation:
        experiment = self.router.balancer.arms
        if experiment is not None and key_hash is not None:
            arm = experiment.assign(key_hash)  # the data path's Exchange._balancer
            self.arm, self.balancer = arm.name, arm.balancer
            total = sum(a.weight for a in experiment.arms)
            self.note += (
                f"A/B experiment {experiment.id!r}: the key falls in arm {arm.name!r}"
                f" ({arm.weight:g} of {total:g} by weight), which routes by"
                f" {arm.routing.strategy.value}; "
            )
        balancer = self.balancer
        strategy = balancer.config.strategy
        ring_of = balancer.members(members)  # an arm's own backends under Split BACKENDS
        if experiment is not None and experiment.split is not None and self.arm is not None:
            self._split(experiment.split, ring_of)
        placement = balancer.placement_of(ring_of)
        if key_hash is not None and strategy is Strategy.PREFIX_AWARE:
            self._walk(key_hash, ring_of, placement)
            spread = balancer.claim_spread
            if spread > 1:  # BalanceMode IN_FLIGHT (else 1)
                self.note += (
                    f"claims spread over {spread} (replicas race for freed places): this"
                    f" request's threshold is lowered by a draw in 0..{spread - 1}; "
                )
        queue = self.router.queue
        if queue is not None and key_hash is not None:  # a keyed first attempt: _route's test
            waits = self._queued(queue, key_hash, members)
            if waits is not None:
                return waits
        queued = queue is not None  # _route passes queue=True to choose then
        picked = balancer.peek(key_hash, members, queue=queued)
        if picked is None:
            serving = "" if self.model is None else f" for model `{self.model[:256]}`"
            return self.answered(503, f"no backend{serving} is available")
        backend, decision, position = picked
        name = backend.name
        if key_hash is not None and self.router.signals is not None:
            plain = balancer.peek(key_hash, members, signals=False, queue=queued)
            if plain is not None and plain[0] is not backend:
                self.unsignalled = plain[0].name
        if decision == "passthrough":
            why = (
                f"no routing key ({self.method} {self.path}): the backend with the fewest in flight"
            )
        elif decision == "random":
            why = (
                "RANDOM: a draw weighted by weight among the available backends (the draw this"
                " process's next request would make, if it came next)"
            )
        elif decision == "least_outstanding":
            why = f"LEAST_OUTSTANDING_REQUESTS: {name} has the fewest in flight per unit of weight"
        else:
            why = self._why(name, decision, position, placement)
        return self.chosen(name, decision, position, why)

    def _split(self, split: Split, ring_of: Members) -> None:
        """Split BACKENDS: the arm's own backends, and whether it routes over them."""
        owned = split.owned()
        if owned is None:
            self.note += "Split BACKENDS suspended (fewer backends than arms): the fleet; "
            return
        assert self.arm is not None
        self.arm_backends = list(owned.get(self.arm, ()))
        mine = ", ".join(self.arm_backends)
        if isinstance(ring_of, Part):
            self.note += f"Split BACKENDS: it routes over its own {mine}; "
        else:
            self.note += (
                f"Split BACKENDS: it owns {mine}, none of them available here (or serving"
                " its model): it routes over them all; "
            )

    def _queued(
        self, queue: AdmissionQueue, key_hash: int, members: Members | None
    ) -> Explanation | None:
        """The admission queue's answer (the data path's order), or None: routed now."""
        pool = None if members is None else cast("ModelPool", members).model
        until = "a backend of its walk is below its bound"
        if queue.busy(pool):
            why = (
                "other requests of its pool wait in the admission queue already"
                f" ({queue.depth} waiting in all): it would go behind them"
            )
        elif queue.holds_back(self.tenant_key, members, self.router.loop.time()):
            why = (
                f"no more places are free than the reserve ({queue.reserve}), kept for the"
                " tenants under their share of the requests, and this one is not"
            )
            until = "more places are free or nobody is under its share"
        elif self.balancer.saturated(key_hash, members):
            why = "every backend of the walk is at its bound"
        else:
            return None
        tenant = "no tenant" if self.tenant_key is None else f"tenant {self.tenant_key[:64]!r}"
        config = queue.config
        if queue.full(self.tenant_key):
            return self._done(
                None,
                None,
                429,
                f"{why}, and the admission queue is full ({queue.waiting(self.tenant_key)}"
                f" of {config.max_queued_per_tenant} waiting for {tenant},"
                f" {queue.depth} of {config.max_queued} in all): the router would answer 429"
                " (queue_full)",
                "full",
            )
        return self._done(
            None,
            None,
            None,
            f"{why}: it would wait in the admission queue ({tenant}) until {until}, at most"
            f" {config.max_wait:g} s (then 429)",
            "wait",
        )

    def _walk(self, key_hash: int, members: Members, placement: Placement | None) -> None:
        """The first ``k`` backends of the key's walk with their counts and bounds."""
        balancer = self.balancer
        fleet = self.router.fleet
        ring = members.ring
        weights = ring.weights
        bound = balancer.bound
        prefill = balancer.prefill_scope
        loads, waiting = fleet.loads, fleet.waiting
        skip = fleet.unavailable
        total_weight = sum(w for name, w in weights.items() if name not in skip)
        balance_total = sum(loads.get(name) for name in weights if name not in skip)
        share: Fraction | None = None
        if placement is not None:
            home = placement.home(key_hash)
            self.home = home if home in ring else None
            if self.home is not None:
                hot = placement.hot_share(key_hash, len(ring))
                if hot:
                    count = min(math.ceil(hot), len(ring))
                    self.hot = HotKey(
                        round(hot, 2), placement.replicas_of(ring, key_hash, self.home, count)
                    )
            share = exact_factor(placement.factor) * (placement.decisions + 1)
        signals = self.router.signals
        now = time.time()
        position = 0
        for name in ring.walk(key_hash):
            if len(self.walk) == self.k:
                break
            backend = fleet.backends.get(name)
            if backend is None or name in fleet.unavailable:  # panic: a down one taken
                state: Literal["available", "down", "draining"] = (
                    "draining"
                    if backend is None or backend.state is AdminState.DRAINING
                    else "down"
                )
                at: int | None = None
            else:
                state, at = "available", position
                position += 1
            weight = weights[name]
            in_flight = loads.get(name)
            counted = waiting.get(name) if prefill else in_flight
            eligible = state == "available" and counted < bound.threshold
            balance: int | None = None
            recent = share_bound = None
            if placement is not None and share is not None and total_weight:
                recent = placement.share(name)
                share_bound = math.ceil(share * weight / total_weight)
            elif bound.numerator and total_weight:
                balance = bound.limit(weight, balance_total, total_weight)
                eligible = eligible and in_flight < balance
            self.walk.append(
                WalkStep(
                    backend=name,
                    position=at,
                    state=state,
                    weight=weight,
                    in_flight=in_flight,
                    waiting=waiting.get(name) if prefill else None,
                    threshold=bound.threshold,
                    balance_bound=balance,
                    recent=recent,
                    share_bound=share_bound,
                    eligible=eligible,
                    engine=None if signals is None else _engine(signals.figures.get(name), now),
                )
            )

    def _why(self, name: str, decision: str, position: int, placement: Placement | None) -> str:
        """One sentence for a PREFIX_AWARE decision."""
        balancer = self.balancer
        fleet = self.router.fleet
        unit = "waiting" if balancer.prefill_scope else "in flight"
        threshold = balancer.bound.threshold

        def counted(member: str) -> str:
            tracker = fleet.waiting if balancer.prefill_scope else fleet.loads
            return f"{tracker.get(member)} {unit}, threshold {threshold}"

        hot, home = self.hot, self.home
        if hot is not None and name in hot.replicas and decision != "fallback":
            return (
                f"a hot key ({hot.share:g} average backends' shares of recent traffic) is served"
                f" by its {len(hot.replicas)} replicas {', '.join(hot.replicas)}: {name} has the"
                f" fewest in flight among those below the threshold ({counted(name)})"
                + self._tie(name)
            )
        if decision == "fallback":
            which = "the earliest of the walk" if self.unsignalled is None else "one"
            return (
                f"every backend of the walk is at its bound: {name} is {which} among the least"
                f" loaded ({fleet.loads.get(name)} in flight; past the threshold, counts within"
                f" {FALLBACK_TOLERANCE} of the shortest queue tie) (fallback)" + self._tie(name)
            )
        if placement is not None and home is not None:
            if decision == "primary":
                return (
                    f"the key's home is {name} (placed by an earlier request) and it is below"
                    f" the threshold ({counted(name)})"
                )
            state = fleet.backends[home].state if home in fleet.backends else None
            if home in fleet.unavailable:
                why = "is down" if state is AdminState.ACTIVE else "is draining"
            else:
                why = f"is at its threshold ({counted(home)})"
            return (
                f"the key's home {home} {why}: {name} is the next backend of the walk below the"
                f" threshold (place {position}, {counted(name)}); the key keeps its home"
            )
        if placement is not None:
            if decision == "primary":
                return (
                    f"a new key: {name}, first of its walk, is below its share of recent traffic"
                    f" and its threshold; it becomes the key's home"
                )
            return (
                f"a new key: the backends before it in the walk are over their share of recent"
                f" traffic or at their threshold; {name} (place {position}) becomes its home"
            )
        if decision == "primary":
            return (
                f"{name} is the first backend of the key's walk and is below its bound"
                f" ({counted(name)})"
            )
        return (
            f"the backends before it in the key's walk are at their bound: {name} is the first"
            f" below it (place {position}, {counted(name)})"
        )

    def _tie(self, name: str) -> str:
        """What engine signals changed, said after the decision ("" if nothing)."""
        other = self.unsignalled
        signals = self.router.signals
        if other is None or signals is None:
            return ""
        loads = self.router.fleet.loads
        now = time.time()
        return (
            f"; it ties with {other} ({loads.get(name)} and {loads.get(other)} in flight) and"
            f" the engine signals break the tie: {name}'s engine"
            f" {_figures(signals.figures.get(name), now)}, {other}'s"
            f" {_figures(signals.figures.get(other), now)} (without them: {other})"
        )


def _engine(signal: Signal | None, now: float) -> EngineView:
    if signal is None:
        return EngineView(None, None, 0, None)
    age = round(max(0.0, now - signal.at), 3)
    return EngineView(signal.waiting, signal.kv_usage, signal.rank, age)


def _figures(signal: Signal | None, now: float) -> str:
    """An engine's figures in words, for the reason sentence."""
    if signal is None:
        return "has no figures (rank 0)"
    waiting = "?" if signal.waiting is None else f"{signal.waiting:g}"
    kv = "?" if signal.kv_usage is None else f"{signal.kv_usage * 100:.0f} %"
    return (
        f"has {waiting} waiting and KV cache {kv} in use (rank {signal.rank},"
        f" read {max(0.0, now - signal.at):.1f} s ago)"
    )


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
