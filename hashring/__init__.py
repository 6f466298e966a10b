"""hashring: pure, synchronous routing core (no I/O, no asyncio, nothing of ours imported).

- ``keys``: 64-bit MurmurHash3 of the routing key, salted by a tenant seed.
- ``ring``: immutable consistent-hash ring with weighted virtual nodes.
- ``bounded``: bounded-load choice along a key's preference walk.
- ``load``: in-flight counts and exactly-once leases.
- ``placement``: sticky placement of new keys bounded by recent traffic share.
"""

from .bounded import Decision, LoadBound, Pick, pick
from .keys import (
    MAX_TENANT_KEY_LENGTH,
    NO_TENANT,
    PrefixHasher,
    TenantKeyError,
    hash_key,
    tenant_seed,
)
from .load import Lease, LoadTracker, Probe
from .placement import Placement
from .ring import DEFAULT_VNODES, Ring

__all__ = [
    "DEFAULT_VNODES",
    "MAX_TENANT_KEY_LENGTH",
    "NO_TENANT",
    "Decision",
    "Lease",
    "LoadBound",
    "LoadTracker",
    "Pick",
    "Placement",
    "PrefixHasher",
    "Probe",
    "Ring",
    "TenantKeyError",
    "hash_key",
    "pick",
    "tenant_seed",
]
