"""Prometheus metrics of the OpenAI-compatible server (``/metrics``) and of the P/D proxy.

Each server or proxy keeps its own ``CollectorRegistry`` (several can live in one process,
e.g. in tests). Server metrics, all labelled ``model_name``:

- per request, recorded when it ends (on the engine thread): ``kvferry_requests_finished_total``
  by ``finished_reason`` (stop, length, abort, error), ``kvferry_prompt_tokens_total``,
  ``kvferry_generation_tokens_total``, ``kvferry_request_{local,external}_cached_tokens_total``,
  histograms ``kvferry_time_to_first_token_seconds``, ``kvferry_time_per_output_token_seconds``
  and ``kvferry_e2e_request_latency_seconds``;
- engine state, read at scrape time from the engine thread's latest snapshot: requests
  running / waiting / waiting for remote KV / held by the connector, ``kvferry_kv_cache_usage_perc``
  (0..1), preemptions, local prefix-cache and external (connector) lookups and hits in tokens
  with their hit rates, and every ``KVConnectorStats`` key the connector reports:
  ``kvferry_kv_connector_total{stat=...}`` for plain numbers (summed since start) and
  ``kvferry_kv_connector_samples_{sum,count}{stat=...}`` for lists of samples. P/D connectors
  should report ``bytes_transferred`` and ``transfer_duration`` (seconds) so that transfer
  bandwidth is ``bytes / duration`` (``kvferry demo pd`` prints it);
- ``kvferry_prompt_tokens_cached_by_source_total{source=...}``: cached prompt tokens by tier,
  ``device`` for the engine's own prefix cache and the connector's
  ``get_external_cache_hit_sources`` tiers (``host``, ``disk``, ``p2p``,
  ``external_unspecified``) for external hits;
- whatever the connector class registers through ``build_prom_metrics`` (labels
  ``model_name`` and ``engine``), fed every step's ``KVConnectorStats.data``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Summary,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.engine.async_llm import EngineSnapshot
    from kvferry.kv_transfer.base import KVConnectorPromMetrics
    from kvferry.outputs import RequestOutput

logger = logging.getLogger(__name__)
disable_created_metrics()  # no *_created series: they double the page and nobody reads them
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort", "error")
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0]
_TTFT_BUCKETS += [2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_TPOT_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5]
_TPOT_BUCKETS += [0.75, 1.0, 2.5, 5.0]
_E2E_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0]


class _EngineCollector(Collector):
    """Gauges and counters read from the engine thread's latest ``EngineSnapshot``."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot | None]) -> None:
        self.model_name = model_name
        self.snapshot = snapshot
        self.bytes_per_token = 0.0

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric([self.model_name], value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        if snap is None:
            return
        s = snap.scheduler
        if s is not None:
            yield self._gauge(
                "kvferry_num_requests_running", "Requests running.", s.num_running_reqs
            )
            yield self._gauge(
                "kvferry_num_requests_waiting",
                "Requests waiting (incl. loads).",
                s.num_waiting_reqs,
            )
            yield self._gauge(
                "kvferry_num_requests_waiting_for_remote_kvs",
                "Waiting requests whose KV a connector is loading.",
                s.num_waiting_for_remote_kvs,
            )
            yield self._gauge(
                "kvferry_num_requests_held_by_connector",
                "Finished requests whose blocks a KV connector still holds.",
                s.num_held_by_connector,
            )
            yield self._gauge(
                "kvferry_kv_cache_usage_perc",
                "Fraction of KV blocks in use (0..1).",
                s.kv_cache_usage,
            )
            yield self._counter("kvferry_num_preemptions", "Preemptions.", s.num_preemptions)
            yield self._counter(
                "kvferry_prefix_cache_queries",
                "Prefix-cache lookups, tokens.",
                s.prefix_cache_queries,
            )
            yield self._counter(
                "kvferry_prefix_cache_hits", "Prefix-cache hits, tokens.", s.prefix_cache_hits
            )
            yield self._gauge(
                "kvferry_prefix_cache_hit_rate",
                "Local prefix-cache hit rate.",
                s.prefix_cache_hit_rate,
            )
            q, h = s.connector_prefix_cache_queries, s.connector_prefix_cache_hits
            yield self._counter(
                "kvferry_external_prefix_cache_queries",
                "Tokens asked of the KV connector beyond the local hit.",
                q,
            )
            yield self._counter(
                "kvferry_external_prefix_cache_hits", "Tokens the KV connector provided.", h
            )
            yield self._gauge(
                "kvferry_external_prefix_cache_hit_rate",
                "External (KV connector) hit rate.",
                h / q if q else 0.0,
            )
        yield self._gauge(
            "kvferry_kv_cache_bytes_per_token",
            "KV bytes per token (all layers).",
            self.bytes_per_token,
        )


def _bound_to(cls: type, registry: CollectorRegistry) -> type:
    """``cls`` (a prometheus_client metric class) registering in ``registry`` by default, for
    connectors that create metrics without naming a registry, as vLLM's do."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("registry", registry)
        cls.__init__(self, *args, **kwargs)  # type: ignore[misc]

    return type(cls.__name__, (cls,), {"__init__": __init__})


def build_connector_prom_metrics(
    config: EngineConfig, model_name: str, registry: CollectorRegistry
) -> KVConnectorPromMetrics | None:
    """The configured connector class's ``build_prom_metrics``, registering in ``registry``."""
    kvt = config.kv_transfer_config
    if kvt is None or kvt.kv_connector is None:
        return None
    from kvferry.kv_transfer.factory import KVConnectorFactory

    connector_cls = KVConnectorFactory.get_connector_class(kvt)
    types = {c: _bound_to(c, registry) for c in (Gauge, Counter, Histogram)}
    return connector_cls.build_prom_metrics(
        config, types, ["model_name", "engine"], {0: [model_name, "0"]}
    )


class ServerMetrics:
    """The server's metrics; also the AsyncLLM's ``StatObserver`` (thread-safe)."""

    def __init__(self, model_name: str, config: EngineConfig | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.finished = Counter(
            "kvferry_requests_finished",
            "Requests ended, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        for reason in FINISH_REASONS:
            self.finished.labels(model_name, reason)
        self.prompt_tokens = Counter(
            "kvferry_prompt_tokens", "Prompt tokens.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "kvferry_generation_tokens", "Generated tokens.", labels, registry=reg
        ).labels(model_name)
        self.local_cached = Counter(
            "kvferry_request_local_cached_tokens",
            "Prompt tokens served from the local prefix cache.",
            labels,
            registry=reg,
        ).labels(model_name)
        self.external_cached = Counter(
            "kvferry_request_external_cached_tokens",
            "Prompt tokens served by the KV connector.",
            labels,
            registry=reg,
        ).labels(model_name)
        self.ttft = Histogram(
            "kvferry_time_to_first_token_seconds",
            "Time to first token (arrival in the engine to first token).",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.tpot = Histogram(
            "kvferry_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.e2e = Histogram(
            "kvferry_e2e_request_latency_seconds",
            "Arrival in the engine to the last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=reg,
        ).labels(model_name)
        self.kv_totals = Counter(
            "kvferry_kv_connector",
            "KVConnectorStats numbers, summed since start, by stat.",
            ["model_name", "stat"],
            registry=reg,
        )
        self.kv_samples = Summary(
            "kvferry_kv_connector_samples",
            "KVConnectorStats lists of samples, by stat.",
            ["model_name", "stat"],
            registry=reg,
        )
        self.cached_by_source = Counter(
            "kvferry_prompt_tokens_cached_by_source",
            "Cached prompt tokens by the tier that held them (device: the local prefix cache).",
            ["model_name", "source"],
            registry=reg,
        )
        self.connector_prom = (
            build_connector_prom_metrics(config, model_name, reg) if config is not None else None
        )
        self._snapshot: Callable[[], EngineSnapshot | None] = lambda: None
        self._engine = _EngineCollector(model_name, lambda: self._snapshot())
        reg.register(self._engine)

    def attach(self, snapshot: Callable[[], EngineSnapshot | None], bytes_per_token: float) -> None:
        """Read engine state from ``snapshot()`` at scrape time."""
        self._snapshot = snapshot
        self._engine.bytes_per_token = bytes_per_token

    # StatObserver
    def record_finished(self, output: RequestOutput) -> None:
        c = output.outputs[0] if output.outputs else None
        self.finished.labels(self.model_name, (c and c.finish_reason) or "stop").inc()
        n_out = len(c.token_ids) if c is not None else 0
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(n_out)
        m = output.metrics
        if m is None:
            return
        self.local_cached.inc(m.num_local_cached_tokens)
        self.external_cached.inc(m.num_external_cached_tokens)
        if m.num_local_cached_tokens:
            self.cached_by_source.labels(self.model_name, "device").inc(m.num_local_cached_tokens)
        for source, n in m.external_cache_hit_sources.items():
            self.cached_by_source.labels(self.model_name, source).inc(n)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_token_time is not None and n_out > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (n_out - 1))

    def record_ended(self, finish_reason: str) -> None:
        self.finished.labels(self.model_name, finish_reason).inc()

    def record_kv_connector_stats(self, data: dict[str, Any]) -> None:
        if self.connector_prom is not None:
            try:
                self.connector_prom.observe(data, 0)
            except Exception:  # a connector's metrics must not stop the engine's stats
                logger.exception("the KV connector's Prometheus observe() failed")
        for key, value in data.items():
            if isinstance(value, list):
                samples = self.kv_samples.labels(self.model_name, key)
                for v in value:
                    samples.observe(float(v))
            elif isinstance(value, (int, float)) and value >= 0:
                self.kv_totals.labels(self.model_name, key).inc(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ProxyMetrics:
    """The P/D proxy's own metrics (the instances' metrics stay on the instances)."""

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        self.requests = Counter(
            "kvferry_proxy_requests",
            "Requests by endpoint and outcome (ok, client_error, prefill_error, decode_error, "
            "disconnected).",
            ["endpoint", "outcome"],
            registry=reg,
        )
        self.upstream_errors = Counter(
            "kvferry_proxy_upstream_errors",
            "Failed calls to an instance.",
            ["role", "instance"],
            registry=reg,
        )
        self.releases = Counter(
            "kvferry_proxy_kv_releases",
            "Prefill KV releases sent after a failed decode, by outcome.",
            ["outcome"],
            registry=reg,
        )
        for outcome in ("ok", "failed"):
            self.releases.labels(outcome)
        self.prefill_seconds = Histogram(
            "kvferry_proxy_prefill_seconds",
            "Round trip of the prefill request.",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.ttft = Histogram(
            "kvferry_proxy_time_to_first_byte_seconds",
            "Client request to the decode instance's first response byte.",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
