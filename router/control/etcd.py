"""The fleet's membership and routing config in etcd, watched by every replica.

Contract:
- Layout under a prefix ``P`` (bytes as given, e.g. ``/prefix-router/prod/``):
  ``P backends/<name>`` -> the JSON of ``router.state.SavedBackend`` (name,
  url, weight, state, health), the name in the key equal to the one in the
  value; ``P routing`` -> the SageMaker-shaped ``{"RoutingConfig": {...}}``
  document.  Other keys under ``P`` are ignored (room for per-replica keys).
  A missing ``P routing`` means ``default_routing``.
- One sequence: writes go to etcd only (``add_backend`` is a transaction on
  create_revision == 0, ``update_backend`` / ``delete_backend`` on the
  mod_revision the caller saw, ``set_routing`` a put) and return the revision
  that made them.  They are applied locally *only* through the watch, so every
  replica calls its ``Listener`` with the same changes in the same revision
  order.  ``await applied(revision)`` returns once the watch has delivered that
  revision and the listener has returned: an admin API answers after its
  change is live locally (within a bound the caller sets: a waiter cancelled
  by its timeout is dropped).
- Listener: ``on_backend(name, backend | None)`` (None: deleted),
  ``on_routing(config)``, and ``on_resync(state)`` after a re-list, which the
  caller diffs against what it has.  Callbacks are awaited one at a time; one
  that raises is logged and the watch goes on (a bug there must not stop
  membership updates).  A value that does not decode (malformed, nested too
  deep, invalid) is logged and skipped: the last good one stays, at the key's
  new mod_revision, so a write made on it replaces the unreadable value.
  A health period an older version saved below today's floor is raised to
  it with a warning (``router.state.raise_to_floors``), not skipped.
- Failure: etcd down or the watch lost -> the last membership is kept (never
  dropped), the watch is re-created from the next revision with a bounded,
  jittered exponential backoff; ``healthy`` turns False once etcd has been
  unreachable for ``unhealthy_after`` seconds and True as soon as a watch is
  up again.  A probe (a linearizable read, every ``probe_interval``) beside the
  watch notices an etcd that stopped answering without closing the stream
  (partition, a member without quorum) and re-creates the watch.  A watch
  cancelled for compaction -> re-list, then ``on_resync``.  Any other error
  in the watch loop (a bug) is logged and the loop starts again, from a
  re-list, after the same backoff: it never ends while the store is open.
- Start while etcd is down (``open``): retry for ``wait`` seconds, then start
  from ``cache`` (a ``router.state.StateFile`` the store rewrites after every
  change it applies: a copy of the last state it saw in etcd), not healthy,
  watching for etcd; on the first successful list ``on_resync`` brings the
  replica up to date.  With no cache, ``open`` raises ``Unavailable`` (the CLI
  exits 2).  Why not refuse always: a replica that restarts during an etcd
  outage with a copy is in the same position as one that stayed up through it
  (serving the last membership); refusing would turn every etcd outage into a
  router outage at the next deploy or crash.  Why not start from nothing: an
  empty fleet would answer 503 for everything, and a replica that never saw
  etcd has nothing better to go on than its configuration.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Mapping
from typing import Protocol

import msgspec

from ..config import ConfigError, RoutingConfig, parse_routing
from ..etcd import (
    Compacted,
    Compare,
    Delete,
    EtcdClient,
    EtcdError,
    Event,
    KeyValue,
    Put,
    Unavailable,
    Watch,
)
from ..log import get_logger
from ..state import VERSION, SavedBackend, State, StateError, StateFile, raise_to_floors
from . import Conflict, NotFound

__all__ = ["EtcdStore", "Listener"]

log = get_logger("etcd")


class Listener(Protocol):
    async def on_backend(self, name: str, backend: SavedBackend | None) -> None: ...

    async def on_routing(self, routing: RoutingConfig) -> None: ...

    async def on_resync(self, state: State) -> None: ...


class EtcdStore:
    def __init__(
        self,
        client: EtcdClient,
        prefix: str | bytes,
        listener: Listener,
        *,
        default_routing: RoutingConfig | None = None,
        cache: StateFile | None = None,
        unhealthy_after: float = 5.0,
        probe_interval: float = 1.0,
        backoff_initial: float = 0.05,
        backoff_max: float = 2.0,
    ) -> None:
        self.client = client
        self.prefix = prefix.encode() if isinstance(prefix, str) else prefix
        self.listener = listener
        self.default_routing = default_routing or RoutingConfig()
        self.cache = cache
        self.unhealthy_after = unhealthy_after
        self.probe_interval = probe_interval
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._backends: dict[str, SavedBackend] = {}
        self._mods: dict[str, int] = {}  # name -> mod_revision of what we applied
        self.routing = self.default_routing
        self.revision = 0  # the last revision applied locally
        self.from_cache = False  # started from the cache and not yet re-listed
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._healthy = False
        self._health_changed = asyncio.Event()
        self._down_since: float | None = None
        self._health_timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None

    # -- keys ----------------------------------------------------------------

    def _backend_key(self, name: str) -> bytes:
        return self.prefix + b"backends/" + name.encode()

    @property
    def _routing_key(self) -> bytes:
        return self.prefix + b"routing"

    # -- reads ---------------------------------------------------------------

    @property
    def backends(self) -> Mapping[str, SavedBackend]:
        return self._backends

    def mod_revision(self, name: str) -> int | None:
        """The etcd mod_revision of ``name`` as applied here (None: not here)."""
        return self._mods.get(name)

    def state(self) -> State:
        return State(VERSION, list(self._backends.values()), self.routing)

    @property
    def healthy(self) -> bool:
        """False once etcd has been unreachable for ``unhealthy_after`` seconds."""
        return self._healthy

    async def wait_health(self, healthy: bool) -> None:
        while self._healthy is not healthy:
            await self._health_changed.wait()

    async def load(self) -> tuple[State, int]:
        """List the prefix: the state in etcd and the revision it was read at."""
        state, revision, _ = await self._list()
        return state, revision

    async def _list(self) -> tuple[State, int, dict[str, int]]:
        kvs, revision = await self.client.range(self.prefix, prefix=True)
        backends: dict[str, SavedBackend] = {}
        mods: dict[str, int] = {}
        routing = self.default_routing
        for kv in kvs:
            kind, name = self._classify(kv.key)
            if kind == "routing":
                routing = self._routing_value(kv) or routing
            elif kind == "backend":
                backend = self._backend_value(name, kv)
                if backend is not None:
                    backends[name] = backend
                    mods[name] = kv.mod_revision
        return State(VERSION, sorted(backends.values(), key=_by_name), routing), revision, mods

    def _classify(self, key: bytes) -> tuple[str, str]:
        rest = key[len(self.prefix) :]
        if rest == b"routing":
            return "routing", ""
        if rest.startswith(b"backends/"):
            return "backend", rest[len(b"backends/") :].decode("utf-8", "replace")
        return "other", ""

    def _routing_value(self, kv: KeyValue) -> RoutingConfig | None:
        try:
            return parse_routing(kv.value)  # ConfigError for any unreadable value, depth too
        except ConfigError as exc:
            log.warning("etcd routing value ignored", revision=kv.mod_revision, reason=str(exc))
            return None

    def _backend_value(self, name: str, kv: KeyValue) -> SavedBackend | None:
        try:
            value = msgspec.json.decode(kv.value)
            # A value an older version saved below today's floor is raised, not dropped.
            raise_to_floors(value, f"etcd {kv.key.decode('utf-8', 'replace')}")
            backend = msgspec.convert(value, SavedBackend)
            backend.spec()  # the admin API's validation
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reason = str(exc)
        except RecursionError:  # msgspec's depth bound
            reason = "nesting too deep"
        else:
            if backend.name == name:
                return backend
            reason = f"the key names {name!r}, the value {backend.name!r}"
        log.warning(
            "etcd backend value ignored", backend=name, revision=kv.mod_revision, reason=reason
        )
        return None

    # -- lifecycle -----------------------------------------------------------

    async def open(self, *, wait: float = 10.0) -> State:
        """Load the state from etcd (or the cache, see the contract) and start watching."""
        assert self._task is None, "already open"
        deadline = time.monotonic() + wait
        attempt = 0
        failure: EtcdError | None = None
        while True:
            try:
                state, revision, mods = await self._list()
                break
            except Unavailable as exc:
                failure = exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return await self._open_from_cache(failure)
            await asyncio.sleep(min(self._delay(attempt), remaining))
            attempt += 1
        self._take(state, revision, mods)
        await self._save()
        self._up()
        self._task = asyncio.create_task(self._run(relist=False), name="etcd watch")
        return state

    async def _open_from_cache(self, failure: EtcdError | None) -> State:
        cached = self.cache.load() if self.cache is not None else None  # StateError: stop
        if cached is None:
            where = f"no copy in {self.cache.path}" if self.cache else "no state file copy"
            raise Unavailable(f"cannot start: {failure}; and {where}")
        log.warning("etcd unreachable: starting from the last copy", reason=str(failure))
        self._backends = {b.name: b for b in cached.backends}
        self.routing = cached.routing
        self.from_cache = True
        self._down()
        self._set_healthy(False)  # etcd was already unreachable for all of ``wait``
        self._task = asyncio.create_task(self._run(relist=True), name="etcd watch")
        return cached

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._health_timer is not None:
            self._health_timer.cancel()
        for _, waiter in self._waiters:
            waiter.cancel()
        self._waiters.clear()

    # -- the watch loop ------------------------------------------------------

    def _delay(self, attempt: int) -> float:
        # Full jitter over the upper half: replicas that lost etcd together do not
        # come back in step (the thundering herd a fixed backoff would make).
        cap = min(self.backoff_max, self.backoff_initial * 2.0 ** min(attempt, 30))
        return cap * random.uniform(0.5, 1.0)

    async def _run(self, *, relist: bool) -> None:
        attempt = 0
        while True:
            try:
                if relist:
                    await self._relist()
                    relist = False
                async with self.client.watch(
                    self.prefix, start_revision=self.revision + 1
                ) as watch:
                    self._up()
                    attempt = 0
                    prober = asyncio.create_task(self._probe(watch), name="etcd probe")
                    try:
                        async for event in watch:
                            await self._apply(event)
                    finally:
                        prober.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await prober
            except Compacted as exc:
                log.warning("etcd watch compacted: re-listing", oldest=exc.revision)
                relist = True
            except EtcdError as exc:
                self._down()
                log.warning("etcd unreachable", reason=str(exc), attempt=attempt)
                await asyncio.sleep(self._delay(attempt))
                attempt += 1
            except Exception as exc:
                # A bug (ours, or a value no check foresaw) must not end the watch for
                # good: the replica would stop following etcd and every admin write
                # would wait on it.  Start again from a re-list, after the backoff, and
                # count as cut off meanwhile (``healthy`` goes False if it lasts).
                self._down()
                log.exception("etcd watch failed: re-listing", error=repr(exc), attempt=attempt)
                relist = True
                await asyncio.sleep(self._delay(attempt))
                attempt += 1

    async def _probe(self, watch: Watch) -> None:
        """A linearizable read now and then: an etcd that went silent ends the watch."""
        while True:
            await asyncio.sleep(self.probe_interval)
            try:
                await self.client.range(self._routing_key, prefix=False)
            except EtcdError as exc:
                log.warning("etcd probe failed: re-creating the watch", reason=str(exc))
                watch.close()
                return

    async def _relist(self) -> None:
        state, revision, mods = await self._list()
        self._take(state, revision, mods)
        self.from_cache = False
        await self._call(self.listener.on_resync(state), "on_resync")
        await self._save()
        self._advance(revision)

    def _take(self, state: State, revision: int, mods: dict[str, int]) -> None:
        self._backends = {b.name: b for b in state.backends}
        self._mods = mods
        self.routing = state.routing
        self.revision = revision

    async def _apply(self, event: Event) -> None:
        kind, name = self._classify(event.key)
        kv = KeyValue(key=event.key, value=event.value, mod_revision=event.mod_revision)
        if kind == "routing":
            routing = self._routing_value(kv) if event.type == "PUT" else self.default_routing
            if routing is not None:
                self.routing = routing
                await self._call(self.listener.on_routing(routing), "on_routing")
        elif kind == "backend":
            if event.type == "DELETE":
                self._mods.pop(name, None)
                if self._backends.pop(name, None) is not None:
                    await self._call(self.listener.on_backend(name, None), "on_backend")
            else:
                backend = self._backend_value(name, kv)
                if backend is not None:
                    self._backends[name] = backend
                    self._mods[name] = event.mod_revision
                    await self._call(self.listener.on_backend(name, backend), "on_backend")
                elif name in self._backends:
                    # The last good value stays, but at the key's revision now: a write
                    # made on it (a PATCH, a drain) replaces the unreadable one, where
                    # the old revision would make it a conflict forever.
                    self._mods[name] = event.mod_revision
        if kind != "other":
            await self._save()
        self._advance(event.mod_revision)

    @staticmethod
    async def _call(callback: Awaitable[None], what: str) -> None:
        try:
            await callback
        except Exception as exc:
            log.exception("etcd listener failed", callback=what, error=repr(exc))

    async def _save(self) -> None:
        if self.cache is None:
            return
        try:
            await asyncio.to_thread(self.cache.save, self.state())
        except StateError as exc:
            log.warning("etcd state copy not saved", reason=str(exc))

    # -- health --------------------------------------------------------------

    def _up(self) -> None:
        self._down_since = None
        if self._health_timer is not None:
            self._health_timer.cancel()
            self._health_timer = None
        self._set_healthy(True)

    def _down(self) -> None:
        if self._down_since is not None:
            return
        self._down_since = time.monotonic()
        loop = asyncio.get_running_loop()
        self._health_timer = loop.call_later(self.unhealthy_after, self._set_healthy, False)

    def _set_healthy(self, healthy: bool) -> None:
        if healthy is self._healthy:
            return
        self._healthy = healthy
        if not healthy:
            log.warning("etcd unreachable for too long: not healthy", bound=self.unhealthy_after)
        event, self._health_changed = self._health_changed, asyncio.Event()
        event.set()

    # -- applied -------------------------------------------------------------

    def _advance(self, revision: int) -> None:
        self.revision = max(self.revision, revision)
        if not self._waiters:
            return
        still = []
        for wanted, waiter in self._waiters:
            if wanted <= self.revision:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                still.append((wanted, waiter))
        self._waiters = still

    async def applied(self, revision: int) -> None:
        """Return once the watch has applied ``revision`` here.  No bound of its own:
        callers wrap it in ``asyncio.timeout`` (a watch that is stuck never gets there)."""
        if revision <= self.revision:
            return
        waiter = asyncio.get_running_loop().create_future()
        entry = (revision, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        finally:
            if entry in self._waiters:
                self._waiters.remove(entry)  # timed out or cancelled: not kept for ever

    # -- writes --------------------------------------------------------------

    async def add_backend(self, backend: SavedBackend) -> int:
        """Create ``P backends/<name>``; ``Conflict`` if it exists."""
        key = self._backend_key(backend.name)
        result = await self.client.txn(
            [Compare.create_revision(key, 0)], [Put(key, msgspec.json.encode(backend))]
        )
        if not result.succeeded:
            raise Conflict(f"backend {backend.name!r} already exists")
        return result.revision

    async def update_backend(
        self, backend: SavedBackend, expected_mod_revision: int | None = None
    ) -> int:
        """Replace a backend if it is still at ``expected_mod_revision`` (default:
        the revision applied here); ``Conflict`` if it changed, ``NotFound`` if gone."""
        key = self._backend_key(backend.name)
        expected = expected_mod_revision or self._mods.get(backend.name)
        if expected is None:
            raise NotFound(f"no backend named {backend.name!r}")
        result = await self.client.txn(
            [Compare.mod_revision(key, expected)], [Put(key, msgspec.json.encode(backend))]
        )
        if not result.succeeded:
            await self._why_not(backend.name, key)
        return result.revision

    async def delete_backend(self, name: str, expected_mod_revision: int | None = None) -> int:
        """Delete a backend (if still at ``expected_mod_revision`` when given)."""
        key = self._backend_key(name)
        compare = (
            Compare.exists(key)
            if expected_mod_revision is None
            else Compare.mod_revision(key, expected_mod_revision)
        )
        result = await self.client.txn([compare], [Delete(key)])
        if not result.succeeded:
            await self._why_not(name, key)
        return result.revision

    async def _why_not(self, name: str, key: bytes) -> None:
        kvs, _ = await self.client.range(key, prefix=False)
        if not kvs:
            raise NotFound(f"no backend named {name!r}")
        raise Conflict(f"backend {name!r} was changed meanwhile (revision {kvs[0].mod_revision})")

    async def set_routing(self, routing: RoutingConfig) -> int:
        return await self.client.put(self._routing_key, msgspec.json.encode(routing.document()))

    async def initialize(self, state: State) -> int | None:
        """Seed an empty prefix (no ``P routing`` yet) with ``state``: the first
        replica of a new fleet writes its configuration.  The revision that did,
        for ``applied``; None if the prefix was seeded already."""
        ops: list[Put | Delete] = [
            Put(self._routing_key, msgspec.json.encode(state.routing.document()))
        ]
        ops += [Put(self._backend_key(b.name), msgspec.json.encode(b)) for b in state.backends]
        result = await self.client.txn([Compare.create_revision(self._routing_key, 0)], ops)
        return result.revision if result.succeeded else None


def _by_name(backend: SavedBackend) -> str:
    return backend.name
