"""``RouterControl``: the ``Control`` interface implemented over a live ``Router``.

Contract (see router/control/__init__.py for the interface):
- Changes run one at a time under a lock.  Each builds the next ``State``,
  writes it to the state file (in a thread: fsync blocks) and only then
  applies it, so a failed write changes nothing and a 2xx answer is durable.
- A backend whose url reaches one of the router's own listeners (see
  ``selfaddr``) is refused with ``Invalid`` on ``url``: every request it got
  would come straight back in.  ``admin_listeners`` is set by whoever starts
  the admin server; the client listener is read from the router.
- Draining: ``remove_backend`` marks the backend draining (no new requests),
  waits until its last request finishes or the timeout passes, then removes
  it.  The wait is an event fired by the lease tracker when the backend's
  in-flight count reaches zero, not a poll.  Setting the backend ``active``
  again while it drains cancels the removal.
- With workers, the fleet holds at most ``router.supervisor.SLOTS`` backends:
  ``add_backend`` on a full fleet is a ``Conflict`` (409) naming the limit,
  raised before anything is persisted.  A membership that arrives from
  elsewhere (etcd's watch or re-list, through ``_apply``) past the limit is
  logged (``backend not added``) and skipped, as are the ops on that name
  that follow it, so the rest of the change still applies.  Such members are
  listed in ``/admin/stats`` (``not_added``) and added, by key, as removals
  free columns (``ReplicatedControl``, which has their latest values).
- A url another backend already has is accepted with a warning naming that
  backend (``backend url already used``): tests and benchmarks put many
  names in front of one server on purpose; in production it is usually a
  mistake that doubles the server's share.
- A state file that cannot be written fails the change with ``NotSaved``
  (500, naming the file and the reason) and changes nothing.  When that
  happens as a drain ends, the backend stays ``draining`` (what the file
  still says), the drain is over and reported to ``?wait=true`` callers as
  that failure; a later DELETE starts a new drain.  No drain task ever ends
  with an exception, so shutdown stays clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import msgspec

from ..abreport import ExperimentView
from ..config import BackendSpec, Limits, RoutingConfig, Timeouts
from ..explain import DryRequest, Explanation, Refused, explain
from ..fleet import ANY_MODEL, AdminState, Backend
from ..log import get_logger
from ..metrics import percentile
from ..selfaddr import Listener, own_listener
from ..state import SavedBackend, State, StateError, StateFile
from . import (
    BackendPatch,
    BackendView,
    Conflict,
    Decisions,
    DrainView,
    Invalid,
    ModelView,
    NotFound,
    NotSaved,
    Rejected,
    ResponseStats,
    Stats,
    Totals,
    Unavailable,
)
from .configview import ConfigSource, ConfigView, config_view
from .ops import (
    AddBackend,
    Op,
    RemoveBackend,
    SetRouting,
    SetSettings,
    SetState,
    SetWeight,
    apply,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from ..app import Router
    from ..replicas import Replicas
    from ..supervisor import Workers

__all__ = ["RouterControl", "snapshot"]

log = get_logger("admin")

# Backends whose views are built per slice of the loop's time (GET /admin/backends,
# /admin/stats): ~1-2 ms with full 512-TTFT windows; the whole of 4,000 backends at
# once held the loop 82 ms (the admin review).
VIEW_SLICE = 100


def snapshot(router: Router) -> State:
    """The router's fleet and routing config as a state-file document."""
    return State(
        version=1,
        backends=[
            SavedBackend.of(b.spec, b.state.value, b.weight) for b in router.fleet.backends.values()
        ],
        routing=router.balancer.config,
    )


class _Drain:
    __slots__ = ("done", "error", "forced", "idle", "task", "timeout")

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.idle = asyncio.Event()
        self.done = asyncio.Event()
        self.forced = False
        self.error: str | None = None  # why it ended without removing the backend
        self.task: asyncio.Task[None] | None = None


