"""``prefix-router``: the command line.

    prefix-router serve --listen 127.0.0.1:8080 --backend a=http://10.0.0.1:8000 ...
    prefix-router demo [--serve]

``serve`` lays its flags over the TOML file given with ``--config`` and
validates the result once; a bad value exits with status 2 and a message that
names the field, as does a backend that is the router's own listener.  A
state file, when it exists, then wins for backends and routing.  The soft
``RLIMIT_NOFILE`` is raised to the hard limit (logged).  SIGTERM and SIGINT
drain in-flight requests (up to ``timeouts.shutdown_grace``) and exit 0.

This module is the composition root of the whole daemon: it wires the data
plane (``router``) to the control plane (the admin API of this package), so
it lives in the outermost layer and the dependency direction hashring <-
router <- admin holds without exception (``tests/test_layers.py``).  Heavy
imports are lazy: ``--help`` and ``demo`` do not load the data plane.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

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

if TYPE_CHECKING:
    from router.app import Router
    from router.control.etcd import EtcdStore
    from router.control.live import RouterControl
    from router.control.replicated import ReplicatedControl
    from router.replicas import Replicas
    from router.supervisor import Workers

__all__ = ["main"]

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
        metavar="NAME=URL[,weight=W]",
        help="a backend; repeat for each (replaces the config file's list)",
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
    serve.add_argument("--retries", type=int, metavar="N", help="other backends tried (2)")
    serve.add_argument(
        "--seed", type=int, metavar="N", help="seed RANDOM's draws (reproducible benchmarks)"
    )
    serve.add_argument("--access-log", metavar="PATH", help='a path, "-" (stdout) or "off"')
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
        "--scrape-metrics", action="store_true", help="read backends' vLLM metrics for stats"
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


# Shortcut flags (argparse dests) for PrefixAwareRoutingConfig fields.
PREFIX_AWARE_FLAGS = (
    ("prefix_length", "PrefixLength"),
    ("concurrency_threshold", "ConcurrencyThreshold"),
    ("balance_factor", "BalanceFactor"),
    ("balance_mode", "BalanceMode"),
    ("concurrency_scope", "ConcurrencyScope"),
)


def prefix_aware_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The PrefixAwareRoutingConfig fields the shortcut flags set (the rest absent)."""
    values = ((field, getattr(args, flag)) for flag, field in PREFIX_AWARE_FLAGS)
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
    if args.workers is not None:
        data["workers"] = args.workers
    if args.etcd is not None:
        data["etcd"] = [url.strip() for url in args.etcd.split(",") if url.strip()]
    if args.etcd_prefix is not None:
        data["etcd_prefix"] = args.etcd_prefix
    if args.replica_id is not None:
        data["replica_id"] = args.replica_id
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
    health = dict(data.get("health", {}))
    if args.health_path is not None:
        health["path"] = args.health_path
    if args.health_interval is not None:
        health["interval"] = args.health_interval
    if args.no_health_checks:
        health["active"] = False
    if args.scrape_metrics:
        health["scrape_metrics"] = True
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
        routing = {
            "RoutingStrategy": parse_routing(text).strategy.value,
            "PrefixAwareRoutingConfig": parse_routing(text).document()["RoutingConfig"][
                "PrefixAwareRoutingConfig"
            ],
        }
    routing = dict(routing)
    if args.strategy is not None:
        routing["RoutingStrategy"] = STRATEGY_ALIASES.get(args.strategy.lower(), args.strategy)
    inner = {**routing.get("PrefixAwareRoutingConfig", {}), **prefix_aware_flags(args)}
    if inner:
        routing["PrefixAwareRoutingConfig"] = inner
    if routing:
        data["RoutingConfig"] = routing
    return build_config(data)


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
) -> None:
    from admin import AdminServer
    from router.app import Router
    from router.control.live import RouterControl
    from router.control.replicated import ReplicatedControl
    from router.fleet import AdminState
    from router.log import get_logger

    replicated = bool(config.etcd)
    # With etcd, the state file is the store's copy of etcd's state: etcd wins.
    router = Router(config if replicated else with_state(config, state), tls=tls)
    saved_backends = state.backends if state and not replicated else []
    draining = [saved.name for saved in saved_backends if saved.state == "draining"]
    router.fleet.set_states(draining, AdminState.DRAINING)  # one refresh, not one per backend
    workers = None
    store = replicas = None
    if config.workers > 1 or replicated:
        from router.supervisor import Workers, reserve

        host, port = config.listen_address
        held = reserve(host, port)
        workers = Workers(router, config.workers, held, remote=replicated)
        await router.start_control(held)
    control: RouterControl
    if replicated:
        assert workers is not None
        control = ReplicatedControl(router, workers)
    else:
        control = RouterControl(router, state_file, workers=workers)
    admin = None
    try:
        if isinstance(control, ReplicatedControl):
            assert workers is not None
            store, replicas = await _open_etcd(config, router, workers, control, state_file)
        if workers is None:
            await router.start()
        else:
            _warn_if_per_process(config)
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
        if config.admin_listen != "off":
            admin = AdminServer(control, token=token)
            host, port = parse_address(config.admin_listen, "admin_listen")
            await admin.start(host, port)
            control.admin_listeners = admin.listeners
            get_logger("admin").info("admin listening", address=f"{host}:{admin.port}")
        if not replicated:
            await _refuse_own_addresses(control, router, state_file if state else None)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        # A second signal while we drain must not kill us half-way (nor after the
        # loop is gone and its handlers with it): from here on, signals are ignored.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
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
            await store.client.close()


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
    from router.replicas import Replicas
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
            backends=[
                SavedBackend(b.name, b.url, b.weight, "active", b.health) for b in config.backends
            ],
            routing=config.routing,
        )
        if await store.initialize(seed):
            get_logger("etcd").info("seeded a new fleet in etcd", prefix=config.etcd_prefix)
    await control.on_resync(store.state())
    replicas = Replicas(
        client,
        store.prefix,
        workers.table,
        lambda: workers.slots,
        lambda: store.revision,
        replica_id=config.replica_id,
    )
    control.replicas = replicas
    return store, replicas


def _warn_if_per_process(config: Config) -> None:
    """Say so when the routing config keeps state each worker keeps on its own."""
    from router.log import get_logger

    prefix = config.routing.prefix_aware
    if config.routing.strategy.value == "PREFIX_AWARE" and prefix.balance_mode == "TRAFFIC":
        get_logger("router").warning(
            "BalanceMode TRAFFIC places keys per worker: workers may give one key"
            " different homes (in-flight counts are shared; placements are not yet)",
            workers=config.workers,
        )


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefix-router", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    demo = sub.add_parser("demo", help="run a simulated fleet behind the router and compare")
    demo.add_argument("--serve", action="store_true", help="keep the fleet and router up")
    sub.add_parser(
        "bench",
        add_help=False,
        help="routing-quality benchmark (python -m loadtests.bench --help for its options)",
    )
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")

    from router.log import configure

    configure()
    if args.command in ("demo", "bench"):
        extra = ["--serve"] if args.command == "demo" and args.serve else []
        return _run_loadtests(args.command, [*extra, *rest])
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
        uvloop.run(_serve(config, token, state_file, state, tls))
    except ConfigError as exc:  # found once listening: the router has shut down again
        print(f"prefix-router: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
