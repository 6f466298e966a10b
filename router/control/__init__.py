"""The control interface: everything the admin API may ask of the router.

Contract:
- ``Control`` is a ``typing.Protocol``; the admin app depends on it alone, so
  it can be tested against a fake, and the router can change behind it.
- Reads are synchronous snapshots.  Changes are coroutines: they are applied
  one at a time, and each is written to the state file (when there is one)
  *before* it returns, so a 2xx answer means the change survives a restart.
- Errors form a small tree translated to HTTP by the admin app:
  ``NotFound`` -> 404, ``Conflict`` -> 409, ``Invalid`` -> 422, ``NotSaved``
  -> 500 (the state file could not be written, so the change was not made;
  the message names the file and the reason), ``Unavailable`` -> 503 (the
  shared store of several replicas is unreachable; retry later),
  ``Rejected`` -> 400 (a dry-run request the data port would refuse).
- ``config`` is a read: the running configuration, where it came from and
  its reloads (``router.control.configview``).
- ``explain`` is a read: a dry run of the routing decision
  (``router.explain``) that changes nothing.  So is ``experiment``: an A/B
  experiment's figures (``router.arms``).
- Views are msgspec Structs: they encode straight to the JSON the admin API
  returns, and their JSON Schemas go into its OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Literal, Protocol

import msgspec
from msgspec import Meta

from ..abreport import ExperimentView
from ..config import BackendSpec, RoutingConfig
from ..explain import DryRequest, Explanation
from .configview import ConfigView

__all__ = [
    "BackendPatch",
    "BackendView",
    "Conflict",
    "Control",
    "ControlError",
    "Decisions",
    "DrainView",
    "Invalid",
    "ModelView",
    "NotFound",
    "NotSaved",
    "PrefixCacheView",
    "Rejected",
    "ResponseStats",
    "Stats",
    "Totals",
    "Unavailable",
    "WorkerView",
]

State = Literal["active", "draining"]


class ControlError(Exception):
    """Base of the errors a control operation reports to its caller."""


class NotFound(ControlError):
    pass


class Conflict(ControlError):
    pass


class Invalid(ControlError):
    """A value the router cannot take; ``field`` names it in the request body."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class NotSaved(ControlError):
    """The state file could not be written: the change was not made."""


class Unavailable(ControlError):
    """The shared store (etcd) cannot take the change now: nothing was changed."""


class Rejected(ControlError):
    """A dry-run request the data port would refuse itself; ``field`` names the body
    field at fault, where the data path names one (``param``)."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class BackendPatch(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Fields of ``PATCH /admin/backends/{name}``; absent fields are left alone."""

    weight: Annotated[int, Meta(ge=1, le=1000)] | None = None
    state: State | None = None


class PrefixCacheView(msgspec.Struct, frozen=True):
    """Is prefix caching on at this backend?  (router.cachecheck has the rule.)"""

    status: Literal["ok", "suspect_off", "unknown"]
    reason: str
    # The window judged last (or, before any verdict, the one gathering evidence):
    verdicts: int = 0  # windows judged ok or suspect_off since start
    evidence: int = 0  # repeated-key requests sent and answered within it
    hit_tokens: float = 0.0  # the backend's prefix-cache hits over it, in tokens
    query_tokens: float = 0.0  # and its prefix-cache queries (vLLM: 0 when caching is off)
    # Since start, summed over the workers: requests repeating a key sent here before.
    repeats_sent: int = 0
    repeats_answered: int = 0  # ... whose 2xx answer ended


class BackendView(msgspec.Struct, frozen=True):
    name: str
    url: str
    weight: int
    state: State
    healthy: bool
    in_flight: int
    requests: int
    share: float  # of all requests routed since start
    overflow: int  # received as an overflow from an earlier backend of the walk
    fallback: int  # received because every backend was at its bound
    errors: int
    ttft_p50_ms: float | None  # over the last requests (a bounded window)
    ttft_p90_ms: float | None
    prefix_cache_hit_rate: float | None  # scraped from the backend's /metrics, if enabled
    num_requests_running: float | None = None
    num_requests_waiting: float | None = None
    kv_cache_usage: float | None = None
    models: list[str] = msgspec.field(default_factory=list)  # served; empty: any model
    prefix_cache: Literal["ok", "suspect_off", "unknown"] = "unknown"  # see prefix_cache_check
    prefix_cache_check: PrefixCacheView | None = None
    server_name: str | None = None  # an https:// backend's name checked, if not its host
    # Slow start (router.slowstart): the weight its ring points stand for now, and
    # when its ramp ends (unix seconds; None: not ramping).
    effective_weight: float | None = None
    slow_start_ends: float | None = None
    # Engine signals (router.signals; None: off): the rank its last scrape gave it
    # (lower first; 0: idle, or no figures) and the requests a rank sent here.
    engine_rank: int | None = None
    engine_tie_breaks: int | None = None


class DrainView(msgspec.Struct, frozen=True):
    name: str
    state: Literal["draining", "removed"]
    in_flight: int
    timeout_s: float
    forced: bool = False  # removed at the timeout with requests still in flight


class Decisions(msgspec.Struct, frozen=True):
    primary: int
    overflow: int
    fallback: int
    other: int  # RANDOM, LEAST_OUTSTANDING_REQUESTS, passthrough and response_id choices
    # Claim spreading's c (router.balancer): the replicas' racing claims the walk
    # spreads over, set from the fleet's rate (router.replicas); 1: off.
    claim_spread: int = 1


