"""The admin REST API over real loopback HTTP, against an in-memory ``FakeControl``.

``FakeControl`` (``tests/harness/control.py``) implements ``router.control.Control``
the way ``RouterControl`` behaves, with switches a test can flip: in-flight requests
(``hold``/``release``), readiness, and an exception the next read raises.  No
sleeps: tests wait on the fake's events.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from admin import AdminServer, load_token, make_app, requires_token
from admin.openapi import document
from admin.routes import ROUTES
from router.config import ConfigError, RoutingConfig
from router.control import Stats
from tests.harness.control import METRICS, TOKEN, FakeControl, conforms

# -- a client that remembers every answer ---------------------------------------------


@dataclasses.dataclass
class Reply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        assert self.headers["Content-Type"].startswith("application/json"), self.headers
        return msgspec.json.decode(self.body)

    def error(self, status: int, kind: str) -> dict[str, Any]:
        """The error object, after checking the status and the shape."""
        assert self.status == status, (self.status, self.body)
        detail: dict[str, Any] = self.json()["error"]
        assert detail["type"] == kind
        assert isinstance(detail["message"], str)
        assert detail["message"]
        assert ("fields" in detail) == (status == 422), detail
        assert b"Traceback" not in self.body
        return detail


class Api:
    def __init__(self, server: AdminServer, control: FakeControl, token: str | None) -> None:
        self.server = server
        self.control = control
        self.token = token
        self.base = f"http://127.0.0.1:{server.port}"
        self.session = aiohttp.ClientSession()
        self.replies: list[Reply] = []

    async def call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: Any = None,
        headers: dict[str, str] | None = None,
        authorized: bool = True,
        skip_auto_headers: tuple[str, ...] = (),
    ) -> Reply:
        sent = dict(headers or {})
        if authorized and self.token is not None:
            sent.setdefault("Authorization", f"Bearer {self.token}")
        if json is not None:
            data = msgspec.json.encode(json)
            sent.setdefault("Content-Type", "application/json")
        async with self.session.request(
            method,
            self.base + path,
            data=data,
            headers=sent,
            skip_auto_headers=skip_auto_headers,
        ) as response:
            reply = Reply(response.status, response.headers, await response.read())
        self.replies.append(reply)
        return reply

    async def close(self) -> None:
        await self.session.close()
        await self.server.close()
        await self.control.close()


Serve = Callable[..., Awaitable[Api]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``api = await serve(FakeControl("a"), token=...)``: the admin API on 127.0.0.1:0.

    At teardown, no answer of a server with a token may contain the token.
    """
    apis: list[Api] = []

    async def start(control: FakeControl | None = None, *, token: str | None = None) -> Api:
        control = control if control is not None else FakeControl()
        server = AdminServer(conforms(control), token=token)
        await server.start("127.0.0.1", 0)
        api = Api(server, control, token)
        apis.append(api)
        return api

    try:
        yield start
        for api in apis:
            if api.token is not None:
                for reply in api.replies:
                    assert api.token.encode() not in reply.body
                    assert all(api.token not in value for value in reply.headers.values())
    finally:
        for api in apis:
            await api.close()


@pytest.fixture
async def api(serve: Serve) -> Api:
    return await serve(FakeControl("a", "b"))


# -- backends ---------------------------------------------------------------------------


async def test_list_add_get_backends(api: Api) -> None:
    reply = await api.call("GET", "/admin/backends")
    assert reply.status == 200
    assert [b["name"] for b in reply.json()] == ["a", "b"]

    reply = await api.call(
        "POST", "/admin/backends", json={"name": "c", "url": "http://10.0.0.3:8000", "weight": 3}
    )
    assert reply.status == 201
    assert reply.headers["Location"] == "/admin/backends/c"
    created = reply.json()
    assert (created["name"], created["url"], created["weight"]) == ("c", "http://10.0.0.3:8000", 3)
    assert created["state"] == "active"

    reply = await api.call("GET", "/admin/backends/c")
    assert reply.status == 200
    assert reply.json() == created
    names = [b["name"] for b in (await api.call("GET", "/admin/backends")).json()]
    assert names == ["a", "b", "c"]


