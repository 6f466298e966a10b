"""Key hashing: murmur over any buffer without copies, tenant seeds validated."""

import mmh3
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hashring import NO_TENANT, PrefixHasher, TenantKeyError, hash_key, tenant_seed


@given(st.binary(max_size=4096), st.integers(0, 2**32 - 1))
def test_hash_is_mmh3_x64_first_64_bits(data: bytes, seed: int) -> None:
    assert hash_key(data, seed) == mmh3.hash64(data, seed, signed=False)[0]


@given(st.binary(min_size=1, max_size=512), st.data())
def test_memoryview_slices_hash_like_the_bytes_they_show(data: bytes, draw: st.DataObject) -> None:
    start = draw.draw(st.integers(0, len(data)))
    stop = draw.draw(st.integers(start, len(data)))
    buffer = bytearray(data)  # writable, as a receive buffer would be
    assert hash_key(memoryview(buffer)[start:stop]) == hash_key(data[start:stop])


def test_hash_is_stable_across_processes() -> None:
    # Pinned vector: every router replica must agree, so the value may never drift.
    assert hash_key(b"hello prefix") == mmh3.hash64(b"hello prefix", 0, signed=False)[0]
    assert hash_key(b"") == 0


def test_tenant_changes_the_hash_and_is_deterministic() -> None:
    prompt = b"You are a helpful support agent. " * 20
    seeds = {tenant_seed(f"tenant-{i}") for i in range(50)}
    assert len(seeds) == 50
    assert NO_TENANT not in seeds
    hashes = {hash_key(prompt, seed) for seed in seeds}
    assert len(hashes) == 50
    assert hash_key(prompt, tenant_seed("tenant-7")) == hash_key(prompt, tenant_seed(b"tenant-7"))


@pytest.mark.parametrize("empty", [None, "", b""])
def test_empty_tenant_means_no_tenant(empty: str | bytes | None) -> None:
    assert tenant_seed(empty) == NO_TENANT


def test_tenant_key_of_64_ascii_characters_is_accepted() -> None:
    assert tenant_seed("k" * 64) != NO_TENANT


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("k" * 65, "65 characters long; at most 64"),
        (b"k" * 65, "65 characters long; at most 64"),
        ("café", "must be ASCII"),
        ("caf\xe9".encode("latin-1"), "must be ASCII"),
    ],
)
def test_bad_tenant_keys_are_rejected_with_a_clear_error(key: str | bytes, message: str) -> None:
    with pytest.raises(TenantKeyError, match=message):
        tenant_seed(key)


@given(st.binary(max_size=3000), st.integers(1, 2048), st.integers(0, 2**32 - 1), st.data())
def test_prefix_hasher_equals_one_shot_hash_however_the_body_is_split(
    body: bytes, limit: int, seed: int, data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8)))
    hasher = PrefixHasher(limit, seed)
    done = False
    for start, stop in zip([0, *cuts], [*cuts, len(body)], strict=True):
        done = hasher.feed(bytearray(body[start:stop]))
    assert done == (len(body) >= limit)
    assert hasher.digest() == hash_key(body[:limit], seed)
