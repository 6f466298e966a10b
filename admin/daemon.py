"""``prefix-router serve``: the daemon, once its configuration is settled.

``serve`` wires the data plane (``router``: one process, or a supervisor and
its workers) to the control plane (the admin API of this package), and, when
configured, to etcd (``router.control.etcd``, ``router.replicas``) and to a
discovery source (``router.discovery``), then runs until SIGTERM or SIGINT
and drains.  It is the composition root of the daemon, so it lives in the
outermost layer and the dependency direction hashring <- router <- admin
holds without exception (``tests/test_layers.py``).  ``admin.cli`` parses
the command line and calls it; heavy imports stay lazy there.

- A state file, when it exists, wins over the configuration for backends
  and routing (``with_state``); with etcd it is only etcd's copy.
- With ``--etcd``: the fleet is loaded (or seeded, waiting up to
  ``SEED_WAIT_S`` for the seed to come back through the watch) before any
  worker starts; a replica that cannot reach etcd starts from its state
  file's copy or refuses (``ConfigError``).
- With ``--discover``: start-up waits up to ``DISCOVER_WAIT`` s for the
  source's first membership, then listens anyway.
- A backend that is one of the router's own listeners is refused (a loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import os
import signal
import socket
import ssl
import time
from typing import TYPE_CHECKING

import msgspec

from router.config import Config, ConfigError, parse_address
from router.state import State, StateFile

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from admin import AdminServer
    from router.app import Router
    from router.config import DiscoverConfig
    from router.control import Control
    from router.control.configview import Membership
    from router.control.etcd import EtcdStore
    from router.control.live import RouterControl
    from router.control.replicated import ReplicatedControl
    from router.discovery import Reconciler, Source
    from router.etcd import EtcdClient
    from router.handover import Handover, Load, Taken
    from router.replicas import Replicas
    from router.supervisor import Workers

__all__ = ["DISCOVER_WAIT", "SEED_WAIT_S", "serve", "with_state"]

# A seeding replica waits this long for its seed to come back through the watch (etcd
# answered the write a moment ago: milliseconds, unless it died since).
SEED_WAIT_S = 10.0


def with_state(config: Config, state: State | None) -> Config:
    """The state file's backends and routing over the configured ones."""
    if state is None:
        return config
    return msgspec.structs.replace(
        config, backends=[saved.spec() for saved in state.backends], routing=state.routing
    )


