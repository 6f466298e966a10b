"""Engine-side cache isolation (issue 14 §4): the router's ``cache_salt``, in process
(uvloop and the stdlib loop; the daemon's side is ``tests/test_cache_salt.py``).

Against simulated instances that honour ``cache_salt`` as vLLM does (the salt
enters the first block's hash), two tenants sending one prompt to one instance
get no cross-tenant cache hit with the option on, and do with it off; against a
recording backend, the exact bytes forwarded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from router.cachesalt import salted_body
from router.heads import TENANT_HEADER
from tests.harness.backends import Backend
from tests.harness.http import connect, req
from tests.harness.routers import SimFleet, StartRouter
from tests.harness.salt import cached_tokens, client, salt_of

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "body", [b'{"a": [1, "}"], "b": {}}\n', b"{}", b" { \r\n } \n", b'{"x":"\\"}"}']
)
def test_salted_body_at_every_split(body: bytes) -> None:
    """The member lands before the closing brace wherever the body's pieces end."""
    member = b',"cache_salt":"s"'
    close = body.rindex(b"}")
    empty = b'"' not in body
    expected = body[:close] + (member[1:] if empty else member) + body[close:]
    one, _ = salted_body([body], member)
    assert b"".join(bytes(piece) for piece in one) == expected
    padded, _ = salted_body([body + b" " * 100], member)  # a long tail stays a view
    assert b"".join(bytes(piece) for piece in padded) == expected + b" " * 100
    for cut in range(len(body) + 1):
        for second in range(cut, len(body) + 1):
            pieces = [body[:cut], body[cut:second], body[second:]]
            out, added = salted_body(pieces, member)
            assert b"".join(bytes(piece) for piece in out) == expected
            assert added == len(expected) - len(body)
    json.loads(expected)


@pytest.mark.parametrize("enabled", [True, False])
async def test_two_tenants_with_one_prompt_share_no_cache_entry(
    sim_fleet: SimFleet, start_router: StartRouter, secret_file: Path, enabled: bool
) -> None:
    (sim,) = await sim_fleet(1)  # one instance: both tenants land on it
    cache_salt = {"enabled": enabled, "secret_file": str(secret_file)}
    router = await start_router([sim], cache_salt=cache_salt)
    async with client(router.port) as via:
        assert await cached_tokens(via, "tenant-a") == 0
        across = await cached_tokens(via, "tenant-b")  # the same prompt, another tenant
        again = await cached_tokens(via, "tenant-a")
        # A client's own salt is replaced: it cannot pick another tenant's entries.
        forged = await cached_tokens(via, "tenant-c", cache_salt="anything")
        forged_again = await cached_tokens(via, "tenant-d", cache_salt="anything")
    assert again > 500  # one tenant's own turns hit either way
    if enabled:
        assert across == forged == forged_again == 0
    else:  # the side channel the option closes
        assert across == again
        assert forged == 0  # a salt never seen: a miss
        assert forged_again == again  # two tenants, one client salt: a shared entry


async def test_keep_client_keeps_a_clients_own_salt(
    sim_fleet: SimFleet, start_router: StartRouter, secret_file: Path
) -> None:
    (sim,) = await sim_fleet(1)
    cache_salt = {"enabled": True, "secret_file": str(secret_file), "keep_client": True}
    router = await start_router([sim], cache_salt=cache_salt)
    async with client(router.port) as via:
        assert await cached_tokens(via, "tenant-a", cache_salt="team") == 0
        assert await cached_tokens(via, "tenant-b", cache_salt="team") > 500  # theirs, kept
        assert await cached_tokens(via, "tenant-b") == 0  # without one: the tenant's


async def test_a_tenant_header_is_the_tenant_whatever_prompt_cache_key_a_client_picks(
    sim_fleet: SimFleet, start_router: StartRouter, secret_file: Path
) -> None:
    # prompt_cache_key is the client's to choose: with a tenant header (an identity
    # a gateway sets), another tenant naming acme's key gets none of acme's entries,
    # and acme's own turns hit under any key.
    (sim,) = await sim_fleet(1)
    cache_salt = {"enabled": True, "secret_file": str(secret_file)}
    router = await start_router([sim], cache_salt=cache_salt, tenants={"header": "X-Tenant"})
    acme, other = {"X-Tenant": "acme"}, {"X-Tenant": "globex"}
    async with client(router.port) as via:
        assert await cached_tokens(via, "key-1", acme) == 0
        assert await cached_tokens(via, "key-1", other) == 0  # acme's key, not acme
        assert await cached_tokens(via, "key-2", acme) > 500  # acme's entry, another key


@pytest.mark.parametrize(
    ("options", "tenant"),
    [
        ({"prompt_cache_key": "tenant-a"}, "tenant-a"),
        ({"header": "acme"}, "acme"),
        ({}, ""),  # no tenant key: the empty one
        ({"prompt_cache_key": "tenant-a", "cache_salt": "mine"}, "tenant-a"),  # replaced
        ({"empty": True}, ""),
        ({"chunked": True, "prompt_cache_key": "t"}, "t"),
        ({"large": True, "prompt_cache_key": "t"}, "t"),  # keyed by the key worker
    ],
)
async def test_the_forwarded_body_is_the_clients_with_the_salt_inserted(
    backends: Any,
    start_router: StartRouter,
    secret_file: Path,
    options: dict[str, Any],
    tenant: str,
) -> None:
    backend: Backend = await backends()
    limits = {"key_offload_bytes": 4096}  # the large body goes through the key worker
    cache_salt = {"enabled": True, "secret_file": str(secret_file)}
    router = await start_router([backend.spec], cache_salt=cache_salt, limits=limits)
    if options.get("empty"):
        body = b"{ \n}"
    else:
        document: dict[str, Any] = {
            "model": "m",
            "messages": [{"role": "user", "content": "x" * (8000 if options.get("large") else 5)}],
        }
        for field in ("prompt_cache_key", "cache_salt"):
            if field in options:
                document[field] = options[field]
        body = json.dumps(document, indent=1).encode() + b"\n"
    headers = (
        b"%s: %s\r\n" % (TENANT_HEADER, options["header"].encode()) if "header" in options else b""
    )
    async with connect(router) as conn:
        if options.get("chunked"):
            message = req(
                b"POST", b"/v1/chat/completions", chunks=[body[:7], body[7:]], headers=headers
            )
        else:
            message = req(b"POST", b"/v1/chat/completions", body=body, headers=headers)
        await conn.send(message)
        assert (await conn.response()).status == 200
    (seen,) = backend.requests
    assert seen.value("content-length") == str(len(seen.body)).encode()
    forwarded = json.loads(seen.body)
    assert forwarded["cache_salt"] == salt_of(tenant)
    member = b',"cache_salt":"%s"' % salt_of(tenant).encode()
    close = body.rstrip().rindex(b"}")
    if options.get("empty"):
        member = member[1:]
    assert seen.body == body[:close] + member + body[close:]  # nothing else changed


async def test_off_the_body_goes_through_untouched(
    backends: Any, start_router: StartRouter
) -> None:
    backend: Backend = await backends()
    router = await start_router([backend.spec])
    assert router.salter is None
    body = b'{"model": "m", "messages": [], "prompt_cache_key": "t", "cache_salt": "c"}'
    async with connect(router) as conn:
        await conn.send(req(b"POST", b"/v1/chat/completions", body=body))
        assert (await conn.response()).status == 200
    assert backend.requests[0].body == body
