"""``prefix-router``: the command line.

    prefix-router serve --listen 127.0.0.1:8080 --backend a=http://10.0.0.1:8000 ...
    prefix-router demo [--serve]
    prefix-router advise access.log ...   (loadtests/advise.py: which PrefixLength fits)
    prefix-router explain /v1/chat/completions body.json   (admin/explain_cli.py)
    prefix-router ab-report [--admin URL ...]              (admin/ab_cli.py)

``serve`` lays its flags over the TOML file given with ``--config`` and
validates the result once; a bad value exits with status 2 and a message that
names the field, as does a backend that is the router's own listener.  A
state file, when it exists, then wins for backends and routing.  The soft
``RLIMIT_NOFILE`` is raised to the hard limit (logged).  SIGTERM and SIGINT
drain in-flight requests (up to ``timeouts.shutdown_grace``) and exit 0.
With ``--discover k8s|dns:NAME:PORT`` membership comes from the source
(``router.discovery``): start-up waits up to ``DISCOVER_WAIT`` s for its first
answer, and the admin API answers 409 to membership writes.  ``--discover``
with ``--etcd`` or with configured backends is refused (exit 2).

This module is the composition root of the whole daemon: it wires the data
plane (``router``) to the control plane (the admin API of this package), so
it lives in the outermost layer and the dependency direction hashring <-
router <- admin holds without exception (``tests/test_layers.py``).  Heavy
imports are lazy: ``--help`` and ``demo`` do not load the data plane.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import signal
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from router.cachesalt import Salter
from router.config import (
    Config,
    ConfigError,
    backend_flag,
    build_config,
    load_toml,
    parse_address,
    parse_routing,
    tls_context,
)
from router.state import State, StateError, StateFile

from . import ab_cli, explain_cli

if TYPE_CHECKING:
    from collections.abc import Callable

    from router.app import Router
    from router.config import DiscoverConfig
    from router.control import Control
    from router.control.etcd import EtcdStore
    from router.control.live import RouterControl
    from router.control.replicated import ReplicatedControl
    from router.discovery import Reconciler, Source
    from router.etcd import EtcdClient
    from router.replicas import Replicas
    from router.supervisor import Workers

__all__ = ["main"]

# A seeding replica waits this long for its seed to come back through the watch (etcd
# answered the write a moment ago: milliseconds, unless it died since).
SEED_WAIT_S = 10.0

STRATEGY_ALIASES = {
    "random": "RANDOM",
    "least": "LEAST_OUTSTANDING_REQUESTS",
    "least_outstanding_requests": "LEAST_OUTSTANDING_REQUESTS",
    "prefix": "PREFIX_AWARE",
    "prefix_aware": "PREFIX_AWARE",
}


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser("serve", help="run the router daemon")
    serve.add_argument("--config", metavar="FILE", help="TOML file with the settings below")
    serve.add_argument("--listen", metavar="HOST:PORT", help="client listener (127.0.0.1:8080)")
    serve.add_argument(
        "--backend",
        action="append",
        metavar="NAME=URL[,weight=W][,model=M ...]",
        help="a backend and the models it serves (model= repeats; none: any); repeat"
        " for each (replaces the config file's list)",
    )
    serve.add_argument(
        "--routing-config",
        metavar="FILE|JSON",
        help='SageMaker-shaped {"RoutingConfig": {...}}, as a file or inline JSON',
    )
    serve.add_argument("--strategy", help="RANDOM, LEAST_OUTSTANDING_REQUESTS or PREFIX_AWARE")
    serve.add_argument("--prefix-length", type=int, metavar="N", help="1024-65536")
    serve.add_argument("--concurrency-threshold", type=int, metavar="N", help="1-1024")
    serve.add_argument("--balance-factor", type=float, metavar="C", help=">= 1.0; off if unset")
    serve.add_argument(
        "--balance-mode",
        choices=("IN_FLIGHT", "TRAFFIC"),
        help="what BalanceFactor bounds: requests in flight, or new keys' placement by"
        " recent traffic share (sticky)",
    )
    serve.add_argument(
        "--concurrency-scope",
        choices=("IN_FLIGHT", "PREFILL"),
        help="what ConcurrencyThreshold counts: requests in flight, or only those not answered yet",
    )
    serve.add_argument(
        "--session-keys",
        type=_comma_list,
        metavar="S,S,...",
        help="affinity key sources in precedence order, prefix last (default"
        " prompt_cache_key,header,conversation,prefix)",
    )
    serve.add_argument("--session-header", metavar="NAME", help="the session header (X-Session-Id)")
    serve.add_argument(
        "--cache-salt",
        action="store_true",
        default=None,
        help="set each OpenAI body's cache_salt to its tenant's HMAC (engine cache isolation)",
    )
    serve.add_argument(
        "--cache-salt-secret-file",
        metavar="FILE",
        help="the HMAC secret (else $PREFIX_ROUTER_CACHE_SALT_SECRET)",
    )
    serve.add_argument(
        "--cache-salt-keep-client",
        action="store_true",
        default=None,
        help="keep a body's own cache_salt instead of replacing it",
    )
    serve.add_argument("--retries", type=int, metavar="N", help="other backends tried (2)")
    serve.add_argument(
        "--seed", type=int, metavar="N", help="seed RANDOM's draws (reproducible benchmarks)"
    )
    serve.add_argument("--access-log", metavar="PATH", help='a path, "-" (stdout) or "off"')
    serve.add_argument(
        "--decision-header",
        action="store_true",
        default=None,
        help="X-Prefix-Router-Decision on proxied responses: decision and key digest",
    )
    serve.add_argument(
        "--decision-header-backend",
        action="store_true",
        default=None,
        help="... and the backend's name in it (implies --decision-header)",
    )
    serve.add_argument(
        "--key-digests",
        action="store_true",
        default=None,
        help="key digests at several PrefixLengths in each access line (prefix-router advise)",
    )
    serve.add_argument(
        "--key-digest-lengths",
        type=_int_list,
        metavar="N,N,...",
        help="the lengths digested besides PrefixLength (1024,2048,...,65536)",
    )
    serve.add_argument(
        "--admin-listen", metavar="HOST:PORT", help='admin API listener (127.0.0.1:9091) or "off"'
    )
    serve.add_argument(
        "--admin-token-file",
        metavar="FILE",
        help="bearer token for the admin API (else $PREFIX_ROUTER_ADMIN_TOKEN);"
        " required off loopback",
    )
    serve.add_argument(
        "--state-file", metavar="FILE", help="persist admin changes here; wins at start-up"
    )
    serve.add_argument("--tls-cert", metavar="PEM", help="serve clients over TLS with this chain")
    serve.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    serve.add_argument("--health-path", metavar="PATH", help="active health check path (/health)")
    serve.add_argument("--health-interval", type=float, metavar="S", help="between checks (5)")
    serve.add_argument(
        "--no-health-checks", action="store_true", help="no active checks (passive ones stay)"
    )
    serve.add_argument(
        "--scrape-metrics",
        action="store_true",
        help="read backends' vLLM or SGLang metrics for stats and the prefix-cache check",
    )
    serve.add_argument(
        "--scrape-interval", type=float, metavar="S", help="between two scrape rounds (10)"
    )
    serve.add_argument(
        "--engine-signals",
        action="store_true",
        default=None,
        help="break routing ties by the engines' queue and KV-cache use (scrapes their"
        " /metrics every --scrape-interval)",
    )
    serve.add_argument(
        "--slow-start",
        metavar="DURATION",
        help="ramp an added or recovered backend's ring share over this (60s, 2m; off)",
    )
    serve.add_argument(
        "--etcd",
        metavar="URL[,URL]",
        help="share membership, routing config and in-flight counts with other replicas"
        " through etcd",
    )
    serve.add_argument("--etcd-prefix", metavar="P", help="the keys under P (/prefix-router/)")
    serve.add_argument("--replica-id", metavar="ID", help="this replica's key (random)")
    serve.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="data-plane processes on the one port (1: a single process does all)",
    )
    serve.add_argument(
        "--discover",
        metavar="k8s|dns:NAME:PORT",
        help="membership from Kubernetes EndpointSlices or a DNS name (not the admin API)",
    )
    serve.add_argument("--k8s-namespace", metavar="NS", help="the Service's namespace")
    serve.add_argument("--k8s-service", metavar="NAME", help="watch this Service's EndpointSlices")
    serve.add_argument(
        "--k8s-selector", metavar="LABELS", help="or EndpointSlices with these labels"
    )
    serve.add_argument("--k8s-port-name", metavar="NAME", help="the EndpointSlice port to use")
    serve.add_argument("--kubeconfig", metavar="FILE", help="else the in-cluster service account")
    serve.add_argument(
        "--discover-interval", type=float, metavar="S", help="between two DNS lookups (5)"
    )
    serve.add_argument(
        "--discover-model",
        action="append",
        metavar="MODEL",
        help="a model every discovered backend serves; repeat for each (none: any model)",
    )
    serve.add_argument(
        "--k8s-model-label",
        metavar="KEY",
        help="the EndpointSlice label whose value is its backends' model",
    )
    serve.add_argument(
        "--otel-endpoint",
        metavar="URL",
        help="trace requests: OTLP/HTTP protobuf spans POSTed to URL/v1/traces (off)",
    )
    serve.add_argument(
        "--otel-service-name", metavar="NAME", help="service.name of the spans (prefix-router)"
    )
    serve.add_argument(
        "--otel-sample",
        type=float,
        metavar="R",
        help="share of new traces sampled, 0-1 (1.0); a client's traceparent decides its own",
    )
    serve.add_argument(
        "--queue",
        action="store_true",
        default=None,
        help="queue requests fairly per tenant when every backend is at its bound (off)",
    )
    serve.add_argument(
        "--tenant-header", metavar="NAME", help="the header that names a request's tenant"
    )


# Shortcut flags (argparse dests) for PrefixAwareRoutingConfig fields.
PREFIX_AWARE_FLAGS = (
    ("prefix_length", "PrefixLength"),
    ("concurrency_threshold", "ConcurrencyThreshold"),
    ("balance_factor", "BalanceFactor"),
    ("balance_mode", "BalanceMode"),
    ("concurrency_scope", "ConcurrencyScope"),
    ("session_keys", "SessionKeys"),
    ("session_header", "SessionHeader"),
)


def _comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in _comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers N,N,...") from None


# Discovery flags (argparse dests) for DiscoverConfig fields.
DISCOVER_FLAGS = (
    ("discover", "source"),
    ("k8s_namespace", "namespace"),
    ("k8s_service", "service"),
    ("k8s_selector", "selector"),
    ("k8s_port_name", "port_name"),
    ("kubeconfig", "kubeconfig"),
    ("discover_interval", "interval"),
    ("discover_model", "models"),
    ("k8s_model_label", "model_label"),
)


def prefix_aware_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The PrefixAwareRoutingConfig fields the shortcut flags set (the rest absent);
    a parser without some of the flags (``loadtests.offline``'s) sets none of those."""
    values = ((field, getattr(args, flag, None)) for flag, field in PREFIX_AWARE_FLAGS)
    return {field: value for field, value in values if value is not None}


