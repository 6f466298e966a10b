"""The admin API's own JSON shapes (the router's views live in ``router.control``).

Contract: these are msgspec Structs, so one definition both validates or encodes
the JSON and yields the JSON Schema that goes into the OpenAPI document.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from router.config import RoutingConfig

__all__ = ["Probe", "RoutingDocument"]


class RoutingDocument(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """SageMaker's shape, ``{"RoutingConfig": {...}}``: what users paste from their endpoint."""

    routing_config: RoutingConfig = msgspec.field(name="RoutingConfig")


class Probe(msgspec.Struct, frozen=True):
    """The answer of ``/healthz`` and ``/readyz``."""

    status: Literal["ok", "ready", "not_ready"]
