"""Running the real ``Router`` in the test's loop: its config, the fixtures' types.

``router_config(backends, **overrides)`` is the config dict ``build_config`` takes,
with SimServers, dicts or (name, url) pairs as backends; ``FAST`` is the simulated
servers' timing (1 model second = 1 real millisecond); ``FAST_HEALTH`` is health
checking quick enough for tests.  The fixtures themselves (``sim_fleet``,
``start_router``, ``backends``) are in ``tests/conftest.py``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from loadtests.simserver import SimServer, Timing

if TYPE_CHECKING:
    from router.app import Router

__all__ = ["FAST", "FAST_HEALTH", "SimFleet", "StartRouter", "router_config"]

# 1 model second = 1 real millisecond: simulated prefills and decodes cost almost no
# wall-clock time, while the model's arithmetic (x-sim-ttft-ms, cached tokens) stays exact.
FAST = Timing(time_scale=0.001)

FAST_HEALTH = {
    "interval": 0.05,
    "timeout": 0.5,
    "healthy_threshold": 2,
    "unhealthy_threshold": 2,
    "passive_failures": 3,
    "backoff_initial": 0.05,
    "backoff_max": 0.2,
}

# ``servers = await sim_fleet(3, capacity_blocks=64)``
SimFleet = Callable[..., Awaitable[list[SimServer]]]
# ``router = await start_router(backends, routing={...}, timeouts={...})``
StartRouter = Callable[..., Awaitable["Router"]]


# SageMaker's exact semantics.  The defaults are BalanceMode TRAFFIC and
# ConcurrencyScope PREFILL; tests of the ring walk and of the in-flight threshold
# as SageMaker defines them pin these.
SAGEMAKER = {"BalanceMode": "IN_FLIGHT", "ConcurrencyScope": "IN_FLIGHT"}


def sagemaker(**prefix_aware: Any) -> dict[str, Any]:
    """A RoutingConfig with SageMaker's exact semantics (and ``prefix_aware`` fields)."""
    return {"PrefixAwareRoutingConfig": {**SAGEMAKER, **prefix_aware}}


def router_config(backends: list[Any], **overrides: Any) -> dict[str, Any]:
    """A config dict for ``build_config``: SimServers or (name, url) pairs as backends."""
    specs = []
    for backend in backends:
        if isinstance(backend, SimServer):
            specs.append({"name": backend.name, "url": backend.url})
        elif isinstance(backend, dict):
            specs.append(backend)
        else:
            name, url = backend
            specs.append({"name": name, "url": url})
    data: dict[str, Any] = {"listen": "127.0.0.1:0", "access_log": "off", "backends": specs}
    routing = overrides.pop("routing", None)
    if routing is not None:
        data["RoutingConfig"] = routing
    data.update(overrides)
    return data