def config_from_args(args: argparse.Namespace) -> Config:
    """The file, then the flags over it, validated once."""
    data: dict[str, Any] = load_toml(args.config) if args.config else {}
    if args.listen is not None:
        data["listen"] = args.listen
    if args.backend:
        data["backends"] = [backend_flag(text) for text in args.backend]
    if args.retries is not None:
        data["retries"] = args.retries
    if args.access_log is not None:
        data["access_log"] = args.access_log
    if args.seed is not None:
        data["seed"] = args.seed
    if args.decision_header or args.decision_header_backend:
        data["decision_header"] = True
    if args.decision_header_backend:
        data["decision_header_backend"] = True
    if args.workers is not None:
        data["workers"] = args.workers
    if args.etcd is not None:
        data["etcd"] = [url.strip() for url in args.etcd.split(",") if url.strip()]
    if args.etcd_prefix is not None:
        data["etcd_prefix"] = args.etcd_prefix
    if args.replica_id is not None:
        data["replica_id"] = args.replica_id
    discover = dict(data.get("discover", {}))
    for flag, field in DISCOVER_FLAGS:
        if getattr(args, flag) is not None:
            discover[field] = getattr(args, flag)
    if discover:
        data["discover"] = discover
    if args.admin_listen is not None:
        data["admin_listen"] = args.admin_listen
    if args.state_file is not None:
        data["state_file"] = args.state_file
    if args.tls_cert is not None:
        data["tls_cert"] = args.tls_cert
    if args.tls_key is not None:
        data["tls_key"] = args.tls_key
    otel = dict(data.get("otel", {}))
    for flag, field in (
        ("otel_endpoint", "endpoint"),
        ("otel_service_name", "service_name"),
        ("otel_sample", "sample"),
    ):
        if getattr(args, flag) is not None:
            otel[field] = getattr(args, flag)
    if otel:
        data["otel"] = otel
    cache_salt = dict(data.get("cache_salt", {}))
    for flag, field in (
        ("cache_salt", "enabled"),
        ("cache_salt_secret_file", "secret_file"),
        ("cache_salt_keep_client", "keep_client"),
    ):
        if getattr(args, flag) is not None:
            cache_salt[field] = getattr(args, flag)
    if cache_salt:
        data["cache_salt"] = cache_salt
    if args.queue:
        data["admission"] = {**data.get("admission", {}), "queue": True}
    advisor = dict(data.get("advisor", {}))
    if args.key_digests:
        advisor["key_digests"] = True
    if args.key_digest_lengths is not None:
        advisor["lengths"] = args.key_digest_lengths
    if advisor:
        data["advisor"] = advisor
    if args.tenant_header is not None:
        data["tenants"] = {**data.get("tenants", {}), "header": args.tenant_header}
    if args.engine_signals is not None:
        data["engine_signals"] = {**data.get("engine_signals", {}), "enabled": True}
    health = dict(data.get("health", {}))
    if args.health_path is not None:
        health["path"] = args.health_path
    if args.health_interval is not None:
        health["interval"] = args.health_interval
    if args.no_health_checks:
        health["active"] = False
    if args.scrape_metrics:
        health["scrape_metrics"] = True
    if args.scrape_interval is not None:
        health["scrape_interval"] = args.scrape_interval
    if args.slow_start is not None:
        health["slow_start"] = args.slow_start
    if health:
        data["health"] = health
    routing = data.get("RoutingConfig", {})
    if args.routing_config is not None:
        text = args.routing_config
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as exc:
                raise ConfigError(f"cannot read --routing-config {text}: {exc.strerror}") from None
        routing = parse_routing(text).document()["RoutingConfig"]  # an experiment's Arms too
    routing = dict(routing)
    if args.strategy is not None:
        routing["RoutingStrategy"] = STRATEGY_ALIASES.get(args.strategy.lower(), args.strategy)
    inner = {**routing.get("PrefixAwareRoutingConfig", {}), **prefix_aware_flags(args)}
    if inner:
        routing["PrefixAwareRoutingConfig"] = inner
    if routing:
        data["RoutingConfig"] = routing
    config = build_config(data)
    if config.discover is not None and config.backends:
        raise ConfigError(
            "backends come from discovery (--discover): leave --backend and the file's backends out"
        )
    return config


