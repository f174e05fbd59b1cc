"""The scrape-time half of the server's ``/metrics``: engine state read from the engine
thread's latest :class:`EngineSnapshot`, under vLLM's ``vllm:`` names where vLLM has the series
and ``kvferry_`` otherwise, all labelled ``model_name`` and ``engine`` as vLLM labels them.
Also the histogram bucket families, matching vLLM's defaults."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvferry.engine.async_llm import EngineSnapshot

LABELS = ["model_name", "engine"]
# vLLM's finish reasons, each pre-created on vllm:request_success.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# vllm:prompt_tokens_by_source and vllm:prompt_tokens_cached_by_source label values.
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")

REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0]
REQUEST_LATENCY_BUCKETS += [40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5]
TTFT_BUCKETS += [5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
ITL_BUCKETS += [7.5, 10.0, 20.0, 40.0, 80.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
NUM_PREEMPTIONS_BUCKETS = [1, 2, 3, 4, 5, 10, 20]


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_model_len`` (vLLM's token-count family)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return out or [float(max_model_len)]
            out.append(float(m * scale))
        scale *= 10


class EngineCollector(Collector):
    """Gauges and counters read from the engine thread's latest ``EngineSnapshot``;
    ``publisher_stats()`` returns the KV event publisher's ``PublisherStats`` (None: no
    publisher)."""

    def __init__(
        self,
        model_name: str,
        engine: str,
        snapshot: Callable[[], EngineSnapshot | None],
    ) -> None:
        self.values = [model_name, engine]
        self.snapshot = snapshot
        self.bytes_per_token = 0.0
        self.publisher_stats: Callable[[], Any] = lambda: None

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=LABELS)
        g.add_metric(self.values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=LABELS)
        c.add_metric(self.values, value)
        return c

    def collect(self) -> Iterator[Metric]:
        sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "Engine sleep state (kvferry never sleeps: awake = 1).",
            labels=[*LABELS, "sleep_state"],
        )
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.add_metric([*self.values, state], value)
        yield sleep
        snap = self.snapshot()
        s = snap.scheduler if snap is not None else None
        if s is not None:
            yield from self._scheduler(s)
        yield self._gauge(
            "kvferry_kv_cache_bytes_per_token",
            "KV bytes per token (all layers).",
            self.bytes_per_token,
        )
        yield from self._kv_events()

    def _scheduler(self, s: Any) -> Iterator[Metric]:
        yield self._gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running_reqs,
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed (KV loads included).",
            s.num_waiting_reqs,
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by reason: capacity (waiting for scheduling capacity), "
            "deferred (waiting for a KV transfer).",
            labels=[*LABELS, "reason"],
        )
        deferred = s.num_waiting_for_remote_kvs
        by_reason.add_metric([*self.values, "capacity"], s.num_waiting_reqs - deferred)
        by_reason.add_metric([*self.values, "deferred"], deferred)
        yield by_reason
        yield self._gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_cache_usage,
        )
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", s.num_preemptions
        )
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        q, h = s.connector_prefix_cache_queries, s.connector_prefix_cache_hits
        yield self._counter(
            "vllm:external_prefix_cache_queries",
            "External (KV connector) prefix cache queries, in queried tokens.",
            q,
        )
        yield self._counter(
            "vllm:external_prefix_cache_hits",
            "External (KV connector) prefix cache hits, in cached tokens.",
            h,
        )
        # kvferry's extras.
        yield self._gauge(
            "kvferry_num_requests_waiting_for_remote_kvs",
            "Waiting requests whose KV a connector is loading.",
            deferred,
        )
        yield self._gauge(
            "kvferry_num_requests_held_by_connector",
            "Finished requests whose blocks a KV connector still holds.",
            s.num_held_by_connector,
        )
        yield self._gauge(
            "kvferry_prefix_cache_hit_rate", "Local prefix-cache hit rate.", s.prefix_cache_hit_rate
        )
        yield self._gauge(
            "kvferry_external_prefix_cache_hit_rate",
            "External (KV connector) hit rate.",
            h / q if q else 0.0,
        )

    def _kv_events(self) -> Iterator[Metric]:
        stats = self.publisher_stats()  # a PublisherStats, or None without a publisher
        if stats is None:
            return
        yield self._counter(
            "kvferry_kv_events_published_batches",
            "KV event batches the KV event publisher sent.",
            stats.published,
        )
        yield self._counter(
            "kvferry_kv_events_dropped_batches",
            "KV event batches dropped (queue full, send or encode error, shutdown).",
            stats.dropped,
        )
        yield self._gauge(
            "kvferry_kv_events_queued_batches",
            "KV event batches waiting in the publisher's queue.",
            stats.queued,
        )
