"""Each tenant's recent share of the requests, against its weight's: who the reserve is for.

Contract:
- ``asked(key, now)`` counts one request of tenant ``key`` (a keyed request
  at its first routing attempt with the admission queue on: ``router.queue``;
  what it asks, whether it is then admitted, waits or is refused).  A
  tenant's *usage* is an exponentially weighted count of its requests, with a
  time constant of ``window`` seconds (a request counts 1, ``window`` seconds
  later 1/e).  Requests, not admissions: what a tenant is admitted depends on
  the reserve itself (holding the heavy tenant back raises the light one's
  part of the admissions towards its share), what it asks does not.
- Active tenants: those with a request within the last ``window`` seconds;
  W is the sum of their weights (``weights[key]``, default 1).  A tenant's
  fair share is ``weight / W`` of the requests.
- ``under(key, now)``: its usage is less than its fair share of all usage
  (``usage / total < weight / W``), or it is new (no request in the window)
  while others are active.  A tenant alone is not under its share (nobody
  to compare with), nor is one at it.
- Cost: ``asked`` is O(1) (an ordered dict moved to its end, one
  exponential; the tenants that left the window are dropped from its front,
  each once); ``under`` is O(1), no exponential (see ``RESCALE_AFTER``):
  1.6-2.5 us for both on this 2-core VM at load 5.  Memory: the tenants
  active within the window, at most ``MAX_TENANTS``.
- One process's view: with several workers or replicas each counts the
  requests it receives (``router.queue`` says what that means).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping

__all__ = ["Shares"]


# Usages are kept scaled by exp((t - epoch) / window): a request at t adds that
# factor, so decaying every usage to "now" multiplies all of them by the same number,
# which a ratio cancels: ``under`` needs no exponential, ``asked`` one.  The epoch
# moves forward (every usage rescaled) before the factor nears a float's range.
RESCALE_AFTER = 300.0  # windows: exp(300) ~ 1e130, far from the 1.8e308 limit
# Tenants remembered at most (a flood of new keys within a window): past it the least
# recently active is forgotten early, and counts as new (under its share) if it returns.
MAX_TENANTS = 65_536


class _Usage:
    __slots__ = ("at", "value", "weight")

    def __init__(self, weight: float):
        self.value = 0.0  # the scaled weighted count
        self.at = 0.0  # its last request (the window is counted from it)
        self.weight = weight


class Shares:
    """Recent requests per tenant (see the module's contract)."""

    __slots__ = ("_epoch", "_oldest", "_tenants", "_total", "_weight", "weights", "window")

    def __init__(self, weights: Mapping[str, float], window: float):
        self.weights = weights
        self.window = window
        self._tenants: OrderedDict[str | None, _Usage] = OrderedDict()  # least recent first
        self._total = 0.0  # the active tenants' scaled usages, summed
        self._weight = 0.0  # W: the active tenants' weights
        self._epoch = 0.0
        self._oldest = math.inf  # at most the least recent request's time

    def __len__(self) -> int:
        """Active tenants (as of the last ``asked`` or ``under``)."""
        return len(self._tenants)

    def asked(self, key: str | None, now: float) -> None:
        """Count one request of tenant ``key`` at ``now`` (loop time, never decreasing)."""
        self._expire(now)
        tenants = self._tenants
        usage = tenants.get(key)
        if usage is None:
            if len(tenants) >= MAX_TENANTS:
                self._drop(*tenants.popitem(last=False))  # the least recently active
            if not tenants:
                self._oldest = now
            weight = self.weights.get(key, 1.0) if key is not None else 1.0
            usage = tenants[key] = _Usage(weight)
            self._weight += weight
        else:
            tenants.move_to_end(key)
        if now - self._epoch > RESCALE_AFTER * self.window:
            self._rescale(now)
        one = math.exp((now - self._epoch) / self.window)
        usage.value += one
        usage.at = now
        self._total += one

    def under(self, key: str | None, now: float) -> bool:
        """Whether tenant ``key`` asks less than its weight's share of the requests.
        A tenant alone here is not (nobody to compare with); a new one beside
        others is."""
        self._expire(now)
        tenants = self._tenants
        usage = tenants.get(key)
        if usage is None:
            return bool(tenants)
        if len(tenants) < 2:
            return False
        # usage / total < weight / W, both usages decayed alike (cancelled).
        return usage.value * self._weight < usage.weight * self._total

    def next_expiry(self) -> float | None:
        """When the least recently active tenant leaves the window (None: nobody active)."""
        for usage in self._tenants.values():
            return usage.at + self.window
        return None

    def _expire(self, now: float) -> None:
        horizon = now - self.window
        if horizon < self._oldest:
            return  # nobody left the window (the common case: one comparison)
        tenants = self._tenants
        while tenants:
            key, usage = next(iter(tenants.items()))
            if usage.at >= horizon:
                self._oldest = usage.at
                return
            del tenants[key]
            self._drop(key, usage)
        self._oldest = math.inf

    def _drop(self, key: str | None, usage: _Usage) -> None:
        """``key`` left ``_tenants``: take its weight and usage out of the sums."""
        if self._tenants:
            self._weight -= usage.weight
            self._total = max(0.0, self._total - usage.value)
        else:  # exactly nothing (no rounding left over)
            self._weight = self._total = 0.0

    def _rescale(self, now: float) -> None:
        factor = math.exp((self._epoch - now) / self.window)
        for usage in self._tenants.values():
            usage.value *= factor
        self._total *= factor
        self._epoch = now
