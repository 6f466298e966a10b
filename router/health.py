"""Health: active polls, passive failure counting, half-open probes, scraping.

Contract:
- Active: each backend's health path (``[health].path`` or its own override)
  is polled every ``interval``; ``unhealthy_threshold`` failures in a row mark
  it down, ``healthy_threshold`` successes in a row bring it back.  A success
  is a 2xx answer within ``timeout``.
- Passive: the data plane reports connect failures, resets, timeouts and 5xx
  answers (``failed``) and good answers (``answered``).  ``passive_failures``
  failures in a row mark the backend down at once; after a backoff (doubling
  from ``backoff_initial`` to ``backoff_max``) one probe is sent: success
  brings it back (half-open), failure doubles the backoff.
- Down backends stay on the ring and are skipped by the walk (``Fleet``), so
  their keys go to the next backend and come back when they recover.  Every
  transition is logged and counted (``transitions``).
- Scraping (``scrape_metrics``): every ``scrape_interval`` one round reads
  every backend's ``/metrics`` at once for vLLM's (or SGLang's) prefix-cache
  and queue figures.  Before it, ``before_round`` (a supervisor: add up the
  workers' counts) runs and each backend's repeated-key counts are read;
  after it ``cache`` (``router.cachecheck``) judges each backend, with
  engine signals on ``signals`` (``router.signals``) ranks them, and
  ``after_round`` gets the backends read (``router.arms``: the arms' hit rates).
- Everything here runs on the control side of the loop: tasks and timers, no
  work on the request path beyond two integer updates per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prometheus_client.parser import text_string_to_metric_families

from .cachecheck import CacheCheck
from .config import ConfigError
from .log import get_logger

if TYPE_CHECKING:
    import aiohttp

    from .backendtls import BackendTLS
    from .config import HealthConfig
    from .fleet import Backend, Fleet
    from .signals import EngineSignals

__all__ = ["HealthMonitor", "Scraped"]

log = get_logger("health")

# vLLM V1 names first, then the V0 ones some deployments still expose.
_SCRAPED = {
    "vllm:prefix_cache_queries": "queries",
    "vllm:prefix_cache_hits": "hits",
    "vllm:gpu_prefix_cache_queries": "queries",
    "vllm:gpu_prefix_cache_hits": "hits",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
}
# SGLang: prompt tokens (cached ones included) and cached prompt tokens, counters
# whose cache_source label (device, host, storage) the sum below adds up; its
# scheduler's gauges (sglang/srt/metrics/collector.py: SchedulerMetricsCollector).
_SCRAPED["sglang:prompt_tokens"] = "queries"
_SCRAPED["sglang:cached_tokens"] = "hits"
_SCRAPED["sglang:num_running_reqs"] = "running"
_SCRAPED["sglang:num_queue_reqs"] = "waiting"
_SCRAPED["sglang:token_usage"] = "kv_usage"
# Without "# TYPE" lines the parser names a counter family after its sample.
_SCRAPED.update({f"{name}_total": field for name, field in list(_SCRAPED.items())})
# A share of one cache: averaged over the engines behind one URL (data-parallel
# ranks), where counts are summed.
_AVERAGED = frozenset({"kv_usage"})


class Scraped:
    """The last figures read from one backend's /metrics."""

    __slots__ = ("hits", "kv_usage", "queries", "running", "waiting")

    def __init__(self) -> None:
        self.queries: float | None = None
        self.hits: float | None = None
        self.running: float | None = None
        self.waiting: float | None = None
        self.kv_usage: float | None = None

    @property
    def hit_rate(self) -> float | None:
        if not self.queries or self.hits is None:
            return None
        return self.hits / self.queries


class _Watch:
    __slots__ = ("backoff", "failed_in_row", "ok_in_row", "passive_in_row", "probe", "tasks")

    def __init__(self) -> None:
        self.ok_in_row = 0
        self.failed_in_row = 0
        self.passive_in_row = 0
        self.backoff = 0.0
        self.probe: asyncio.TimerHandle | None = None
        self.tasks: list[asyncio.Task[None]] = []


