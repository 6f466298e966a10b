"""One request crossing the router: route it, stream it both ways, account for it.

``Exchange`` is what ``ClientConnection`` drives: the request side (the head
checked, the body keyed and forwarded) and the one ending every path goes
through.  It is built in three layers, one module each, with no call between
them that a single class would not make:

  router.relay.Relay        the state (every slot), the response side, errors
  router.routing.Routing    the backend chosen, waited for, connected, retried
  router.exchange.Exchange  the request side and ``_finish``

Contract (the rules of ../shared/DESIGN.md "Request flow", in code; the
routing's and the response's halves are stated in their modules):
- The key is computed from the head and as much body as routing needs:
  nothing for passthroughs, the whole (bounded) body for OpenAI kinds, the
  first ``PrefixLength`` bytes for native kinds, hashed as they arrive
  (``PrefixHasher``), never gathered.  Body pieces are forwarded as the
  objects they arrived in; the only body copies are the ones asyncio makes
  when a socket cannot take a write at once.
- The lease taken by the routing is released exactly once, in ``_finish``,
  which every ending path (complete, error, timeout, client gone) goes
  through once, before the response's last bytes are written: a client that
  has its whole answer finds its place free.  ``_finish`` also ends what the
  request may be waiting in (an id's wait, the admission queue).
- Responses API follow-ups (``router.responses``): a request naming a
  response id (``previous_response_id`` of ``POST /v1/responses``, from the
  same decode as the key; or ``/v1/responses/{id}[/...]``, then routed by the
  id alone) is routed to that response's backend (``router.routing``).
- Session keys (``router.sessions``): the affinity key is the first of the
  configured sources the request carries (``prompt_cache_key``, the session
  header, the Responses API ``conversation``, the prefix), salted by the
  tenant as before; the source is kept for the metrics and the access log.
  A native request with a session header is routed at its head.
- Cache salt (``router.cachesalt``, only when on): an OpenAI body is
  forwarded with its tenant's ``cache_salt`` member inserted, as views of the
  body held (no copy), its length adjusted.
- Heads are checked before anything is routed: one ``Host`` (required on
  HTTP/1.1), at most one tenant header, no transfer coding but ``chunked``
  (501), no fragment, no ``Via`` entry of this router (508: a backend URL
  that leads back to us).  The kind is decided on the path a backend's
  framework routes on (``wire.request_path``: absolute form, percent
  escapes and dot segments resolved), so no spelling of an OpenAI path
  escapes its limits and key rule.  Every forwarded request carries our
  ``Via`` entry, and with tracing on our ``traceparent`` (``router.tracing``:
  ``span`` is None while it is off, the only thing checked then).
- Opt-in (``[advisor] key_digests``, ``router.keydigests``): a keyed
  request's access line gets the digests of its prompt's key at several
  lengths: an OpenAI body's from the one decode (and its key, when that holds
  the whole prompt), a native body's fed the pieces as they arrive, the same
  objects that are forwarded.  Off, one attribute is checked per body piece.
- Models (``router.fleet``, "Model pools"): where the fleet declares models,
  an OpenAI request's ``model`` (read from the one decode of its body) picks
  the pool it routes over (``router.routing``), and ``GET /v1/models`` (and
  ``/v1/models/{id}``) is answered by the router: the declared models.
  Where it declares none, nothing of this happens (no read of ``model``).
- Tenants (``router.tenants``, ``router.queue``, ``router.cachesalt``): ``tenant_key`` is the
  ``[tenants] header`` when configured and sent, else the routing salt's key
  (``prompt_cache_key`` or the SageMaker header), else None; the admission
  queue, when on, orders waiting requests by it (``router.routing``).
"""

from __future__ import annotations

import asyncio
from time import perf_counter
from typing import TYPE_CHECKING

from hashring import PrefixHasher, TenantKeyError, hash_key, tenant_seed

from .cachesalt import salted_body
from .extract import (
    BadRequest,
    conversation_id,
    decode_openai,
    has_cache_salt,
    model_name,
    prompt_key,
)
from .heads import TENANT_HEADER, Kind
from .responses import response_id_of
from .routing import Routing
from .sessions import CONVERSATION, HEADER, PREFIX, conversation_key, header_key
from .wire import CHUNKED_END, CONTINUE_100

if TYPE_CHECKING:
    from msgspec import Raw

    from .fleet import ModelPool
    from .keyworker import Keyed

__all__ = ["Exchange"]

# Body reads smaller than this, one after another, are kept in one buffer: a
# body that arrives in tiny reads holds a bounded number of pieces (what the
# key worker's pipe and a backend's writelines take), not one per read.
SMALL_READ = 64 * 1024
MODELS_PATH = b"/v1/models"
OWNED_BY = "prefix-router"