def with_state(config: Config, state: State | None) -> Config:
    """The state file's backends and routing over the configured ones."""
    if state is None:
        return config
    return msgspec.structs.replace(
        config, backends=[saved.spec() for saved in state.backends], routing=state.routing
    )


async def _serve(
    config: Config,
    token: str | None,
    state_file: StateFile | None,
    state: State | None,
    tls: ssl.SSLContext | None = None,
    reread: Callable[[], Config] | None = None,
) -> None:
    from admin import AdminServer
    from admin.reload import Reloads
    from router.app import Router
    from router.control.live import RouterControl
    from router.control.replicated import ReplicatedControl
    from router.discovery import DiscoveredControl
    from router.fleet import AdminState
    from router.log import get_logger

    # etcd: in-flight counts and TRAFFIC placements shared with the other replicas;
    # and membership and routing too, unless discovery gives every replica those.
    shared = bool(config.etcd)
    replicated = shared and config.discover is None
    # With etcd, the state file is the store's copy of etcd's state: etcd wins.
    router = Router(config if replicated else with_state(config, state), tls=tls)
    saved_backends = state.backends if state and not replicated else []
    draining = [saved.name for saved in saved_backends if saved.state == "draining"]
    router.fleet.set_states(draining, AdminState.DRAINING)  # one refresh, not one per backend
    workers = None
    store = replicas = None
    if config.workers > 1 or shared:
        from router.supervisor import Workers, reserve

        host, port = config.listen_address
        held = reserve(host, port)
        if shared and not config.replica_id:
            config = msgspec.structs.replace(config, replica_id=os.urandom(6).hex())
        workers = Workers(
            router, config.workers, held, remote=shared, stamp_base=_stamp_base(config)
        )
        await router.start_control(held)
    control: RouterControl
    if replicated:
        assert workers is not None
        control = ReplicatedControl(router, workers)
    else:
        control = RouterControl(router, state_file, workers=workers)
    admin = None
    admin_control: Control = control
    discovery: tuple[Reconciler, Source] | None = None
    try:
        if isinstance(control, ReplicatedControl):
            assert workers is not None
            store, replicas = await _open_etcd(config, router, workers, control, state_file)
        elif shared:
            from router.etcd import EtcdClient

            assert workers is not None
            replicas = _join_replicas(config, workers, EtcdClient(config.etcd), lambda: 0)
        if config.discover is not None:
            discovery = await _open_discovery(config.discover, router, control)
            admin_control = DiscoveredControl(control, discovery[0], discovery[1].description)
        if workers is None:
            await router.start()
        else:
            await workers.start()
            if replicas is not None:
                replicas.start()
            get_logger("router").info(
                "workers listening",
                address=f"{router.listeners[0].host}:{router.port}",
                workers=config.workers,
                pids=workers.pids,
                replica=replicas.id if replicas is not None else None,
            )
        # Before "admin listening", the line supervisors and tests wait for: a
        # SIGHUP sent once it is logged must find its handler (not kill us).
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        if reread is not None:
            owns = not (replicated or state_file or config.discover)  # the file: their source
            reloads = Reloads(reread, control, router, owns_membership=owns)
            loop.add_signal_handler(signal.SIGHUP, reloads.request)
        if config.admin_listen != "off":
            admin = AdminServer(admin_control, token=token)
            host, port = parse_address(config.admin_listen, "admin_listen")
            await admin.start(host, port)
            control.admin_listeners = admin.listeners
            get_logger("admin").info("admin listening", address=f"{host}:{admin.port}")
        if not replicated:
            await _refuse_own_addresses(control, router, state_file if state else None)
        await stop.wait()
    finally:
        # A second signal while we drain must not kill us half-way (nor after the
        # loop is gone and its handlers with it): from here on, signals are ignored.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if discovery is not None:
            reconciler, source = discovery
            await reconciler.close()  # no membership change while we drain
            await source.close()
        if replicas is not None:
            await replicas.close()  # our key goes: the others stop counting us
        if workers is not None:
            await workers.stop()
        await router.shutdown()
        if admin is not None:
            await admin.close()
        await control.close()
        if store is not None:
            await store.close()
        if replicas is not None:
            await replicas.client.close()


