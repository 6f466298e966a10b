"""The OpenAPI 3.1 document of the admin API, served at ``/openapi.json``.

Contract:
- Component schemas are generated from the msgspec Structs the API encodes and
  decodes (``msgspec.json.schema_components``), so they cannot drift from the code.
  Paths are written here by hand, in one place, and a test holds their (method,
  path) pairs equal to ``routes.ROUTES``.
- Every operation lists every status it can answer: its successes, the error
  statuses of its input checks and of ``Control``, 401 (the bearer scheme is
  required except on the probes) and 500.  405 (a method no path has) is left out:
  it answers no operation.
- ``document()`` is pure and cheap; the app encodes it once at start-up.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.abreport import ExperimentView
from router.config import BackendSpec, RoutingConfig
from router.control import BackendPatch, BackendView, DrainView, Stats
from router.control.configview import ConfigView
from router.explain import DEFAULT_K, MAX_K, DryRequest, Explanation

from .bodies import MAX_BODY
from .errors import ErrorBody
from .routes import DRAIN_TIMEOUT_DEFAULT, DRAIN_TIMEOUT_MAX, METRICS_CONTENT_TYPE
from .schemas import Probe, RoutingDocument

__all__ = ["document"]

_REF = "#/components/schemas/{name}"

_ERRORS: dict[str, tuple[str, str]] = {
    # status: (component name, description)
    "400": ("BadRequest", "The body is not JSON (malformed, empty, or not UTF-8)."),
    "401": ("Unauthorized", "Missing or wrong bearer token."),
    "404": ("NotFound", "No backend of that name."),
    "409": ("Conflict", "The change conflicts with the current state."),
    "413": ("PayloadTooLarge", f"The body is larger than {MAX_BODY} bytes."),
    "415": (
        "UnsupportedMediaType",
        "The body is not application/json (a missing Content-Type is read as JSON).",
    ),
    "417": ("ExpectationFailed", "An `Expect` header other than `100-continue`."),
    "422": ("ValidationError", "A value is out of range or of the wrong type; see `fields`."),
    "500": (
        "InternalError",
        "The state file could not be written (the message names it and why; nothing"
        " was changed), or an unexpected error (details in the router's log only).",
    ),
}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(name=name)}


def _ok(description: str, schema: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"description": description, "content": _json(schema), **extra}


def _responses(ok: dict[str, Any], *errors: str) -> dict[str, Any]:
    responses = dict(ok)
    for status in sorted({"401", "417", "500", *errors}):
        responses[status] = {"$ref": f"#/components/responses/{_ERRORS[status][0]}"}
    return responses


def _body(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"required": True, "description": description, "content": _json(schema)}


_BODY_ERRORS = ("400", "413", "415", "422")

_NAME = {
    "name": "name",
    "in": "path",
    "required": True,
    "description": "The backend's name.",
    "schema": {"type": "string"},
}


def _paths() -> dict[str, Any]:
    backend = _ref("BackendView")
    routing = _ref("RoutingDocument")
    return {
        "/admin/backends": {
            "get": {
                "operationId": "listBackends",
                "summary": "List the backends, sorted by name",
                "responses": _responses(
                    {"200": _ok("The backends.", {"type": "array", "items": backend})}
                ),
            },
            "post": {
                "operationId": "addBackend",
                "summary": "Add a backend; it takes traffic at once",
                "requestBody": _body(_ref("BackendSpec"), "The new backend."),
                "responses": _responses(
                    {
                        "201": _ok(
                            "Added.",
                            backend,
                            headers={
                                "Location": {
                                    "description": "The backend's URL path.",
                                    "schema": {"type": "string"},
                                }
                            },
                        )
                    },
                    "409",
                    *_BODY_ERRORS,
                ),
            },
        },
        "/admin/backends/{name}": {
            "parameters": [_NAME],
            "get": {
                "operationId": "getBackend",
                "summary": "One backend",
                "responses": _responses({"200": _ok("The backend.", backend)}, "404"),
            },
            "patch": {
                "operationId": "updateBackend",
                "summary": "Change a backend's weight or state; absent fields are left alone",
                "description": "Setting `active` on a draining backend cancels its removal.",
                "requestBody": _body(_ref("BackendPatch"), "The fields to change."),
                "responses": _responses(
                    {"200": _ok("The backend after the change.", backend)},
                    "404",
                    "409",
                    *_BODY_ERRORS,
                ),
            },
            "delete": {
                "operationId": "removeBackend",
                "summary": "Drain a backend, then remove it",
                "description": (
                    "The backend takes no new requests; those in flight may finish until "
                    "the timeout, then it is removed.  Without `wait` the answer is 202 "
                    "at once; with `wait=true` it is 200 once the backend is removed."
                ),
                "parameters": [
                    {
                        "name": "wait",
                        "in": "query",
                        "required": False,
                        "description": "Answer when the backend is removed, not at once.",
                        "schema": {"type": "boolean", "default": False},
                    },
                    {
                        "name": "timeout",
                        "in": "query",
                        "required": False,
                        "description": "Seconds in-flight requests may take to finish.",
                        "schema": {
                            "type": "number",
                            "minimum": 0,
                            "maximum": DRAIN_TIMEOUT_MAX,
                            "default": DRAIN_TIMEOUT_DEFAULT,
                        },
                    },
                ],
                "responses": _responses(
                    {
                        "200": _ok("Removed (with `wait=true`).", _ref("DrainView")),
                        "202": _ok("Draining; it will be removed.", _ref("DrainView")),
                    },
                    "404",
                    "409",
                    "422",
                ),
            },
        },
        "/admin/routing": {
            "get": {
                "operationId": "getRouting",
                "summary": "The live routing config, in SageMaker's shape",
                "responses": _responses({"200": _ok("The routing config.", routing)}),
            },
            "put": {
                "operationId": "setRouting",
                "summary": "Replace the routing config; in-flight requests are not disturbed",
                "requestBody": _body(
                    {"anyOf": [routing, _ref("RoutingConfig")]},
                    'SageMaker\'s `{"RoutingConfig": {...}}`, or the bare inner object. '
                    "Absent fields take their defaults.",
                ),
                "responses": _responses(
                    {"200": _ok("The routing config now in force.", routing)},
                    "409",
                    *_BODY_ERRORS,
                ),
            },
        },
        "/admin/stats": {
            "get": {
                "operationId": "getStats",
                "summary": "Per-backend and total routing statistics",
                "responses": _responses({"200": _ok("The statistics.", _ref("Stats"))}),
            }
        },
        "/admin/config": {
            "get": {
                "operationId": "getConfig",
                "summary": "The running configuration, where it came from, and its reloads",
                "description": (
                    "The configuration in force, as the TOML file spells it: RoutingConfig"
                    " the one in force now, backends left out (GET /admin/backends), secrets"
                    " redacted.  With the config file, where the membership comes from, the"
                    " SIGHUP reloads (the last one's result and reason) and the fields whose"
                    " new value waits for a restart.  With `--workers N` the supervisor's,"
                    " which it pushes to every worker; each replica answers for itself."
                ),
                "responses": _responses({"200": _ok("The configuration.", _ref("ConfigView"))}),
            }
        },
        "/admin/ab": {
            "get": {
                "operationId": "getExperiment",
                "summary": "An A/B experiment's arms, their TTFT samples, and the test",
                "description": (
                    "Per arm of the RoutingConfig's Arms: requests, errors, TTFT percentiles"
                    " and a bottom-k sample of TTFTs (mergeable across replicas), the"
                    " attributed prefix-cache hit rate; each arm against the first with a"
                    " Mann-Whitney U test.  `prefix-router ab-report` reads it."
                ),
                "responses": _responses(
                    {"200": _ok("The experiment.", _ref("ExperimentView"))}, "404"
                ),
            }
        },
        "/admin/route": {
            "post": {
                "operationId": "explainRoute",
                "summary": "Dry run: where a request would be routed now, and why",
                "description": (
                    "The request, as a client would send it to the data port, is keyed and"
                    " routed by the data path's own code, and nothing changes: nothing is"
                    " sent, no lease, counter, placement or random draw is taken.  With"
                    " `--workers N` a worker answers, with every worker's in-flight counts."
                ),
                "parameters": [
                    {
                        "name": "k",
                        "in": "query",
                        "required": False,
                        "description": "Backends of the key's walk to show.",
                        "schema": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": MAX_K,
                            "default": DEFAULT_K,
                        },
                    }
                ],
                "requestBody": _body(_ref("DryRequest"), "The request to explain."),
                "responses": {
                    **_responses(
                        {"200": _ok("The decision and its reasons.", _ref("Explanation"))},
                        *_BODY_ERRORS,
                    ),
                    "400": {
                        "description": (
                            "The body is not JSON, or the data port would refuse the request"
                            " itself (the message gives its status and reason)."
                        ),
                        "content": _json(_ref("ErrorBody")),
                    },
                    "503": {
                        "description": "No worker could answer now (`--workers N`); retry.",
                        "content": _json(_ref("ErrorBody")),
                    },
                },
            }
        },
        "/healthz": {
            "get": {
                "operationId": "healthz",
                "summary": "Liveness: the process is up (no token needed)",
                "security": [],
                "responses": _responses({"200": _ok("Up.", _ref("Probe"))}),
            }
        },
        "/readyz": {
            "get": {
                "operationId": "readyz",
                "summary": "Readiness: the router can route requests (no token needed)",
                "security": [],
                "responses": _responses(
                    {
                        "200": _ok("Ready.", _ref("Probe")),
                        "503": _ok("Not ready (no available backend, or stopping).", _ref("Probe")),
                    }
                ),
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics",
                "responses": _responses(
                    {
                        "200": {
                            "description": f"Prometheus text format ({METRICS_CONTENT_TYPE}).",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    }
                ),
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "responses": _responses({"200": _ok("OpenAPI 3.1.", {"type": "object"})}),
            }
        },
    }


def _components() -> dict[str, Any]:
    _, schemas = msgspec.json.schema_components(
        [
            BackendSpec,
            BackendPatch,
            BackendView,
            DrainView,
            Stats,
            ConfigView,
            ExperimentView,
            RoutingDocument,
            RoutingConfig,
            Probe,
            ErrorBody,
            DryRequest,
            Explanation,
        ],
        ref_template=_REF,
    )
    # BackendSpec checks its url in code (__post_init__), which the generated schema
    # cannot see; say it here so clients (and schemathesis) know the rule.
    schemas["BackendSpec"]["properties"]["url"].update(
        description=(
            "http://HOST[:PORT], with no credentials, path, query or fragment; PORT"
            " 1-65535; not one of the router's own listeners."
        ),
        pattern=r"^http://[^/?#@\s]+/?$",
    )
    responses = {
        name: {"description": description, "content": _json(_ref("ErrorBody"))}
        for name, description in _ERRORS.values()
    }
    responses["Unauthorized"]["headers"] = {
        "WWW-Authenticate": {
            "description": 'Bearer realm="prefix-router"',
            "schema": {"type": "string"},
        }
    }
    return {
        "schemas": schemas,
        "responses": responses,
        "securitySchemes": {
            "bearerAuth": {
                "type": "http",
                "scheme": "bearer",
                "description": (
                    "Required on every path but /healthz and /readyz when the router "
                    "was started with an admin token (always, off loopback)."
                ),
            }
        },
    }


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "prefix-router admin API",
            # The version of this API's contract, not of the package.
            "version": "1.0.0",
            "description": (
                "Manage a prefix-router: its backends, its routing config, and its "
                'statistics.  Errors are `{"error": {"message", "type", '
                '"fields"?}}`; `fields` (422 only) points at each bad value.'
            ),
        },
        "paths": _paths(),
        "components": _components(),
        "security": [{"bearerAuth": []}],
    }