async def serve(
    config: Config,
    token: str | None,
    state_file: StateFile | None,
    state: State | None,
    tls: ssl.SSLContext | None = None,
    reread: Callable[[], Config] | None = None,
    config_file: str | None = None,
) -> None:
    from admin import AdminServer
    from admin.reload import Reloads
    from router.app import Router
    from router.control.configview import ConfigSource
    from router.control.live import RouterControl
    from router.control.replicated import ReplicatedControl
    from router.discovery import DiscoveredControl
    from router.fleet import AdminState
    from router.handover import HandoverError
    from router.log import get_logger

    from .upgrade import Upgrade, notify

    # etcd: in-flight counts and TRAFFIC placements shared with the other replicas;
    # and membership and routing too, unless discovery gives every replica those.
    shared = bool(config.etcd)
    replicated = shared and config.discover is None
    # A router running with our handover socket hands its listeners over (router.handover).
    # The membership comes from where a restart takes it: with a state file, the state
    # as of the old process's freeze (the file's, and no change since: read here, the
    # file may predate a write the old process made before it froze); else the config.
    taken = await _take_over(config) if config.handover_socket is not None else None
    if taken is not None and taken.state is not None and state_file is not None:
        state = taken.state
    if shared and not config.replica_id:
        # Before the Router: its config is the one GET /admin/config shows.
        config = msgspec.structs.replace(config, replica_id=os.urandom(6).hex())
    # With etcd, the state file is the store's copy of etcd's state: etcd wins.
    router = Router(config if replicated else with_state(config, state), tls=tls)
    if taken is not None:
        router.responses.apply(taken.responses)
    saved_backends = state.backends if state and not replicated else []
    draining = [saved.name for saved in saved_backends if saved.state == "draining"]
    router.fleet.set_states(draining, AdminState.DRAINING)  # one refresh, not one per backend
    workers = None
    store = replicas = None
    if config.workers > 1 or shared:
        from router.sockets import listen
        from router.supervisor import Workers

        if taken is not None:
            held = taken.client
        else:
            host, port = config.listen_address
            held = listen(host, port, backlog=config.limits.listen_backlog, reuse_port=True)
        workers = Workers(
            router,
            config.workers,
            held,
            remote=shared,
            predecessor=taken is not None,  # its requests count here while it drains
            stamp_base=_stamp_base(config),
            signal_changes=shared and config.replica_listen is not None,
        )
        await router.start_control(workers.sockets)
    control: RouterControl
    if replicated:
        assert workers is not None
        control = ReplicatedControl(router, workers)
    else:
        control = RouterControl(router, state_file, workers=workers)
    if replicated:
        membership: Membership = "etcd"
    elif config.discover is not None:
        membership = "discovery"
    else:
        membership = "state_file" if state_file is not None else "config"
    control.source = ConfigSource(config_file, membership, time.time())
    admin: AdminServer | None = None
    admin_address = ""
    admin_control: Control = control
    discovery: tuple[Reconciler, Source] | None = None
    handover: Handover | None = None
    following: asyncio.Task[None] | None = None  # the old process's ids, while it drains
    upgrade: Upgrade | None = None
    retiring = False  # handed over: the admin API stops before the drain, not after
    try:
        if isinstance(control, ReplicatedControl):
            assert workers is not None
            store, replicas = await _open_etcd(config, router, workers, control, state_file)
        elif shared:
            from router.etcd import EtcdClient

            assert workers is not None
            replicas = await _join_replicas(config, workers, EtcdClient(config.etcd), lambda: 0)
            control.replicas = replicas
        if config.discover is not None:
            discovery = await _open_discovery(config.discover, router, control)
            admin_control = DiscoveredControl(control, discovery[0], discovery[1].description)
        if workers is None:
            # SO_REUSEPORT with a handover socket: the process that takes over may
            # run --workers N, each with its own accept queue on the port.
            await router.start(
                sockets=taken.client if taken is not None else None,
                reuse_port=config.handover_socket is not None,
            )
            gc.freeze()  # see router.worker._Worker.serve
        else:
            await workers.start()
            if replicas is not None:
                replicas.start()
                _warn_late_counts(config, router)
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
            await admin.start(host, port, taken.admin if taken is not None else None)
            control.admin_listeners = admin.listeners
            admin_address = f"{host}:{admin.port}"
        if not replicated:
            await _refuse_own_addresses(control, router, state_file if state else None)
        upgrade = Upgrade(config.handover_socket)  # SIGUSR2: the code on disk takes over
        loop.add_signal_handler(signal.SIGUSR2, upgrade.start)
        if config.handover_socket is not None:

            async def retire(pid: int) -> None:
                nonlocal retiring
                retiring = upgrade.retired = True
                control.thaw(f"this router handed over to process {pid}: ask again")
                stop.set()
                if admin is not None:  # before Released: the new one answers alone from then
                    await admin.stop_accepting()

            handover = _handover(control, router, workers, admin, replicated, retire)
            if taken is None:
                try:
                    await handover.listen(config.handover_socket)
                except HandoverError as exc:
                    raise ConfigError(str(exc)) from None
            else:
                # PATH is taken over once the old process has retired (Released), not
                # before: one that gave up on us (READY_WAIT) serves on, and must stay
                # the one a later process finds there.
                # The ids the old process learns while it drains, as they come.
                learnt = router.responses.apply if workers is None else workers.learnt
                # And its requests in flight, counted here until they end.
                loads = _outside(router) if workers is None else workers.predecessor
                try:
                    following = await taken.ready(learnt, loads)
                except HandoverError as exc:
                    raise ConfigError(str(exc)) from None
                if following is not None and workers is None:  # (workers wait anyway)
                    _wait_for_ids(router, following)
                taken = None
                try:
                    await handover.listen(config.handover_socket)
                except HandoverError as exc:  # we serve: the next restart cannot hand over
                    get_logger("handover").error("handover socket not listened on", error=str(exc))
                    handover = None
        if admin is not None:  # the line supervisors and tests wait for: all is up
            get_logger("admin").info("admin listening", address=admin_address)
        notify(f"READY=1\nMAINPID={os.getpid()}")  # systemd follows a process that took over
        await stop.wait()
        if not retiring:
            notify("STOPPING=1")
    except BaseException:
        if taken is not None:
            taken.abandon()  # the old process thaws and keeps serving
        raise
    finally:
        # A second signal while we drain must not kill us half-way (nor after the
        # loop is gone and its handlers with it): from here on, signals are ignored.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_IGN)
        if handover is not None:
            handover.stopping = True  # a process that asks from now on is told, not given nothing
        if retiring and admin is not None:
            await admin.close()  # the new process answers on its sockets from now on
            admin = None
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
        if retiring and following is not None:
            # The process we took over from still drains: the one that took over from
            # us counts its requests through us (our loads) until it is gone.
            await asyncio.wait([following], timeout=config.timeouts.shutdown_grace)
        if handover is not None:
            await handover.close()
        if upgrade is not None:
            await upgrade.close()
        if following is not None:
            following.cancel()


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
    replicas = await _join_replicas(config, workers, client, lambda: store.revision)
    control.replicas = replicas
    return store, replicas


