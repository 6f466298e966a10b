"""Routing-key hashing.

Contract:
- ``hash_key(data, seed)`` is the 64-bit MurmurHash3 (x64/128, first 64 bits,
  unsigned) of any bytes-like object.  ``memoryview`` slices of ``bytes`` or
  ``bytearray`` are hashed in place: nothing is copied.
- A tenant key salts the hash by becoming the murmur *seed*:
  ``tenant_seed(key)`` is the unsigned 32-bit MurmurHash3 of the key's ASCII
  bytes, and 0 means "no tenant".  Two tenants with the same prompt therefore
  get unrelated hashes.  This is routing separation, not access control: two
  tenants whose seeds collide (about 1 in 2**32 per pair) share placement and
  nothing else.
- ``tenant_seed`` is the caller-facing validator: a tenant key is at most 64
  ASCII characters (SageMaker's limit for ``X-Amzn-SageMaker-Prefix-Aware-Id``);
  anything else raises ``TenantKeyError``.  An empty key means no tenant.
"""

from __future__ import annotations

import mmh3

__all__ = [
    "MAX_TENANT_KEY_LENGTH",
    "NO_TENANT",
    "Buffer",
    "PrefixHasher",
    "TenantKeyError",
    "hash_key",
    "tenant_seed",
]

MAX_TENANT_KEY_LENGTH = 64
NO_TENANT = 0

# mmh3.hash64 insists on a read-only buffer; the utuple digest takes any
# buffer (a memoryview of a bytearray included) and returns unsigned halves.
_murmur128 = mmh3.mmh3_x64_128_utupledigest

# collections.abc.Buffer arrives in Python 3.12; these are the kinds we hash.
Buffer = bytes | bytearray | memoryview


class TenantKeyError(ValueError):
    """A tenant key that cannot be used for routing (too long, not ASCII)."""


def hash_key(data: Buffer, seed: int = NO_TENANT) -> int:
    """Return the unsigned 64-bit routing hash of ``data`` under ``seed``."""
    return _murmur128(data, seed)[0]


def tenant_seed(key: str | bytes | None) -> int:
    """Validate a tenant key and return its 32-bit hash seed (0 for none)."""
    if not key:
        return NO_TENANT
    if len(key) > MAX_TENANT_KEY_LENGTH:
        raise TenantKeyError(
            f"tenant key is {len(key)} characters long; at most {MAX_TENANT_KEY_LENGTH} are allowed"
        )
    if not key.isascii():
        raise TenantKeyError("tenant key must be ASCII")
    return mmh3.mmh3_32_uintdigest(key.encode() if isinstance(key, str) else key, 0)


class PrefixHasher:
    """The hash of the first ``limit`` bytes of a body that arrives in pieces.

    Streaming murmur gives exactly ``hash_key(body[:limit], seed)`` however the
    body is split, and reads each piece through a memoryview: a native body's
    prefix is hashed without being copied or gathered into one buffer.
    """

    __slots__ = ("_hasher", "remaining")

    def __init__(self, limit: int, seed: int = NO_TENANT):
        self._hasher = mmh3.mmh3_x64_128(seed=seed)
        self.remaining = limit

    def feed(self, data: Buffer) -> bool:
        """Hash what ``data`` adds to the prefix; True once the prefix is complete."""
        take = min(self.remaining, len(data))
        if take:
            self._hasher.update(memoryview(data)[:take] if take < len(data) else data)
            self.remaining -= take
        return not self.remaining

    def digest(self) -> int:
        return self._hasher.utupledigest()[0]
