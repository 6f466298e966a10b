"""RoutingConfig: the SageMaker-shaped routing document and its A/B arms.

Contract:
- Routing uses SageMaker's shape so users can paste theirs:
  ``{"RoutingConfig": {"RoutingStrategy": "PREFIX_AWARE",
  "PrefixAwareRoutingConfig": {"PrefixLength": 4096, "ConcurrencyThreshold": 10}}}``
  with SageMaker's ranges (PrefixLength 1,024-65,536, ConcurrencyThreshold
  1-1,024) and extensions: ``BalanceFactor`` (>= 1.0; absent = off),
  ``BalanceMode``, ``ConcurrencyScope``, and the affinity key's sources,
  ``SessionKeys`` (in precedence order, ``prefix`` last) with ``SessionHeader``
  (router.sessions), and an A/B experiment's ``Experiment``, ``Arms`` and
  ``Split`` (router.arms, router.split).
- Frozen msgspec Structs, checked in ``__post_init__`` (a ValueError there is
  reported at the struct's path); parsed from text by ``router.config.parse_routing``,
  the one place that turns their errors into ConfigError.  Pure data: no I/O.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

__all__ = [
    "KEY_FIELDS",
    "MAX_ARMS",
    "SESSION_SOURCES",
    "Arm",
    "ArmPrefixAware",
    "ArmRouting",
    "BalanceMode",
    "Factor",
    "PrefixAwareRoutingConfig",
    "PrefixLength",
    "RoutingConfig",
    "Scope",
    "SessionHeader",
    "SessionKeys",
    "SessionSource",
    "SplitMode",
    "Strategy",
    "Threshold",
]


class Strategy(enum.Enum):
    RANDOM = "RANDOM"
    LEAST_OUTSTANDING_REQUESTS = "LEAST_OUTSTANDING_REQUESTS"
    PREFIX_AWARE = "PREFIX_AWARE"


# Where a request's affinity key comes from (router.sessions), in precedence order.
SessionSource = Literal["prompt_cache_key", "header", "conversation", "prefix"]
SESSION_SOURCES: tuple[SessionSource, ...] = (
    "prompt_cache_key",
    "header",
    "conversation",
    "prefix",
)
# Request headers the router reads or writes itself: a session header cannot be one.
_RESERVED_HEADERS = frozenset(
    {
        "host", "content-length", "transfer-encoding", "connection", "keep-alive", "te",
        "trailer", "upgrade", "expect", "via", "x-forwarded-for", "x-forwarded-proto",
        "x-request-id", "traceparent", "tracestate", "x-amzn-sagemaker-prefix-aware-id",
    }
)  # fmt: skip


PrefixLength = Annotated[int, Meta(ge=1024, le=65_536)]
Threshold = Annotated[int, Meta(ge=1, le=1024)]
Factor = Annotated[float, Meta(ge=1.0, le=1000.0)]
BalanceMode = Literal["IN_FLIGHT", "TRAFFIC"]
Scope = Literal["IN_FLIGHT", "PREFILL"]
SessionKeys = Annotated[tuple[SessionSource, ...], Meta(min_length=1)]
SessionHeader = Annotated[str, Meta(pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")]
SplitMode = Literal["KEYS", "BACKENDS"]
# The fields that make a request's key: an experiment's, the same in every arm.
KEY_FIELDS = ("prefix_length", "session_keys", "session_header")


class PrefixAwareRoutingConfig(
    msgspec.Struct, rename="pascal", forbid_unknown_fields=True, frozen=True
):
    prefix_length: PrefixLength = 4096
    concurrency_threshold: Threshold = 10
    balance_factor: Factor | None = None
    # IN_FLIGHT: BalanceFactor bounds each request by in-flight counts (stateless).
    # TRAFFIC (the default): it bounds where a *new* key is placed by each
    # backend's share of recent requests, keys stick, and a key hot enough to
    # overload one backend is served by several (see hashring.placement); one
    # placement for every worker and replica (router.worker, router.replicas).
    balance_mode: BalanceMode = "TRAFFIC"
    # What ConcurrencyThreshold counts: every request in flight (SageMaker's
    # meaning), or PREFILL (the default): only those a backend has not started
    # answering, so long streams in their decode phase do not count.
    # BalanceFactor always counts every request in flight.  SageMaker's exact
    # semantics: BalanceMode IN_FLIGHT and ConcurrencyScope IN_FLIGHT.
    concurrency_scope: Scope = "PREFILL"
    # The affinity key: the first source a request carries, in this order; prefix
    # (always present) must come last.  See router.sessions.
    session_keys: SessionKeys = SESSION_SOURCES
    session_header: SessionHeader = "X-Session-Id"

    def __post_init__(self) -> None:
        keys = self.session_keys
        if len(set(keys)) != len(keys):
            raise ValueError(f"SessionKeys lists a source twice: {list(keys)}")
        if keys[-1] != "prefix":
            raise ValueError(
                f"SessionKeys must end with prefix (the key every request has): {list(keys)}"
            )
        if self.session_header.lower() in _RESERVED_HEADERS:
            raise ValueError(
                f"SessionHeader {self.session_header!r} is a header the router reads or sets"
            )


class ArmPrefixAware(
    msgspec.Struct, rename="pascal", forbid_unknown_fields=True, frozen=True, omit_defaults=True
):
    """An arm's PrefixAwareRoutingConfig: the fields it sets; the rest are the top level's.
    ``"BalanceFactor": null`` turns a top-level BalanceFactor off in the arm."""

    prefix_length: PrefixLength | UnsetType = UNSET
    concurrency_threshold: Threshold | UnsetType = UNSET
    balance_factor: Factor | UnsetType | None = UNSET
    balance_mode: BalanceMode | UnsetType = UNSET
    concurrency_scope: Scope | UnsetType = UNSET
    session_keys: SessionKeys | UnsetType = UNSET
    session_header: SessionHeader | UnsetType = UNSET


class ArmRouting(
    msgspec.Struct, rename="pascal", forbid_unknown_fields=True, frozen=True, omit_defaults=True
):
    """An arm's RoutingConfig: what it changes of the top level's (no ``Arms`` of its own)."""

    routing_strategy: Strategy | UnsetType = UNSET
    prefix_aware_routing_config: ArmPrefixAware | UnsetType = UNSET


MAX_ARMS = 8  # each arm is a label value of the arm series (router.arms)


class Arm(msgspec.Struct, rename="pascal", forbid_unknown_fields=True, frozen=True):
    """One arm of an A/B experiment (router.arms): its name, its share of the keys, and
    what it routes them by."""

    # A Prometheus label value and a word in reports.
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")]
    weight: Annotated[float, Meta(ge=0.0, le=1_000_000.0)]
    routing_config: ArmRouting = msgspec.field(default_factory=ArmRouting)


class RoutingConfig(
    msgspec.Struct, rename="pascal", forbid_unknown_fields=True, frozen=True, omit_defaults=True
):
    routing_strategy: Strategy = Strategy.PREFIX_AWARE
    prefix_aware_routing_config: PrefixAwareRoutingConfig = msgspec.field(
        default_factory=PrefixAwareRoutingConfig
    )
    # A/B on live traffic (router.arms): each keyed request routes by the RoutingConfig
    # of one arm, the top level with the arm's fields over it; the arm is a function
    # of the routing key salted by the experiment's id.  omit_defaults: a document
    # without an experiment is written as before (a state file an older version reads).
    experiment: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")] | None = None
    arms: Annotated[tuple[Arm, ...], Meta(max_length=MAX_ARMS)] = ()
    # What the arms divide (router.split): KEYS, the arms share every backend;
    # BACKENDS, each arm also routes over backends of its own, as many as its
    # weight's share (largest remainder, one at least).
    split: SplitMode = "KEYS"

    def __post_init__(self) -> None:
        if not self.arms:
            if self.experiment is not None:
                raise ValueError("Experiment names the Arms it compares: give Arms too")
            if self.split != "KEYS":
                raise ValueError("Split divides an experiment's Arms: give Experiment and Arms")
            return
        if self.experiment is None:
            raise ValueError(
                "Arms need an Experiment id: it salts which keys go to which arm"
                " (a new id draws them afresh)"
            )
        names = [arm.name for arm in self.arms]
        if len(self.arms) < 2 or len(set(names)) != len(names):
            raise ValueError(f"Arms must be 2 or more, each with a name of its own: {names}")
        if not any(arm.weight for arm in self.arms):
            raise ValueError("Arms: at least one arm needs a Weight above 0")
        base = self.prefix_aware
        for arm, routing in zip(self.arms, self.arm_configs(), strict=True):
            for field in KEY_FIELDS:
                if getattr(routing.prefix_aware, field) != getattr(base, field):
                    pascal = "".join(part.title() for part in field.split("_"))
                    raise ValueError(
                        f"arm {arm.name!r}: {pascal} is the experiment's, set at the top level"
                        " (the key it makes decides the arm): every arm has the same"
                    )

    @property
    def strategy(self) -> Strategy:
        return self.routing_strategy

    @property
    def prefix_aware(self) -> PrefixAwareRoutingConfig:
        return self.prefix_aware_routing_config

    @property
    def active_arms(self) -> int:
        """Arms with a weight above 0: under Split BACKENDS, the fewest backends needed."""
        return sum(1 for arm in self.arms if arm.weight > 0)

    def arm_configs(self) -> tuple[RoutingConfig, ...]:
        """Each arm's whole RoutingConfig: the top level with the arm's fields over it."""
        configs = []
        for arm in self.arms:
            changes = arm.routing_config
            strategy = changes.routing_strategy
            aware = self.prefix_aware
            fields = changes.prefix_aware_routing_config
            if not isinstance(fields, UnsetType):
                given = {
                    name: value
                    for name, value in msgspec.structs.asdict(fields).items()
                    if value is not UNSET
                }
                aware = msgspec.structs.replace(aware, **given)
            configs.append(
                RoutingConfig(self.strategy if isinstance(strategy, UnsetType) else strategy, aware)
            )
        return tuple(configs)

    def document(self) -> dict[str, Any]:
        """The SageMaker-shaped JSON document, ``{"RoutingConfig": {...}}``."""
        aware = msgspec.to_builtins(self.prefix_aware)
        aware["SessionKeys"] = list(aware["SessionKeys"])  # JSON's shape, as it comes back
        inner: dict[str, Any] = {
            "RoutingStrategy": self.strategy.value,
            "PrefixAwareRoutingConfig": aware,
        }
        if self.arms:
            inner["Experiment"] = self.experiment
            inner["Arms"] = msgspec.json.decode(msgspec.json.encode(self.arms))  # lists, as JSON
            if self.split != "KEYS":
                inner["Split"] = self.split
        return {"RoutingConfig": inner}