async def test_add_backend_weight_defaults_to_one(api: Api) -> None:
    reply = await api.call("POST", "/admin/backends", json={"name": "c", "url": "http://h:1"})
    assert reply.status == 201
    assert reply.json()["weight"] == 1


async def test_add_duplicate_backend_is_409(api: Api) -> None:
    reply = await api.call("POST", "/admin/backends", json={"name": "a", "url": "http://h:1"})
    assert "already exists" in reply.error(409, "conflict")["message"]


@pytest.mark.parametrize(
    ("body", "path", "words"),
    [
        ({"name": "c", "url": "ftp://h:1"}, "$.url", "http://"),
        ({"name": "c", "url": "http://h:1/v1"}, "$.url", "path"),
        ({"name": "c", "url": "http://h:99999"}, "$.url", "port"),
        ({"name": "c", "url": "http://:80"}, "$.url", "host"),
        ({"name": "c", "url": "http://h:0"}, "$.url", "port from 1 to 65535"),
        ({"name": "c", "url": "http://h:"}, "$.url", "port from 1 to 65535"),
        ({"name": "c", "url": "http://a b:80"}, "$.url", "spaces"),
        ({"name": "c", "url": "http://h\n:80"}, "$.url", "control characters"),
        ({"name": "c", "url": "http://-h:80"}, "$.url", "invalid host name"),
        ({"name": "c", "url": "http://[::g]:80"}, "$.url", "invalid"),
        ({"name": "c", "url": "http://user:pw@h:80"}, "$.url", "credentials"),
        ({"name": "c", "url": "http://user@h:80"}, "$.url", "credentials"),
        ({"name": "c", "url": 5}, "$.url", "str"),
        ({"name": "c", "url": "http://h:1", "weight": 0}, "$.weight", ">= 1"),
        ({"name": "c", "url": "http://h:1", "weight": 1001}, "$.weight", "<= 1000"),
        ({"name": "c", "url": "http://h:1", "weight": 1.5}, "$.weight", "int"),
        ({"name": "c", "url": "http://h:1", "weight": "2"}, "$.weight", "int"),
        ({"name": "c", "url": "http://h:1", "weight": True}, "$.weight", "int"),
        ({"name": "c", "url": "http://h:1", "weight": 10**30}, "$.weight", ""),
        ({"name": "-c", "url": "http://h:1"}, "$.name", "match"),
        ({"name": "c" * 65, "url": "http://h:1"}, "$.name", "match"),
        ({"url": "http://h:1"}, "$.name", "missing"),
        ({"name": "c", "url": "http://h:1", "port": 1}, "$.port", "unknown"),
        (
            {"name": "c", "url": "http://h:1", "health": {"interval": 1e-9}},
            "$.health.interval",
            ">= 0.05",
        ),
        (
            {"name": "c", "url": "http://h:1", "health": {"timeout": 0.001}},
            "$.health.timeout",
            ">= 0.05",
        ),
        ([{"name": "c"}], "$", "object"),
        ({"name": "c", "url": "http://h:1", "models": ["m", "n", "m"]}, "$.models[2]", "twice"),
        ({"name": "c", "url": "ftp://h:1", "models": ["m", "m"]}, "$.models[1]", "'m'"),
        ({"name": "c", "url": "http://h:1", "models": ["m", 5]}, "$.models[1]", "str"),
        ({"name": "c", "url": "http://h:1", "models": "m"}, "$.models", "array"),
    ],
)
async def test_add_backend_bad_values_are_422_with_the_field(
    api: Api, body: Any, path: str, words: str
) -> None:
    detail = (await api.call("POST", "/admin/backends", json=body)).error(422, "validation_error")
    assert detail["fields"][0]["path"] == path
    assert words in detail["fields"][0]["message"]
    assert detail["message"] == detail["fields"][0]["message"]
    assert "pw" not in detail["message"]  # credentials are never quoted back
    assert len(api.control.views()) == 2  # nothing was added


async def test_unknown_backend_is_404(api: Api) -> None:
    for method, body in [("GET", None), ("PATCH", {"weight": 2}), ("DELETE", None)]:
        reply = await api.call(method, "/admin/backends/nope", json=body)
        assert "nope" in reply.error(404, "not_found")["message"]


