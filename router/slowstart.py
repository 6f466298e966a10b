"""Slow start: a new or recovered backend's ring weight ramps up over a window.

Why: a backend that joins the ring (added, or up again after being down)
takes about 1/(n+1) of the keys at once, all cold on it: a burst of misses
and queueing on one instance.  As HAProxy's ``slowstart`` (a server that
comes back up "will run at full speed" only after the window, its weight
growing linearly, never when HAProxy itself starts), the backend's share of
the ring grows over ``seconds`` instead.

Contract:
- A ``Ramp`` is (start, seconds): unix time the backend became active, and
  the window.  ``fraction(ramp, now)`` is a pure function of them: ``k/n``
  with ``n = steps(seconds)`` (one step a second up to 20, as HAProxy steps
  its weight at most every second and in 20ths of the window) and ``k =
  max(1, floor(n * elapsed / seconds))``, so the backend holds ``1/n`` of its
  points from the start and all of them at ``start + seconds``; None once
  the ramp is over.  Every worker and every replica that has the same Ramp
  computes the same step at the same moment (to their clocks' skew) without
  messages per step: each process runs its own timer to the next step
  boundary (``Fleet``), and the ring is rebuilt only when ``k`` changes.
- The ramp's start travels with the change that starts it: the admin add
  (``AddBackend.ramp``, to workers; ``SavedBackend.ramp`` in etcd, so every
  replica ramps a newcomer the same way), a health recovery (``SetHealthy.since``
  from the supervisor to its workers).  Health is per replica, so a recovery
  ramp is too: each replica ramps a backend from the moment *it* saw it up.
- Only the ring's point count follows the ramp (``hashring.Ring`` fractions):
  ``ConcurrencyThreshold``, ``BalanceFactor`` and TRAFFIC shares compare the
  configured weight, unchanged.  RANDOM and LEAST_OUTSTANDING_REQUESTS are
  not ramped (no cache to warm for them to protect).
- Backends present at start-up never ramp (HAProxy's rule: ramping them all
  would only shift load among them); a backend saved mid-ramp resumes it.
"""

from __future__ import annotations

import math
import re

import msgspec

__all__ = ["MAX_STEPS", "Ramp", "fraction", "next_change", "parse_duration", "steps"]

# At most this many steps a window, and at least a second each (HAProxy:
# MAX(1000 ms, slowstart / 20) between two weight updates).
MAX_STEPS = 20

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
MAX_SECONDS = 86_400.0


class Ramp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    start: float  # unix seconds: when the backend became active here
    seconds: float  # the window


def parse_duration(value: float | int | str) -> float:
    """Seconds of a slow-start window: a number of seconds, ``"60s"``, ``"2m"``,
    ``"500ms"``, or ``"off"``/0 (none); ValueError saying why otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"slow_start {value!r} must be a duration such as 60, '60s' or 'off'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif value.strip().lower() == "off":
        return 0.0
    else:
        match = _DURATION.match(value)
        if match is None:
            raise ValueError(
                f"slow_start {value!r} must be a duration such as 60, '60s', '2m' or 'off'"
            )
        seconds = float(match[1]) * _UNIT[match[2]]
    if not math.isfinite(seconds) or not 0 <= seconds <= MAX_SECONDS:
        raise ValueError(f"slow_start {value!r} must be between 0 (off) and 86400 seconds")
    return seconds


def steps(seconds: float) -> int:
    """How many steps a window of ``seconds`` ramps in."""
    return max(1, min(MAX_STEPS, int(seconds)))


def fraction(ramp: Ramp, now: float) -> tuple[int, int] | None:
    """``(k, n)``: the share of its ring points the backend holds at ``now``;
    None once the ramp is over (every point)."""
    whole = steps(ramp.seconds)
    elapsed = now - ramp.start
    if elapsed >= ramp.seconds:
        return None
    part = max(1, int(whole * elapsed // ramp.seconds)) if elapsed > 0 else 1
    return None if part >= whole else (part, whole)


def next_change(ramp: Ramp, now: float) -> float | None:
    """The unix time of the ramp's next step after ``now``; None when it is over."""
    current = fraction(ramp, now)
    if current is None:
        return None
    part, whole = current
    return ramp.start + ramp.seconds * (part + 1) / whole