class RouterControl:
    def __init__(
        self,
        router: Router,
        state_file: StateFile | None = None,
        *,
        workers: Workers | None = None,
    ):
        self._router = router
        self._state_file = state_file
        self._workers = workers
        self._lock = asyncio.Lock()
        self._retired: str | None = None  # handed over (router.handover): why writes are refused
        self._drains: dict[str, _Drain] = {}
        self._unslotted: set[str] = set()  # added elsewhere (etcd) past the slots: skipped
        self.admin_listeners: list[Listener] = []
        self.replicas: Replicas | None = None  # with etcd: the other replicas' rows
        # Where the configuration came from and its reloads (the daemon fills it in).
        self.source = ConfigSource(None, "config", time.time())
        if workers is None:
            router.fleet.loads.on_idle = self._backend_idle
        else:
            workers.on_idle = self._backend_idle

    # -- reads ---------------------------------------------------------------------

    async def _refresh(self) -> None:
        """With workers: add up their accounting first (one router's view)."""
        if self._workers is not None:
            await self._workers.refresh()

    def _in_flight(self, name: str) -> int:
        if self._workers is not None:
            return self._workers.in_flight(name)
        return self._router.fleet.loads.get(name)

    async def backends(self) -> list[BackendView]:
        await self._refresh()
        return await self._views()

    async def _views(self) -> list[BackendView]:
        """Every backend's view, ``VIEW_SLICE`` at a time with the loop running
        between: each view is read in one step, views are a few ms apart at most."""
        total = self._total_requests()  # once, not per backend
        backends = dict(self._router.fleet.backends)  # removed meanwhile: still shown
        names = sorted(backends)
        views: list[BackendView] = []
        for start in range(0, len(names), VIEW_SLICE):
            if start:
                await asyncio.sleep(0)
            views += (
                self._view(backends[name], total) for name in names[start : start + VIEW_SLICE]
            )
        return views

    async def backend(self, name: str) -> BackendView:
        await self._refresh()
        return self._view(self._get(name), self._total_requests())

    def routing(self) -> RoutingConfig:
        return self._router.balancer.config

    def config(self) -> ConfigView:
        return config_view(self._router.config, self.routing(), self.source)

    def ready(self) -> bool:
        router = self._router
        workers = self._workers
        return (
            bool(router.fleet.available)
            and not router.stopping
            and (workers is None or workers.ready)
        )

    async def metrics(self) -> bytes:
        await self._refresh()
        return await self._router.collector.render_async()

    async def stats(self) -> Stats:
        await self._refresh()
        views = await self._views()
        router = self._router
        recorder = router.recorder
        decisions = recorder.decisions
        primary, overflow, fallback = (
            decisions["primary"],
            decisions["overflow"],
            decisions["fallback"],
        )
        return Stats(
            strategy=router.balancer.config.strategy.value,
            backends=views,
            totals=Totals(
                requests=sum(recorder.requests.values()),
                in_flight=router.fleet.loads.total,
                errors=sum(b.errors for b in router.fleet.backends.values()),
                no_backend=recorder.no_backend,
                connections=router.client_connections()[0],
            ),
            decisions=Decisions(
                primary=primary,
                overflow=overflow,
                fallback=fallback,
                other=sum(decisions.values()) - primary - overflow - fallback,
                claim_spread=router.balancer.claim_spread,  # with workers: theirs (refresh)
            ),
            workers=self._workers.views() if self._workers is not None else [],
            models=self._models(),
            responses=ResponseStats(
                **router.responses.counts(),
                held=len(router.responses),
                capacity=router.responses.capacity,
            ),
            experiment=router.balancer.arms.view() if router.balancer.arms is not None else None,
            replicas=self.replicas.view() if self.replicas is not None else None,
            not_added=sorted(self._unslotted),
            panic=sorted(router.fleet.rescued),
        )

    async def experiment(self) -> ExperimentView:
        await self._refresh()
        arms = self._router.balancer.arms
        if arms is None:
            raise NotFound("no A/B experiment: the RoutingConfig has no Arms")
        return arms.view(samples=True)

    async def explain(self, request: DryRequest, k: int) -> Explanation:
        """The dry run: here, or with workers in one of them (``Workers.explain``)."""
        if self._workers is not None:
            return await self._workers.explain(request, k)
        try:
            return explain(self._router, request, k)
        except Refused as exc:
            raise Rejected(str(exc), field=exc.param) from None

    def _models(self) -> list[ModelView]:
        fleet = self._router.fleet
        counts = self._router.recorder.models
        pools = fleet.models() + ([fleet.any_model] if fleet.any_model is not None else [])
        return [
            ModelView(
                pool.model if pool.model != ANY_MODEL else None,
                list(pool.members),
                counts[pool.model],
            )
            for pool in pools
        ]

    def _get(self, name: str) -> Backend:
        backend = self._router.fleet.backends.get(name)
        if backend is None:
            raise NotFound(f"no backend named {name!r}")
        return backend

    def _total_requests(self) -> int:
        return sum(b.requests for b in self._router.fleet.backends.values())

    def _view(self, backend: Backend, total: int) -> BackendView:
        """``total``: requests routed to all backends (``share``'s denominator)."""
        router = self._router
        fleet = router.fleet
        ramp = fleet.ramps.get(backend.name)
        window = list(router.recorder.windows.get(backend.name, ()))
        scraped = router.health.scraped.get(backend.name)
        signals = router.signals
        signal = signals.figures.get(backend.name) if signals is not None else None
        return BackendView(
            name=backend.name,
            url=backend.url,
            weight=backend.weight,
            state=backend.state.value,
            healthy=backend.healthy,
            in_flight=router.fleet.loads.get(backend.name),
            requests=backend.requests,
            share=backend.requests / total if total else 0.0,
            overflow=backend.overflow,
            fallback=backend.fallback,
            errors=backend.errors,
            ttft_p50_ms=percentile(window, 0.5),
            ttft_p90_ms=percentile(window, 0.9),
            prefix_cache_hit_rate=scraped.hit_rate if scraped else None,
            num_requests_running=scraped.running if scraped else None,
            num_requests_waiting=scraped.waiting if scraped else None,
            kv_cache_usage=scraped.kv_usage if scraped else None,
            models=list(backend.spec.models),
            server_name=backend.spec.server_name,
            prefix_cache=router.health.cache.status(backend.name),
            prefix_cache_check=router.health.cache.view(backend),
            effective_weight=fleet.effective_weight(backend.name),
            slow_start_ends=ramp.start + ramp.seconds if ramp is not None else None,
            engine_rank=None if signals is None else signal.rank if signal is not None else 0,
            engine_tie_breaks=None if signals is None else backend.tie_breaks,
        )

    # -- changes -------------------------------------------------------------------

    async def _apply(self, op: Op) -> None:
        """Make a change here and, with workers, in every worker (the one apply path)."""
        workers = self._workers
        if workers is not None:
            if self._skipped(op, workers):
                return
            op = workers.prepare(op)
        apply(self._router, op)
        sent = workers.apply(op) if workers is not None else None  # no await in between
        if isinstance(op, (AddBackend, SetWeight)):
            # The ring is rebuilt in slices: answer once the newcomer gets keys.  A
            # removed backend is skipped at once and leaves the ring in the background.
            await self._router.fleet.settled()
        if sent is not None:
            await sent

    def _skipped(self, op: Op, workers: Workers) -> bool:
        """An add past the workers' slots (only a membership from etcd gets here: the
        admin API refuses first), and what follows for that name, is logged and skipped
        rather than raised: a raise would end an etcd re-list half-way."""
        if isinstance(op, AddBackend):
            if not workers.full:
                self._unslotted.discard(op.spec.name)
                return False
            self._unslotted.add(op.spec.name)
            log.error(
                "backend not added",
                backend=op.spec.name,
                reason=f"the fleet is full: at most {workers.limit} backends with workers",
            )
            return True
        if isinstance(op, (RemoveBackend, SetState, SetWeight)) and op.name in self._unslotted:
            if isinstance(op, RemoveBackend):
                self._unslotted.discard(op.name)
            return True
        return False

    async def refuse_own_address(self, spec: BackendSpec) -> None:
        """Raise Invalid if ``spec``'s url reaches one of this router's listeners."""
        host, port = spec.address()
        listener = await own_listener(host, port, [*self._router.listeners, *self.admin_listeners])
        if listener is not None:
            raise Invalid(
                f"backend {spec.name!r} ({spec.url}) is this router's own {listener}: every"
                " request sent to it would come back in",
                field="url",
            )

    async def _persist(self, state: State) -> None:
        if self._state_file is not None:
            try:
                await asyncio.to_thread(self._state_file.save, state)
            except StateError as exc:
                log.error("state file not written", error=str(exc))
                raise NotSaved(str(exc)) from None

    def _state_with(
        self,
        *,
        backends: list[SavedBackend] | None = None,
        routing: RoutingConfig | None = None,
    ) -> State:
        current = snapshot(self._router)
        return State(
            version=current.version,
            backends=current.backends if backends is None else backends,
            routing=current.routing if routing is None else routing,
        )

    @contextlib.asynccontextmanager
    async def _changing(self) -> AsyncIterator[None]:
        """One change at a time; none once this process has handed over."""
        async with self._lock:
            if self._retired is not None:
                raise Unavailable(self._retired)
            yield

    async def freeze(self) -> State:
        """Hold every change (a handover, ``router.handover``): the membership now."""
        await self._lock.acquire()
        return snapshot(self._router)

    def thaw(self, retired: str | None = None) -> None:
        """Let changes go again; ``retired``: refuse each from now on (503), saying this."""
        if retired is not None:
            self._retired = retired
        self._lock.release()

    async def add_backend(self, spec: BackendSpec) -> BackendView:
        await self.refuse_own_address(spec)
        async with self._changing():
            if spec.name in self._router.fleet.backends:
                raise Conflict(f"a backend named {spec.name!r} already exists")
            self.refuse_when_full()
            shared = self._same_url(spec)
            saved = SavedBackend.of(spec)
            await self._persist(
                self._state_with(backends=[*snapshot(self._router).backends, saved])
            )
            await self._apply(AddBackend(spec, ramp=self._router.fleet.ramp_for(spec)))
            backend = self._router.fleet.backends[spec.name]
            log.info("backend added", backend=spec.name, url=spec.url, weight=spec.weight)
            if shared:
                log.warning("backend url already used", backend=spec.name, url=spec.url, by=shared)
            return self._view(backend, self._total_requests())

    def refuse_when_full(self) -> None:
        """Raise Conflict if the workers have no column for one more backend."""
        workers = self._workers
        if workers is not None and workers.full:
            raise Conflict(
                f"the fleet is full: at most {workers.limit} backends with --workers (one"
                " column each in the shared in-flight table); remove one first"
            )

    def _same_url(self, spec: BackendSpec) -> list[str]:
        """The backends at ``spec``'s host and port (told apart as the fleet holds them)."""
        host, port = spec.address()
        backends = self._router.fleet.backends.values()
        return [b.name for b in backends if b.port == port and b.host == host]

    async def update_backend(self, name: str, patch: BackendPatch) -> BackendView:
        async with self._changing():
            backend = self._get(name)
            weight = backend.weight if patch.weight is None else patch.weight
            state = backend.state.value if patch.state is None else patch.state
            backends = [
                msgspec.structs.replace(s, weight=weight, state=state) if s.name == name else s
                for s in snapshot(self._router).backends
            ]
            await self._persist(self._state_with(backends=backends))
            if weight != backend.weight:
                await self._apply(SetWeight(name, weight))
            if state != backend.state.value:
                await self._apply(SetState(name, state))
                if state == "active":
                    self._cancel_drain(name)
            log.info("backend changed", backend=name, weight=weight, state=state)
            return self._view(backend, self._total_requests())

    async def set_settings(self, timeouts: Timeouts, limits: Limits, retries: int) -> None:
        """Timeouts, limits and retries, live (a config reload); this replica only."""
        async with self._changing():
            await self._apply(SetSettings(timeouts, limits, retries))

    async def set_routing(self, routing: RoutingConfig) -> RoutingConfig:
        async with self._changing():
            await self._persist(self._state_with(routing=routing))
            await self._apply(SetRouting(routing))
            log.info("routing changed", routing=routing.document())
            return routing

    async def remove_backend(self, name: str, *, timeout: float, wait: bool) -> DrainView:
        async with self._changing():
            backend = self._get(name)
            drain = self._drains.get(name)
            if drain is None:
                backends = [
                    msgspec.structs.replace(s, state="draining") if s.name == name else s
                    for s in snapshot(self._router).backends
                ]
                await self._persist(self._state_with(backends=backends))
                await self._apply(SetState(name, AdminState.DRAINING.value))
                drain = self._drains[name] = _Drain(timeout)
                if not self._in_flight(name):
                    drain.idle.set()
                drain.task = asyncio.create_task(self._drain(backend, drain))
                log.info("backend draining", backend=name, timeout_s=timeout)
        if wait:
            await drain.done.wait()
            if drain.error is not None:
                raise NotSaved(drain.error)
            if name in self._router.fleet.backends:
                raise Conflict(f"the drain of {name!r} was cancelled: it is active again")
            return DrainView(name, "removed", 0, drain.timeout, drain.forced)
        return DrainView(name, "draining", self._in_flight(name), drain.timeout)

    async def _drain(self, backend: Backend, drain: _Drain) -> None:
        name = backend.name
        try:
            try:
                async with asyncio.timeout(drain.timeout):
                    await drain.idle.wait()
            except TimeoutError:
                drain.forced = True
            async with self._lock:
                if self._drains.get(name) is not drain or self._retired is not None:
                    return  # cancelled by a PATCH back to active, or handed over
                del self._drains[name]
                remaining = [s for s in snapshot(self._router).backends if s.name != name]
                try:
                    await self._persist(self._state_with(backends=remaining))
                except NotSaved as exc:
                    # The file still says draining, and so does the fleet.
                    drain.error = (
                        f"backend {name!r} drained but was not removed: {exc}; it stays"
                        " draining, DELETE it again to retry"
                    )
                    log.error("backend not removed", backend=name, error=str(exc))
                    return
                await self._apply(RemoveBackend(name))
                log.info("backend removed", backend=name, forced=drain.forced)
        except Exception:
            # A bug, not an outcome: logged here, since nothing awaits this task
            # but close(), and reported to the waiting callers as a 500.
            log.exception("drain failed", backend=name)
            if self._drains.get(name) is drain:
                del self._drains[name]
            drain.error = f"the drain of {name!r} failed; see the router's log"
        finally:
            drain.done.set()

    def _cancel_drain(self, name: str) -> None:
        drain = self._drains.pop(name, None)
        if drain is not None:
            if drain.task is not None:
                drain.task.cancel()
            # A task cancelled before it first ran never reaches its ``finally``:
            # wake the DELETE ?wait=true callers here (they answer 409).
            drain.done.set()

    def _backend_idle(self, name: str) -> None:
        drain = self._drains.get(name)
        if drain is not None:
            drain.idle.set()

    async def close(self) -> None:
        for name in list(self._drains):
            drain = self._drains.pop(name)
            if drain.task is not None:
                drain.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drain.task
