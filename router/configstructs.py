"""Config and its sections: frozen msgspec Structs, every one but the routing's.

Contract:
- ``Config`` holds the sections (timeouts, limits, health, backends, backend TLS,
  tracing, tenants, admission, discovery, ...) and takes ``RoutingConfig`` from
  router.routingconfig.  Ranges are in the annotations; checks across fields are
  in ``__post_init__``, whose ValueError msgspec reports at the struct's path
  (``$.backends[0]``).  Built by ``router.config.build_config`` in one
  ``msgspec.convert``; import these names from router.config.
- ``cache_salt``: the engine-side cache isolation (router.cachesalt); its
  secret is read by that module, never held in ``Config`` (which the admin
  API and the logs may show).
- Pure data and checks: no I/O, nothing probed per request.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from typing import Annotated, Literal
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from .addresses import backend_address, check_server_name, parse_address
from .routingconfig import RoutingConfig
from .slowstart import parse_duration

__all__ = [
    "HEALTH_FLOOR_S",
    "MAX_MODELS",
    "MAX_MODEL_NAME",
    "PERIOD_FLOOR_S",
    "AdmissionConfig",
    "AdvisorConfig",
    "BackendSpec",
    "BackendTLS",
    "CacheSaltConfig",
    "Config",
    "DiscoverConfig",
    "EngineSignalsConfig",
    "HealthConfig",
    "HealthOverride",
    "HealthSeconds",
    "Limits",
    "ModelName",
    "OtelConfig",
    "PeriodSeconds",
    "Seconds",
    "TenantKey",
    "TenantsConfig",
    "Timeouts",
]


Seconds = Annotated[float, Meta(gt=0, le=86_400)]
# The health checks' period and timeout have a floor, where any ``Seconds`` above 0
# was taken: an interval of 1e-9 s checked each backend back to back (~900 checks
# a second, a core's worth), and a timeout under a loopback round trip marks every
# backend down.  50 ms is twenty checks a second per backend, the most any
# detection needs (real traffic's failures mark a backend down at once, passively),
# and what the test suite itself runs at.
HEALTH_FLOOR_S = 0.05
HealthSeconds = Annotated[float, Meta(ge=HEALTH_FLOOR_S, le=86_400)]
# The other periods of a loop (a probe's backoff, DNS lookups, trace exports) have
# a floor too: 1e-9 made each a busy loop.  10 ms keeps the suite's 20 ms runs.
PERIOD_FLOOR_S = 0.01
PeriodSeconds = Annotated[float, Meta(ge=PERIOD_FLOOR_S, le=86_400)]


_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"


class HealthOverride(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Per-backend health settings; absent fields take the global ``[health]`` ones."""

    path: Annotated[str, Meta(pattern=r"^/")] | None = None
    interval: HealthSeconds | None = None
    timeout: HealthSeconds | None = None
    # This backend's slow-start window (router.slowstart): seconds, "60s", "off".
    slow_start: float | str | None = None

    def __post_init__(self) -> None:
        if self.slow_start is not None:
            parse_duration(self.slow_start)  # a ValueError names the value

    @property
    def slow_start_seconds(self) -> float:
        return 0.0 if self.slow_start is None else parse_duration(self.slow_start)


# A model name as clients send it (``meta-llama/Llama-3.1-8B-Instruct``): no
# whitespace, no comma (the ``--backend`` flag's separator).
MAX_MODEL_NAME = 256
ModelName = Annotated[str, Meta(pattern=rf"^[^\s,]{{1,{MAX_MODEL_NAME}}}$")]
MAX_MODELS = 64  # per backend


class BackendSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, omit_defaults=True):
    name: Annotated[str, Meta(pattern=_NAME)]
    url: str
    weight: Annotated[int, Meta(ge=1, le=1000)] = 1
    health: HealthOverride | None = None
    # The models it serves (the body's ``model``); empty: whatever it is asked
    # (see router.fleet, "Model pools").
    models: Annotated[tuple[ModelName, ...], Meta(max_length=MAX_MODELS)] = ()
    # An https:// backend: the name sent (SNI) and checked in its certificate, when
    # that is not the URL's host (a pod's IP, its certificate naming the Service).
    server_name: str | None = None

    def __post_init__(self) -> None:
        # A ValueError here is reported by msgspec at the backend object's path
        # (``$.backends[0]``); its message names the url.
        self.address()
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"backend {self.name!r} lists a model twice")
        if self.server_name is not None:
            if not self.tls:
                raise ValueError(f"backend {self.name!r}: server_name needs an https:// url")
            check_server_name(self.server_name, f"backend {self.name!r}")

    def address(self) -> tuple[str, int]:
        return backend_address(self.url)

    @property
    def tls(self) -> bool:
        """An ``https://`` backend (the scheme is checked case-blind, as urlsplit reads it)."""
        return self.url[:6].lower() == "https:"