class HealthMonitor:
    def __init__(self, fleet: Fleet, config: HealthConfig, tls: BackendTLS | None = None):
        self.fleet = fleet
        self.config = config
        self.tls = tls  # for https:// backends (router.backendtls); None: the default
        self.transitions: Counter[tuple[str, str]] = Counter()  # (backend, "up"/"down")
        self.scraped: dict[str, Scraped] = {}
        self.cache = CacheCheck(config.scrape_metrics)
        self.signals: EngineSignals | None = None  # engine signals on: told every round
        # Awaited before each scrape round (a supervisor adds up its workers' counts).
        self.before_round: Callable[[], Awaitable[None]] | None = None
        # Called after each round with the backends read in it (router.arms' hit rates).
        self.after_round: Callable[[list[str]], None] | None = None
        self._rounds: asyncio.Task[None] | None = None
        self.rounds = 0  # scrape rounds done (``wait`` re-checks after each)
        self._watches: dict[str, _Watch] = {}
        self._session: aiohttp.ClientSession | None = None
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future[None]]] = []
        # Told of every transition after the fleet has it (a supervisor passes them on
        # to its workers).
        self.on_transition: Callable[[str, bool], None] | None = None

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        # Imported here: a worker process never probes (its supervisor does), and
        # aiohttp is ~0.25 s of every worker's start-up (a restart, a test's daemon).
        import aiohttp

        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, force_close=True),
            skip_auto_headers=("User-Agent",),
        )
        for backend in self.fleet.backends.values():
            self.watch(backend)
        if self.config.scrape_metrics:
            self._rounds = asyncio.create_task(self._scrape_rounds())

    async def close(self) -> None:
        if self._rounds is not None:
            self._rounds.cancel()
        for name in list(self._watches):
            self.unwatch(name)
        if self._session is not None:
            await self._session.close()

    def watch(self, backend: Backend) -> None:
        watch = self._watches[backend.name] = _Watch()
        if self._session is None:
            return  # not started: start() watches everyone
        if self.config.active:
            watch.tasks.append(asyncio.create_task(self._poll(backend, watch)))
        if self.config.scrape_metrics:
            self.scraped[backend.name] = Scraped()  # read from the next round on

    def unwatch(self, name: str) -> None:
        watch = self._watches.pop(name, None)
        self.scraped.pop(name, None)
        self.cache.forget(name)
        if watch is None:
            return
        for task in watch.tasks:
            task.cancel()
        if watch.probe is not None:
            watch.probe.cancel()

    async def wait(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, re-checked after every transition and
        scrape: the synchronisation point for tests and operators' tooling."""
        if predicate():
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, future))
        try:
            await future
        finally:
            self._waiters = [w for w in self._waiters if w[1] is not future]

    def _changed(self) -> None:
        for predicate, future in self._waiters:
            if not future.done() and predicate():
                future.set_result(None)

    # -- passive: reported by the data plane ---------------------------------------

    def failed(self, backend: Backend, reason: str) -> None:
        watch = self._watches.get(backend.name)
        if watch is None:
            return
        watch.passive_in_row += 1
        if backend.healthy and watch.passive_in_row >= self.config.passive_failures:
            self._set(backend, False, f"{watch.passive_in_row} failures in a row: {reason}")
            watch.backoff = self.config.backoff_initial
            self._schedule_probe(backend, watch)

    def answered(self, backend: Backend) -> None:
        watch = self._watches.get(backend.name)
        if watch is not None:
            watch.passive_in_row = 0

    def _schedule_probe(self, backend: Backend, watch: _Watch) -> None:
        loop = asyncio.get_running_loop()
        watch.probe = loop.call_later(watch.backoff, self._start_probe, backend, watch)

    def _start_probe(self, backend: Backend, watch: _Watch) -> None:
        watch.probe = None
        if self._watches.get(backend.name) is watch and not backend.healthy:
            watch.tasks.append(asyncio.create_task(self._half_open(backend, watch)))

    async def _half_open(self, backend: Backend, watch: _Watch) -> None:
        task = asyncio.current_task()
        try:
            if await self._check(backend):
                watch.passive_in_row = 0
                self._set(backend, True, "half-open probe succeeded")
            elif self._watches.get(backend.name) is watch and not backend.healthy:
                watch.backoff = min(watch.backoff * 2, self.config.backoff_max)
                self._schedule_probe(backend, watch)
        finally:
            with contextlib.suppress(ValueError):
                watch.tasks.remove(task)  # type: ignore[arg-type]

    # -- active ---------------------------------------------------------------------

    async def _poll(self, backend: Backend, watch: _Watch) -> None:
        interval = (backend.spec.health and backend.spec.health.interval) or self.config.interval
        while True:
            await asyncio.sleep(interval)  # a period, not a synchronisation
            if await self._check(backend):
                watch.ok_in_row += 1
                watch.failed_in_row = 0
                if not backend.healthy and watch.ok_in_row >= self.config.healthy_threshold:
                    watch.passive_in_row = 0
                    self._set(backend, True, f"{watch.ok_in_row} health checks passed")
            else:
                watch.failed_in_row += 1
                watch.ok_in_row = 0
                if backend.healthy and watch.failed_in_row >= self.config.unhealthy_threshold:
                    self._set(backend, False, f"{watch.failed_in_row} health checks failed")

    async def _check(self, backend: Backend) -> bool:
        override = backend.spec.health
        path = (override and override.path) or self.config.path
        timeout = (override and override.timeout) or self.config.timeout
        assert self._session is not None
        import aiohttp  # loaded by start()

        try:
            tls = await self._ssl(backend)
        except ConfigError:
            return backend.healthy  # our files, not the backend (router.backendtls): as it was
        try:
            async with self._session.get(
                backend.url.rstrip("/") + path,
                timeout=aiohttp.ClientTimeout(total=timeout),
                allow_redirects=False,
                ssl=tls,
                server_hostname=backend.spec.server_name,
            ) as response:
                await response.read()
                return 200 <= response.status < 300
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _ssl(self, backend: Backend) -> ssl.SSLContext | bool:
        """What aiohttp's ``ssl`` takes for ``backend``: the router's context for an
        ``https://`` one (router.backendtls), else its default (unused for http)."""
        tls = self.tls
        if not backend.tls or tls is None:
            return True
        return tls.built or await tls.get()

    def _set(self, backend: Backend, healthy: bool, reason: str) -> None:
        if backend.name not in self.fleet.backends or backend.healthy == healthy:
            return
        self.fleet.set_healthy(backend.name, healthy)
        direction = "up" if healthy else "down"
        self.transitions[backend.name, direction] += 1
        log.warning("backend " + direction, backend=backend.name, reason=reason)
        if self.on_transition is not None:
            self.on_transition(backend.name, healthy)
        self._changed()

    # -- scraping ---------------------------------------------------------------------

    async def _scrape_rounds(self) -> None:
        while True:
            try:
                await self._round()
            except Exception:  # a bug: logged, and the next round tries again
                log.exception("scrape round failed")
            await asyncio.sleep(self.config.scrape_interval)  # a period, not a synchronisation

    async def _round(self) -> None:
        fresh = True
        if self.before_round is not None:
            try:
                async with asyncio.timeout(self.config.timeout):
                    await self.before_round()
            except TimeoutError:
                fresh = False  # the counts are not read now: no verdict this round
        known = self.fleet.backends
        backends = [known[name] for name in self.scraped if name in known]
        # Read before the scrapes: every repeat counted here reached its engine first.
        counts = [(b.repeats_sent, b.repeats_answered) for b in backends]
        read = await asyncio.gather(*(self._scrape(b.name) for b in backends))
        for backend, (sent, answered), ok in zip(backends, counts, read, strict=True):
            scraped = self.scraped.get(backend.name)  # None: removed meanwhile
            if fresh and scraped is not None:
                self.cache.judge(backend, sent, answered, scraped if ok else None)
        if self.signals is not None:  # this round's figures only: a failed scrape has none
            got = zip(backends, read, strict=True)
            self.signals.scraped(
                ((b.name, self.scraped.get(b.name) if ok else None) for b, ok in got), time.time()
            )
        if fresh and self.after_round is not None:
            self.after_round([b.name for b, ok in zip(backends, read, strict=True) if ok])
        self.rounds += 1
        self._changed()

    async def _scrape(self, name: str) -> bool:
        """Read one backend's /metrics into ``scraped``; False if that failed."""
        assert self._session is not None
        backend = self.fleet.backends.get(name)
        if backend is None:
            return False
        url = backend.url.rstrip("/") + "/metrics"
        import aiohttp  # loaded by start()

        timeout = aiohttp.ClientTimeout(total=self.config.timeout)
        try:
            async with self._session.get(
                url,
                timeout=timeout,
                ssl=await self._ssl(backend),
                server_hostname=backend.spec.server_name,
            ) as response:
                if response.status != 200:
                    return False
                self._parse(name, await response.text())
                return True
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, ConfigError):
            return False  # the health checks report an unreachable backend; keep the last figures

    def _parse(self, name: str, text: str) -> None:
        scraped = self.scraped.get(name)
        if scraped is None:
            return
        sums: dict[str, float] = {}
        samples: dict[str, int] = {}
        for family in text_string_to_metric_families(text):
            field = _SCRAPED.get(family.name)
            if field is None:
                continue
            for sample in family.samples:
                if sample.name.endswith(("_created", "_bucket")):
                    continue
                sums[field] = sums.get(field, 0.0) + sample.value  # summed over engines
                samples[field] = samples.get(field, 0) + 1
        for field in _AVERAGED & sums.keys():
            sums[field] /= samples[field]
        for field in Scraped.__slots__:  # absent now: None, never a stale (flat) figure
            setattr(scraped, field, sums.get(field))
