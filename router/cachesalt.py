"""Engine-side cache isolation: a ``cache_salt`` per tenant in OpenAI bodies.

Why: the tenant salt separates routing, not caches.  Two tenants on one
backend share its prefix cache, and the time to first token tells one
whether the other sent a prompt (a known side channel).  vLLM's
``cache_salt`` enters the hash of a request's first KV block, so requests
with different salts share no cached block.

Contract:
- Off unless ``[cache_salt] enabled``: then ``Router.salter`` is None and
  the exchange checks nothing else; bodies go out exactly as they came.
- On, every OpenAI body (chat, completions, responses) is forwarded with
  ``"cache_salt": hex(HMAC-SHA256(secret, tenant key))``, the tenant key
  being the one routing is salted with: ``prompt_cache_key``, else the
  tenant header, else the empty key (requests without one are one tenant).
  Never the key itself, and no client can compute another tenant's salt
  without the secret.  A client's own ``cache_salt`` is overridden, or with
  ``keep_client`` kept (the body then goes out unchanged).
- The secret: the bytes of ``secret_file`` (one trailing newline stripped)
  or of ``$PREFIX_ROUTER_CACHE_SALT_SECRET``; at least 16 bytes, else a
  ``ConfigError`` at start-up.  Every process reads it at start-up: workers
  and replicas with the same secret give a tenant the same salt, so its
  cache hits survive whichever worker or replica routed it; a changed secret
  starts every tenant's cache afresh (a restart is needed to change it).
- The rewrite copies no body byte: the pieces become views of the body up to
  the top-level object's closing brace (the decode has checked that the body
  is one object), the salt member, and the rest.  Inserting the member last
  makes it win over a client's: the engines' JSON parsers (Python's ``json``
  under FastAPI, pydantic's) keep the last of duplicate keys.
- Salts are cached per tenant key (bounded, cleared when full): a request
  costs a dict lookup, an HMAC only for a tenant's first request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .config import ConfigError

if TYPE_CHECKING:
    from .config import CacheSaltConfig

__all__ = ["ENV_SECRET", "MIN_SECRET_BYTES", "Salter", "load_secret", "salted_body"]

ENV_SECRET = "PREFIX_ROUTER_CACHE_SALT_SECRET"
MIN_SECRET_BYTES = 16  # 128 bits: no guessing it from salts
MAX_CACHED = 4096  # tenants whose salt is kept; more: the cache starts again


def load_secret(config: CacheSaltConfig, environ: Mapping[str, str] | None = None) -> bytes:
    """The HMAC key, or ``ConfigError`` saying what is missing (never the secret)."""
    if config.secret_file is not None:
        try:
            with open(config.secret_file, "rb") as file:
                secret = file.read()
        except OSError as exc:
            raise ConfigError(
                f"cannot read cache_salt secret_file {config.secret_file}: {exc.strerror}"
            ) from None
        secret = secret.removesuffix(b"\n").removesuffix(b"\r")
        source = f"cache_salt secret_file {config.secret_file}"
    else:
        value = (os.environ if environ is None else environ).get(ENV_SECRET)
        if value is None:
            raise ConfigError(f"cache_salt is enabled: give it a secret_file or ${ENV_SECRET}")
        secret = value.encode("utf-8", "surrogateescape")
        source = f"${ENV_SECRET}"
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"{source}: the secret must be at least {MIN_SECRET_BYTES} bytes")
    return secret


class Salter:
    """The salt member of each tenant, and whether a client's own salt is kept."""

    __slots__ = ("_members", "_secret", "keep_client")

    def __init__(self, secret: bytes, *, keep_client: bool = False):
        self._secret = secret
        self.keep_client = keep_client
        self._members: dict[str | bytes | None, bytes] = {}

    @classmethod
    def from_config(
        cls, config: CacheSaltConfig, environ: Mapping[str, str] | None = None
    ) -> Salter | None:
        if not config.enabled:
            return None
        return cls(load_secret(config, environ), keep_client=config.keep_client)

    def salt(self, tenant_key: str | bytes | None) -> str:
        """The salt of a tenant key (the hex HMAC-SHA256)."""
        if isinstance(tenant_key, str):
            message = tenant_key.encode("utf-8", "surrogatepass")
        else:
            message = tenant_key or b""
        return hmac.digest(self._secret, message, hashlib.sha256).hex()

    def member(self, tenant_key: str | bytes | None) -> bytes:
        """``,"cache_salt":"<salt>"``: the JSON member to insert, for this tenant."""
        member = self._members.get(tenant_key)
        if member is None:
            if len(self._members) >= MAX_CACHED:
                self._members.clear()  # a tenant flood: recompute rather than grow
            member = b',"cache_salt":"%s"' % self.salt(tenant_key).encode()
            self._members[tenant_key] = member
        return member


def salted_body(
    pieces: Sequence[bytes | bytearray | memoryview], member: bytes
) -> tuple[list[bytes | bytearray | memoryview], int]:
    """The body with ``member`` inserted before its closing brace (no body byte
    copied), and the bytes that adds.

    ``pieces`` hold one JSON object (the decode checked it), so its closing
    brace is the last ``}`` of the body (only whitespace may follow it), and
    the object is empty exactly when the body holds no ``"`` (any member has a
    string key).  ``member`` starts with a comma, dropped for an empty object.
    Both searches run at C speed (``bytes.rfind``, ``in``).
    """
    if len(pieces) == 1:  # the usual case: a body read at once, or joined to be keyed
        body = pieces[0]
        if type(body) is bytes:
            end = body.rfind(b"}")
            if end < 0:
                raise ValueError("an OpenAI body without a JSON object")
            if b'"' not in body:
                member = member[1:]  # {}: no comma
            # Views, no copy; the brace and what follows (whitespace) is copied
            # when short: one view fewer to make.
            view = memoryview(body)
            tail = body[end:] if len(body) - end <= 64 else view[end:]
            return [view[:end], member, tail], len(member)
    for index in range(len(pieces) - 1, -1, -1):
        piece = pieces[index]
        end = (piece if isinstance(piece, bytes) else bytes(piece)).rfind(b"}")
        if end >= 0:
            break
    else:
        raise ValueError("an OpenAI body without a JSON object")
    for piece in pieces:
        if b'"' in (piece if isinstance(piece, bytes) else bytes(piece)):
            break
    else:
        member = member[1:]  # {}: no comma
    view = memoryview(pieces[index])
    return [*pieces[:index], view[:end], member, view[end:], *pieces[index + 1 :]], len(member)
