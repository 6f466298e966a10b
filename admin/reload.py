"""SIGHUP: read the configuration again and apply what changed, without a restart.

Contract:
- ``Reloads.request()`` is the SIGHUP handler: it starts a reload, or, while
  one runs, marks one more to run after it (signals that arrive meanwhile
  coalesce into that one).  A reload reads the config file and the flags as
  ``serve`` read them at start (``reread``); an invalid file changes nothing
  and is logged (``config not reloaded``, with the field path).
- Applied live, through the same control calls as the admin API (so every
  worker has them when the reload logs ``config reloaded``): timeouts,
  limits and retries always; the RoutingConfig and the backends only where
  the file is their source, which is where a restart would take them from:
  not with ``--etcd`` (etcd's), ``--discover`` (the platform's) or a state
  file (the admin API's, persisted there; at start the state file wins
  too).  The backends: a new name is added, a name gone is drained and
  removed (the admin API's DELETE, ``DRAIN_TIMEOUT``), a changed weight is
  set; a name back in the file while the drain a reload started still runs
  is set active again (the drain cancelled, as a PATCH does; a drain the
  admin API started is left alone: the file says nothing of states); a
  changed URL, models list or health override under one name is refused
  with a warning (remove the name, add a new one): the fleet holds a
  backend's spec as it was added.
- Everything else (``RESTART_FIELDS``: listeners, TLS, workers, etcd, state
  file, access log, health checks, vnodes, seed, cache_salt, advisor,
  backend_tls, otel, discover, ...) needs a restart, and so does
  ``limits.listen_backlog`` (the queue is set at bind: the running value is
  kept in the limits applied): a reload that changes one logs ``config fields
  need a restart`` naming them and applies the rest.  A replica id made up at
  start (``--etcd`` without one) is kept, not taken for a change.
- Each reload is recorded in ``control.source`` (``GET /admin/config``):
  when, whether it was applied, invalid (the reason) or failed, and the
  fields that wait for a restart.
- Connections are never dropped: nothing here touches a listener, and a
  drained backend finishes its requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec

from router.config import BackendSpec, Config, ConfigError
from router.control import BackendPatch, ControlError
from router.control.configview import ReloadView
from router.fleet import AdminState
from router.log import get_logger

if TYPE_CHECKING:
    from router.app import Router
    from router.control.live import RouterControl

__all__ = ["DRAIN_TIMEOUT", "RESTART_FIELDS", "Reloads"]

log = get_logger("config")

DRAIN_TIMEOUT = 30.0  # a backend gone from the file drains as a DELETE does
RESTART_FIELDS = (
    "listen",
    "admin_listen",
    "tls_cert",
    "tls_key",
    "proxy_protocol",
    "backend_tls",
    "workers",
    "etcd",
    "etcd_prefix",
    "etcd_apply_wait",
    "replica_id",
    "replica_listen",
    "state_file",
    "handover_socket",
    "access_log",
    "decision_header",
    "decision_header_backend",
    "health",
    "vnodes",
    "seed",
    "cache_salt",
    "tenants",
    "admission",
    "engine_signals",
    "advisor",
    "otel",
    "discover",
)


class Reloads:
    def __init__(
        self,
        reread: Callable[[], Config],
        control: RouterControl,
        router: Router,
        *,
        owns_membership: bool,
    ):
        """``owns_membership``: the file is the source of the backends and routing."""
        self.reread = reread
        self.control = control
        self.router = router
        self.owns_membership = owns_membership
        self._running: asyncio.Task[None] | None = None
        self._again = False
        self._drained: set[str] = set()  # names a reload started draining (gone from the file)
        self._pending: list[str] | None = None  # the running reload's restart fields, once read
        self.done = 0  # reloads finished, applied or not (tests wait on it)

    def request(self) -> None:
        if self._running is not None and not self._running.done():
            self._again = True
            return
        self._running = asyncio.create_task(self._run(), name="config reload")

    async def _run(self) -> None:
        while True:
            self._again = False
            self._pending = None
            try:
                await self.reload()
            except Exception as exc:  # a bug: logged, the next SIGHUP tries again
                log.exception("config reload failed")
                # What it read of the file still holds: its restart fields wait as they would.
                failed = ReloadView(time.time(), "failed", repr(exc), self._pending or [])
                self.control.source.reloaded(failed, read=self._pending is not None)
            self.done += 1
            if not self._again:
                return

    async def reload(self) -> None:
        try:
            new = self.reread()
        except ConfigError as exc:
            log.error("config not reloaded", reason=str(exc))
            self.control.source.reloaded(ReloadView(time.time(), "invalid", str(exc)))
            return
        old = self.router.config
        if new.replica_id is None:  # random at start (admin.daemon): the file did not name one
            new = msgspec.structs.replace(new, replica_id=old.replica_id)
        restart = [field for field in RESTART_FIELDS if getattr(new, field) != getattr(old, field)]
        if new.limits.listen_backlog != old.limits.listen_backlog:
            # The listener's queue is set at bind: the running one stays (and shows).
            restart.append("limits.listen_backlog")
            limits = msgspec.structs.replace(new.limits, listen_backlog=old.limits.listen_backlog)
            new = msgspec.structs.replace(new, limits=limits)
        self._pending = restart
        if restart:
            log.warning("config fields need a restart", fields=restart)
        control = self.control
        if (new.timeouts, new.limits, new.retries) != (old.timeouts, old.limits, old.retries):
            await control.set_settings(new.timeouts, new.limits, new.retries)
        if self.owns_membership:
            if new.routing != control.routing():
                await control.set_routing(new.routing)
            await self._backends(new.backends)
        log.info("config reloaded", membership_from_file=self.owns_membership)
        self.control.source.reloaded(ReloadView(time.time(), "applied", restart_pending=restart))

    async def _backends(self, specs: list[BackendSpec]) -> None:
        control, fleet = self.control, self.router.fleet
        wanted = {spec.name: spec for spec in specs}
        for name in [name for name in fleet.backends if name not in wanted]:
            drain = control.remove_backend(name, timeout=DRAIN_TIMEOUT, wait=False)
            if await self._call(name, drain):
                self._drained.add(name)
        for name, spec in wanted.items():
            backend = fleet.backends.get(name)
            if backend is None:
                self._drained.discard(name)
                await self._call(name, control.add_backend(spec))
                continue
            held = backend.spec
            if (held.url, held.models, held.health) != (spec.url, spec.models, spec.health):
                log.warning(
                    "backend URL, models or health not changed by a reload: remove it and add"
                    " a new name",
                    backend=name,
                    url=held.url,
                    file_url=spec.url,
                    models=list(held.models),
                    file_models=list(spec.models),
                    health=msgspec.to_builtins(held.health),
                    file_health=msgspec.to_builtins(spec.health),
                )
                continue
            back = name in self._drained and backend.state is AdminState.DRAINING
            patch = BackendPatch(
                weight=spec.weight if backend.weight != spec.weight else None,
                state="active" if back else None,
            )
            if patch != BackendPatch() and await self._call(
                name, control.update_backend(name, patch)
            ):
                self._drained.discard(name)

    @staticmethod
    async def _call(name: str, change: Awaitable[object]) -> bool:
        """Await ``change``; False (logged) if the control refused it."""
        try:
            await change
        except ControlError as exc:  # e.g. a drain already running, its own address
            log.warning("backend not changed by a reload", backend=name, reason=str(exc))
            return False
        return True