async def test_patch_backend(api: Api) -> None:
    reply = await api.call("PATCH", "/admin/backends/a", json={"weight": 7})
    assert reply.status == 200
    assert (reply.json()["weight"], reply.json()["state"]) == (7, "active")
    reply = await api.call("PATCH", "/admin/backends/a", json={"state": "draining"})
    assert (reply.json()["weight"], reply.json()["state"]) == (7, "draining")
    reply = await api.call("PATCH", "/admin/backends/a", json={})
    assert reply.status == 200
    assert (reply.json()["weight"], reply.json()["state"]) == (7, "draining")


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"state": "down"}, "$.state"),
        ({"state": 1}, "$.state"),
        ({"weight": 0}, "$.weight"),
        ({"weight": 1001}, "$.weight"),
        ({"weight": "heavy"}, "$.weight"),
        ({"name": "b"}, "$.name"),
        ("active", "$"),
    ],
)
async def test_patch_bad_values_are_422(api: Api, body: Any, path: str) -> None:
    detail = (await api.call("PATCH", "/admin/backends/a", json=body)).error(
        422, "validation_error"
    )
    assert detail["fields"][0]["path"] == path
    assert api.control.view("a").weight == 1


# -- drain and remove ---------------------------------------------------------------------


async def test_delete_answers_202_at_once_then_removes_when_idle(api: Api) -> None:
    api.control.hold("a")
    reply = await api.call("DELETE", "/admin/backends/a")
    assert reply.status == 202
    assert reply.json() == {
        "name": "a",
        "state": "draining",
        "in_flight": 1,
        "timeout_s": 30.0,
        "forced": False,
    }
    assert (await api.call("GET", "/admin/backends/a")).json()["state"] == "draining"
    api.control.release("a")
    await api.control.drained("a")
    (await api.call("GET", "/admin/backends/a")).error(404, "not_found")


async def test_delete_wait_answers_200_when_removed(api: Api) -> None:
    api.control.hold("a")
    pending = asyncio.create_task(api.call("DELETE", "/admin/backends/a?wait=true&timeout=60"))
    await api.control.drain_started.wait()
    assert not pending.done()
    api.control.release("a")
    reply = await pending
    assert reply.status == 200
    assert reply.json() == {
        "name": "a",
        "state": "removed",
        "in_flight": 0,
        "timeout_s": 60.0,
        "forced": False,
    }
    names = [b["name"] for b in (await api.call("GET", "/admin/backends")).json()]
    assert names == ["b"]


async def test_delete_wait_forces_removal_at_the_timeout(api: Api) -> None:
    api.control.hold("a")
    reply = await api.call("DELETE", "/admin/backends/a?wait=TRUE&timeout=0")
    assert reply.status == 200
    assert (reply.json()["state"], reply.json()["forced"]) == ("removed", True)


async def test_delete_of_an_idle_backend_with_wait_false(api: Api) -> None:
    reply = await api.call("DELETE", "/admin/backends/b?wait=false&timeout=2.5")
    assert reply.status == 202
    assert (reply.json()["in_flight"], reply.json()["timeout_s"]) == (0, 2.5)
    await api.control.drained("b")
    (await api.call("GET", "/admin/backends/b")).error(404, "not_found")


async def test_cancelled_drain_answers_409_to_the_waiting_delete(api: Api) -> None:
    api.control.hold("a")
    pending = asyncio.create_task(api.call("DELETE", "/admin/backends/a?wait=true"))
    await api.control.drain_started.wait()
    reply = await api.call("PATCH", "/admin/backends/a", json={"state": "active"})
    assert reply.json()["state"] == "active"
    (await pending).error(409, "conflict")


@pytest.mark.parametrize(
    ("query", "path"),
    [
        ("timeout=-1", "?timeout"),
        ("timeout=3600.5", "?timeout"),
        ("timeout=nan", "?timeout"),
        ("timeout=inf", "?timeout"),
        ("timeout=soon", "?timeout"),
        ("timeout=", "?timeout"),
        ("timeout=1&timeout=2", "?timeout"),
        ("wait=yes", "?wait"),
        ("wait=", "?wait"),
    ],
)
async def test_delete_bad_query_is_422(api: Api, query: str, path: str) -> None:
    detail = (await api.call("DELETE", f"/admin/backends/a?{query}")).error(422, "validation_error")
    assert detail["fields"][0]["path"] == path
    assert api.control.view("a").state == "active"  # nothing started


