"""Changes to a running router, as values: one apply path for every source.

Contract:
- An ``Op`` is one change to the fleet or the routing config, a msgspec
  Struct tagged by its class name, so it crosses a process boundary as is
  (``encode``/``decode``: msgpack).  Every source of change builds ops: the
  admin API in one process, the supervisor for its workers, and any store
  that replicas watch.  ``apply(router, op)`` is the only code that turns an
  op into a change, so the same sequence of ops leaves every process in the
  same state.
- ``apply`` is synchronous and changes the fleet at once; a ring rebuild
  follows in slices (``await router.fleet.settled()`` waits for it).  It
  raises ``KeyError`` for an unknown backend name and for a name taken, as
  ``Fleet`` does: the sources check first, so that is a bug, not an input.
- ``AddBackend.slot`` is the backend's column in a shared in-flight table
  (``--workers N``), chosen by the supervisor; -1 where there is none.
- Slow start (``router.slowstart``): ``AddBackend.ramp`` is the newcomer's
  ramp, made once by whoever accepted the add (so every worker and replica
  ramps it alike); ``SetHealthy.since`` is when the supervisor saw a backend
  up again, from which its workers ramp it (None: at once, or now).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from ..config import BackendSpec, Limits, RoutingConfig, Timeouts
from ..fleet import AdminState
from ..slowstart import Ramp

if TYPE_CHECKING:
    from ..app import Router

__all__ = [
    "AddBackend",
    "Op",
    "RemoveBackend",
    "SetHealthy",
    "SetRouting",
    "SetSettings",
    "SetState",
    "SetWeight",
    "apply",
]


class AddBackend(msgspec.Struct, tag=True, frozen=True):
    spec: BackendSpec
    slot: int = -1
    ramp: Ramp | None = None


class RemoveBackend(msgspec.Struct, tag=True, frozen=True):
    name: str


class SetWeight(msgspec.Struct, tag=True, frozen=True):
    name: str
    weight: int


class SetState(msgspec.Struct, tag=True, frozen=True):
    name: str
    state: str  # an AdminState value


class SetHealthy(msgspec.Struct, tag=True, frozen=True):
    name: str
    healthy: bool
    since: float | None = None  # up again at (unix seconds): a slow start's ramp begins


class SetRouting(msgspec.Struct, tag=True, frozen=True):
    routing: RoutingConfig


class SetSettings(msgspec.Struct, tag=True, frozen=True):
    """What a config reload changes live besides membership and routing."""

    timeouts: Timeouts
    limits: Limits
    retries: int


Op = AddBackend | RemoveBackend | SetWeight | SetState | SetHealthy | SetRouting | SetSettings


def apply(router: Router, op: Op) -> None:
    """Make the change ``op`` describes (the ring follows in the background)."""
    fleet = router.fleet
    match op:
        case AddBackend(spec=spec, ramp=ramp):
            router.add_backend(spec, ramp)
        case RemoveBackend(name=name):
            router.remove_backend(name)
        case SetWeight(name=name, weight=weight):
            fleet.set_weight(name, weight)
        case SetState(name=name, state=state):
            fleet.set_state(name, AdminState(state))
        case SetHealthy(name=name, healthy=healthy, since=since):
            fleet.set_healthy(name, healthy, since=since)
        case SetRouting(routing=routing):
            router.configure_routing(routing)
        case SetSettings(timeouts=timeouts, limits=limits, retries=retries):
            router.configure_settings(timeouts, limits, retries)
