"""The running configuration as the admin API shows it (``GET /admin/config``).

Why: after a SIGHUP, an admin write or a restart with new flags, "what is
this router running with?" had no answer but its log.  nginx has ``-T``,
Envoy ``/config_dump``, HAProxy ``show info``.

Contract:
- ``config_view(config, routing, source)`` is the answer: ``config`` the
  running configuration (as ``serve`` built it from the file and its flags,
  with the timeouts, limits and retries a reload applied since), as the TOML
  file spells it, with ``RoutingConfig`` the one in force (the admin API or
  etcd may have set it since) and without ``backends`` (those are
  ``/admin/backends``, with their states); where the membership comes from;
  the file; and the reloads (``ConfigSource``, which ``admin.reload`` keeps).
- ``restart_pending`` names the fields whose value in the file, as the last
  reload read it, is not the running one (a listener, TLS, workers, ...):
  they wait for a restart.  A reload of an invalid file leaves it as it was;
  one that failed while applying a valid file sets it (the file was read).
- Secrets stay out: ``tenants.label_key`` is shown as ``"<redacted>"``, and
  a password in a URL (``etcd``, ``otel.endpoint``) as ``<redacted>``.
  The admin token and the cache salt's secret are never in ``Config``; file
  paths are shown.
- With ``--workers N`` the supervisor answers: its configuration is the one
  it pushes to every worker (the same ops).  Each replica answers for itself:
  replicas may run different files.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import msgspec

from ..config import Config, RoutingConfig

__all__ = ["REDACTED", "ConfigSource", "ConfigView", "Membership", "ReloadView", "config_view"]

REDACTED = "<redacted>"

# Where the backends and the RoutingConfig come from (README, "check and reload").
Membership = Literal["config", "state_file", "etcd", "discovery"]


class ReloadView(msgspec.Struct, frozen=True):
    at: float  # Unix time it finished
    result: Literal["applied", "invalid", "failed"]
    reason: str | None = None  # what was invalid (the field path), or what failed
    restart_pending: list[str] = msgspec.field(default_factory=list)  # as read that time


class ConfigView(msgspec.Struct, frozen=True):
    file: str | None  # the config file serve read, if any (flags win over it)
    membership: Membership
    started: float  # Unix time the process started serving
    reloads: int  # SIGHUPs handled, applied or not
    last_reload: ReloadView | None
    restart_pending: list[str]
    config: dict[str, Any]


class ConfigSource:
    """What the daemon knows of where the configuration came from; ``admin.reload``
    records each reload here."""

    __slots__ = ("file", "last_reload", "membership", "reloads", "restart_pending", "started")

    def __init__(self, file: str | None, membership: Membership, started: float):
        self.file, self.membership, self.started = file, membership, started
        self.reloads = 0
        self.last_reload: ReloadView | None = None
        self.restart_pending: list[str] = []

    def reloaded(self, view: ReloadView, *, read: bool | None = None) -> None:
        """Record a reload; ``read``: it read a valid file (by default, if applied)."""
        self.reloads += 1
        self.last_reload = view
        if view.result == "applied" if read is None else read:
            self.restart_pending = list(view.restart_pending)


def config_view(config: Config, routing: RoutingConfig, source: ConfigSource) -> ConfigView:
    """The admin API's answer (the module's contract)."""
    return ConfigView(
        file=source.file,
        membership=source.membership,
        started=source.started,
        reloads=source.reloads,
        last_reload=source.last_reload,
        restart_pending=source.restart_pending,
        # The backends left out before converting: 8,192 of them would hold the loop.
        config=public(msgspec.structs.replace(config, routing=routing, backends=[])),
    )


def public(config: Config) -> dict[str, Any]:
    """``config`` as the TOML file spells it, without its backends and secrets."""
    document: dict[str, Any] = msgspec.to_builtins(config)
    del document["backends"]
    # Every field, defaults included, as GET /admin/routing shows it.
    document.update(config.routing.document())
    document["etcd"] = [_without_password(url) for url in config.etcd]
    otel = document["otel"]
    if otel.get("endpoint") is not None:
        otel["endpoint"] = _without_password(otel["endpoint"])
    tenants = document["tenants"]
    if tenants.get("label_key") is not None:
        tenants["label_key"] = REDACTED
    return document


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    # "https://TOKEN@host" is a credential too (basic auth with an empty password).
    user = REDACTED if parts.password is None else f"{parts.username}:{REDACTED}"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}"))