async def test_delete_timeout_bounds_are_inclusive(api: Api) -> None:
    assert (await api.call("DELETE", "/admin/backends/a?timeout=3600")).status == 202
    assert (await api.call("DELETE", "/admin/backends/b?timeout=0")).status == 202


# -- routing config ------------------------------------------------------------------------


async def test_routing_get_is_the_sagemaker_document(api: Api) -> None:
    reply = await api.call("GET", "/admin/routing")
    assert reply.status == 200
    assert reply.json() == RoutingConfig().document()
    assert reply.json()["RoutingConfig"]["RoutingStrategy"] == "PREFIX_AWARE"


@pytest.mark.parametrize(("length", "threshold"), [(1024, 1), (65_536, 1024), (8192, 32)])
async def test_routing_put_round_trip(api: Api, length: int, threshold: int) -> None:
    document = {
        "RoutingConfig": {
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": {
                "PrefixLength": length,
                "ConcurrencyThreshold": threshold,
                "BalanceFactor": 1.25,
                "BalanceMode": "TRAFFIC",
                "ConcurrencyScope": "PREFILL",
                "SessionKeys": ["header", "prompt_cache_key", "prefix"],
                "SessionHeader": "X-Conversation",
            },
        }
    }
    reply = await api.call("PUT", "/admin/routing", json=document)
    assert reply.status == 200
    assert reply.json() == document
    assert (await api.call("GET", "/admin/routing")).json() == document
    assert api.control.routing().prefix_aware.prefix_length == length


async def test_routing_put_accepts_the_bare_inner_object(api: Api) -> None:
    reply = await api.call("PUT", "/admin/routing", json={"RoutingStrategy": "RANDOM"})
    assert reply.status == 200
    inner = reply.json()["RoutingConfig"]
    assert inner["RoutingStrategy"] == "RANDOM"
    assert inner["PrefixAwareRoutingConfig"]["PrefixLength"] == 4096  # the default
    assert api.control.routing().strategy.value == "RANDOM"


@pytest.mark.parametrize(
    ("inner", "path", "words"),
    [
        ({"PrefixAwareRoutingConfig": {"PrefixLength": 1023}}, "PrefixLength", ">= 1024"),
        ({"PrefixAwareRoutingConfig": {"PrefixLength": 65_537}}, "PrefixLength", "<= 65536"),
        ({"PrefixAwareRoutingConfig": {"ConcurrencyThreshold": 0}}, "ConcurrencyThreshold", ">= 1"),
        (
            {"PrefixAwareRoutingConfig": {"ConcurrencyThreshold": 1025}},
            "ConcurrencyThreshold",
            "<= 1024",
        ),
        ({"PrefixAwareRoutingConfig": {"BalanceFactor": 0.5}}, "BalanceFactor", ">= 1.0"),
        ({"PrefixAwareRoutingConfig": {"Prefix": 1}}, "Prefix", "unknown"),
        ({"RoutingStrategy": "ROUND_ROBIN"}, "", "ROUND_ROBIN"),
        (
            {"PrefixAwareRoutingConfig": {"SessionKeys": ["user", "prefix"]}},
            "SessionKeys[0]",
            "user",
        ),
        ({"PrefixAwareRoutingConfig": {"SessionKeys": []}}, "SessionKeys", "length >= 1"),
        ({"PrefixAwareRoutingConfig": {"SessionHeader": "X Session"}}, "SessionHeader", "regex"),
    ],
)
async def test_routing_put_out_of_range_is_422_with_the_field(
    api: Api, inner: dict[str, Any], path: str, words: str
) -> None:
    field = (
        f"PrefixAwareRoutingConfig.{path}"
        if "PrefixAwareRoutingConfig" in inner
        else "RoutingStrategy"
    )
    for body, prefix in [({"RoutingConfig": inner}, "$.RoutingConfig."), (inner, "$.")]:
        detail = (await api.call("PUT", "/admin/routing", json=body)).error(422, "validation_error")
        assert detail["fields"] == [{"path": prefix + field, "message": detail["message"]}]
        assert words in detail["message"]
    assert api.control.routing() == RoutingConfig()  # unchanged