async def _open_etcd(
    config: Config,
    router: Router,
    workers: Workers,
    control: ReplicatedControl,
    state_file: StateFile | None,
) -> tuple[EtcdStore, Replicas]:
    """Join the replicas: load (or seed) the fleet from etcd, before any worker starts."""
    from router.control.etcd import EtcdStore
    from router.etcd import EtcdClient, Unavailable
    from router.log import get_logger
    from router.state import VERSION, SavedBackend

    client = EtcdClient(config.etcd)
    store = EtcdStore(
        client,
        config.etcd_prefix,
        control,
        default_routing=config.routing,
        cache=state_file,
    )
    control.store = store
    try:
        await store.open(wait=10.0)
    except Unavailable as exc:
        await client.close()
        raise ConfigError(f"etcd {','.join(config.etcd)}: {exc}") from None
    if not store.from_cache:
        # An empty prefix is a new fleet: this replica's configuration seeds it.
        seed = State(
            version=VERSION,
            backends=[SavedBackend.of(b) for b in config.backends],
            routing=config.routing,
        )
        revision = await store.initialize(seed)
        if revision is not None:
            get_logger("etcd").info("seeded a new fleet in etcd", prefix=config.etcd_prefix)
            # The seed reaches this replica through the watch, as every change does: once
            # it has, the fleet below is the whole seed, and the workers start with it.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(SEED_WAIT_S):
                    await store.applied(revision)
    await control.on_resync(store.state())
    replicas = _join_replicas(config, workers, client, lambda: store.revision)
    control.replicas = replicas
    return store, replicas


