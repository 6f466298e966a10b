"""Addresses in the configuration, checked: HOST:PORT, backend urls, TLS server names.

Contract:
- ``parse_address`` reads ``HOST:PORT`` (listeners; an empty host is 127.0.0.1);
  ``backend_address`` reads a backend's ``http[s]://HOST[:PORT][/]`` into its
  (host, port); ``check_server_name`` accepts a DNS name a certificate can hold.
- Each raises ValueError naming the value (never a url's credentials): the
  structs' ``__post_init__`` call them, so msgspec reports the error at the
  field's path.  Pure: no I/O, no name lookups.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

__all__ = [
    "backend_address",
    "check_server_name",
    "parse_address",
]


# One DNS label (RFC 1123, plus "_" for container service names), and a name of them.
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?")


def check_server_name(name: str, what: str) -> None:
    """ValueError unless ``name`` is a DNS name a certificate can hold."""
    if len(name) > 253 or not _HOSTNAME.fullmatch(name) or name.endswith("."):
        raise ValueError(f"{what}: server_name {name!r} is not a host name")


def backend_address(url: str) -> tuple[str, int]:
    """(host, port) of a backend url ``http[s]://HOST[:PORT][/]``, or ValueError saying why.

    Credentials are refused without being quoted back: the message would carry
    them into logs and API answers.
    """
    authority = re.split(r"[/?#]", url.partition("//")[2], maxsplit=1)[0]
    if "@" in authority:
        raise ValueError(
            "backend url must not contain credentials (user:password@); the router"
            " would store and show them"
        )
    if any(c.isspace() or not c.isprintable() for c in url):
        # urlsplit silently drops tabs and newlines; the stored url would keep them.
        raise ValueError(f"backend url {url!r} must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"backend url {url!r} has an invalid host or port") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"backend url {url!r} must start with http:// or https://")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"backend url {url!r} must not have a path or query")
    host = parts.hostname
    if not host:
        raise ValueError(f"backend url {url!r} has no host")
    if port == 0 or parts.netloc.endswith(":"):
        raise ValueError(f"backend url {url!r} needs a port from 1 to 65535 after its colon")
    if ":" in host:  # only a bracketed IPv6 address gets past urlsplit with a colon
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"backend url {url!r} has an invalid IPv6 address") from None
    elif len(host) > 253 or not _HOSTNAME.fullmatch(host):
        raise ValueError(f"backend url {url!r} has an invalid host name")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return host, port


def parse_address(text: str, what: str = "address") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65_535:
        raise ValueError(f"{what} {text!r} must look like HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)