@pytest.mark.parametrize(
    ("inner", "words"),
    [
        ({"SessionKeys": ["header", "prefix", "conversation"]}, "must end with prefix"),
        ({"SessionKeys": ["header", "header", "prefix"]}, "lists a source twice"),
        ({"SessionHeader": "Host"}, "a header the router reads or sets"),
        ({"SessionHeader": "x-amzn-sagemaker-prefix-aware-id"}, "a header the router reads"),
    ],
)
async def test_routing_put_inconsistent_session_keys_are_422(
    api: Api, inner: dict[str, Any], words: str
) -> None:
    body = {"RoutingConfig": {"PrefixAwareRoutingConfig": inner}}
    detail = (await api.call("PUT", "/admin/routing", json=body)).error(422, "validation_error")
    assert detail["fields"][0]["path"] == "$.RoutingConfig.PrefixAwareRoutingConfig"
    assert words in detail["message"]
    assert api.control.routing() == RoutingConfig()  # unchanged


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({"RoutingConfig": 5}, "$.RoutingConfig"),
        ({"RoutingConfig": {}, "Extra": 1}, "$.Extra"),
        ([], "$"),
        ("PREFIX_AWARE", "$"),
    ],
)
async def test_routing_put_wrong_shapes_are_422(api: Api, body: Any, path: str) -> None:
    detail = (await api.call("PUT", "/admin/routing", json=body)).error(422, "validation_error")
    assert detail["fields"][0]["path"] == path


# -- stats, probes, metrics -----------------------------------------------------------------


async def test_stats(api: Api) -> None:
    api.control.hold("b", 2)
    reply = await api.call("GET", "/admin/stats")
    assert reply.status == 200
    stats = msgspec.json.decode(reply.body, type=Stats)
    assert stats.strategy == "PREFIX_AWARE"
    assert [b.name for b in stats.backends] == ["a", "b"]
    assert stats.totals.in_flight == 2


async def test_healthz_and_readyz(api: Api) -> None:
    reply = await api.call("GET", "/healthz")
    assert (reply.status, reply.json()) == (200, {"status": "ok"})
    reply = await api.call("GET", "/readyz")
    assert (reply.status, reply.json()) == (200, {"status": "ready"})
    api.control.is_ready = False
    reply = await api.call("GET", "/readyz")
    assert (reply.status, reply.json()) == (503, {"status": "not_ready"})
    assert (await api.call("GET", "/healthz")).status == 200


async def test_metrics_are_prometheus_text(api: Api) -> None:
    reply = await api.call("GET", "/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert reply.body == METRICS


# -- bad requests ----------------------------------------------------------------------------


@pytest.mark.parametrize("body", [b'{"name": "c", ', b"{'name': 'c'}", b"\xff\xfe", b"  ", b""])
async def test_unreadable_json_is_400(api: Api, body: bytes) -> None:
    reply = await api.call(
        "POST", "/admin/backends", data=body, headers={"Content-Type": "application/json"}
    )
    reply.error(400, "bad_request")


@pytest.mark.parametrize(
    "nested", [b"[" * 1000 + b"]" * 1000, b'{"a":' * 1000 + b"1" + b"}" * 1000]
)
async def test_json_nested_too_deep_is_400(api: Api, nested: bytes) -> None:
    # Well under MAX_BODY; the untyped decode of a routing document raised
    # RecursionError (a 500) where a malformed body is a 400.
    before = api.control.routing()
    reply = await api.call(
        "PUT", "/admin/routing", data=nested, headers={"Content-Type": "application/json"}
    )
    detail = reply.error(400, "bad_request")
    assert "nesting too deep" in detail["message"]
    assert api.control.routing() == before


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "application/json; charset=latin-1"],
)
async def test_non_json_content_type_is_415(api: Api, content_type: str) -> None:
    reply = await api.call(
        "PUT", "/admin/routing", data=b"{}", headers={"Content-Type": content_type}
    )
    reply.error(415, "unsupported_media_type")


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=UTF-8", "application/merge-patch+json"]
)
async def test_json_content_types_are_accepted(api: Api, content_type: str) -> None:
    reply = await api.call(
        "PATCH", "/admin/backends/a", data=b'{"weight": 2}', headers={"Content-Type": content_type}
    )
    assert reply.status == 200