class Totals(msgspec.Struct, frozen=True):
    requests: int
    in_flight: int
    errors: int
    no_backend: int  # answered 502/503 because no backend could take them
    connections: int = 0  # client connections open (Router.client_connections)


class ModelView(msgspec.Struct, frozen=True):
    """A model pool: a declared model, or (``id`` None) any model nobody declares."""

    id: str | None
    backends: list[str]  # that serve it: those declaring it and those declaring none
    requests: int  # routed over this pool since start (404s for unknown models not included)


class WorkerView(msgspec.Struct, frozen=True):
    """One data-plane process under ``--workers N``."""

    index: int
    pid: int | None
    up: bool  # listening now
    restarts: int  # started again after exiting on its own


class ResponseStats(msgspec.Struct, frozen=True):
    """Responses API follow-ups (``router.responses``): requests naming a response id."""

    hits: int = 0  # sent to the backend that made the response
    misses: int = 0  # id unknown here: routed by the strategy
    fallbacks: int = 0  # its backend down, draining or gone: routed by the strategy
    learnt: int = 0  # response ids read from answers
    unread: int = 0  # answers whose id could not be read in their first bytes
    held: int = 0  # ids remembered now
    capacity: int = 0  # limits.response_ids (0: off)


class UdpView(msgspec.Struct, frozen=True):
    """This replica's UDP rows (router.udprows): datagrams, each to or from one replica."""

    address: str
    sent: int
    # The workers' change signals the sender took (router.shared.ChangeSignal):
    # each sends the counts at once if they changed (0: the workers do not signal).
    signals: int
    received: int
    rejected: int  # not signed by a replica in etcd, or not decodable: dropped
    stale: int  # signed, but numbered before the last one taken (replays): dropped
    oversize: int  # samples too big for one datagram (the etcd row carried them)
    errors: int  # sends the OS reported failed (a replica that left)
    # From the oldest change a sample carries, on the sending replica's worker
    # (from the sample itself where the workers do not signal), to its counts
    # written in this replica's remote row, ms, over the last
    # ``router.udprows.LAG_SAMPLES`` new samples of the last LAG_WINDOW (60 s)
    # (across hosts, their clocks' skew too); None if there are none.
    lag_ms: LagView | None = None


class LagView(msgspec.Struct, frozen=True):
    samples: int
    p50: float
    p90: float
    p99: float
    max: float


class PeerView(msgspec.Struct, frozen=True):
    id: str
    seq: int  # the number of its counts held (router.replicas)
    udp: bool  # its counts come by UDP: a datagram in the last 0.5 s


class ReplicasView(msgspec.Struct, frozen=True):
    id: str
    others: list[PeerView]
    udp: UdpView | None = None  # None: no replica_listen


class Stats(msgspec.Struct, frozen=True):
    strategy: Literal["RANDOM", "LEAST_OUTSTANDING_REQUESTS", "PREFIX_AWARE"]
    backends: list[BackendView]
    totals: Totals
    decisions: Decisions
    workers: list[WorkerView] = msgspec.field(default_factory=list)  # empty: one process
    models: list[ModelView] = msgspec.field(default_factory=list)  # empty: none declared
    responses: ResponseStats = msgspec.field(default_factory=ResponseStats)
    # An A/B experiment's arms (router.arms), without their TTFT samples (/admin/ab
    # has them); None: the RoutingConfig has no Arms.
    experiment: ExperimentView | None = None
    replicas: ReplicasView | None = None  # None: no etcd
    # Members etcd lists that this replica has no column for (past the workers' slots),
    # by key: each is added, in this order, as a removal frees a column.
    not_added: list[str] = msgspec.field(default_factory=list)
    # Backends down that are routed to all the same: every pool they serve has none
    # up ([health] panic, router.fleet).
    panic: list[str] = msgspec.field(default_factory=list)


class Control(Protocol):
    """Errors: ``backend``, ``update_backend`` and ``remove_backend`` raise
    NotFound for an unknown name; ``add_backend`` raises Conflict for a taken
    one, and ``remove_backend(wait=True)`` when the drain is cancelled (the
    backend was set active again); any change may raise Invalid, and NotSaved
    when there is a state file and it cannot be written.
    ``metrics`` returns Prometheus text exposition format 0.0.4.  Reads that
    carry traffic figures are coroutines: with worker processes they are
    gathered from every worker first."""

    async def backends(self) -> list[BackendView]: ...

    async def backend(self, name: str) -> BackendView: ...

    async def add_backend(self, spec: BackendSpec) -> BackendView: ...

    async def update_backend(self, name: str, patch: BackendPatch) -> BackendView: ...

    async def remove_backend(self, name: str, *, timeout: float, wait: bool) -> DrainView: ...

    def routing(self) -> RoutingConfig: ...

    async def set_routing(self, routing: RoutingConfig) -> RoutingConfig: ...

    async def stats(self) -> Stats: ...

    def ready(self) -> bool: ...

    async def metrics(self) -> bytes: ...

    async def explain(self, request: DryRequest, k: int) -> Explanation: ...

    async def experiment(self) -> ExperimentView:
        """The A/B experiment's figures with each arm's TTFT sample (mergeable across
        replicas, router.arms); NotFound when the RoutingConfig has no Arms."""
        ...

    def config(self) -> ConfigView: ...
