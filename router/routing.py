"""An exchange's routing: the backend chosen, waited for and connected, retried.

``Routing`` sits between ``router.relay.Relay`` (the state and the response
side) and ``router.exchange.Exchange`` (the request side, which calls
``_route`` once it has the key, or at the head when none is needed).  It
picks the backend, takes the pooled or a new connection to it, sends the
head and what is held of the body, and hands the response to the relay.

Contract:
- ``Balancer.choose`` takes the lease in the same step as the pick (and
  ``Balancer.pin`` for a follow-up); a failed attempt gives it back before
  the next (``_connect_failed``), and ``_finish`` releases the last one.
- Responses API follow-ups (``router.responses``): a request naming a known
  response id goes to that response's backend when it is available (with
  shared ids, an unknown one is waited for once, bounded: ``_wait_for``),
  else by the strategy; hits, fallbacks and misses are counted.
- Retries: a connect failure moves on to the next backend of the walk
  (``avoid``), at most ``retries`` times (a new connection already lost when
  its connect's callback runs is one: nothing was sent on it); a reused keep-alive connection that
  dies before any response byte is replaced by a fresh one to the same
  backend, but only when the router still holds the whole request.  Nothing
  is replayed once the backend may have started on it otherwise.  Running
  out of file descriptors is the router's 503, not the backend's failure.
- Models (``router.fleet``): a request with a ``model`` routes over that
  model's pool only, retries and the queue included; a model no backend
  serves is answered 404 in OpenAI's shape (``code: model_not_found``).
- A/B experiments (``router.arms``): a keyed request is assigned its arm once,
  by its key, when it is first routed (``arm``), and every attempt (retries,
  the admission queue, a follow-up) routes with that arm's balancer.
- The admission queue (``router.queue``, only when on): a keyed request's
  first routing attempt that finds every backend at its bound (or others of
  its pool already waiting, or only the places kept for tenants under their
  share free) waits in the queue (``queue_entered``) until ``admit`` places
  it, or is answered 429 with ``Retry-After`` (``reject``); leaving while
  queued frees its place (``_finish``).
- The head goes out in one ``writelines`` with the body held so far
  (chunk-framed when the client's was); after that the body streams
  through (``_write_body``) and is no longer held for a replay.
"""

from __future__ import annotations

import asyncio
import errno
from typing import TYPE_CHECKING

from .balancer import SATURATED
from .cachecheck import MIN_KEY_BYTES
from .config import MAX_MODEL_NAME, ConfigError
from .heads import upstream_head
from .queue import QUEUE_FULL
from .relay import Relay
from .upstream import CLIENT
from .wire import CHUNKED_END

if TYPE_CHECKING:
    from .arms import Experiment
    from .balancer import Balancer, Choice, Members
    from .queue import AdmissionQueue
    from .upstream import UpstreamConnection

__all__ = ["Routing"]

_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


class Routing(Relay):
    """The routing of an exchange (see the module): ``Exchange``'s middle layer."""

    __slots__ = ()

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
        if isinstance(exc, ConfigError):
            # [backend_tls] files gone (router.backendtls): ours, not the backend's.
            self._fail(503, "the router cannot load its backend_tls files (see its log)")
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

    def _unknown_model(self, model: str) -> None:
        self._fail(404, f"The model `{_shown(model)}` does not exist.", code="model_not_found")


def _shown(model: str) -> str:
    """A client's model name as an answer quotes it: at most a model name's length."""
    return model if len(model) <= MAX_MODEL_NAME else model[:MAX_MODEL_NAME] + "..."