async def test_a_body_without_content_type_is_read_as_json(api: Api) -> None:
    reply = await api.call(
        "PATCH", "/admin/backends/a", data=b'{"weight": 2}', skip_auto_headers=("Content-Type",)
    )
    assert reply.status == 200
    assert reply.json()["weight"] == 2


async def test_oversize_body_is_413(api: Api) -> None:
    padding = "x" * (64 * 1024)
    reply = await api.call(
        "PUT", "/admin/routing", json={"RoutingStrategy": "RANDOM", "p": padding}
    )
    assert "65536" in reply.error(413, "payload_too_large")["message"]

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: aiohttp's own check
        yield b'{"RoutingStrategy": "RANDOM", "p": "'
        for _ in range(70):
            yield b"x" * 1024
        yield b'"}'

    reply = await api.call(
        "PUT", "/admin/routing", data=chunks(), headers={"Content-Type": "application/json"}
    )
    reply.error(413, "payload_too_large")
    assert api.control.routing() == RoutingConfig()


async def test_unknown_path_is_404_json(api: Api) -> None:
    for path in ["/", "/admin", "/admin/backends/a/b", "/v1/chat/completions", "/healthz/"]:
        (await api.call("GET", path)).error(404, "not_found")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/admin/backends", {"GET", "POST"}),
        ("POST", "/admin/backends/a", {"GET", "PATCH", "DELETE"}),
        ("DELETE", "/admin/routing", {"GET", "PUT"}),
        ("POST", "/healthz", {"GET"}),
        ("HEAD", "/admin/stats", {"GET"}),
    ],
)
async def test_wrong_method_is_405_json(
    api: Api, method: str, path: str, allowed: set[str]
) -> None:
    reply = await api.call(method, path)
    assert reply.status == 405
    assert {m.strip() for m in reply.headers["Allow"].split(",")} == allowed
    if method != "HEAD":  # a HEAD answer has no body
        assert method in reply.error(405, "method_not_allowed")["message"]


async def test_control_invalid_is_422(api: Api) -> None:
    from router.control import Invalid

    async def refuse(routing: RoutingConfig) -> RoutingConfig:
        raise Invalid("PREFIX_AWARE needs at least one backend")

    api.control.set_routing = refuse  # type: ignore[method-assign]
    detail = (await api.call("PUT", "/admin/routing", json={})).error(422, "validation_error")
    assert detail["fields"] == [{"path": "$", "message": "PREFIX_AWARE needs at least one backend"}]


async def test_unexpected_exception_is_500_without_details(
    api: Api, caplog: pytest.LogCaptureFixture
) -> None:
    api.control.fail_next = RuntimeError("internal detail /etc/secret")
    with caplog.at_level(logging.ERROR, logger="prefix_router.admin"):
        reply = await api.call("GET", "/admin/stats")
    detail = reply.error(500, "internal_error")
    assert b"secret" not in reply.body
    assert "RuntimeError" not in detail["message"]
    assert "internal detail /etc/secret" in caplog.text  # the log has it, with the traceback
    assert "Traceback" in caplog.text
    assert (await api.call("GET", "/admin/stats")).status == 200  # the server carries on


# -- auth ------------------------------------------------------------------------------------


async def test_token_is_required_everywhere_but_the_probes(serve: Serve) -> None:
    api = await serve(FakeControl("a"), token=TOKEN)
    for method, path, _ in ROUTES:
        path = path.replace("{name}", "a")
        if path in ("/healthz", "/readyz"):
            reply = await api.call(method, path, authorized=False)
            assert reply.status == 200
            continue
        reply = await api.call(method, path, json={}, authorized=False)
        assert "missing" in reply.error(401, "unauthorized")["message"]
        assert reply.headers["WWW-Authenticate"] == 'Bearer realm="prefix-router"'
    assert api.control.view("a").state == "active"  # the DELETE did nothing