class Exchange(Routing):
    """One request and its response (see the module): what ``ClientConnection`` drives."""

    __slots__ = ()

    @property
    def client_ip(self) -> bytes:
        """The client's address (its connection's: the peer's or a PROXY header's)."""
        return self._conn.peer_ip

    # -- request side (driven by ClientConnection) ------------------------------

    def start(self) -> None:
        """The head is complete and this exchange is the connection's current one."""
        router = self._router
        self.started = perf_counter()  # loop.time() is millisecond-grained on uvloop
        router.exchange_started()
        request = self._request
        self.request_id = request.request_id or router.next_request_id()
        tracer = router.tracer
        if tracer is not None:
            self.span = tracer.begin(request)
        self._client_paused = self._conn.write_paused
        if request.refusal is not None:
            self._fail(*request.refusal)
            return
        if router.responses.enabled and self.path.startswith(b"/v1/responses/"):
            # GET/DELETE /v1/responses/{id}, POST .../cancel: by the id alone
            self._response_id = response_id_of(self.path)
            if self._response_id is not None:
                self.kind = Kind.PASSTHROUGH
        if self.kind is Kind.OPENAI:
            if (request.content_length or 0) > router.config.limits.max_body_bytes:
                limit = router.config.limits.max_body_bytes
                self._fail(413, f"request body is larger than {limit} bytes")
                return
        elif self.kind is Kind.NATIVE:
            seed = self._seed(request.tenant)
            if seed is None:
                return
            self.tenant = request.tenant is not None and seed != 0
            prefix_length = router.balancer.config.prefix_aware.prefix_length
            if router.key_digests is not None:
                self.key_digests = self._digesting = router.key_digests.native(prefix_length, seed)
            if request.session and router.sessions.native_header:
                # The session decides: route now, stream the body unhashed.
                self.key_source = HEADER
                self.key_hash = hash_key(header_key(request.session), seed)
                self._route()
            else:
                self.key_source = PREFIX
                self._hasher = PrefixHasher(prefix_length, seed)
        elif router.fleet.pools and self.method == b"GET" and _lists_models(self.path):
            self._listing = True  # answered at the request's end: keep-alive stays
        else:
            self._route()
        if request.expect_continue and not request.bodiless and not self.http10 and not self.done:
            self._conn.write(CONTINUE_100)  # we read the body now: no need to wait for a backend

    def request_body(self, data: bytes) -> None:
        self.bytes_in += len(data)
        if self._digesting is not None:
            self._digesting.feed(data)
        if self.done:
            return
        upstream = self.upstream
        if upstream is not None:  # streaming: straight through
            self._replayable = False
            self._write_body(upstream, data)
            return
        if self.kind is Kind.OPENAI:
            limit = self._router.config.limits.max_body_bytes
            if self.bytes_in > limit:
                self._fail(413, f"request body is larger than {limit} bytes")
                return
        body = self._body
        if body and len(data) < SMALL_READ and len(body[-1]) < SMALL_READ:
            last = body[-1]
            if type(last) is not bytearray:
                last = body[-1] = bytearray(last)  # a copy of one small read, once
            last += data
        else:
            body.append(data)
        hasher = self._hasher
        if (
            hasher is not None
            and self.choice is None
            and self._queue_timer is None
            and hasher.feed(data)
        ):
            self.key_hash = hasher.digest()
            self.key_bytes = self._router.balancer.config.prefix_aware.prefix_length
            self._route()

    def request_end(self) -> None:
        self.request_complete = True
        if self._digesting is not None:
            self._digesting.ended()
        if self.done:
            return
        if self._listing:
            self._list_models()
        elif self.kind is Kind.OPENAI:
            self._route_openai()
        elif self._queue_timer is not None:
            pass  # queued: admission sends the body, its end included
        elif self.choice is None and self._hasher is not None:
            self.key_hash = self._hasher.digest()  # the body was shorter than the prefix
            self.key_bytes = self.bytes_in
            self._route()
        elif self.upstream is not None:
            if self._request.chunked:
                self.upstream.transport.write(CHUNKED_END)
            self._last_read = self._router.loop.time()
        # else: still connecting or waiting for an id; _attach sends everything, end included

    def _route_openai(self) -> None:
        router = self._router
        limit = router.balancer.config.prefix_aware.prefix_length
        offload = router.config.limits.key_offload_bytes
        if offload and self.bytes_in > offload:
            # One syntax pass over a large body would hold the loop: the key
            # worker computes the same key in its own process.
            future = router.keyworker.key(self._body, self.bytes_in, limit)
            future.add_done_callback(self._keyed)
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = [body]
        try:
            request = decode_openai(body, limit)
            conversation = conversation_id(request.conversation)
            source = router.sessions.openai_source(
                request.prompt_cache_key, self._request.session, conversation
            )
            # A session key needs no prompt: the prompt is rendered only for the prefix.
            key = b"" if source in (HEADER, CONVERSATION) else prompt_key(request, limit)
            digester = router.key_digests
            if digester is not None:
                tenant: str | bytes | None = request.prompt_cache_key
                if tenant is None:
                    tenant = self._request.tenant  # the header, when the body has none
                self.key_digests = digester.openai(request, key, limit, tenant)
        except BadRequest as exc:
            self._fail(400, str(exc), param=exc.param)
            return
        self._route_key(
            key,
            request.prompt_cache_key,
            request.previous_response_id,
            request.model,
            conversation,
            has_cache_salt(request),
        )

    def _keyed(self, future: asyncio.Future[Keyed]) -> None:
        """The key worker's answer for a large body."""
        exc = None if future.cancelled() else future.exception()  # retrieved either way
        if self.done:  # the client left meanwhile
            return
        if isinstance(exc, BadRequest):
            self._fail(400, str(exc), param=exc.param)
        elif exc is not None or future.cancelled():
            # Ours, not the backend's nor the client's: retry later.
            self._fail(503, "the router could not read this request body now; retry")
        else:
            self._route_key(*future.result())

    def _route_key(
        self,
        key: bytes,
        prompt_cache_key: str | None,
        previous_response_id: str | None,
        model: bytes | Raw,
        conversation: str | None = None,
        client_salt: bool = False,
    ) -> None:
        """Salt an OpenAI request's key with its tenant and route it (a Responses
        API follow-up to its previous response's backend, if known; to its
        model's pool where the fleet declares models: ``model`` is raw JSON).
        ``key`` is the prompt's key; a session source, when one decides, replaces
        it (router.sessions).  With the cache salt on, the body gets its
        tenant's (router.cachesalt)."""
        if self._router.fleet.pools:
            try:
                self.model = model_name(model)
            except BadRequest as exc:
                self._fail(400, str(exc), param=exc.param)
                return
        if prompt_cache_key is not None:
            seed = self._seed(prompt_cache_key, "prompt_cache_key")
        else:
            seed = self._seed(self._request.tenant)  # the header, when the body has none
        if seed is None:
            return
        self.tenant = seed != 0
        session = self._request.session
        source = self._router.sessions.openai_source(prompt_cache_key, session, conversation)
        if source == HEADER:
            assert session is not None
            key = header_key(session)
        elif source == CONVERSATION:
            assert conversation is not None
            key = conversation_key(conversation)
        self.key_source = source
        self.key_hash = hash_key(key, seed)
        self.key_bytes = len(key)
        self._request.content_length = self.bytes_in  # forwarded with a length now
        self._request.chunked = False
        salter = self._router.salter
        if salter is not None and not (client_salt and salter.keep_client):
            # The request's tenant, as the metrics and the queue see it: the
            # configured tenant header (an identity a gateway sets) before the
            # routing salt's key, which any client may choose.
            self._body, added = salted_body(self._body, salter.member(self.tenant_key))
            self._request.content_length += added
        if previous_response_id is not None and self.path == b"/v1/responses":
            self._response_id = previous_response_id
        self._route()

    def _seed(self, tenant_key: str | bytes | None, field: str | None = None) -> int | None:
        """The murmur seed of a tenant key; None, answered 400, for an invalid key.

        ``field`` names the body field the key came from; None: the header.
        """
        try:
            seed = tenant_seed(tenant_key)
        except TenantKeyError as exc:
            if field is None:
                self._fail(400, f"invalid {TENANT_HEADER.decode()} header: {exc}")
            else:
                self._fail(400, f"invalid {field}: {exc}", param=field)
            return None
        if self.tenant_key is None and tenant_key:
            key = tenant_key
            self.tenant_key = key if isinstance(key, str) else key.decode("latin-1")
        return seed

    # -- the fleet's models (router.fleet), answered by the router ----------------

    def _list_models(self) -> None:
        """``GET /v1/models`` (the declared models) or ``/v1/models/{id}`` (one)."""
        fleet = self._router.fleet
        name = self.path[len(MODELS_PATH) + 1 :].decode("utf-8", "replace")
        if not name:
            self._reply({"object": "list", "data": [_model(pool) for pool in fleet.models()]})
        elif name in fleet.pools:
            self._reply(_model(fleet.pools[name]))
        else:
            self._unknown_model(name)

    # -- the one ending: every path comes through _finish exactly once ------------

    def _finish(self, upstream_reusable: bool) -> None:
        if self.done:
            return
        # The lease first, then the response's last bytes: a client that has its
        # answer finds its place free (in this worker's cells, which every other
        # process reads), whichever process it asks next.
        if self.choice is not None:
            self.choice.release()
        self.flush()
        self.done = True
        # What was held of the body goes now, not with the exchange: a refused
        # body can be tens of MB, and the exchange may wait for a collection.
        # (The list is the exchange's own: the key worker and salting copy it.)
        self._body.clear()
        router = self._router
        self.ended = perf_counter()
        self._disarm()
        if self._id_wait is not None:
            self._stop_waiting()
        if self._queue_timer is not None:  # gone while queued: its place is free at once
            self._stop_queue_timer()
            assert router.queue is not None
            router.queue.leave(self)
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            if upstream_reusable:
                upstream.pool.give_back(upstream)
            else:
                upstream.close()
        router.exchange_finished(self)
        self._conn.exchange_done(self)


def _lists_models(path: bytes) -> bool:
    return path == MODELS_PATH or path.startswith(b"/v1/models/")


def _model(pool: ModelPool) -> dict[str, object]:
    """A model as OpenAI's ``GET /v1/models`` lists it."""
    return {"id": pool.model, "object": "model", "created": pool.created, "owned_by": OWNED_BY}
