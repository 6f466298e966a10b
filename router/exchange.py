"""One request crossing the router: route it, stream it both ways, account for it.

``Exchange`` is what ``ClientConnection`` drives: the request side (the head
checked, the body keyed and forwarded, the backend chosen and connected, the
retries) and the one ending every path goes through.  Its base,
``router.relay.Relay``, holds its state and relays the response.

Contract (the rules of ../shared/DESIGN.md "Request flow", in code; the
response half is ``router.relay``'s):
- The key is computed from the head and as much body as routing needs:
  nothing for passthroughs, the whole (bounded) body for OpenAI kinds, the
  first ``PrefixLength`` bytes for native kinds, hashed as they arrive
  (``PrefixHasher``), never gathered.  Body pieces are forwarded as the
  objects they arrived in; the only body copies are the ones asyncio makes
  when a socket cannot take a write at once.
- ``Balancer.choose`` takes the lease in the same step as the pick; the
  lease is released exactly once, in ``_finish``, which every ending path
  (complete, error, timeout, client gone) goes through once, before the
  response's last bytes are written: a client that has its whole answer
  finds its place free.
- Responses API follow-ups (``router.responses``): a request naming a
  response id (``previous_response_id`` of ``POST /v1/responses``, from the
  same decode as the key; or ``/v1/responses/{id}[/...]``, then routed by the
  id alone) goes to that response's backend when it is known and available
  (with shared ids, an unknown one is waited for, bounded), else by the
  strategy; the 2xx answers to ``POST /v1/responses`` are read for their id
  in their first bytes only.
- Session keys (``router.sessions``): the affinity key is the first of the
  configured sources the request carries (``prompt_cache_key``, the session
  header, the Responses API ``conversation``, the prefix), salted by the
  tenant as before; the source is kept for the metrics and the access log.
  A native request with a session header is routed at its head.
- Cache salt (``router.cachesalt``, only when on): an OpenAI body is
  forwarded with its tenant's ``cache_salt`` member inserted, as views of the
  body held (no copy), its length adjusted.
- Retries: a connect failure moves on to the next backend of the walk
  (``avoid``), at most ``retries`` times (a new connection already lost when
  its connect's callback runs is one: nothing was sent on it); a reused keep-alive connection that
  dies before any response byte is replaced by a fresh one to the same
  backend, but only when the router still holds the whole request.  Nothing
  is replayed once the backend may have started on it otherwise.
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
  the pool it routes over, retries included; a model no backend serves is
  answered 404 in OpenAI's shape (``code: model_not_found``), and ``GET
  /v1/models`` (and ``/v1/models/{id}``) by the router: the declared models.
  Where it declares none, nothing of this happens (no read of ``model``).
- A/B experiments (``router.arms``): a keyed request is assigned its arm once,
  by its key, when it is first routed (``arm``), and every attempt (retries,
  the admission queue, a follow-up) routes with that arm's balancer.
- Tenants (``router.tenants``, ``router.queue``, ``router.cachesalt``): ``tenant_key`` is the
  ``[tenants] header`` when configured and sent, else the routing salt's key
  (``prompt_cache_key`` or the SageMaker header), else None.  With the
  admission queue on, a keyed request's first routing attempt that finds every
  backend at its bound (or others of its pool already waiting) waits in the
  queue (``queue_entered``) until ``admit`` places it, or is answered 429 with
  ``Retry-After`` (``reject``); leaving while queued frees its place.
"""

from __future__ import annotations

import asyncio
import errno
from time import perf_counter
from typing import TYPE_CHECKING

from hashring import PrefixHasher, TenantKeyError, hash_key, tenant_seed

from .balancer import SATURATED
from .cachecheck import MIN_KEY_BYTES
from .cachesalt import salted_body
from .config import MAX_MODEL_NAME
from .extract import (
    BadRequest,
    conversation_id,
    decode_openai,
    has_cache_salt,
    model_name,
    prompt_key,
)
from .heads import TENANT_HEADER, Kind, upstream_head
from .queue import QUEUE_FULL
from .relay import Relay
from .responses import response_id_of
from .sessions import CONVERSATION, HEADER, PREFIX, conversation_key, header_key
from .upstream import CLIENT
from .wire import CHUNKED_END, CONTINUE_100

_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)

if TYPE_CHECKING:
    from msgspec import Raw

    from .arms import Experiment
    from .balancer import Balancer, Choice, Members
    from .fleet import ModelPool
    from .keyworker import Keyed
    from .queue import AdmissionQueue
    from .upstream import UpstreamConnection

__all__ = ["Exchange"]

# Body reads smaller than this, one after another, are kept in one buffer: a
# body that arrives in tiny reads holds a bounded number of pieces (what the
# key worker's pipe and a backend's writelines take), not one per read.
SMALL_READ = 64 * 1024
MODELS_PATH = b"/v1/models"
OWNED_BY = "prefix-router"