@pytest.mark.parametrize(
    "header",
    [
        "Bearer wrong",
        f"Bearer {TOKEN}x",
        f"Bearer {TOKEN[:-1]}",
        f"Basic {TOKEN}",
        TOKEN,
        "Bearer ",
        "Bearer caf\u00e9",
    ],
)
async def test_wrong_token_is_401(serve: Serve, header: str) -> None:
    api = await serve(FakeControl("a"), token=TOKEN)
    reply = await api.call("GET", "/admin/backends", headers={"Authorization": header})
    detail = reply.error(401, "unauthorized")
    assert reply.headers["WWW-Authenticate"].startswith('Bearer realm="prefix-router"')
    assert "wrong" not in detail["message"]
    assert "caf" not in detail["message"]


async def test_right_token_is_accepted(serve: Serve) -> None:
    api = await serve(FakeControl("a"), token=TOKEN)
    assert (await api.call("GET", "/admin/backends")).status == 200
    reply = await api.call("GET", "/admin/backends", headers={"Authorization": f"bearer  {TOKEN}"})
    assert reply.status == 200
    assert (await api.call("GET", "/openapi.json")).status == 200
    # Unknown paths answer 401 too: no probing for what exists without the token.
    (await api.call("GET", "/admin/nothing", authorized=False)).error(401, "unauthorized")
    (await api.call("GET", "/admin/nothing")).error(404, "not_found")


