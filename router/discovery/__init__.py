"""Membership from a discovery source (Kubernetes EndpointSlices, DNS).

Contract:
- A ``Source`` produces *snapshots*: the complete set of endpoints it wants
  now, ``{name: Endpoint(name, url, serving)}``.  ``Source.run(sink)`` runs
  until cancelled, calling ``sink.publish(snapshot)`` whenever its view may
  have changed and ``sink.failed(reason)`` whenever it cannot tell (API down,
  DNS error, a watch lost); it retries on its own with ``Backoff``.
- An endpoint carries the models it serves (``models``: the source's
  ``--discover-model`` list, or for Kubernetes the value of the slice's
  ``--k8s-model-label`` label); they are its backend's ``BackendSpec.models``.
  A backend whose url or models change is replaced: drained out, then the
  latest snapshot is applied again (counted as one more), which adds it back.
- Names are a function of the endpoint alone (``endpoint``: ``<ip>:<port>``),
  so every replica watching the same source builds the same ring, and a name
  never changes its url (a pod that comes back on another IP is another
  backend).
- ``Reconciler`` (the sink) applies the difference between the latest
  snapshot and the router's current membership through the *same* ``Control``
  methods the admin API uses, so it works unchanged with ``--workers N`` and
  with a state file: serving endpoint -> an ``active`` backend (added, or set
  active again, which cancels a drain); not serving (``terminating``,
  ``serving: false``) -> ``draining`` (no new requests, in-flight ones
  finish), kept while the endpoint is listed; gone from the snapshot -> the
  admin DELETE's drain (``remove_backend(wait=False)``, ``drain_timeout``).
  Snapshots are coalesced (the latest wins) and the latest is applied again
  every ``resync_interval`` seconds, so a change refused once (a state file
  that could not be written) or undone by hand converges.
- Failure never empties the fleet: a failing source leaves the last membership
  in place.  ``healthy`` is False until the first snapshot, True from each
  snapshot on, and False once the source has failed without a snapshot since
  for ``unhealthy_after`` seconds; ``ready()`` of the control served to the
  admin API includes it (``/readyz`` 503), routing goes on.
- ``DiscoveredControl`` is what the admin API gets with discovery on: reads,
  routing and weight changes pass through; adding or removing a backend, or
  changing its state, answers 409 (``Conflict``) saying membership comes from
  discovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import random
import time
from collections.abc import Awaitable, Mapping
from typing import Protocol

import msgspec

from ..abreport import ExperimentView
from ..config import BackendSpec, RoutingConfig
from ..control import (
    BackendPatch,
    BackendView,
    Conflict,
    Control,
    ControlError,
    DrainView,
    Stats,
)
from ..control import State as State
from ..control.configview import ConfigView
from ..explain import DryRequest, Explanation
from ..log import get_logger

__all__ = [
    "Backoff",
    "DiscoveredControl",
    "Endpoint",
    "Reconciler",
    "Sink",
    "Source",
    "endpoint",
]

log = get_logger("discovery")


class Endpoint(msgspec.Struct, frozen=True):
    name: str
    url: str
    serving: bool  # False: terminating or not serving -> draining
    models: tuple[str, ...] = ()  # served; empty: any


def endpoint(host: str, port: int, serving: bool, models: tuple[str, ...] = ()) -> Endpoint:
    """The endpoint at ``host:port``, named ``<ip>:<port>`` (deterministic)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a host name (an FQDN EndpointSlice)
        host = host.rstrip(".")
        return Endpoint(f"{host}:{port}", f"http://{host}:{port}", serving, models)
    text = address.compressed
    if address.version == 6:
        # A backend name starts with a letter or digit: "::1" is written "0::1".
        name = f"0{text}:{port}" if text.startswith(":") else f"{text}:{port}"
        return Endpoint(name, f"http://[{text}]:{port}", serving, models)
    return Endpoint(f"{text}:{port}", f"http://{text}:{port}", serving, models)


class Sink(Protocol):
    def publish(self, endpoints: Mapping[str, Endpoint]) -> None: ...

    def failed(self, reason: str) -> None: ...


class Source(Protocol):
    description: str

    async def run(self, sink: Sink) -> None: ...

    async def close(self) -> None: ...


