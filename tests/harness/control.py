"""``FakeControl``: an in-memory ``router.control.Control`` for admin API tests.

It behaves the way ``RouterControl`` does (a drain is a task that ends when the
backend's last request finishes or its timeout passes; ``wait=True`` waits for
that task), with switches a test can flip: in-flight requests
(``hold``/``release``), readiness, and an exception the next read raises.  No
sleeps: tests wait on the fake's events.  ``TOKEN`` is the admin token the tests use.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from router.abreport import ExperimentView
from router.config import BackendSpec, Config, RoutingConfig
from router.control import (
    BackendPatch,
    BackendView,
    Conflict,
    Control,
    Decisions,
    DrainView,
    NotFound,
    Rejected,
    Stats,
    Totals,
)
from router.control.configview import ConfigSource, ConfigView, config_view
from router.explain import DryRequest, Explanation

__all__ = ["METRICS", "TOKEN", "FakeControl", "conforms"]

TOKEN = "s3cret-Token_for.tests~"
METRICS = b"# HELP fake_requests_total Requests.\n# TYPE fake_requests_total counter\n"


@dataclasses.dataclass
class _Backend:
    spec: BackendSpec
    weight: int
    state: str = "active"
    in_flight: int = 0


@dataclasses.dataclass
class _Drain:
    timeout: float
    idle: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    forced: bool = False
    task: asyncio.Task[None] | None = None


class FakeControl:
    """``Control`` in memory, behaving like ``router.control.live.RouterControl``."""

    def __init__(self, *names: str) -> None:
        self._backends: dict[str, _Backend] = {}
        self._drains: dict[str, _Drain] = {}
        self._routing = RoutingConfig()
        self.is_ready = True
        self.fail_next: Exception | None = None  # raised by the next stats()
        self.drain_started = asyncio.Event()
        for i, name in enumerate(names):
            spec = BackendSpec(name=name, url=f"http://127.0.0.1:{9000 + i}")
            self._backends[name] = _Backend(spec, spec.weight)

    # -- switches for tests ------------------------------------------------------

    def hold(self, name: str, count: int = 1) -> None:
        self._backends[name].in_flight += count

    def release(self, name: str) -> None:
        backend = self._backends[name]
        backend.in_flight -= 1
        drain = self._drains.get(name)
        if drain is not None and backend.in_flight == 0:
            drain.idle.set()

    async def drained(self, name: str) -> None:
        drain = self._drains.get(name)
        if drain is not None:
            await drain.done.wait()

    async def close(self) -> None:
        for drain in self._drains.values():
            if drain.task is not None:
                drain.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await drain.task

    # -- Control: reads ------------------------------------------------------------

    def _get(self, name: str) -> _Backend:
        try:
            return self._backends[name]
        except KeyError:
            raise NotFound(f"no backend named {name!r}") from None

    def _view(self, backend: _Backend) -> BackendView:
        return BackendView(
            name=backend.spec.name,
            url=backend.spec.url,
            weight=backend.weight,
            state="draining" if backend.state == "draining" else "active",
            healthy=True,
            in_flight=backend.in_flight,
            requests=0,
            share=0.0,
            overflow=0,
            fallback=0,
            errors=0,
            ttft_p50_ms=None,
            ttft_p90_ms=None,
            prefix_cache_hit_rate=None,
        )

    async def backends(self) -> list[BackendView]:
        return self.views()

    def views(self) -> list[BackendView]:
        return [self._view(b) for _, b in sorted(self._backends.items())]

    async def backend(self, name: str) -> BackendView:
        return self.view(name)

    def view(self, name: str) -> BackendView:
        return self._view(self._get(name))

    def routing(self) -> RoutingConfig:
        return self._routing

    async def stats(self) -> Stats:
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        in_flight = sum(b.in_flight for b in self._backends.values())
        return Stats(
            strategy=self._routing.strategy.value,
            backends=self.views(),
            totals=Totals(requests=0, in_flight=in_flight, errors=0, no_backend=0),
            decisions=Decisions(primary=0, overflow=0, fallback=0, other=0),
        )

    def ready(self) -> bool:
        return self.is_ready

    async def metrics(self) -> bytes:
        return METRICS

    async def explain(self, request: DryRequest, k: int) -> Explanation:
        """A canned passthrough answer; a path of ``/refused`` is refused as the data
        port refuses (the real dry run: ``tests/test_explain.py``)."""
        if request.path == "/refused":
            raise Rejected("the data port would answer 400: refused", field="messages")
        first = min(self._backends, default=None)
        return Explanation(
            kind="passthrough",
            method=request.method,
            path=request.path,
            key=None,
            model=None,
            pool=None,
            response_id=None,
            response_backend=None,
            strategy=self._routing.strategy.value,
            home=None,
            hot_key=None,
            walk=[],
            backend=first,
            decision=None if first is None else "passthrough",
            router_answer=503 if first is None else None,
            reason=f"fake: k={k}",
        )

    async def experiment(self) -> ExperimentView:
        raise NotFound("no A/B experiment: the RoutingConfig has no Arms")

    def config(self) -> ConfigView:
        return config_view(Config(), self._routing, ConfigSource(None, "config", 0.0))

    # -- Control: changes ------------------------------------------------------------

    async def add_backend(self, spec: BackendSpec) -> BackendView:
        if spec.name in self._backends:
            raise Conflict(f"a backend named {spec.name!r} already exists")
        backend = self._backends[spec.name] = _Backend(spec, spec.weight)
        return self._view(backend)

    async def update_backend(self, name: str, patch: BackendPatch) -> BackendView:
        backend = self._get(name)
        if patch.weight is not None:
            backend.weight = patch.weight
        if patch.state is not None:
            backend.state = patch.state
            if patch.state == "active":
                drain = self._drains.pop(name, None)
                if drain is not None and drain.task is not None:
                    drain.task.cancel()
        return self._view(backend)

    async def set_routing(self, routing: RoutingConfig) -> RoutingConfig:
        self._routing = routing
        return routing

    # timeout= is how long the drain may last (the Protocol's signature), not a call limit.
    async def remove_backend(self, name: str, *, timeout: float, wait: bool) -> DrainView:  # noqa: ASYNC109
        backend = self._get(name)
        drain = self._drains.get(name)
        if drain is None:
            backend.state = "draining"
            drain = self._drains[name] = _Drain(timeout)
            if backend.in_flight == 0:
                drain.idle.set()
            drain.task = asyncio.create_task(self._drain(name, drain))
            self.drain_started.set()
        if wait:
            await drain.done.wait()
            if name in self._backends:
                raise Conflict(f"the drain of {name!r} was cancelled: it is active again")
            return DrainView(name, "removed", 0, drain.timeout, drain.forced)
        return DrainView(name, "draining", backend.in_flight, drain.timeout)

    async def _drain(self, name: str, drain: _Drain) -> None:
        try:
            try:
                async with asyncio.timeout(drain.timeout):
                    await drain.idle.wait()
            except TimeoutError:
                drain.forced = True
            if self._drains.get(name) is drain:
                del self._backends[name], self._drains[name]
        finally:
            drain.done.set()


def conforms(control: Control) -> Control:
    return control  # mypy: FakeControl implements the whole Protocol
