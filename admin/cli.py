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
(``router.discovery``): start-up waits up to ``admin.daemon.DISCOVER_WAIT`` s
for its first answer, and the admin API answers 409 to membership writes.
``--discover`` with ``--etcd`` or with configured backends is refused (exit 2).

This module parses; ``admin.daemon`` is the composition root that wires the
data plane to the control plane and runs it.  Heavy imports are lazy:
``--help`` and ``demo`` do not load the data plane.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from router import backendtls
from router.accesslog import open_target
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
from router.state import StateError, StateFile

from . import ab_cli, explain_cli

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
    serve.add_argument(
        "--handover-socket",
        metavar="PATH",
        help="restart without refusing a connection: a new process given the same PATH"
        " takes the listeners and membership from the running one, which drains",
    )
    serve.add_argument("--tls-cert", metavar="PEM", help="serve clients over TLS with this chain")
    serve.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    serve.add_argument(
        "--proxy-protocol",
        action="store_true",
        default=None,
        help="every client connection opens with a PROXY protocol header (v1 or v2)",
    )
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
        "--etcd-apply-wait",
        metavar="S",
        type=float,
        help="an admin write waits this long for the watch to apply it, then 503 (10)",
    )
    serve.add_argument(
        "--replica-listen",
        metavar="HOST:PORT",
        help="with --etcd: take the other replicas' in-flight counts by UDP here, a"
        " millisecond after they change (HOST: the address they send to)",
    )
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
    serve.add_argument(
        "--discover-scheme",
        choices=("http", "https"),
        help="how discovered backends are spoken to (http; https: [backend_tls])",
    )
    serve.add_argument(
        "--discover-server-name",
        metavar="NAME",
        help="with https: the name each discovered backend's certificate must hold",
    )
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
    ("discover_scheme", "scheme"),
    ("discover_server_name", "server_name"),
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
    if args.etcd_apply_wait is not None:
        data["etcd_apply_wait"] = args.etcd_apply_wait
    if args.replica_listen is not None:
        data["replica_listen"] = args.replica_listen
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
    if args.handover_socket is not None:
        data["handover_socket"] = args.handover_socket
    if args.tls_cert is not None:
        data["tls_cert"] = args.tls_cert
    if args.tls_key is not None:
        data["tls_key"] = args.tls_key
    if args.proxy_protocol is not None:
        data["proxy_protocol"] = True
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
    """``prefix-router check-config FILE``: what ``serve --config FILE`` would refuse,
    the state file it names included (it wins for backends, as in ``serve``)."""
    from router.supervisor import refuse_past_slots

    from .daemon import with_state

    try:
        config = build_config(load_toml(path))
        parse_address(config.listen, "listen")
        if config.admin_listen != "off":
            parse_address(config.admin_listen, "admin_listen")
        tls_context(config)
        if backendtls.files(config.backend_tls):
            backendtls.context(config.backend_tls)
        Salter.from_config(config.cache_salt)
        state = StateFile(config.state_file).load() if config.state_file else None
        replicated = bool(config.etcd) and config.discover is None  # etcd's, not the file's
        backends = (config if replicated else with_state(config, state)).backends
        if config.workers > 1 or config.etcd:  # serve's supervisor: a column a backend
            refuse_past_slots(len(backends))
    except ConfigError as exc:
        print(f"{path}: invalid configuration: {exc}", file=sys.stderr)
        return 2
    except StateError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 2
    source = " (the state file's)" if state is not None and not replicated else ""
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
        f"{path}: ok: {len(backends)} backends{source}, {strategy},"
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
        if backendtls.files(config.backend_tls):  # now rather than in a worker
            backendtls.context(config.backend_tls)
        Salter.from_config(config.cache_salt)  # its secret, now rather than in a worker
        if config.access_log not in ("-", "off"):
            os.close(open_target(config.access_log))  # a path it cannot write: exit 2 now
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

    from .daemon import serve

    # Every client and upstream connection is a file descriptor: take all we may.
    before, after = raise_nofile()
    get_logger("router").info("file descriptor limit", nofile=after, raised_from=before)
    try:
        file = os.path.abspath(args.config) if args.config else None
        uvloop.run(
            serve(config, token, state_file, state, tls, lambda: config_from_args(args), file)
        )
    except ConfigError as exc:  # found once listening: the router has shut down again
        print(f"prefix-router: invalid configuration: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