async def _join_replicas(
    config: Config, workers: Workers, client: EtcdClient, applied: Callable[[], int]
) -> Replicas:
    """This replica's row in etcd, and the other replicas' rows and placements folded in
    (``applied``: the etcd revision of the membership this replica has applied); with
    ``replica_listen``, its UDP rows open (``router.udprows``)."""
    from router.replicas import Replicas
    from router.udprows import UdpRows

    assert config.replica_id is not None  # made up before the workers start
    udp = None
    if config.replica_listen is not None:
        udp = UdpRows(config.replica_id, lambda _: None)
        try:
            await udp.open(config.replica_listen)
        except OSError as exc:
            raise ConfigError(f"replica_listen {config.replica_listen}: {exc}") from None
    prefix = config.etcd_prefix.encode()
    replicas = Replicas(
        client,
        prefix,
        workers.table,
        lambda: workers.slots,
        applied,
        replica_id=config.replica_id,
        udp=udp,
        changes_fd=workers.changes_fd,
    )
    workers.on_records = replicas.add_records
    replicas.on_records = workers.relay
    return replicas


def _handover(
    control: RouterControl,
    router: Router,
    workers: Workers | None,
    admin: AdminServer | None,
    replicated: bool,
    retire: Callable[[int], Awaitable[None] | None],
) -> Handover:
    """What a process that asks on the handover socket gets: our listeners (the
    workers' if any, the admin API's) and membership (none under etcd: etcd has it)."""
    from router.handover import IDS_PER_FRAME, Handover, Snapshot

    async def freeze() -> Snapshot:
        frozen = await control.freeze()
        listening = workers.sockets if workers is not None else router.sockets
        # Ids learnt from here on (we serve while the new process starts) are passed
        # on after it took over; those held now go in parts, read as they are sent.
        router.responses.tap = handover.learnt
        ids = router.responses.frozen(IDS_PER_FRAME)
        return Snapshot(
            client=[sock.fileno() for sock in listening],
            admin=[sock.fileno() for sock in admin.sockets] if admin else [],
            state=None if replicated else frozen,
            responses=ids,
            parts=ids.count,
            release=ids.close,
        )

    def thaw() -> None:
        router.responses.tap = None  # it failed: nobody to pass them on to
        control.thaw()

    handover = Handover(freeze, thaw, retire)
    handover.loads = workers.host_loads if workers is not None else _OwnLoads(router)
    return handover


