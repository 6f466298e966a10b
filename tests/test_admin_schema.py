"""Schemathesis against the running admin API: it does what /openapi.json says.

The app runs with a token, over a ``FakeControl`` with a few backends, on a loop
in a thread of its own: schemathesis calls it with blocking ``requests``, which
would stall a server on the test's own loop.  Schemathesis takes the document the
server serves, generates valid and invalid requests for every operation (missing
or wrong auth included, through the bearer scheme), sends them over loopback and
checks every answer: no 5xx, a documented status, a documented content type, and
a body that matches the documented schema.  Examples are bounded (25 per
operation) so the run stays within a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from admin import AdminServer
from admin.openapi import document
from router.app import Router
from router.config import build_config
from router.control.live import RouterControl
from router.state import StateFile
from tests.harness.control import TOKEN, FakeControl
from tests.harness.routers import router_config

AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHECKS = [
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    content_type_conformance,
]


@pytest.fixture(scope="module", params=["fake", "router"])
def admin_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """The admin API served from a loop in its own thread, over a ``FakeControl``
    or over a real ``Router`` and its ``RouterControl`` (with a state file)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="admin-api", daemon=True)
    thread.start()

    def run(coroutine: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=10)

    router: Router | None = None
    control: FakeControl | RouterControl
    if request.param == "fake":
        control = FakeControl("a", "b", "c")
    else:
        # Backends on ports nobody listens on; no active health checks, so
        # whatever backends schemathesis adds are never dialled.
        config = build_config(
            router_config(
                [("a", "http://127.0.0.1:9"), ("b", "http://127.0.0.1:9")],
                health={"active": False},
                # Schemathesis sets weights up to 1,000: at the default 1,024 points
                # per weight unit each such PATCH rebuilds a ring of ~1M points before
                # it answers (1.3-1.7 s alone, past requests' 10 s read timeout at load
                # 7.5).  The answers' shapes do not depend on the ring's size.
                vnodes=64,
            )
        )
        router = Router(config)
        state = StateFile(tmp_path_factory.mktemp("state") / "state.json")
        control = RouterControl(router, state)
        run(router.start())
    server = AdminServer(control, token=TOKEN)
    try:
        run(server.start("127.0.0.1", 0))
        yield f"http://127.0.0.1:{server.port}"
    finally:
        run(server.close())
        run(control.close())
        if router is not None:
            run(router.shutdown(grace=1))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


# Loaded at import, from the same document the app serves (``test_served_document``
# holds the two equal): schemathesis' ``from_fixture`` loader needs the private
# ``Node._nodeid`` that pytest 9.2 no longer has.
schema = schemathesis.openapi.from_dict(
    document(),
    config=schemathesis.Config.from_dict(
        {
            "auth": {"openapi": {"bearerAuth": {"bearer": TOKEN}}},
        }
    ),
)


def test_served_document(admin_url: str) -> None:
    request = urllib.request.Request(f"{admin_url}/openapi.json", headers=AUTH)
    with urllib.request.urlopen(request, timeout=10) as served:
        assert json.load(served) == json.loads(json.dumps(document()))


@schema.parametrize()
@settings(
    max_examples=12,  # 29 operations x 2 servers: ~700 calls per run keeps the suite in budget
    deadline=None,  # loopback latency is not what this test is about
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_admin_api_conforms_to_its_openapi_document(
    admin_url: str, case: schemathesis.Case[Any]
) -> None:
    case.call_and_validate(base_url=admin_url, checks=CHECKS)