class Exchange(Relay):
    __slots__ = ()

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

    # -- routing and connecting ------------------------------------------------

    def _route(self) -> None:
        router = self._router
        model = self.model
        members = None if model is None else router.fleet.members_for(model)
        if model is not None:
            if members is None:
                self._unknown_model(model)
                return
            self.pool = members.model
        choice = None
        balancer = router.balancer
        if balancer.arms is not None and self.key_hash is not None:
            balancer = self._arm_balancer(balancer.arms)  # an A/B experiment's arm's
        response_id = self._response_id
        if response_id is not None and not self._tried:
            name = router.responses.backend_of(response_id)
            if name is None and self._wait_for(response_id):
                return  # routed when the id arrives or the wait ends
            if members is not None and name not in members.ring:
                name = None  # held by a backend of another model: this one's pool decides
            choice = self._follow(name)
        if choice is None:
            queue = router.queue
            if queue is not None and self.key_hash is not None and not self._tried:
                # Others of this pool wait: behind them.  Else wait if saturated, or
                # if only the places kept for tenants under their share are free.
                now = router.loop.time()
                queue.asked(self.tenant_key, now)
                if queue.busy(self.pool) or queue.holds_back(self.tenant_key, members, now):
                    self._enqueue(queue)
                    return
                choice = balancer.choose(self.key_hash, self._tried, members, queue=True)
                if choice is SATURATED:
                    self._enqueue(queue)
                    return
            else:
                choice = balancer.choose(self.key_hash, self._tried, members)
        if choice is None:
            serving = "" if model is None else f" for model `{_shown(model)}`"
            if self._tried:
                self._fail(502, f"no backend{serving} could be reached")
            else:
                self._fail(503, f"no backend{serving} is available")
            return
        self._dispatch(choice)

    def _arm_balancer(self, arms: Experiment) -> Balancer:
        """A keyed request's arm's balancer: its arm assigned once (again if retired)."""
        arm = self.arm
        if arm is None or arm.retired:
            assert self.key_hash is not None
            arm = self.arm = arms.assign(self.key_hash)
        return arm.balancer

    def _dispatch(self, choice: Choice) -> None:
        self.choice = choice
        router = self._router
        key_hash = self.key_hash
        if key_hash is not None and self.key_bytes >= MIN_KEY_BYTES:
            self.repeat = router.repeats.sent(key_hash, choice.backend)
        conn = router.pools[choice.backend.name].take()
        if conn is not None:
            self._attach(conn)
        else:
            self._connect()

    # -- the admission queue (router.queue) ----------------------------------

    def _enqueue(self, queue: AdmissionQueue) -> None:
        if not queue.enter(self):
            self.reject(QUEUE_FULL, queue.retry_after(self.tenant_key))

    def queue_entered(self, now: float, timer: asyncio.TimerHandle) -> None:
        """Waiting from ``now``; ``timer`` ends the wait (429)."""
        self.queued = True
        self._entered = now
        self._queue_timer = timer
        if not self.request_complete:
            # A native body still streaming: hold what came, read no more meanwhile.
            self._conn.pause_reading_for_upstream(True)

    def members(self) -> Members | None:
        """What this request routes over (None: its model is served no more)."""
        fleet = self._router.fleet
        return fleet if self.model is None else fleet.members_for(self.model)

    def admit(self, now: float) -> bool:
        """The queue offers a place: route now if a backend is below its bound.
        False: still saturated (stays queued); True: it left the queue."""
        router = self._router
        model = self.model
        members = None if model is None else router.fleet.members_for(model)
        if model is not None and members is None:
            self._stop_queue_timer()
            self._unknown_model(model)
            return True
        balancer = router.balancer
        if balancer.arms is not None and self.key_hash is not None:
            balancer = self._arm_balancer(balancer.arms)
        choice = balancer.choose(self.key_hash, self._tried, members, queue=True)
        if choice is SATURATED:
            return False
        self._stop_queue_timer()
        self.queue_wait = now - self._entered
        if choice is None:
            serving = "" if model is None else f" for model `{_shown(model)}`"
            self._fail(503, f"no backend{serving} is available")
        else:
            self._dispatch(choice)
        return True

    def reject(self, reason: int, retry_after: int) -> None:
        """Answer 429 for the queue: full (``QUEUE_FULL``) or waited too long."""
        self._stop_queue_timer()
        self.rejected = reason
        if reason == QUEUE_FULL:
            message = "too many requests of this tenant are waiting for a backend"
            code = "queue_full"
        else:
            waited = self._router.config.admission.max_wait
            message = f"no backend was below its bound within {waited:g} s"
            code = "queue_timeout"
        self._fail(
            429,
            f"{message}; retry after {retry_after} s",
            code=code,
            extra=b"retry-after: %d\r\n" % retry_after,
        )

    def _stop_queue_timer(self) -> None:
        timer = self._queue_timer
        if timer is not None:
            timer.cancel()
            self._queue_timer = None

    def _wait_for(self, response_id: str) -> bool:
        """Wait (once, bounded) for an id another process may be sharing right now;
        False: a miss, counted."""
        responses = self._router.responses
        if self._id_wait is not None or not responses.wait_s:
            responses.misses += 1
            return False
        responses.wait(response_id, self._id_shared)
        self._id_wait = self._router.loop.call_later(responses.wait_s, self._id_shared)
        return True

    def _id_shared(self) -> None:
        """The awaited id arrived, or the wait is over: route now."""
        self._stop_waiting()
        if not self.done:
            self._route()

    def _stop_waiting(self) -> None:
        timer = self._id_wait
        if timer is not None and not timer.cancelled():
            timer.cancel()
            assert self._response_id is not None
            self._router.responses.unwait(self._response_id, self._id_shared)

    def _follow(self, name: str | None) -> Choice | None:
        """The backend that holds the response, if known and available (counted)."""
        if name is None:
            return None
        router = self._router
        responses = router.responses
        choice = router.balancer.pin(name)
        if choice is None:
            responses.fallbacks += 1
        else:
            responses.hits += 1
        return choice

    def _connect(self) -> None:
        assert self.choice is not None
        router = self._router
        pool = router.pools.get(self.choice.backend.name)
        if pool is None:  # removed (a forced drain) since this request was routed to it
            self._connect_failed("backend removed")
            return
        self._connecting = True
        self._conn.pause_reading_for_upstream(True)  # hold the body until we can send it
        pool.connect(router.config.timeouts.connect).add_done_callback(self._connected)

    def _connected(self, future: asyncio.Future[UpstreamConnection]) -> None:
        self._connecting = False
        exc = None if future.cancelled() else future.exception()
        if self.done:  # the client left while we were connecting
            if exc is None and not future.cancelled():
                conn = future.result()
                conn.pool.give_back(conn)
            return
        if isinstance(exc, OSError) and exc.errno in _OUT_OF_DESCRIPTORS:
            # Our limit, not the backend's fault: it must not count against its
            # health, and every other backend would fail the same way.
            self._fail(503, "the router is out of file descriptors")
            return
        if future.cancelled() or exc is not None:
            assert self.choice is not None
            self._router.backend_failed(self.choice.backend, f"connect failed: {exc!r}")
            self._connect_failed("could not connect to backend")
            return
        upstream = future.result()
        if not upstream.open:
            # Lost between the connect and this callback, a few loop turns later (a
            # backend dying as it accepted: a reset).  Its connection_lost found no
            # owner, so nothing would ever end an exchange attached to it now; and
            # nothing was sent: the next backend of the walk may take the request.
            assert self.choice is not None
            self._router.backend_failed(self.choice.backend, "connection lost at once")
            self._connect_failed("could not connect to backend")
            return
        self._attach(upstream)

    def _connect_failed(self, reason: str) -> None:
        """Give the lease back and try the next backend of the walk (bounded)."""
        choice = self.choice
        assert choice is not None
        choice.release()
        self._tried.add(choice.backend.name)
        self._attempts += 1
        self.choice = None
        if self._attempts > self._router.config.retries:
            self._fail(502, f"{reason} {choice.backend.name}")
        else:
            self._route()

    def _attach(self, upstream: UpstreamConnection) -> None:
        upstream.attach(self)
        self.upstream = upstream
        if self._client_paused:
            upstream.pause(CLIENT)
        self._upstream_bytes = False
        span = self.span
        pieces: list[bytes | bytearray | memoryview] = [
            upstream_head(
                self._request,
                host=upstream.pool.authority,
                client_ip=self._conn.peer_ip,
                tail=self._router.head_tail if span is None else span.tail,
                request_id=self.request_id,
            )
        ]
        if self._request.chunked:
            for piece in self._body:
                if piece:
                    pieces += (b"%x\r\n" % len(piece), piece, b"\r\n")
            if self.request_complete:
                pieces.append(CHUNKED_END)
        else:
            pieces += self._body
        upstream.transport.writelines(pieces)
        if not self.request_complete and not self._request.bodiless:
            # The rest streams through; what was sent cannot be replayed.
            self._replayable = False
            self._body = []
        self._arm_read_deadline()
        self._conn.pause_reading_for_upstream(False)

    def _write_body(self, upstream: UpstreamConnection, data: bytes) -> None:
        if not self._request.chunked:
            upstream.transport.write(data)
        elif data:
            upstream.transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        self._last_read = self._router.loop.time()  # progress either way defers the deadline

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

    def _unknown_model(self, model: str) -> None:
        self._fail(404, f"The model `{_shown(model)}` does not exist.", code="model_not_found")

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


def _shown(model: str) -> str:
    """A client's model name as an answer quotes it: at most a model name's length."""
    return model if len(model) <= MAX_MODEL_NAME else model[:MAX_MODEL_NAME] + "..."