class _OwnLoads:
    """Our requests in flight per backend (a process that took over counts them): the
    same list while the counts are those of the last call (two dict copies compared)."""

    def __init__(self, router: Router):
        self._fleet = router.fleet
        self._seen: tuple[dict[str, int], dict[str, int]] = ({}, {})
        self._loads: list[Load] = []

    def __call__(self) -> list[Load]:
        now = (dict(self._fleet.loads.counts), dict(self._fleet.waiting.counts))
        if now != self._seen:
            loads, waiting = self._seen = now
            self._loads = sorted((name, n, waiting.get(name, 0)) for name, n in loads.items())
        return self._loads


def _outside(router: Router) -> Callable[[dict[str, tuple[int, int]]], None]:
    """Count the requests of the process we took over from as ours while it drains
    (``router.handover``): a bound holds for the backends' load, not only ours.  Every
    backend it names is counted, one we do not route to as well: added back, it is
    as busy as it is."""

    def count(changes: dict[str, tuple[int, int]]) -> None:
        fleet = router.fleet
        fell = fleet.loads.outside({name: n for name, (n, _) in changes.items()})
        fell = fleet.waiting.outside({name: w for name, (_, w) in changes.items()}) or fell
        if fell and router.queue is not None:
            router.queue.wake()  # a place freed

    return count


def _wait_for_ids(router: Router, following: asyncio.Task[None]) -> None:
    """While the old process drains, an unknown response id is waited for briefly: it
    may be on its way (``router.handover.FOLLOW_WAIT``)."""
    from router.handover import FOLLOW_WAIT

    responses = router.responses
    responses.wait_s = FOLLOW_WAIT

    def done(_: asyncio.Task[None]) -> None:
        responses.wait_s = 0.0

    following.add_done_callback(done)


async def _take_over(config: Config) -> Taken | None:
    """The listeners (and membership) of the router running on our handover socket."""
    from router.handover import HandoverError, take_over

    assert config.handover_socket is not None
    try:
        taken = await take_over(config.handover_socket)
    except HandoverError as exc:
        raise ConfigError(str(exc)) from None
    if taken is None:
        return None
    # What was handed over is what we serve: a listener the config moved cannot be.
    wanted = [("listen", config.listen, taken.client)]
    if config.admin_listen == "off":
        for sock in taken.admin:
            sock.close()
        taken.admin = []
    elif taken.admin:  # else it had none: ours is bound anew
        wanted.append(("admin_listen", config.admin_listen, taken.admin))
    for field, address, sockets in wanted:
        host, port = parse_address(address, field)
        names = {sock.getsockname()[:2] for sock in sockets}
        ports = {name[1] for name in names}
        # The host too: the config moved from 127.0.0.1 to 0.0.0.0 would otherwise be
        # served on the old address while the log and GET /admin/config name the new.
        try:
            infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            hosts = {info[4][0] for info in infos}
        except OSError:
            hosts = set()
        if (port and ports != {port}) or {name[0] for name in names} != hosts:
            taken.abandon()
            where = sorted(f"{name[0]}:{name[1]}" for name in names) or ["nothing"]
            raise ConfigError(
                f"{field} {address}: the running router (pid {taken.pid}) listens on"
                f" {', '.join(where)}; a handover keeps its listeners, so stop it to"
                " move one"
            )
    return taken


def _warn_late_counts(config: Config, router: Router) -> None:
    """Replicas without UDP rows, in a RoutingConfig that pays for counts 0.1 s late."""
    from router.log import get_logger
    from router.replicas import late_counts_cost

    cost = late_counts_cost(router.balancer.config)
    if config.replica_listen is None and cost is not None:
        get_logger("replicas").warning(
            "the other replicas' in-flight counts come through etcd, 0.1 s late: give"
            " --replica-listen (UDP rows) for this RoutingConfig",
            cost=f"{cost} on one hot prompt, offline (README, Several replicas)",
        )


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
        scheme=discover.scheme,
        server_name=discover.server_name,
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