class Timeouts(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    connect: Seconds = 5.0  # TCP connect to a backend
    first_byte: Seconds = 300.0  # request sent -> response head (long prefills queue)
    idle: Seconds = 120.0  # between two reads of a response body
    client_header: Seconds = 10.0  # request line + headers (slowloris)
    client_body: Seconds = 60.0  # between two reads of a request body
    # A request body in all, from the end of its head (0: no bound).  A body
    # trickled just under client_body holds its place and a backend connection
    # for as long as it lasts; this bounds that (slow POST).  Time the router
    # spends not reading it (the backend not taking it) is not counted.
    client_request: Annotated[float, Meta(ge=0, le=86_400)] = 0.0
    keepalive: Seconds = 75.0  # idle client connection between requests
    client_send: Seconds = 60.0  # a client that reads none of the response for this long
    # uvicorn (vLLM, SGLang) closes idle connections after 5 s: reuse ours for less.
    upstream_keepalive: Seconds = 4.0
    shutdown_grace: Seconds = 30.0  # in-flight requests may finish on SIGTERM


class Limits(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    max_header_bytes: Annotated[int, Meta(ge=1024, le=1 << 20)] = 32 * 1024
    max_headers: Annotated[int, Meta(ge=8, le=1000)] = 100
    max_body_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 32 * 1024 * 1024  # OpenAI kinds
    # OpenAI bodies above this are keyed in a helper process (router/keyworker.py):
    # the JSON syntax pass over the whole body would hold the loop. 0: never.
    key_offload_bytes: Annotated[int, Meta(ge=0, le=1 << 30)] = 1024 * 1024
    max_idle_upstream: Annotated[int, Meta(ge=0, le=10_000)] = 64  # pooled per backend
    # Responses API ids remembered with their backend (router/responses.py), ~180
    # bytes each; 0: follow-ups are routed as any other request.
    response_ids: Annotated[int, Meta(ge=0, le=10_000_000)] = 100_000
    # Connections the kernel queues for accept (the kernel caps it at
    # net.core.somaxconn): past it, a SYN is dropped and the client retries it a
    # second later.  A flood of new connections fills 1,024 in under a second.
    listen_backlog: Annotated[int, Meta(ge=16, le=65_535)] = 4096
    # Client connections one address may hold open at once, per worker process
    # (router.admission); past it a 429.  0: no limit, the default: behind a
    # proxy or a NAT every client shares one address.
    client_connections: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    # The IPv6 network client_connections counts as one client: /64, what one host or
    # subscriber is usually given (128: each address).  IPv4 addresses count alone.
    client_ipv6_prefix: Annotated[int, Meta(ge=32, le=128)] = 64
    # Requests one client connection may carry; the last is answered with
    # Connection: close (router.client).  0: no limit, the default (Envoy's and
    # HAProxy's; nginx's is 1,000).  A limit spreads long-lived connections over
    # --workers N again as clients reconnect.
    keepalive_requests: Annotated[int, Meta(ge=0, le=1 << 31)] = 0


class HealthConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    active: bool = True  # poll each backend's health path
    path: Annotated[str, Meta(pattern=r"^/")] = "/health"
    interval: HealthSeconds = 5.0
    timeout: HealthSeconds = 2.0
    healthy_threshold: Annotated[int, Meta(ge=1, le=100)] = 2  # successes in a row to come back
    unhealthy_threshold: Annotated[int, Meta(ge=1, le=100)] = 3  # failures in a row to go down
    # Passive: connect failures, resets, timeouts and 5xx answers in a row on real
    # traffic mark a backend down at once; a probe after the backoff (doubling up
    # to backoff_max) brings it back.
    passive_failures: Annotated[int, Meta(ge=1, le=1000)] = 3
    backoff_initial: PeriodSeconds = 1.0
    backoff_max: PeriodSeconds = 30.0
    # Scrape each backend's Prometheus /metrics (vLLM names) for /admin/stats.
    scrape_metrics: bool = False
    scrape_interval: HealthSeconds = 10.0
    # Slow start (router.slowstart): a backend added through the admin API or
    # discovery, or up again after being down, gets its ring share over this
    # window; seconds, "60s", "2m", or 0/"off" (the default: at once).
    slow_start: float | str = 0.0
    # Panic (router.fleet): where every backend a request could go to is down,
    # route to them all the same rather than answer 503.
    panic: bool = True

    def __post_init__(self) -> None:
        parse_duration(self.slow_start)  # a ValueError names the value

    @property
    def slow_start_seconds(self) -> float:
        return parse_duration(self.slow_start)


TenantKey = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[\x21-\x7e]+$")]


class TenantsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Who a request's tenant is, and how tenants show in the metrics (router.tenants)."""

    # A header naming the tenant, for metrics and the admission queue (the routing
    # salt stays prompt_cache_key / X-Amzn-SageMaker-Prefix-Aware-Id); unset: the salt's key.
    header: Annotated[str, Meta(pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}$")] | None = None
    metrics_top: Annotated[int, Meta(ge=0, le=1000)] = 20  # tenants with a label; 0: off
    metrics_names: bool = False  # labels are the keys themselves, not keyed digests
    # The digest's key (same on every replica for the same labels); unset: random per start.
    label_key: Annotated[str, Meta(min_length=16, max_length=256)] | None = None


class AdmissionConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The fair admission queue at saturation (router.queue); off: "least loaded" fallback."""

    queue: bool = False
    max_queued_per_tenant: Annotated[int, Meta(ge=1, le=100_000)] = 64
    max_queued: Annotated[int, Meta(ge=1, le=1_000_000)] = 4096  # all tenants, per process
    max_wait: Seconds = 30.0  # queued longer: 429
    # Deficit round robin weights per tenant key (absent: 1).
    weights: dict[TenantKey, Annotated[float, Meta(ge=0.01, le=1000.0)]] = msgspec.field(
        default_factory=dict
    )
    # Places (one below a backend's ConcurrencyThreshold) that a tenant not under its share
    # of the requests may not take while another tenant is under its share (0: none held).
    reserve: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    share_window: Seconds = (
        10.0  # the requests a share is counted over; a tenant is active this long
    )


class DiscoverConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Membership from a discovery source (router.discovery) instead of the admin API."""

    source: str  # "k8s" or "dns:NAME:PORT"
    namespace: str | None = None  # k8s: default the pod's (in-cluster) or the context's
    service: str | None = None  # k8s: EndpointSlices labelled kubernetes.io/service-name=<it>
    selector: str | None = None  # k8s: or this label selector
    port_name: str | None = None  # k8s: the EndpointSlice port; unset: the only TCP port
    kubeconfig: str | None = None  # k8s: unset: the in-cluster service account
    interval: PeriodSeconds = 5.0  # dns: between two lookups
    drain_timeout: Seconds = 30.0  # a removed endpoint's drain (as DELETE ?timeout=)
    unhealthy_after: Seconds = 10.0  # source failing this long: /readyz 503 (routing goes on)
    # The models every discovered backend serves (BackendSpec.models); empty: any.
    models: Annotated[tuple[ModelName, ...], Meta(max_length=MAX_MODELS)] = ()
    # k8s: the EndpointSlice label whose value is its endpoints' model (a Service's
    # labels are copied to its slices); a slice without it serves ``models``.
    model_label: str | None = None
    # How the discovered backends are spoken to; https: over TLS ([backend_tls]),
    # each certificate checked for server_name (unset: the endpoint's address).
    scheme: Literal["http", "https"] = "http"
    server_name: str | None = None

    def __post_init__(self) -> None:
        if self.server_name is not None:
            if self.scheme != "https":
                raise ValueError('discover server_name needs scheme = "https"')
            check_server_name(self.server_name, "discover")
        if self.source == "k8s":
            if (self.service is None) == (self.selector is None):
                raise ValueError("discover k8s needs exactly one of service and selector")
        elif self.source.startswith("dns:"):
            k8s = [
                field
                for field in (
                    "namespace",
                    "service",
                    "selector",
                    "port_name",
                    "kubeconfig",
                    "model_label",
                )
                if getattr(self, field) is not None
            ]
            if k8s:
                raise ValueError(f"discover {self.source!r} takes no k8s field: {', '.join(k8s)}")
            name, sep, port = self.source[4:].rpartition(":")
            if not sep or not name or not port.isdigit() or not 1 <= int(port) <= 65_535:
                raise ValueError(
                    f"discover {self.source!r} must look like dns:NAME:PORT (port 1-65535)"
                )
        else:
            raise ValueError(f"discover {self.source!r} must be k8s or dns:NAME:PORT")


class OtelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """OpenTelemetry tracing (router.tracing); off while ``endpoint`` is unset."""

    # OTLP/HTTP base URL of a collector: spans are POSTed to ENDPOINT/v1/traces.
    endpoint: str | None = None
    service_name: Annotated[str, Meta(min_length=1, max_length=255)] = "prefix-router"
    # Share of new traces sampled; a client's traceparent decides for its own trace.
    sample: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0
    export_interval: PeriodSeconds = 1.0  # a batch is sent at least this often
    max_queue: Annotated[int, Meta(ge=1, le=1_000_000)] = 8192  # spans waiting; more are dropped

    def __post_init__(self) -> None:
        if self.endpoint is not None:
            parts = urlsplit(self.endpoint)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(
                    f"otel endpoint {self.endpoint!r} must be an http:// or https:// URL"
                )
            if parts.query or parts.fragment:
                raise ValueError(f"otel endpoint {self.endpoint!r} must not have a query")


class CacheSaltConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Engine-side cache isolation (router.cachesalt): off unless ``enabled``."""

    enabled: bool = False
    # The HMAC key's file (its bytes, a trailing newline stripped); unset: the
    # environment variable PREFIX_ROUTER_CACHE_SALT_SECRET.  Every worker and
    # replica must have the same secret, so one tenant gets one salt everywhere.
    secret_file: str | None = None
    # A body's own cache_salt is kept rather than replaced.
    keep_client: bool = False


class EngineSignalsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Engine queues and KV-cache use as tie-breaks (router.signals): off unless ``enabled``.

    On, the backends' /metrics are scraped every ``health.scrape_interval`` even
    without ``health.scrape_metrics``."""

    enabled: bool = False


class AdvisorConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Key digests in the access log for ``prefix-router advise`` (router.keydigests)."""

    key_digests: bool = False
    # The lengths digested besides the current PrefixLength: the advisor's
    # candidates (those from 1,024 to 65,536); shorter ones refine its cache model.
    lengths: Annotated[
        tuple[Annotated[int, Meta(ge=256, le=65_536)], ...], Meta(min_length=1, max_length=32)
    ] = (1024, 2048, 4096, 8192, 16384, 32768, 65536)

    def __post_init__(self) -> None:
        if len(set(self.lengths)) != len(self.lengths):
            raise ValueError(f"advisor lengths lists a length twice: {list(self.lengths)}")


class BackendTLS(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How the router speaks TLS to ``https://`` backends (requests, health checks,
    metric scrapes); ``http://`` backends are not affected."""

    ca_file: str | None = (
        None  # PEM bundle the backends' certificates chain to; unset: the system's
    )
    verify: bool = True  # false: any certificate, any name (a warning at start-up)
    cert_file: str | None = None  # the router's client certificate (mutual TLS), PEM
    key_file: str | None = None  # its private key, PEM

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("backend_tls: cert_file and key_file go together")


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    listen: str = "127.0.0.1:8080"
    backends: list[BackendSpec] = msgspec.field(default_factory=list)
    routing: RoutingConfig = msgspec.field(default_factory=RoutingConfig, name="RoutingConfig")
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    limits: Limits = msgspec.field(default_factory=Limits)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    admin_listen: str = "127.0.0.1:9091"  # "off" disables the admin API
    state_file: str | None = None
    # A Unix socket: a new process started with the same path takes this one's
    # listening sockets and membership from it, and this one drains (router.handover).
    handover_socket: str | None = None
    tls_cert: str | None = None  # PEM certificate chain for the client listener
    tls_key: str | None = None  # its private key (PEM)
    # Every client connection opens with a PROXY protocol header (v1 or v2) naming
    # the client, sent by the L4 proxy in front (router.proxyproto).
    proxy_protocol: bool = False
    backend_tls: BackendTLS = msgspec.field(default_factory=BackendTLS)  # https:// backends
    # Other backends tried when one cannot be reached.
    retries: Annotated[int, Meta(ge=0, le=10)] = 2
    vnodes: Annotated[int, Meta(ge=1, le=65_536)] = 1024
    access_log: str = "-"  # a path, "-" for stdout, "off"
    # X-Prefix-Router-Decision on proxied responses: the access log's decision and
    # key digest; the backend's name too only with decision_header_backend.
    decision_header: bool = False
    decision_header_backend: bool = False
    # Seeds the RANDOM strategy's draws (and least-outstanding tie breaks), so a
    # benchmark can replay the same picks; unset: seeded from the OS.
    seed: int | None = None
    # Data-plane processes on one port (SO_REUSEPORT) under a supervisor that owns
    # the admin API, health checks and the state file; 1: one process does all.
    workers: Annotated[int, Meta(ge=1, le=64)] = 1
    # Several replicas: membership and the routing config in etcd under this
    # prefix, in-flight counts shared through it (router.replicas).
    etcd: list[str] = msgspec.field(default_factory=list)  # client URLs
    etcd_prefix: str = "/prefix-router/"
    # How long an admin write waits for this replica's watch to bring the change
    # back (seconds).  The watch takes milliseconds; one that is re-connecting
    # waits out its backoff (at most 2 s) first.  Past this it is stuck: a 503
    # saying the change was made, not a request that never ends.  The default is
    # as long as the seed's wait at start (admin.daemon.SEED_WAIT_S).
    etcd_apply_wait: Annotated[float, Meta(gt=0, le=3600)] = 10.0
    replica_id: str | None = None  # this replica's name in etcd; random when unset
    # UDP rows: the others' in-flight counts a millisecond after they change, sent
    # to this address (router.udprows); unset: through etcd only, every 0.1 s.
    replica_listen: str | None = None
    # Membership from Kubernetes EndpointSlices or DNS (router.discovery).
    discover: DiscoverConfig | None = None
    otel: OtelConfig = msgspec.field(default_factory=OtelConfig)  # tracing, off by default
    cache_salt: CacheSaltConfig = msgspec.field(default_factory=CacheSaltConfig)  # off by default
    tenants: TenantsConfig = msgspec.field(default_factory=TenantsConfig)
    admission: AdmissionConfig = msgspec.field(default_factory=AdmissionConfig)
    engine_signals: EngineSignalsConfig = msgspec.field(default_factory=EngineSignalsConfig)
    advisor: AdvisorConfig = msgspec.field(default_factory=AdvisorConfig)  # key digests, off

    def __post_init__(self) -> None:
        parse_address(self.listen, "listen")
        if self.admin_listen != "off":
            parse_address(self.admin_listen, "admin_listen")
        if self.handover_socket is not None and self.replica_listen is not None:
            raise ValueError(
                "handover_socket with replica_listen: the UDP rows' port is not handed"
                " over yet; restart such a replica as a new one (the others keep serving)"
            )
        if self.replica_listen is not None:
            host, _ = parse_address(self.replica_listen, "replica_listen")
            if not self.etcd:
                raise ValueError("replica_listen needs etcd: the replicas find each other there")
            if self.replica_id is not None and len(self.replica_id.encode()) > 255:
                raise ValueError("replica_id: at most 255 bytes with replica_listen")
            try:
                wildcard = ipaddress.ip_address(host).is_unspecified
            except ValueError:
                raise ValueError(
                    f"replica_listen {self.replica_listen!r}: HOST must be an IP address"
                ) from None
            if wildcard:
                raise ValueError(
                    f"replica_listen {self.replica_listen!r}: give the address the other"
                    " replicas send to, not a wildcard"
                )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.proxy_protocol and self.tls_cert is not None:
            raise ValueError(
                "proxy_protocol with tls_cert is not supported: terminate TLS at the proxy"
                " (its header comes before the TLS handshake)"
            )
        names = Counter(b.name for b in self.backends)  # (list.count: 5 s at 8,192)
        duplicates = sorted(name for name, count in names.items() if count > 1)
        if duplicates:
            raise ValueError(f"duplicate backend names: {', '.join(duplicates)}")

    @property
    def listen_address(self) -> tuple[str, int]:
        return parse_address(self.listen, "listen")