async def test_token_never_logged(serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        api = await serve(FakeControl("a"), token=TOKEN)
        await api.call("GET", "/admin/backends")
        await api.call("GET", "/admin/backends", headers={"Authorization": "Bearer guess"})
        api.control.fail_next = RuntimeError("boom")
        await api.call("GET", "/admin/stats")
    assert "boom" in caplog.text
    assert TOKEN not in caplog.text
    assert "guess" not in caplog.text


async def test_malformed_request_does_not_log_its_headers(
    serve: Serve, caplog: pytest.LogCaptureFixture
) -> None:
    # aiohttp's parser answers this itself (400, before any middleware) and its error
    # quotes the bad line: here, the Authorization header.
    api = await serve(FakeControl("a"), token=TOKEN)
    reader, writer = await asyncio.open_connection("127.0.0.1", api.server.port)
    with caplog.at_level(logging.DEBUG):
        writer.write(
            b"GET /admin/backends HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\x01\r\n\r\n"
        )
        head = await reader.readline()
        await reader.read()
    writer.close()
    await writer.wait_closed()
    assert head.startswith(b"HTTP/1.0 400")
    assert "request text withheld" in caplog.text
    assert TOKEN not in caplog.text


@pytest.mark.parametrize(
    ("host", "needed"),
    [
        ("127.0.0.1", False),
        ("127.8.9.10", False),
        ("::1", False),
        ("[::1]", False),
        ("::ffff:127.0.0.1", False),
        ("localhost", False),
        ("LocalHost.", False),
        ("0.0.0.0", True),
        ("::", True),
        ("", True),
        ("10.1.2.3", True),
        ("192.168.0.1", True),
        ("fe80::1%eth0", True),
        ("router.internal", True),
        ("localhost.example.com", True),
    ],
)
def test_requires_token(host: str, needed: bool) -> None:
    assert requires_token(host) is needed


async def test_server_refuses_a_public_address_without_token() -> None:
    server = AdminServer(FakeControl(), token=None)
    with pytest.raises(ConfigError, match="needs a token"):
        await server.start("0.0.0.0", 0)
    await server.close()


def test_make_app_refuses_a_token_no_client_can_send() -> None:
    with pytest.raises(ConfigError, match="visible ASCII"):
        make_app(FakeControl(), token="two words")


def test_load_token(tmp_path: Path) -> None:
    file = tmp_path / "token"
    file.write_text("  from-file\n")
    env = {"PREFIX_ROUTER_ADMIN_TOKEN": " from-env "}
    assert load_token(str(file), env) == "from-file"  # the file wins
    assert load_token(None, env) == "from-env"
    assert load_token(None, {}) is None
    assert load_token(None, {"PREFIX_ROUTER_ADMIN_TOKEN": "  "}) is None


def test_load_token_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n \n")
    with pytest.raises(ConfigError, match=re.escape(f"admin token file {empty} is empty")):
        load_token(str(empty), {"PREFIX_ROUTER_ADMIN_TOKEN": "ignored"})
    with pytest.raises(ConfigError, match=r"cannot read admin token file .*missing"):
        load_token(str(tmp_path / "missing"), {})
    spaced = tmp_path / "spaced"
    spaced.write_text("two words\n")
    with pytest.raises(ConfigError, match="visible ASCII") as info:
        load_token(str(spaced), {})
    assert "two words" not in str(info.value)
    with pytest.raises(ConfigError, match="PREFIX_ROUTER_ADMIN_TOKEN"):
        load_token(None, {"PREFIX_ROUTER_ADMIN_TOKEN": "caf\u00e9"})


# -- the document ------------------------------------------------------------------------------


async def test_openapi_document_matches_the_routes(api: Api) -> None:
    reply = await api.call("GET", "/openapi.json")
    assert reply.status == 200
    served = reply.json()
    assert served == msgspec.json.decode(msgspec.json.encode(document()))
    assert served["openapi"] == "3.1.0"
    documented = {
        (method.upper(), path)
        for path, item in served["paths"].items()
        for method in item
        if method != "parameters"
    }
    assert documented == {(method, path) for method, path, _ in ROUTES}
    app_routes = {
        (route.method, route.resource.canonical)
        for route in make_app(FakeControl(), token=None).router.routes()
        if route.resource is not None
    }
    assert app_routes == documented
    assert served["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    for path in ("/healthz", "/readyz"):
        assert served["paths"][path]["get"]["security"] == []
    error = served["components"]["schemas"]["ErrorDetail"]
    assert set(error["properties"]) == {"message", "type", "fields"}
    for status in ("401", "404", "409", "422"):
        assert status in served["paths"]["/admin/backends/{name}"]["delete"]["responses"]


def test_the_config_view_leaves_out_passwords_in_urls_and_the_label_key() -> None:
    from router.config import build_config
    from router.control.configview import public

    config = build_config(
        {
            "etcd": ["http://root:hunter2@127.0.0.1:2379", "http://127.0.0.1:2380"],
            "otel": {"endpoint": "https://svc:s3cret@collector.example:4318"},
            "discover": {"source": "dns:vllm:8000"},
            "tenants": {"label_key": "0123456789abcdef-key"},
            "backends": [{"name": "b0", "url": "http://127.0.0.1:9000"}],
        }
    )
    shown = public(config)
    text = json.dumps(shown)
    for secret in ("hunter2", "s3cret", "0123456789abcdef-key"):
        assert secret not in text
    assert shown["etcd"] == ["http://root:<redacted>@127.0.0.1:2379", "http://127.0.0.1:2380"]
    assert shown["otel"]["endpoint"] == "https://svc:<redacted>@collector.example:4318"
    assert shown["tenants"]["label_key"] == "<redacted>"
    assert "backends" not in shown
    assert shown["RoutingConfig"]["RoutingStrategy"] == "PREFIX_AWARE"
    token_only = build_config({"otel": {"endpoint": "http://apikey123@collector:4318"}})
    assert public(token_only)["otel"]["endpoint"] == "http://<redacted>@collector:4318"


def test_every_config_field_is_applied_by_a_reload_or_waits_for_a_restart() -> None:
    """A field missing from both lists would be shown as running by /admin/config
    while the reload dropped it silently."""
    from admin.reload import RESTART_FIELDS
    from router.config import Config

    live = {"timeouts", "limits", "retries", "routing", "backends"}
    fields = set(Config.__struct_fields__)
    assert fields == live | set(RESTART_FIELDS), fields ^ (live | set(RESTART_FIELDS))


async def test_an_expectation_other_than_100_continue_gets_a_json_417(api: Api) -> None:
    """aiohttp's own answer was a plain-text 417 quoting the header back (a
    generated OpenAPI case found it: no operation listed 417)."""
    refused = await api.call("GET", "/admin/stats", headers={"Expect": "3"})
    assert refused.status == 417
    error = json.loads(refused.body)["error"]
    assert error == {
        "message": "the only Expect the admin API takes is 100-continue",
        "type": "expectation_failed",
    }
    spec = {"name": "c", "url": "http://127.0.0.1:9009"}
    added = await api.call("POST", "/admin/backends", json=spec, headers={"Expect": "100-continue"})
    assert added.status == 201
