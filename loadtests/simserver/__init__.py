"""A simulated vLLM instance for tests and benchmarks: ``python -m loadtests.simserver``.

``model`` is the pure engine (tokenizer, prefix cache, timing, scheduling), reusable
by an offline simulator; ``wire`` parses requests and shapes replies; ``app`` serves
it over HTTP with aiohttp; ``metrics`` exposes vLLM-named Prometheus metrics.
"""

from .app import SimConfig, SimInstance, SimServer, make_app, serve_fleet
from .model import Engine, KVCache, Timing, tokenize
from .wire import Limits

__all__ = [
    "Engine",
    "KVCache",
    "Limits",
    "SimConfig",
    "SimInstance",
    "SimServer",
    "Timing",
    "make_app",
    "serve_fleet",
    "tokenize",
]
