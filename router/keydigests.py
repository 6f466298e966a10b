"""Key digests: what a request's routing key would be at other PrefixLengths.

Opt-in (``[advisor] key_digests = true``, ``serve --key-digests``): each
access line of a keyed request gets one more field, read by ``prefix-router
advise`` to replay the traffic at other PrefixLengths without its text::

    "key_digests": {"lengths": [1024, 2048, 4096, ...], "digests": ["3f0c...", ...], "length": 5321}

Contract:
- ``lengths`` are the configured ``[advisor] lengths`` and the current
  PrefixLength, sorted, each once.  ``digests[i]`` is the first 12 hex digits
  (the top 48 bits) of the routing hash the request's prefix key would have
  at PrefixLength ``lengths[i]``, under the same tenant seed: the first 12
  digits of ``prefix_hash`` where ``lengths[i]`` is the PrefixLength and the
  key's source is its prefix.  48 bits: two distinct prefixes of a million
  share a digest with probability ~2e-3 (a birthday bound); one digest costs
  ~15 bytes of the line.
- The list stops at the first length that holds the whole key: the key at
  every longer length is the same.  ``length`` is the key's whole length
  (characters of an OpenAI prompt as the key renders it, bytes of a token-id
  prompt or of a native body), or null when it is longer than the largest
  length (OpenAI: then only ``bytes_in`` tells its size) or not known yet
  (a native body still arriving when the line was written).
- Session-keyed requests (``key_source`` header or conversation) get the
  digests of their prompt too: the replay needs them for the cache, whatever
  routed the request.
- OpenAI: the key at length g is ``prompt_key(request, g)``: the text cut at
  g characters, or the first g/4 token ids.  When the routing key already
  holds the whole prompt (the common case) every digest is a hash of a slice
  of it; otherwise the prompt is rendered once more, at the largest length.
  Either way one incremental murmur pass over one buffer gives every digest
  (``memoryview`` slices, no copy; a non-ASCII prompt is decoded once and
  each segment between two lengths encoded once).  A digest is read off the
  hasher's bytes (``_hexdigest``), not formatted from an integer.
  Exception, for shapes no client sends: with more than g content parts the
  key at g stops after the g-th part, so the digest of a longer rendering cut
  at g can differ from that key (``router.extract``, "Two bounds").
- Native: the body's first g bytes, hashed incrementally as its pieces arrive,
  the same pieces that are forwarded (memoryview slices, no copy): one murmur
  pass over the first ``max(lengths)`` bytes, besides the routing hasher's
  pass over the first PrefixLength.
- Bodies keyed by the helper process (over ``key_offload_bytes``) have no
  digests: their key is computed in another process (``router.keyworker``).
- Nothing is computed while the option is off (the exchange checks one
  attribute); on, nothing is logged but the digests: no text, no tenant key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mmh3
import msgspec

from hashring import NO_TENANT, TenantKeyError, tenant_seed

from .extract import key_source, prompt_key

if TYPE_CHECKING:
    from hashring.keys import Buffer

    from .extract import BoundedRequest, OpenAIRequest

__all__ = [
    "DEFAULT_LENGTHS",
    "DIGEST_DIGITS",
    "KeyDigester",
    "KeyDigests",
    "NativeDigests",
    "digest_of",
    "openai_digests",
]

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)  # SageMaker's range, doubling
DIGEST_DIGITS = 12
_SHIFT = 64 - 4 * DIGEST_DIGITS


def digest_of(key_hash: int) -> str:
    """A 64-bit routing hash as a key digest: its first 12 hex digits."""
    return f"{key_hash >> _SHIFT:012x}"


class KeyDigests(msgspec.Struct):
    """The access log's ``key_digests`` field (see the module contract)."""

    lengths: tuple[int, ...]
    digests: list[str]
    length: int | None

    def field(self) -> KeyDigests:
        return self


def _hexdigest(hasher: mmh3.mmh3_x64_128) -> str:
    # The digest's first 8 bytes are the routing hash, little-endian: its top 48
    # bits are bytes 7 down to 2.  Twice as fast as formatting the integer.
    return hasher.digest()[7:1:-1].hex()


def _text(key: bytes, ids: bool) -> str | None:
    """The key as text where a unit is not a byte (non-ASCII text), else None."""
    if ids or key.isascii():
        return None
    return key.decode("utf-8", "surrogatepass")


