"""Bearer-token auth for the admin API, and the helpers the CLI uses to set it up.

Contract:
- ``requires_token(host)``: the API may run without a token only when bound to
  loopback (127.0.0.0/8, ::1, ``localhost``); any other bind address, including
  the wildcard ``0.0.0.0``/``::``/``""`` and any host name, needs one.
- ``load_token(path, env)``: the token file wins over the environment variable
  ``PREFIX_ROUTER_ADMIN_TOKEN``; surrounding whitespace is stripped (files end in
  a newline).  An empty or unreadable file is a ``ConfigError`` (a file was asked
  for, so running without one would be a surprise); an empty variable counts as
  unset.  A token must be visible ASCII with no spaces, or no client could send it.
- ``check(request_header, token)`` raises ``Unauthorized`` (401, with
  ``WWW-Authenticate: Bearer realm="prefix-router"``) unless the header is
  ``Bearer <token>``.  The comparison is ``hmac.compare_digest`` on bytes, so its
  time does not depend on how much of the token matched.  Neither the token nor
  what the client sent ever appears in a message.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Mapping

from router.config import ConfigError

from .errors import Unauthorized

__all__ = ["ENV_VAR", "OPEN_PATHS", "REALM", "check", "checked", "load_token", "requires_token"]

ENV_VAR = "PREFIX_ROUTER_ADMIN_TOKEN"
REALM = "prefix-router"
# Probes must work without credentials: an orchestrator's liveness/readiness checks
# do not carry secrets, and these two answers reveal nothing but up/ready.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def requires_token(host: str) -> bool:
    """True unless ``host`` is a loopback address or ``localhost``."""
    name = host.strip().strip("[]").rstrip(".").lower()
    if name == "localhost":
        return False
    try:
        address = ipaddress.ip_address(name.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return True  # a host name (other than localhost) or "": may be reachable from outside
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_loopback


def load_token(path: str | None, env: Mapping[str, str]) -> str | None:
    """The admin token from ``path`` if given, else from ``$PREFIX_ROUTER_ADMIN_TOKEN``."""
    if path is not None:
        try:
            with open(path, encoding="utf-8") as file:
                token = file.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read admin token file {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"admin token file {path} is not UTF-8 text") from None
        if not token:
            raise ConfigError(f"admin token file {path} is empty")
        return checked(token, f"admin token file {path}")
    token = env.get(ENV_VAR, "").strip()
    return checked(token, ENV_VAR) if token else None


def checked(token: str, source: str) -> str:
    """``token``, if an HTTP client can send it; else a ``ConfigError`` naming ``source``."""
    # RFC 6750's b64token is narrower; visible ASCII is what an HTTP header can carry.
    if not all("!" <= char <= "~" for char in token):
        raise ConfigError(f"{source}: the token must be visible ASCII characters with no spaces")
    return token


def check(header: str | None, token: str) -> None:
    """Raise ``Unauthorized`` unless ``header`` is ``Bearer <token>``."""
    if not header:
        raise Unauthorized(
            "missing bearer token: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": f'Bearer realm="{REALM}"'},
        )
    scheme, _, credentials = header.strip().partition(" ")
    # aiohttp decodes header bytes as UTF-8 with surrogateescape: encode back the same way,
    # so any header compares as bytes and never raises.
    given = credentials.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, token.encode("ascii")):
        raise Unauthorized(
            "invalid bearer token",
            headers={"WWW-Authenticate": f'Bearer realm="{REALM}", error="invalid_token"'},
        )