class Backoff:
    """Bounded exponential backoff with jitter over the upper half (replicas that
    lost the source together do not come back in step)."""

    def __init__(self, initial: float = 0.1, maximum: float = 10.0) -> None:
        self.initial = initial
        self.maximum = maximum
        self.attempt = 0

    def reset(self) -> None:
        self.attempt = 0

    def next(self) -> float:
        cap = min(self.maximum, self.initial * 2.0 ** min(self.attempt, 30))
        self.attempt += 1
        return cap * random.uniform(0.5, 1.0)


class Reconciler:
    def __init__(
        self,
        control: Control,
        *,
        drain_timeout: float = 30.0,
        unhealthy_after: float = 10.0,
        resync_interval: float = 30.0,
        scheme: str = "http",
        server_name: str | None = None,
    ) -> None:
        self.control = control
        self.https = scheme == "https"  # the endpoints' urls are made https://
        self.server_name = server_name  # ... and their certificates checked for it
        self.drain_timeout = drain_timeout
        self.unhealthy_after = unhealthy_after
        self.resync_interval = resync_interval
        self._wanted: dict[str, Endpoint] | None = None
        self._published = 0  # snapshots received
        self._applied = 0  # the last snapshot number fully applied
        self._changed = asyncio.Condition()
        self._wake = asyncio.Event()
        self._healthy = False
        self._health_changed = asyncio.Event()
        self._down_since: float | None = None
        self._health_timer: asyncio.TimerHandle | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._replacing: dict[str, asyncio.Task[None]] = {}  # drained out to join again

    # -- the sink ------------------------------------------------------------

    def publish(self, endpoints: Mapping[str, Endpoint]) -> None:
        if self.https:  # sources make http:// urls: the same endpoint, spoken to over TLS
            endpoints = {
                name: msgspec.structs.replace(e, url="https" + e.url.removeprefix("http"))
                for name, e in endpoints.items()
            }
        wanted = dict(endpoints)
        self._up()
        if wanted == self._wanted:
            return  # nothing new (a DNS answer unchanged, a watch re-opened)
        self._wanted = wanted
        self._published += 1
        self._wake.set()

    def failed(self, reason: str) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            loop = asyncio.get_running_loop()
            self._health_timer = loop.call_later(self.unhealthy_after, self._unhealthy)
        log.warning("discovery source failing: membership kept", reason=reason)

    # -- health --------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy

    def _up(self) -> None:
        self._down_since = None
        if self._health_timer is not None:
            self._health_timer.cancel()
            self._health_timer = None
        if not self._healthy:
            log.info("discovery source healthy")
            self._set_healthy(True)

    def _unhealthy(self) -> None:
        self._health_timer = None
        if self._healthy:
            log.warning(
                "discovery source failing for too long: not ready", bound=self.unhealthy_after
            )
            self._set_healthy(False)

    def _set_healthy(self, healthy: bool) -> None:
        self._healthy = healthy
        event, self._health_changed = self._health_changed, asyncio.Event()
        event.set()

    async def wait_health(self, healthy: bool) -> None:
        while self._healthy is not healthy:
            await self._health_changed.wait()

    # -- lifecycle -----------------------------------------------------------

    def start(self, source: Source) -> None:
        self._tasks = [
            asyncio.create_task(self._apply_loop(), name="discovery reconcile"),
            asyncio.create_task(source.run(self), name=f"discovery {source.description}"),
        ]

    async def wait_synced(self, within: float) -> bool:
        """Wait until a first snapshot is applied; False if none came in ``within`` s."""
        try:
            async with asyncio.timeout(within):
                await self.wait_applied(1)
        except TimeoutError:
            return False
        return True

    async def wait_applied(self, count: int) -> None:
        """Return once ``count`` snapshots have been received and the latest applied."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._applied >= count)

    @property
    def published(self) -> int:
        return self._published

    async def close(self) -> None:
        tasks, self._tasks = [*self._tasks, *self._replacing.values()], []
        self._replacing = {}
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._health_timer is not None:
            self._health_timer.cancel()

    # -- reconciling ---------------------------------------------------------

    async def _apply_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.resync_interval):
                    await self._wake.wait()
            self._wake.clear()
            wanted, number = self._wanted, self._published
            if wanted is None:
                continue
            try:
                await self.reconcile(wanted)
            except Exception:
                # A bug, not an outcome: logged, and the next snapshot tries again.
                log.exception("discovery reconcile failed")
                continue
            async with self._changed:
                self._applied = number
                self._changed.notify_all()

    async def reconcile(self, wanted: Mapping[str, Endpoint]) -> None:
        """Make the membership ``wanted``'s, through the control interface: joins
        first, then drains, then removals, so a change that replaces endpoints never
        leaves a moment with none serving."""
        control = self.control
        current = {view.name: view for view in await control.backends()}
        joins: list[Endpoint] = []
        drains: list[str] = []
        removals: list[str] = []
        for name in sorted(set(current) | set(wanted)):
            want, have = wanted.get(name), current.get(name)
            if want is None or (
                have is not None and (have.url, have.models) != (want.url, list(want.models))
            ):
                # Gone; or a name from another setup (a state file): drained out, and
                # the resync adds the endpoint once the name is free.
                removals.append(name)
            elif want.serving and (have is None or have.state != "active"):
                joins.append(want)
            elif not want.serving and have is not None and have.state != "draining":
                drains.append(name)
        for want in joins:
            await self._change(want.name, self._join(want, want.name in current))
        for name in drains:
            await self._change(name, control.update_backend(name, BackendPatch(state="draining")))
        for name in removals:
            if name in wanted:  # another url or models: out, then in again
                if name not in self._replacing:
                    self._replacing[name] = asyncio.create_task(self._replace(name))
                continue
            # Idempotent: a backend already draining out keeps its drain.
            await self._change(
                name, control.remove_backend(name, timeout=self.drain_timeout, wait=False)
            )

    async def _replace(self, name: str) -> None:
        removal = self.control.remove_backend(name, timeout=self.drain_timeout, wait=True)
        try:
            await self._change(name, removal)
        finally:
            self._replacing.pop(name, None)
        self._published += 1  # the latest snapshot again: it joins as it is now
        self._wake.set()

    async def _join(self, want: Endpoint, present: bool) -> object:
        if present:  # draining: set active again (cancels a drain under way)
            return await self.control.update_backend(want.name, BackendPatch(state="active"))
        fields: dict[str, object] = {"name": want.name, "url": want.url, "models": want.models}
        if self.server_name is not None:
            fields["server_name"] = self.server_name
        spec = msgspec.convert(fields, BackendSpec)
        return await self.control.add_backend(spec)

    @staticmethod
    async def _change(name: str, change: Awaitable[object]) -> None:
        try:
            await change
        except msgspec.ValidationError as exc:
            log.warning("discovered endpoint ignored", backend=name, reason=str(exc))
        except ControlError as exc:
            # Own address (Invalid), a state file that cannot be written
            # (NotSaved), a race with a drain (NotFound): the resync retries.
            log.warning("discovered change not applied", backend=name, reason=str(exc))


class DiscoveredControl:
    """The admin API's view with discovery on: membership writes answer 409."""

    def __init__(self, inner: Control, reconciler: Reconciler, what: str) -> None:
        self.inner = inner
        self.reconciler = reconciler
        self.what = what

    def _refuse(self, action: str) -> Conflict:
        return Conflict(
            f"membership comes from discovery ({self.what}): {action} it there, not"
            " through the admin API"
        )

    async def backends(self) -> list[BackendView]:
        return await self.inner.backends()

    async def backend(self, name: str) -> BackendView:
        return await self.inner.backend(name)

    async def add_backend(self, spec: BackendSpec) -> BackendView:
        raise self._refuse("add a backend")

    async def update_backend(self, name: str, patch: BackendPatch) -> BackendView:
        if patch.state is not None:
            raise self._refuse("change a backend's state (terminating endpoints drain)")
        return await self.inner.update_backend(name, patch)

    async def remove_backend(self, name: str, *, timeout: float, wait: bool) -> DrainView:  # noqa: ASYNC109
        raise self._refuse("remove a backend")

    def routing(self) -> RoutingConfig:
        return self.inner.routing()

    async def set_routing(self, routing: RoutingConfig) -> RoutingConfig:
        return await self.inner.set_routing(routing)

    async def stats(self) -> Stats:
        return await self.inner.stats()

    def ready(self) -> bool:
        return self.inner.ready() and self.reconciler.healthy

    async def metrics(self) -> bytes:
        return await self.inner.metrics()

    async def explain(self, request: DryRequest, k: int) -> Explanation:
        return await self.inner.explain(request, k)

    async def experiment(self) -> ExperimentView:
        return await self.inner.experiment()

    def config(self) -> ConfigView:
        return self.inner.config()
