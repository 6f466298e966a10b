"""vLLM-named Prometheus metrics of one simulated instance, read from its engine at scrape.

Contract: ``EngineCollector(engine, model_name, now)`` is a prometheus_client
collector that keeps no state of its own; each scrape reads the engine's gauges (at
model time ``now()``) and counters, so ``Engine.reset`` (``POST
/reset_prefix_cache``) zeroes the counters at once.
Names, types, labels (``model_name``, ``engine``) and TTFT buckets follow vLLM's V1
``PrometheusStatLogger``; counters are exposed with the ``_total`` suffix:

- ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges, as vLLM
  V1's scheduler counts them: a request waits until its prefill starts,
  ``Engine.gauges``)
- ``vllm:kv_cache_usage_perc`` (gauge, 0..1: the blocks of the requests whose
  prefill has started / capacity)
- ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` (tokens)
- ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``
- ``vllm:request_success_total{finished_reason="stop"|"length"|"abort"}``
- ``vllm:time_to_first_token_seconds`` (histogram, model seconds)
- ``vllm:cache_config_info{block_size, num_gpu_blocks}`` (gauge, always 1)

Model seconds: TTFT is the engine's, independent of ``time_scale``; it is observed
when a request ends (vLLM observes it at the first token).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .model import Engine

__all__ = ["EngineCollector"]

_LABELS = ["model_name", "engine"]


class EngineCollector:
    def __init__(self, engine: Engine, model_name: str, now: Callable[[], float]) -> None:
        self._engine = engine
        self._labels = [model_name, "0"]  # one engine core per simulated instance
        self._now = now  # model time

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        cache = engine.cache
        stats = engine.stats
        labels = self._labels
        running, waiting, kv_usage = engine.gauges(self._now())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            kv_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            cache.queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            cache.hits,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            stats.generation_tokens,
        )

        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        for reason, count in (("stop", 0), ("length", stats.finished), ("abort", stats.aborted)):
            success.add_metric([*labels, reason], count)
        yield success

        ttft = HistogramMetricFamily(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels=_LABELS,
        )
        ttft.add_metric(labels, stats.ttft.cumulative(), sum_value=stats.ttft.total)
        yield ttft

        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(cache.block_size), str(cache.capacity_blocks)], 1)
        yield info
