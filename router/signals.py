"""Engine-side signals as tie-breaks: a rank per backend from its scraped gauges.

Contract:
- Off unless ``[engine_signals] enabled`` (``--engine-signals``), which turns
  scraping on as ``--scrape-metrics`` does (``router.health``: one round every
  ``scrape_interval``, every backend's ``/metrics`` at once).  Read from it:
  the engine's waiting requests (vLLM ``vllm:num_requests_waiting``, SGLang
  ``sglang:num_queue_reqs``) and its KV-cache use, 0..1 (vLLM
  ``vllm:kv_cache_usage_perc``, V0 ``vllm:gpu_cache_usage_perc``; SGLang
  ``sglang:token_usage``).
- After each round every backend gets a *rank*, lower first: its engine's
  waiting requests, then its KV-cache use in steps of ``KV_STEP``.  A backend
  whose scrape failed this round, or that exposes neither gauge, ranks 0 as
  an idle engine does: the signal then says nothing about it (in a fleet that
  mixes engines with and without the gauges, ties lean to those without).
- A rank breaks ties and nothing else (``hashring.bounded``,
  ``hashring.placement``): among a hot key's replicas with the same number in
  flight, before their recent requests; among the backends of a walk that are
  all at their bound (the fallback), before the walk order.  The prefix rule
  (a key's home or primary, overflow in walk order) and every bound decide
  without it, and a live in-flight count always outweighs it: the figures are
  up to one scrape interval old, and ordering by them would send every tie of
  that interval to the same backend.
- Hot path: the balancer reads ``Balancer.engine_ranks``, a dict (only the
  nonzero ranks) swapped by reference after each round, with one ``get`` per
  candidate on the two tie paths; nothing is parsed per request.  A decision
  a rank settled counts in ``Backend.tie_breaks``.
- Several workers: the supervisor scrapes; each round's figures go to every
  worker in one ``Signals`` message (``router.channel``), and to a worker that
  starts in its ``Init``.  A worker reads its channel in order, so once it has
  answered a ``Query`` sent after a round (``/admin/stats`` sends one to every
  worker), it routes by that round's figures.  Several replicas: each scrapes
  the engines on its own and ranks by what it read; nothing goes through etcd
  (the engines are the shared state: replicas read the same gauges, at
  moments up to one interval apart).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from .balancer import Balancer
    from .health import Scraped

__all__ = ["KV_STEP", "EngineSignals", "Signal", "rank"]

# KV-cache use counts in steps of 5 % of the cache: a step is what one long
# request holds (a 16k-token prompt is 6 % of the simulated instance's cache,
# ~1-10 % of a real node's), while the few blocks of short requests are noise
# that would otherwise decide every tie in place of the walk order.
KV_STEP = 0.05
_KV_STEPS = 21  # 0 .. 20: a use of 1.0 (or a figure above it) is the last
_MAX_WAITING = 1 << 20


class Signal(msgspec.Struct, array_like=True, frozen=True):
    """One backend's engine figures from one scrape round (None: not exposed)."""

    waiting: float | None  # requests queued in the engine, not yet scheduled
    kv_usage: float | None  # share of its KV cache in use, 0..1
    at: float  # when the round read it (unix seconds)

    @property
    def rank(self) -> int:
        return rank(self.waiting, self.kv_usage)


def rank(waiting: float | None, kv_usage: float | None) -> int:
    """Lower first: waiting requests, then KV-cache use in ``KV_STEP`` steps."""
    queued = 0
    if waiting is not None and math.isfinite(waiting) and waiting > 0:
        queued = min(int(waiting), _MAX_WAITING)
    steps = 0
    if kv_usage is not None and math.isfinite(kv_usage) and kv_usage > 0:
        # + 1e-9: 0.15 / 0.05 is 2.9999999999999996 in floats, and 15 % is 3 steps.
        steps = min(int(kv_usage / KV_STEP + 1e-9), _KV_STEPS - 1)
    return queued * _KV_STEPS + steps


class EngineSignals:
    """The last round's figures and the balancer's ranks made from them."""

    __slots__ = ("_balancer", "figures", "on_change")

    def __init__(self, balancer: Balancer) -> None:
        self._balancer = balancer
        self.figures: dict[str, Signal] = {}
        # Told every round's figures (a supervisor passes them on to its workers).
        self.on_change: Callable[[dict[str, Signal]], None] | None = None
        balancer.set_engine_ranks({})  # on: every backend ranks 0 until the first round

    def scraped(self, backends: Iterable[tuple[str, Scraped | None]], at: float) -> None:
        """A scrape round: each backend's figures, None where its scrape failed."""
        figures = {
            name: Signal(scraped.waiting, scraped.kv_usage, at)
            for name, scraped in backends
            if scraped is not None
        }
        self.set(figures)
        if self.on_change is not None:
            self.on_change(figures)

    def set(self, figures: dict[str, Signal]) -> None:
        """Route by ``figures`` from now on (a worker: what its supervisor read)."""
        self.figures = figures
        self._balancer.set_engine_ranks(
            {name: value for name, signal in figures.items() if (value := signal.rank)}
        )
