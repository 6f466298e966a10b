"""Configuration: loaded and validated once at start-up; every module imports it from here.

Contract:
- ``Config`` is everything ``prefix-router serve`` needs.  It is built from a
  plain dict (the TOML file, with command-line flags laid over it) by one
  ``msgspec.convert`` call, so every error names its field, e.g.
  ``Expected `int` >= 1024 - at `$.RoutingConfig.PrefixAwareRoutingConfig.PrefixLength```.
- The structs live in router.routingconfig (the SageMaker-shaped RoutingConfig
  and its A/B arms) and router.configstructs (``Config`` and its other
  sections), the address checks in router.addresses; this module re-exports
  them all (``__all__``), and is the one that turns their errors into
  ConfigError: ``build_config``, ``parse_routing``, ``load_toml``, the
  ``--backend`` flag's parser and the listener's ``tls_context``.
- Nothing here does I/O except ``load_toml`` and ``tls_context`` (the listener's
  certificate, at start-up); nothing is probed per request.
"""

from __future__ import annotations

import ssl
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from .addresses import (
    backend_address,
    check_server_name,
    parse_address,
)
from .configstructs import (
    HEALTH_FLOOR_S,
    MAX_MODEL_NAME,
    MAX_MODELS,
    PERIOD_FLOOR_S,
    AdmissionConfig,
    AdvisorConfig,
    BackendSpec,
    BackendTLS,
    CacheSaltConfig,
    Config,
    DiscoverConfig,
    EngineSignalsConfig,
    HealthConfig,
    HealthOverride,
    HealthSeconds,
    Limits,
    ModelName,
    OtelConfig,
    PeriodSeconds,
    Seconds,
    TenantKey,
    TenantsConfig,
    Timeouts,
)
from .routingconfig import (
    KEY_FIELDS,
    MAX_ARMS,
    SESSION_SOURCES,
    Arm,
    ArmPrefixAware,
    ArmRouting,
    BalanceMode,
    Factor,
    PrefixAwareRoutingConfig,
    PrefixLength,
    RoutingConfig,
    Scope,
    SessionHeader,
    SessionKeys,
    SessionSource,
    SplitMode,
    Strategy,
    Threshold,
)

__all__ = [
    "HEALTH_FLOOR_S",
    "KEY_FIELDS",
    "MAX_ARMS",
    "MAX_MODELS",
    "MAX_MODEL_NAME",
    "PERIOD_FLOOR_S",
    "SESSION_SOURCES",
    "AdmissionConfig",
    "AdvisorConfig",
    "Arm",
    "ArmPrefixAware",
    "ArmRouting",
    "BackendSpec",
    "BackendTLS",
    "BalanceMode",
    "CacheSaltConfig",
    "Config",
    "ConfigError",
    "DiscoverConfig",
    "EngineSignalsConfig",
    "Factor",
    "HealthConfig",
    "HealthOverride",
    "HealthSeconds",
    "Limits",
    "ModelName",
    "OtelConfig",
    "PeriodSeconds",
    "PrefixAwareRoutingConfig",
    "PrefixLength",
    "RoutingConfig",
    "Scope",
    "Seconds",
    "SessionHeader",
    "SessionKeys",
    "SessionSource",
    "SplitMode",
    "Strategy",
    "TenantKey",
    "TenantsConfig",
    "Threshold",
    "Timeouts",
    "backend_address",
    "backend_flag",
    "build_config",
    "check_server_name",
    "load_toml",
    "parse_address",
    "parse_routing",
    "tls_context",
]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the field."""


def tls_context(config: Config) -> ssl.SSLContext | None:
    """The server-side TLS context, loaded once at start-up (ConfigError if unusable)."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load tls_cert/tls_key: {exc}") from None
    return context


def build_config(data: dict[str, Any]) -> Config:
    """Validate a plain dict into a Config, or raise ConfigError naming the field."""
    try:
        config = msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
    # Here, not in __post_init__: serve makes a replica id up when none is given.
    if config.handover_socket is not None and config.etcd and config.replica_id is not None:
        raise ConfigError(
            "handover_socket with a fixed replica_id: both processes would write one"
            " row in etcd while the old one drains; leave replica_id unset (each"
            " process then joins as a replica of its own)"
        )
    return config


def parse_routing(document: bytes | str | dict[str, Any]) -> RoutingConfig:
    """Parse ``{"RoutingConfig": {...}}`` (JSON text or a dict); bare inner objects too."""
    try:
        data = msgspec.json.decode(document) if isinstance(document, bytes | str) else document
    except msgspec.DecodeError as exc:
        raise ConfigError(f"routing config is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's depth bound: a value nested past Python's limit
        raise ConfigError("routing config is not valid JSON: nesting too deep") from None
    if isinstance(data, dict) and set(data) == {"RoutingConfig"}:
        data = data["RoutingConfig"]
    try:
        return msgspec.convert(data, RoutingConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"RoutingConfig: {exc}") from None


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def backend_flag(text: str) -> dict[str, Any]:
    """Parse ``--backend NAME=URL[,weight=W][,model=M]...`` into a backend dict
    (validated later); ``model=`` repeats, one model each."""
    name, _, rest = text.partition("=")
    url, *options = rest.split(",")
    spec: dict[str, Any] = {"name": name, "url": url}
    models: list[str] = []
    for option in options:
        key, sep, value = option.partition("=")
        if key == "weight" and value.isdigit() and "weight" not in spec:
            spec["weight"] = int(value)
        elif key == "model" and sep and value:
            models.append(value)
        else:
            break
    else:
        if name and url:
            if models:
                spec["models"] = models
            return spec
    raise ConfigError(
        f"--backend {text!r} must look like NAME=http[s]://HOST:PORT[,weight=W][,model=M ...]"
    )
