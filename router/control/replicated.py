"""``ReplicatedControl``: the admin API of one replica among several that share etcd.

Contract (see router/control/__init__.py for the interface):
- Membership and the routing config live in etcd (``router.control.etcd``).
  A change is written there (a transaction on the revision this replica
  has, so a concurrent change by another replica is a 409, not a lost
  update) and applied here *only* when the watch delivers it, through the
  same ``_apply`` as every other source: every replica applies the same
  changes in the same order.  The answer waits until the change is applied
  here (and in this replica's workers); other replicas follow within their
  watch's delay.
- etcd unreachable for a write: ``Unavailable`` (503), nothing changed.  A
  write made in etcd that the watch has not brought back here within
  ``etcd_apply_wait`` (10 s unless configured): ``Unavailable`` (503) too,
  saying the change was made.
  Reads keep answering from the last membership; ``ready()`` is False once
  the store has been cut off for its bound (the replica keeps routing).
- Drain: ``remove_backend`` sets the backend draining in etcd; the replica
  that took the DELETE removes it from etcd once every live replica has
  applied that and has nothing in flight to it, or the timeout passes
  (``forced``).  If this replica dies meanwhile, the backend stays draining
  (safe: no new requests) until a DELETE is sent again.
- Health (up/down) stays per replica: each one checks the backends itself.
- Members past the workers' slots are skipped (``RouterControl``); after
  each change from etcd that leaves columns free, the skipped ones take
  them in key order, with their latest value, so the fleet is whole again
  without waiting for a change of those members.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import msgspec

from ..config import BackendSpec, RoutingConfig
from ..etcd import EtcdError, OutcomeUnknown
from ..fleet import AdminState
from ..log import get_logger
from ..state import SavedBackend, State
from . import BackendPatch, BackendView, Conflict, DrainView, Unavailable
from .live import RouterControl
from .ops import AddBackend, Op, RemoveBackend, SetRouting, SetState, SetWeight

if TYPE_CHECKING:
    from ..app import Router
    from ..supervisor import Workers
    from .etcd import EtcdStore

__all__ = ["ReplicatedControl"]

log = get_logger("admin")


class _Drain:
    __slots__ = ("done", "error", "forced", "task", "timeout")

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.done = asyncio.Event()
        self.forced = False
        self.error: str | None = None
        self.task: asyncio.Task[None] | None = None


class ReplicatedControl(RouterControl):
    def __init__(self, router: Router, workers: Workers):
        super().__init__(router, None, workers=workers)
        self.store: EtcdStore | None = None  # set before the store opens
        self._etcd_drains: dict[str, _Drain] = {}
        self._idle = asyncio.Event()
        self._listening = asyncio.Lock()  # the watch and the start-up resync, one at a time
        workers.on_idle = lambda name: self._idle.set()

    # -- the store's listener: etcd's sequence, applied here --------------------------

    async def on_backend(self, name: str, backend: SavedBackend | None) -> None:
        async with self._listening:
            for op in self._diff(name, backend):
                await self._apply(op)
            await self._add_unslotted()

    async def on_routing(self, routing: RoutingConfig) -> None:
        async with self._listening:
            if routing != self._router.balancer.config:
                await self._apply(SetRouting(routing))

    async def on_resync(self, state: State) -> None:
        """Make this replica's fleet and config the ones ``state`` has."""
        async with self._listening:
            wanted = {b.name: b for b in state.backends}
            for name in sorted(set(self._router.fleet.backends) | set(wanted)):
                for op in self._diff(name, wanted.get(name)):
                    await self._apply(op)
            if state.routing != self._router.balancer.config:
                await self._apply(SetRouting(state.routing))
            await self._add_unslotted()

    async def _add_unslotted(self) -> None:
        """Add the members skipped past the workers' slots that the columns freed by
        now can take, by key (etcd's order), each as etcd has it now.  After a whole
        event, not at each removal: a member re-added under a new url takes its own
        column back first."""
        store = self.store
        workers = self._workers
        assert store is not None
        assert workers is not None
        saved = store.backends
        self._unslotted -= {name for name in self._unslotted if name not in saved}  # deleted
        for name in sorted(self._unslotted):
            if workers.full:
                return
            for op in self._diff(name, saved[name]):
                await self._apply(op)
            log.info("backend added: a column freed", backend=name)

    def _diff(self, name: str, saved: SavedBackend | None) -> list[Op]:
        backend = self._router.fleet.backends.get(name)
        if saved is None:
            return [] if backend is None else [RemoveBackend(name)]
        if backend is None:
            return self._diff_new(saved)
        spec = backend.spec
        if (spec.url, spec.health, spec.models) != (saved.url, saved.health, saved.models):
            return [RemoveBackend(name), *self._diff_new(saved)]
        ops: list[Op] = []
        if backend.weight != saved.weight:
            ops.append(SetWeight(name, saved.weight))
        if backend.state.value != saved.state:
            ops.append(SetState(name, saved.state))
        return ops

    @staticmethod
    def _diff_new(saved: SavedBackend) -> list[Op]:
        ops: list[Op] = [AddBackend(saved.spec(), ramp=saved.ramp)]
        if saved.state != "active":
            ops.append(SetState(saved.name, saved.state))
        return ops

    # -- reads ------------------------------------------------------------------------

    def ready(self) -> bool:
        store = self.store
        return super().ready() and store is not None and store.healthy

    # -- changes: to etcd, back through the watch ---------------------------------------

    async def _write(self, write: Awaitable[int]) -> None:
        store = self.store
        assert store is not None
        try:
            revision = await write
        except OutcomeUnknown as exc:
            raise Unavailable(
                f"etcd did not answer ({exc}): the change may or may not have been made;"
                " read it back before retrying"
            ) from None
        except EtcdError as exc:
            raise Unavailable(f"etcd is unreachable, nothing was changed: {exc}") from None
        wait = self._router.config.etcd_apply_wait
        try:
            async with asyncio.timeout(wait):
                await store.applied(revision)
        except TimeoutError:
            raise Unavailable(
                f"the change was made in etcd (revision {revision}) but this replica has not"
                f" applied it within {wait:g} s: its etcd watch is behind; read it"
                " back before retrying"
            ) from None

    def _saved(self, name: str) -> SavedBackend:
        store = self.store
        assert store is not None
        self._get(name)  # NotFound as the single-replica router says it
        saved = store.backends.get(name)
        if saved is None:
            raise Conflict(f"backend {name!r} is being removed")
        return saved

    async def add_backend(self, spec: BackendSpec) -> BackendView:
        await self.refuse_own_address(spec)
        self.refuse_when_full()  # not written to etcd only for every replica to skip it
        store = self.store
        assert store is not None
        # The ramp travels in etcd: every replica applies the add with this start.
        saved = SavedBackend.of(spec, ramp=self._router.fleet.ramp_for(spec))
        await self._write(store.add_backend(saved))
        log.info("backend added", backend=spec.name, url=spec.url, weight=spec.weight)
        return await self.backend(spec.name)

    async def update_backend(self, name: str, patch: BackendPatch) -> BackendView:
        store = self.store
        assert store is not None
        saved = self._saved(name)
        weight = saved.weight if patch.weight is None else patch.weight
        state = saved.state if patch.state is None else patch.state
        changed = msgspec.structs.replace(saved, weight=weight, state=state)
        if changed != saved:
            await self._write(store.update_backend(changed))
            if state == "active":
                self._cancel_etcd_drain(name)
            log.info("backend changed", backend=name, weight=weight, state=state)
        return await self.backend(name)

    async def set_routing(self, routing: RoutingConfig) -> RoutingConfig:
        store = self.store
        assert store is not None
        await self._write(store.set_routing(routing))
        log.info("routing changed", routing=routing.document())
        return routing

    async def remove_backend(self, name: str, *, timeout: float, wait: bool) -> DrainView:
        store = self.store
        assert store is not None
        drain = self._etcd_drains.get(name)
        if drain is None:
            saved = self._saved(name)
            if saved.state != "draining":
                draining = msgspec.structs.replace(saved, state="draining")
                await self._write(store.update_backend(draining))
            drain = self._etcd_drains[name] = _Drain(timeout)
            drain.task = asyncio.create_task(self._drain_everywhere(name, drain, store.revision))
            log.info("backend draining", backend=name, timeout_s=timeout)
        if wait:
            await drain.done.wait()
            if drain.error is not None:
                raise Unavailable(drain.error)
            if name in self._router.fleet.backends:
                raise Conflict(f"the drain of {name!r} was cancelled: it is active again")
            return DrainView(name, "removed", 0, drain.timeout, drain.forced)
        return DrainView(name, "draining", self._in_flight(name), drain.timeout)

    def _busy(self, name: str, since: int) -> bool:
        replicas = self.replicas
        elsewhere = replicas is not None and replicas.busy_elsewhere(name, since)
        return bool(self._in_flight(name)) or elsewhere

    async def _drain_everywhere(self, name: str, drain: _Drain, since: int) -> None:
        store = self.store
        assert store is not None
        try:
            try:
                async with asyncio.timeout(drain.timeout):
                    while self._busy(name, since):
                        self._idle.clear()
                        waits: list[asyncio.Task[object]] = [asyncio.create_task(self._idle.wait())]
                        if self.replicas is not None:
                            waits.append(asyncio.create_task(self.replicas.changed()))
                        try:
                            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                        finally:
                            for waiting in waits:
                                waiting.cancel()
            except TimeoutError:
                drain.forced = True
            if self._etcd_drains.get(name) is not drain:
                return  # cancelled by a PATCH back to active
            backend = self._router.fleet.backends.get(name)
            if backend is not None and backend.state is AdminState.DRAINING:
                try:
                    await self._write(store.delete_backend(name))
                except (Unavailable, Conflict) as exc:
                    drain.error = f"backend {name!r} drained but was not removed: {exc}"
                    log.error("backend not removed", backend=name, error=str(exc))
                    return
                log.info("backend removed", backend=name, forced=drain.forced)
        except Exception:
            log.exception("drain failed", backend=name)
            drain.error = f"the drain of {name!r} failed; see the router's log"
        finally:
            if self._etcd_drains.get(name) is drain:
                del self._etcd_drains[name]
            drain.done.set()

    def _cancel_etcd_drain(self, name: str) -> None:
        drain = self._etcd_drains.pop(name, None)
        if drain is not None:
            if drain.task is not None:
                drain.task.cancel()
            drain.done.set()

    async def close(self) -> None:
        for name in list(self._etcd_drains):
            drain = self._etcd_drains.pop(name)
            if drain.task is not None:
                drain.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drain.task
        await super().close()