def _join_replicas(
    config: Config, workers: Workers, client: EtcdClient, applied: Callable[[], int]
) -> Replicas:
    """This replica's row in etcd, and the other replicas' rows and placements folded in
    (``applied``: the etcd revision of the membership this replica has applied)."""
    from router.replicas import Replicas

    prefix = config.etcd_prefix.encode()
    replicas = Replicas(
        client, prefix, workers.table, lambda: workers.slots, applied, replica_id=config.replica_id
    )
    workers.on_records = replicas.add_records
    replicas.on_records = workers.relay
    return replicas


def _stamp_base(config: Config) -> int:
    """This replica's TRAFFIC placement stamps: ``base + worker``, unique in the fleet."""
    if not config.replica_id:
        return 0  # one replica: its workers are numbered 0..N-1
    digest = hashlib.blake2b(config.replica_id.encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big") << 16


# How long start-up waits for the discovery source's first answer before it
# listens anyway (with the state file's membership, if any; /readyz says 503).
DISCOVER_WAIT = 10.0


async def _open_discovery(
    discover: DiscoverConfig, router: Router, control: RouterControl
) -> tuple[Reconciler, Source]:
    """Start the discovery source and wait (boundedly) for its first membership."""
    from router.discovery import Reconciler
    from router.log import get_logger

    source: Source
    if discover.source == "k8s":
        from router.discovery.k8s import K8sSource, from_kubeconfig, in_cluster

        auth = from_kubeconfig(discover.kubeconfig) if discover.kubeconfig else in_cluster()
        source = K8sSource(
            auth,
            discover.namespace or auth.namespace or "default",
            service=discover.service,
            selector=discover.selector,
            port_name=discover.port_name,
            models=discover.models,
            model_label=discover.model_label,
        )
    else:
        from router.discovery.dns import DnsSource, parse_target

        name, port = parse_target(discover.source)
        source = DnsSource(name, port, interval=discover.interval, models=discover.models)
    reconciler = Reconciler(
        control,
        drain_timeout=discover.drain_timeout,
        unhealthy_after=discover.unhealthy_after,
    )
    reconciler.start(source)
    log = get_logger("discovery")
    if await reconciler.wait_synced(DISCOVER_WAIT):
        log.info("discovered", source=source.description, backends=sorted(router.fleet.backends))
    else:
        log.warning(
            "no membership from the discovery source yet: listening with the last one",
            source=source.description,
            backends=sorted(router.fleet.backends),
            waited_s=DISCOVER_WAIT,
        )
    return reconciler, source


async def _refuse_own_addresses(
    control: RouterControl, router: Router, state_file: StateFile | None
) -> None:
    """ConfigError if a backend is one of the router's own listeners (a loop)."""
    from router.control import Invalid

    for backend in router.fleet.backends.values():
        try:
            await control.refuse_own_address(backend.spec)
        except Invalid as exc:
            where = f" (backends come from the state file {state_file.path})" if state_file else ""
            raise ConfigError(f"{exc}{where}") from None


def _run_loadtests(module: str, argv: list[str]) -> int:
    """Run ``python -m loadtests.MODULE`` from the repository (not installed with us)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "loadtests" / f"{module}.py").is_file():
        where = root / "loadtests"
        print(f"prefix-router {module}: {where} not found; run it from a clone", file=sys.stderr)
        return 2
    import subprocess

    child = subprocess.Popen([sys.executable, "-m", f"loadtests.{module}", *argv], cwd=root)
    # Not subprocess.run: on Ctrl-C it SIGKILLs the child, orphaning the child's children.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
    code = child.wait()
    return 128 - code if code < 0 else code  # killed by signal N: exit 128 + N


def _check_config(path: str) -> int:
    """``prefix-router check-config FILE``: what ``serve --config FILE`` would refuse."""
    try:
        config = build_config(load_toml(path))
        parse_address(config.listen, "listen")
        if config.admin_listen != "off":
            parse_address(config.admin_listen, "admin_listen")
        tls_context(config)
        Salter.from_config(config.cache_salt)
    except ConfigError as exc:
        print(f"{path}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    routing = config.routing
    strategy = routing.strategy.value
    if routing.arms:  # an A/B experiment: each arm's weight and strategy
        arms = ", ".join(
            f"{arm.name} {arm.weight:g} {arm_routing.strategy.value}"
            for arm, arm_routing in zip(routing.arms, routing.arm_configs(), strict=True)
        )
        strategy = f"experiment {routing.experiment} ({arms})"
        if routing.split == "BACKENDS":  # router.split
            strategy += ", each arm on backends of its own"
    print(
        f"{path}: ok: {len(config.backends)} backends, {strategy},"
        f" listen {config.listen}, admin {config.admin_listen}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefix-router", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    demo = sub.add_parser("demo", help="run a simulated fleet behind the router and compare")
    demo.add_argument("--serve", action="store_true", help="keep the fleet and router up")
    check = sub.add_parser(
        "check-config", help="validate a config file without starting (exit 2 on an error)"
    )
    check.add_argument("file", metavar="FILE", help="the TOML file serve --config would read")
    explain_cli.add_parser(sub)
    ab_cli.add_parser(sub)
    sub.add_parser(
        "bench",
        add_help=False,
        help="routing-quality benchmark (python -m loadtests.bench --help for its options)",
    )
    sub.add_parser(
        "advise",
        add_help=False,
        help="which PrefixLength fits your traffic, from access logs with key digests"
        " (prefix-router advise --help)",
    )
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("bench", "advise"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    from router.log import configure

    configure()
    if args.command in ("demo", "bench", "advise"):
        extra = ["--serve"] if args.command == "demo" and args.serve else []
        return _run_loadtests(args.command, [*extra, *rest])
    if args.command == "check-config":
        return _check_config(args.file)
    if args.command == "explain":
        return explain_cli.run(args)
    if args.command == "ab-report":
        return ab_cli.run(args)
    from admin import load_token, requires_token

    try:
        config = config_from_args(args)
        token = load_token(args.admin_token_file, os.environ)
        if config.admin_listen != "off":
            host, _ = parse_address(config.admin_listen, "admin_listen")
            if requires_token(host) and token is None:
                raise ConfigError(
                    f"the admin API on {config.admin_listen} is not on loopback: give it a"
                    " token (--admin-token-file or PREFIX_ROUTER_ADMIN_TOKEN)"
                )
        tls = tls_context(config)
        Salter.from_config(config.cache_salt)  # its secret, now rather than in a worker
        state_file = StateFile(config.state_file) if config.state_file else None
        if state_file is not None:
            state_file.check()  # a missing directory now, not a 500 at the first change
        state = state_file.load() if state_file else None
    except ConfigError as exc:
        print(f"prefix-router: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except StateError as exc:
        print(f"prefix-router: {exc}", file=sys.stderr)
        return 2
    import uvloop

    from router.admission import raise_nofile
    from router.log import get_logger

    # Every client and upstream connection is a file descriptor: take all we may.
    before, after = raise_nofile()
    get_logger("router").info("file descriptor limit", nofile=after, raised_from=before)
    try:
        uvloop.run(_serve(config, token, state_file, state, tls, lambda: config_from_args(args)))
    except ConfigError as exc:  # found once listening: the router has shut down again
        print(f"prefix-router: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
