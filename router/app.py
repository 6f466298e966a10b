"""The composition root: builds the router from a Config and runs its lifecycle.

Contract:
- ``Router(config)`` owns the fleet, the balancer, one upstream pool per
  backend, the client connections and the access log.  ``start()`` binds the
  listener (or serves sockets given to it: a supervisor's, or handed over,
  ``router.handover``); ``shutdown()`` stops accepting, closes the
  connections that have waited for a request longer than
  ``client.STOPPING_IDLE_SECONDS`` and counts the others in the drain as if
  in flight (``ClientConnection.hold``: a request may be on its way; it is
  answered, saying close), lets in-flight requests finish for up to
  ``shutdown_grace`` seconds, then closes the rest.  Both are idempotent.
- Client connections are capped below the fd limit read at ``start()`` (see
  ``admission``): past the cap a client gets a 503, and the admin API, the
  health checks and the upstream connections keep the fds they need.
- Exchanges reach back only through the small surface below
  (``next_request_id``, ``backend_failed``, ``backend_answered``,
  ``exchange_started``/``exchange_finished``, ``request_refused`` and the
  shared objects: ``responses`` (``router.responses``), and ``tracer``,
  None unless ``otel.endpoint`` is set); membership changes go through
  ``add_backend`` / ``remove_backend`` so that pools follow the fleet.  Both
  change the fleet at once; the ring follows in the background (``await
  router.fleet.settled()`` for it), so neither blocks the loop.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from typing import TYPE_CHECKING

import msgspec

from .abreport import ArmCollector
from .accesslog import AccessLog
from .admission import Admission, nofile_limit
from .backendtls import BackendTLS
from .balancer import Balancer
from .cachecheck import Repeats
from .cachesalt import Salter
from .config import BackendSpec, Config, Limits, RoutingConfig, Timeouts
from .fleet import Backend, Fleet
from .health import HealthMonitor
from .keydigests import KeyDigester
from .keyworker import KeyWorker
from .log import get_logger
from .metrics import Recorder, RouterCollector
from .queue import AdmissionQueue
from .responses import ResponseIds
from .selfaddr import Listener
from .sessions import SessionRule
from .signals import EngineSignals
from .slowstart import Ramp
from .tenants import TenantCollector, TenantMetrics
from .upstream import Pool
from .wire import DateHeader

if TYPE_CHECKING:
    from .client import ClientConnection
    from .exchange import Exchange
    from .tracing import Tracer

__all__ = ["Router"]

SWEEP_SECONDS = 2.0
log = get_logger("router")


class Router:
    def __init__(self, config: Config, *, tls: ssl.SSLContext | None = None):
        self.config = config
        self.tls = tls
        self.forwarded_proto = (
            b"\r\nx-forwarded-proto: https" if tls else b"\r\nx-forwarded-proto: http"
        )
        self.fleet = Fleet(
            config.backends,
            vnodes=config.vnodes,
            slow_start=config.health.slow_start_seconds,
            panic=config.health.panic,
        )
        self.balancer = Balancer(self.fleet, config.routing, seed=config.seed)
        self.responses = ResponseIds(config.limits.response_ids)
        self.sessions = SessionRule(config.routing.prefix_aware)  # router.sessions
        self.salter = Salter.from_config(config.cache_salt)  # None: off (router.cachesalt)
        self.pools: dict[str, Pool] = {}
        self.backend_tls = BackendTLS(config.backend_tls)  # https:// backends, built when used
        self.connections: set[ClientConnection] = set()
        self.date = DateHeader()
        self.access = AccessLog(config.access_log)
        # [advisor] key_digests: each access line gets the key's digests at several
        # lengths (router.keydigests); None, the one check the data plane makes, when off.
        self.key_digests = (
            KeyDigester(config.advisor.lengths)
            if config.advisor.key_digests and self.access.enabled
            else None
        )
        # X-Prefix-Router-Decision: 0 off, 1 decision and key, 2 and the backend's name.
        self.decision_header = (
            0 if not config.decision_header else 2 if config.decision_header_backend else 1
        )
        self.recorder = Recorder()
        self.collector = RouterCollector(self)
        health = config.health
        if config.engine_signals.enabled and not health.scrape_metrics:
            health = msgspec.structs.replace(health, scrape_metrics=True)  # what it reads
        self.health = HealthMonitor(self.fleet, health, self.backend_tls)
        # [engine_signals]: engine queues and KV use break routing ties (router.signals).
        self.signals: EngineSignals | None = None
        if config.engine_signals.enabled:
            self.signals = self.health.signals = EngineSignals(self.balancer)
        tenants = config.tenants
        self.tenants = TenantMetrics(
            tenants.metrics_top,
            key=tenants.label_key.encode() if tenants.label_key else None,
            show_names=tenants.metrics_names,
        )
        # [tenants] header: who a request's tenant is (metrics, the admission queue).
        self.tenant_header = tenants.header.lower().encode() if tenants.header else None
        # [admission] queue: requests wait, fairly per tenant, when every backend is at its bound.
        self.queue: AdmissionQueue | None = None
        if config.admission.queue:
            self.queue = AdmissionQueue(self, config.admission)
            self.balancer.on_release = self.queue.wake  # a lease let go: a place may be free
        self.reported_queue: tuple[int, int] | None = None  # a supervisor's: the workers' sum
        self.reported_connections: tuple[int, int] | None = None  # ... and client_connections'
        # metrics_top 0 and no queue: nothing per tenant to count (~2 us a request saved).
        self._per_tenant = bool(tenants.metrics_top) or self.queue is not None
        self.collector.registry.register(TenantCollector(self))
        self.collector.registry.register(ArmCollector(self))  # A/B arms (router.arms)
        self.health.after_round = self._scraped  # the arms' hit rates (router.arms)
        self.repeats = Repeats()  # keys sent to each backend before (router.cachecheck)
        self.stopping = False
        self.active = 0  # exchanges started and not finished
        self._quiet = asyncio.Event()  # set while no exchange is active
        self._quiet.set()
        self._request_prefix = os.urandom(4).hex().encode()
        # Our entry in the Via header of every forwarded request; a request that
        # already carries it has come back to us (a backend URL pointing here).
        self.via_name = b"prefix-router-" + self._request_prefix
        self.via = b"\r\nvia: 1.1 " + self.via_name
        self.head_tail = self.forwarded_proto + self.via  # constant lines of every upstream head
        self._request_seq = 0
        self._servers: list[asyncio.Server] = []
        self._held: list[Listener] = []  # start_control: the addresses the workers serve
        self.reported_idle: dict[str, int] | None = None  # set by a supervisor's merge
        self.admission: Admission = None  # type: ignore[assignment]  # set by start
        self._sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set by start
        self.keyworker: KeyWorker = None  # type: ignore[assignment]  # set by start
        # Set by start when otel.endpoint is: the one check the data plane makes.
        self.tracer: Tracer | None = None

    # -- lifecycle -------------------------------------------------------------

    async def start(
        self,
        *,
        port: int | None = None,
        reuse_port: bool = False,
        sockets: list[socket.socket] | None = None,
    ) -> None:
        """Listen on ``listen`` (or its host and ``port``; ``reuse_port``: SO_REUSEPORT,
        one of several worker processes on one port), or on ``sockets``, listening
        already (handed over by the process this one replaces, ``router.handover``,
        or by a supervisor)."""
        self.loop = asyncio.get_running_loop()
        self.keyworker = KeyWorker(self.loop)  # its process starts with the first large body
        for backend in self.fleet.backends.values():
            self._open_pool(backend)
        host, configured_port = self.config.listen_address
        # A TLS handshake gets the time a request head does (asyncio's default: 60 s);
        # admission uncounts the connections whose handshake failed past it.
        handshake = self.config.timeouts.client_header if self.tls is not None else None
        self.admission = Admission(self, nofile_limit(), handshake)
        backlog = self.config.limits.listen_backlog
        if sockets:
            for sock in sockets:
                self._servers.append(
                    await self.loop.create_server(
                        self.admission,
                        sock=sock,
                        backlog=backlog,
                        ssl=self.tls,
                        ssl_handshake_timeout=handshake,
                    )
                )
        else:
            server = await self.loop.create_server(
                self.admission,
                host,
                configured_port if port is None else port,
                backlog=backlog,
                reuse_address=True,
                reuse_port=reuse_port or None,
                ssl=self.tls,
                ssl_handshake_timeout=handshake,
            )
            self._servers.append(server)
        self.access.start(self.loop)
        if not self.config.backend_tls.verify:
            log.warning(
                "backend_tls.verify is off: any certificate is taken from https:// backends"
            )
        if self.config.otel.endpoint is not None and self.tracer is None:
            from .tracing import Tracer, TracerCollector  # imported only when tracing is on

            self.tracer = Tracer(self.config.otel, self.head_tail)
            self.collector.registry.register(TracerCollector(self.tracer.counts))
            self.tracer.start()
        self.health.start()
        self._sweeper = self.loop.call_later(SWEEP_SECONDS, self._sweep)
        log.info(
            "listening",
            address=f"{host}:{self.port}",
            tls=self.tls is not None,
            strategy=self.balancer.config.strategy.value,
            backends=sorted(self.fleet.backends),
            max_clients=self.admission.cap if self.admission.nofile is not None else None,
        )

    async def start_control(self, sockets: list[socket.socket]) -> None:
        """Run the control side only (a supervisor of worker processes): health
        checks, no listener and no pools; ``sockets`` are the client listener's
        addresses, held by the supervisor and served by the workers."""
        self.loop = asyncio.get_running_loop()
        # Their names, read now: the workers' supervisor closes its copies at stop.
        names = [sock.getsockname() for sock in sockets]
        self._held = [Listener("client listener", str(n[0]), int(n[1])) for n in names]
        for backend in self.fleet.backends.values():
            self._open_pool(backend)  # never used: kept so membership changes stay one path
        self.health.start()

    @property
    def port(self) -> int:
        return self.listeners[0].port

    @property
    def sockets(self) -> list[socket.socket]:
        """The client listener's sockets (what a handover passes on; a supervisor's
        workers hold theirs: ``Workers.sockets``)."""
        return [sock for server in self._servers for sock in server.sockets]

    @property
    def listeners(self) -> list[Listener]:
        """The client listener's bound sockets (a host name can bind several)."""
        if not self._servers:
            return self._held
        names = [sock.getsockname() for sock in self.sockets]
        return [Listener("client listener", str(name[0]), int(name[1])) for name in names]

    async def shutdown(self, grace: float | None = None) -> None:
        if self.stopping:
            return
        self.stopping = True
        grace = self.config.timeouts.shutdown_grace if grace is None else grace
        for server in self._servers:
            server.close()  # a handed-over socket lives on in the process that took it
        if self.admission is not None:
            self.admission.hold_awaiting()  # no PROXY header yet: as a client that sent nothing
            self.admission.hold_handshaking()  # ... and no TLS handshake done yet
        for conn in list(self.connections):
            if conn.current is not None:
                continue
            if conn.hold():
                self.exchange_started()  # a request on its way: drained as one (unhold)
            else:
                conn.transport.close()  # idle keep-alive: nothing to wait for
        if self.active:
            log.info("draining", in_flight=self.active, grace_s=grace)
            try:
                async with asyncio.timeout(grace):
                    while self.active:  # an exchange's end may hold its connection on
                        await self._quiet.wait()
            except TimeoutError:
                log.warning("grace period over", in_flight=self.active)
        for conn in list(self.connections):
            conn.transport.abort()
        await self.health.close()
        self.fleet.close()
        if self.keyworker is not None:
            await self.keyworker.close()
        for pool in self.pools.values():
            pool.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for server in self._servers:
            await server.wait_closed()
        if self.tracer is not None:
            await self.tracer.close()
        self.access.close()
        log.info("stopped")

    def client_connections(self) -> tuple[int, int]:
        """Client connections open now (under the cap: a 429 of client_connections
        counts until it closes, a 503 at the cap does not) and accepted since start,
        refused ones included (the workers' sums in a supervisor, as of their last
        report)."""
        if self.reported_connections is not None:
            return self.reported_connections
        admission = self.admission
        if admission is None:
            return 0, 0  # not listening (a supervisor before its first report)
        return admission.clients, admission.accepted

    def idle_connections(self) -> dict[str, int]:
        """Keep-alive connections waiting per backend (the workers' sum in a supervisor)."""
        if self.reported_idle is not None:
            return self.reported_idle
        return {name: pool.idle for name, pool in self.pools.items()}

    def _sweep(self) -> None:
        for pool in self.pools.values():
            pool.sweep()
        self.admission.sweep()
        self._sweeper = self.loop.call_later(SWEEP_SECONDS, self._sweep)

    # -- membership and config -------------------------------------------------

    def _open_pool(self, backend: Backend) -> None:
        limits, timeouts = self.config.limits, self.config.timeouts
        self.pools[backend.name] = Pool(
            self.loop,
            backend.host,
            backend.port,
            max_idle=limits.max_idle_upstream,
            keepalive=timeouts.upstream_keepalive,
            tls=self.backend_tls if backend.tls else None,
            server_name=backend.spec.server_name,
        )

    def add_backend(self, spec: BackendSpec, ramp: Ramp | None = None) -> Backend:
        """``ramp``: its slow start (router.slowstart), None: its whole weight at once."""
        backend = self.fleet.add(spec, ramp)
        self._open_pool(backend)
        self.health.watch(backend)
        if self.queue is not None:
            self.queue.wake()
        return backend

    def remove_backend(self, name: str) -> Backend:
        backend = self.fleet.remove(name)
        self.health.unwatch(name)
        # In-flight exchanges keep their connections; idle ones go now.
        self.pools.pop(name).close()
        return backend

    def configure_routing(self, routing: RoutingConfig) -> None:
        self.balancer.configure(routing)
        self.sessions = SessionRule(routing.prefix_aware)
        if self.queue is not None:
            self.queue.wake()

    def configure_settings(self, timeouts: Timeouts, limits: Limits, retries: int) -> None:
        """A config reload: what requests read from ``config`` from now on, and the pools."""
        self.config = msgspec.structs.replace(
            self.config, timeouts=timeouts, limits=limits, retries=retries
        )
        for pool in self.pools.values():
            pool.keepalive = timeouts.upstream_keepalive
            pool.max_idle = limits.max_idle_upstream
        self.responses.resize(limits.response_ids)

    # -- used by exchanges -----------------------------------------------------

    def next_request_id(self) -> bytes:
        self._request_seq += 1
        return b"%s-%x" % (self._request_prefix, self._request_seq)

    async def wait_quiet(self) -> None:
        """Return once no request is in flight (tests, shutdown)."""
        await self._quiet.wait()

    def exchange_started(self) -> None:
        if not self.active:
            self._quiet.clear()
        self.active += 1

    def unhold(self) -> None:
        """A connection held at shutdown began its request (now an exchange) or closed."""
        self.active -= 1
        if not self.active:
            self._quiet.set()

    def exchange_finished(self, exchange: Exchange) -> None:
        self.active -= 1
        self.recorder.observe(exchange)
        if exchange.arm is not None:
            exchange.arm.stats.observe(exchange)
        if self._per_tenant:
            self.tenants.observe(
                exchange.tenant_key,
                ttft=exchange.ttft - exchange.started if exchange.ttft else None,
                queued=exchange.queued,
                wait=exchange.queue_wait,
                rejected=exchange.rejected,
            )
        self.access.record(exchange)
        if exchange.span is not None:
            self.tracer.end(exchange)  # type: ignore[union-attr]  # a span means a tracer
        if not self.active:
            self._quiet.set()

    def _scraped(self, fresh: list[str]) -> None:
        """A scrape round read ``fresh`` backends: the experiment's hit-rate cells."""
        arms = self.balancer.arms
        if arms is not None:
            arms.attribute(self.health.scraped, fresh)

    def request_refused(self, status: int, reason: str, client: bytes) -> None:
        """A request answered with an error before it became an exchange; ``client``
        is its address."""
        self.recorder.refused[status] += 1
        self.access.refused(status, reason, client)

    def backend_failed(self, backend: Backend, reason: str) -> None:
        """A connect failure, reset, timeout or garbled answer (passive health)."""
        backend.errors += 1
        self.health.failed(backend, reason)

    def backend_answered(self, backend: Backend, status: int) -> None:
        if status >= 500:
            backend.errors += 1
            self.health.failed(backend, f"answered {status}")
        else:
            self.health.answered(backend)
