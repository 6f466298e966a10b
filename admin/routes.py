"""The admin API's handlers and its route table.

Contract:
- ``ROUTES`` is the whole API: (method, path, handler).  ``openapi`` describes the
  same (method, path) pairs by hand, and a test holds the two equal.
- A handler reads its input through ``bodies`` (which raises the 4xx errors; a
  check msgspec would report on the whole object is made here first, at its
  field), calls one ``Control`` method, and encodes the view it gets back.  It never catches an
  error: ``ControlError`` s and ``RequestError`` s are translated by the app's
  error middleware.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from router.config import BackendSpec, RoutingConfig
from router.control import BackendPatch, Control
from router.explain import DEFAULT_K, MAX_K, DryRequest

from .bodies import convert, decode, parse, query_bool, query_int, query_seconds, read_json
from .errors import FieldError, RequestError, ValidationFailed
from .schemas import Probe, RoutingDocument

__all__ = [
    "CONTROL",
    "DRAIN_TIMEOUT_DEFAULT",
    "DRAIN_TIMEOUT_MAX",
    "METRICS_CONTENT_TYPE",
    "OPENAPI",
    "ROUTES",
    "json_response",
]

CONTROL = web.AppKey("control", Control)
OPENAPI = web.AppKey("openapi", bytes)  # the encoded document, built once per app

# A drain longer than an hour is a mistake (a typo of units), not a plan.
DRAIN_TIMEOUT_DEFAULT = 30.0
DRAIN_TIMEOUT_MAX = 3600.0
# The Prometheus text exposition format, version 0.0.4: what every scraper accepts.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_encoder = msgspec.json.Encoder()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(
    value: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_encoder.encode(value),
        status=status,
        headers=headers,
        content_type="application/json",
    )


# -- backends -----------------------------------------------------------------------


async def list_backends(request: web.Request) -> web.Response:
    return json_response(await request.app[CONTROL].backends())


async def add_backend(request: web.Request) -> web.Response:
    data = parse(await read_json(request))
    # BackendSpec checks its url and its models in __post_init__, which msgspec reports
    # on the whole object: the models are checked here first, so that what is left of
    # a whole-object error is the url's.
    _refuse_repeated_models(data)
    spec = convert(data, BackendSpec, root_field="url")
    view = await request.app[CONTROL].add_backend(spec)
    return json_response(view, status=201, headers={"Location": f"/admin/backends/{view.name}"})


def _refuse_repeated_models(data: object) -> None:
    """422 at the second ``$.models[i]`` that names a model listed before it."""
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return  # absent, or the wrong type: convert's error
    seen: set[str] = set()
    for i, model in enumerate(models):
        if isinstance(model, str):
            if model in seen:
                raise ValidationFailed(
                    [FieldError(f"$.models[{i}]", f"model {model[:256]!r} is listed twice")]
                )
            seen.add(model)


async def get_backend(request: web.Request) -> web.Response:
    return json_response(await request.app[CONTROL].backend(request.match_info["name"]))


async def patch_backend(request: web.Request) -> web.Response:
    patch = decode(await read_json(request), BackendPatch)
    view = await request.app[CONTROL].update_backend(request.match_info["name"], patch)
    return json_response(view)


async def delete_backend(request: web.Request) -> web.Response:
    """Drain, then remove: 202 at once, or 200 with the final view when ``?wait=true``."""
    wait = query_bool(request, "wait", False)
    timeout = query_seconds(
        request, "timeout", DRAIN_TIMEOUT_DEFAULT, low=0.0, high=DRAIN_TIMEOUT_MAX
    )
    view = await request.app[CONTROL].remove_backend(
        request.match_info["name"], timeout=timeout, wait=wait
    )
    return json_response(view, status=200 if wait else 202)


# -- routing config, stats ------------------------------------------------------------


async def get_routing(request: web.Request) -> web.Response:
    return json_response(request.app[CONTROL].routing().document())


async def put_routing(request: web.Request) -> web.Response:
    data = parse(await read_json(request))
    # The SageMaker document or its bare inner object, told apart by the one key, as
    # router.config.parse_routing does; unlike it, errors keep their field path.
    if isinstance(data, dict) and "RoutingConfig" in data:
        routing = convert(data, RoutingDocument).routing_config
    else:
        routing = convert(data, RoutingConfig)
    control = request.app[CONTROL]
    if routing.split == "BACKENDS":
        # A config valid alone that this fleet cannot hold: each arm needs a backend
        # of its own (router.split; a fleet that shrinks later suspends the split).
        backends = len(await control.backends())
        if backends < routing.active_arms:
            raise RequestError(
                f"Split BACKENDS gives each arm with a Weight above 0 backends of its own:"
                f" {routing.active_arms} arms need {routing.active_arms} backends, the fleet"
                f" has {backends}"
            )
    applied = await control.set_routing(routing)
    return json_response(applied.document())


async def get_stats(request: web.Request) -> web.Response:
    return json_response(await request.app[CONTROL].stats())


async def get_config(request: web.Request) -> web.Response:
    """The running configuration, where it came from, its reloads (router.control.configview)."""
    return json_response(request.app[CONTROL].config())


async def get_experiment(request: web.Request) -> web.Response:
    """An A/B experiment's arms, each with its TTFT sample, and the test (router.arms)."""
    return json_response(await request.app[CONTROL].experiment())


async def explain_route(request: web.Request) -> web.Response:
    """The dry run of a routing decision: where this request would go, and why."""
    k = query_int(request, "k", DEFAULT_K, low=1, high=MAX_K)
    dry = decode(await read_json(request), DryRequest)
    return json_response(await request.app[CONTROL].explain(dry, k))


# -- probes, metrics, the document ------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    # Answering at all is the signal: the process and its event loop are up.
    return json_response(Probe("ok"))


async def readyz(request: web.Request) -> web.Response:
    if request.app[CONTROL].ready():
        return json_response(Probe("ready"))
    return json_response(Probe("not_ready"), status=503)


# /metrics is written this much at a time, each write awaited: 16 MB at 4,000
# backends in one piece held the loop 27 ms (bench_scrape), in slices 7 ms.
WRITE_SLICE = 256 * 1024


async def metrics(request: web.Request) -> web.StreamResponse:
    body = memoryview(await request.app[CONTROL].metrics())
    response = web.StreamResponse(headers={"Content-Type": METRICS_CONTENT_TYPE})
    response.content_length = len(body)
    await response.prepare(request)
    for start in range(0, len(body), WRITE_SLICE):
        await response.write(body[start : start + WRITE_SLICE])
    await response.write_eof()
    return response


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI], content_type="application/json")


ROUTES: list[tuple[str, str, Handler]] = [
    ("GET", "/admin/backends", list_backends),
    ("POST", "/admin/backends", add_backend),
    ("GET", "/admin/backends/{name}", get_backend),
    ("PATCH", "/admin/backends/{name}", patch_backend),
    ("DELETE", "/admin/backends/{name}", delete_backend),
    ("GET", "/admin/routing", get_routing),
    ("PUT", "/admin/routing", put_routing),
    ("GET", "/admin/stats", get_stats),
    ("GET", "/admin/config", get_config),
    ("GET", "/admin/ab", get_experiment),
    ("POST", "/admin/route", explain_route),
    ("GET", "/healthz", healthz),
    ("GET", "/readyz", readyz),
    ("GET", "/metrics", metrics),
    ("GET", "/openapi.json", openapi),
]