def openai_digests(
    request: OpenAIRequest | BoundedRequest,
    key: bytes,
    limit: int,
    seed: int,
    lengths: tuple[int, ...],
) -> KeyDigests:
    """The digests of an OpenAI request's prompt key at ``lengths``.

    ``key`` is its routing key at PrefixLength ``limit`` when the prompt keyed
    it (b"" when a session did: the prompt is then rendered here).
    """
    top = lengths[-1]
    ids = key_source(request, limit) == "token ids"
    text = _text(key, ids)
    units = len(key) if text is None else len(text)
    # A key as long as the limit allows may have been cut there (g/4 ids, g characters).
    maybe_cut = not key or units >= (4 * (limit // 4) if ids else limit)
    if maybe_cut and (top > limit or not key):
        # The routing key stops short of the largest length: render the prompt
        # once at it (4 more characters, one more id: whether it is longer shows).
        key = prompt_key(request, top + 4)
        text = _text(key, ids)
        units = len(key) if text is None else len(text)
        whole = units <= top
    else:
        whole = not maybe_cut
    hasher = mmh3.mmh3_x64_128(seed=seed)
    update = hasher.update
    digests: list[str] = []
    if text is None:  # one byte a unit (ASCII, or ids counted in bytes): slices, no copy
        view = memoryview(key)
        done = 0
        for g in lengths:
            end = 4 * (g // 4) if ids else g
            if whole and units <= end:
                update(view[done:] if done else key)
                digests.append(_hexdigest(hasher))
                break
            update(view[done:end])
            done = end
            digests.append(_hexdigest(hasher))
    else:  # characters to bytes: each segment encoded once, the key decoded once
        done = 0
        for g in lengths:
            if whole and units <= g:
                update(text[done:].encode("utf-8", "surrogatepass"))
                digests.append(_hexdigest(hasher))
                break
            update(text[done:g].encode("utf-8", "surrogatepass"))
            done = g
            digests.append(_hexdigest(hasher))
    return KeyDigests(lengths, digests, units if whole else None)


class NativeDigests:
    """The digests of a native body, fed the pieces as they arrive (no copy)."""

    __slots__ = ("_digests", "_ended", "_fed", "_hasher", "_index", "_size", "lengths")

    def __init__(self, lengths: tuple[int, ...], seed: int = NO_TENANT):
        self.lengths = lengths
        self._hasher = mmh3.mmh3_x64_128(seed=seed)
        self._digests: list[str] = []
        self._index = 0  # the next length to reach
        self._fed = 0  # bytes hashed: the body's first ones, up to the largest length
        self._size = 0  # bytes seen
        self._ended = False

    def feed(self, data: Buffer) -> None:
        size = len(data)
        self._size += size
        lengths = self.lengths
        index = self._index
        if index == len(lengths):
            return  # past the largest length: nothing more to hash
        hasher = self._hasher
        fed = self._fed
        start = 0
        while True:
            boundary = lengths[index]
            end = start + boundary - fed  # where the next length falls in this piece
            if end > size:
                hasher.update(memoryview(data)[start:] if start else data)
                fed += size - start
                break
            hasher.update(memoryview(data)[start:end] if start or end < size else data)
            self._digests.append(_hexdigest(hasher))
            fed, start, index = boundary, end, index + 1
            if index == len(lengths) or start == size:
                break
        self._fed = fed
        self._index = index

    def ended(self) -> None:
        """The whole body has arrived."""
        self._ended = True

    def field(self) -> KeyDigests:
        """What the access line gets: the digests so far, and the whole body's
        when it ended short of a length (its key at that length and beyond)."""
        if not self._ended:
            return KeyDigests(self.lengths, list(self._digests), None)
        digests = self._digests
        index = self._index
        if index < len(self.lengths) and (index == 0 or self._fed > self.lengths[index - 1]):
            digests = [*digests, _hexdigest(self._hasher)]
        return KeyDigests(self.lengths, digests, self._size)


class KeyDigester:
    """One process's digest settings: the lengths, with the current PrefixLength."""

    __slots__ = ("_configured", "_merged")

    def __init__(self, lengths: Sequence[int]):
        self._configured = frozenset(lengths)
        self._merged: dict[int, tuple[int, ...]] = {}

    def lengths(self, prefix_length: int) -> tuple[int, ...]:
        merged = self._merged.get(prefix_length)
        if merged is None:
            merged = self._merged[prefix_length] = tuple(sorted(self._configured | {prefix_length}))
        return merged

    def openai(
        self,
        request: OpenAIRequest | BoundedRequest,
        key: bytes,
        limit: int,
        tenant: str | bytes | None,
    ) -> KeyDigests | None:
        """None for an invalid tenant key (the exchange answers it 400)."""
        try:
            seed = tenant_seed(tenant)
        except TenantKeyError:
            return None
        return openai_digests(request, key, limit, seed, self.lengths(limit))

    def native(self, prefix_length: int, seed: int) -> NativeDigests:
        return NativeDigests(self.lengths(prefix_length), seed)
