"""Prometheus metrics of the OpenAI-compatible server (``/metrics``) and of the P/D proxy.

Each server or proxy keeps its own ``CollectorRegistry`` (several can live in one process,
e.g. in tests). The server exports vLLM's series under vLLM's names, types, units, bucket
families and labels (``model_name``, ``engine``), so dashboards and autoscalers built for vLLM
read kvferry unchanged; what vLLM has no series for keeps the ``kvferry_`` prefix. The README's
"Metrics" table maps every series to its meaning and its source in kvferry.

- per request, recorded when it ends (on the engine thread): ``vllm:request_success`` by
  ``finished_reason``, prompt / generation token counters (also by source and by cache tier),
  the per-request token histograms and the latency histograms (TTFT, e2e, queue, prefill,
  decode, inference, time per output token);
- per engine step (:meth:`ServerMetrics.record_step`): ``vllm:iteration_tokens_total`` and
  ``vllm:inter_token_latency_seconds``;
- engine state, read at scrape time from the engine thread's latest snapshot
  (:mod:`kvferry.entrypoints.engine_metrics`): running / waiting gauges, KV cache usage,
  preemptions, local and external (connector) prefix-cache queries and hits;
- every ``KVConnectorStats`` key the connector reports: ``kvferry_kv_connector_total{stat=...}``
  for plain numbers (summed since start) and ``kvferry_kv_connector_samples_{sum,count}`` for
  lists of samples. P/D connectors should report ``bytes_transferred`` and
  ``transfer_duration`` (seconds) so that transfer bandwidth is ``bytes / duration``;
- whatever the connector class registers through ``build_prom_metrics`` (labels
  ``model_name`` and ``engine``), fed every step's ``KVConnectorStats.data``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
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

from kvferry.entrypoints.engine_metrics import (
    CACHE_HIT_SOURCES,
    FINISH_REASONS,
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    LABELS,
    NUM_PREEMPTIONS_BUCKETS,
    PARAMS_N_BUCKETS,
    PROMPT_SOURCES,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    EngineCollector,
    request_tokens_buckets,
)

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.engine.async_llm import EngineSnapshot
    from kvferry.kv_transfer.base import KVConnectorPromMetrics
    from kvferry.outputs import RequestOutput

logger = logging.getLogger(__name__)
disable_created_metrics()  # no *_created series: they double the page and nobody reads them
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_INDEX = "0"
_PRUNE_EVERY_STEPS = 128


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
    return connector_cls.build_prom_metrics(config, types, LABELS, {0: [model_name, ENGINE_INDEX]})


class ServerMetrics:
    """The server's metrics; also the AsyncLLM's ``StatObserver`` (thread-safe)."""

    def __init__(self, model_name: str, config: EngineConfig | None = None) -> None:
        self.registry = reg = CollectorRegistry()
        self.model_name = model_name
        self.values = values = [model_name, ENGINE_INDEX]
        # Token-count buckets go up to the context (configs without a model: a wide range).
        model_config = getattr(config, "model_config", None)
        tok_buckets = request_tokens_buckets(model_config.max_len if model_config else 1 << 20)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=reg).labels(*values)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(*values)

        self.success = Counter(
            "vllm:request_success",
            "Count of finished requests, by finish reason.",
            [*LABELS, "finished_reason"],
            registry=reg,
        )
        for reason in FINISH_REASONS:
            self.success.labels(*values, reason)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source (computed, local cache hit, KV transfer).",
            [*LABELS, "source"],
            registry=reg,
        )
        for source in PROMPT_SOURCES:
            self.prompt_by_source.labels(*values, source)
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Cached prompt tokens by the tier that supplied them (device: the local prefix "
            "cache; host, disk, p2p, external_unspecified: the KV connector's tiers).",
            [*LABELS, "source"],
            registry=reg,
        )
        for source in CACHE_HIT_SOURCES:
            self.cached_by_source.labels(*values, source)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.req_prompt = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok_buckets
        )
        self.req_generation = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tok_buckets
        )
        self.req_max_generation = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of generated tokens (n = 1: the request's).",
            tok_buckets,
        )
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS
        )
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tok_buckets,
        )
        self.prefill_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tok_buckets,
        )
        self.iteration_tokens = hist(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        phases = {
            "e2e_request_latency": "e2e request latency",
            "request_queue_time": "time spent in WAITING phase for request",
            "request_inference_time": "time spent in RUNNING phase for request",
            "request_prefill_time": "time spent in PREFILL phase for request",
            "request_decode_time": "time spent in DECODE phase for request",
        }
        self.phase = {
            key: hist(
                f"vllm:{key}_seconds", f"Histogram of {doc} in seconds.", REQUEST_LATENCY_BUCKETS
            )
            for key, doc in phases.items()
        }
        self.req_preemptions = hist(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            NUM_PREEMPTIONS_BUCKETS,
        )
        self.kv_totals = Counter(
            "kvferry_kv_connector",
            "KVConnectorStats numbers, summed since start, by stat.",
            [*LABELS, "stat"],
            registry=reg,
        )
        self.kv_samples = Summary(
            "kvferry_kv_connector_samples",
            "KVConnectorStats lists of samples, by stat.",
            [*LABELS, "stat"],
            registry=reg,
        )
        self.connector_prom = (
            build_connector_prom_metrics(config, model_name, reg) if config is not None else None
        )
        self._snapshot: Callable[[], EngineSnapshot | None] = lambda: None
        self._engine = EngineCollector(model_name, ENGINE_INDEX, lambda: self._snapshot())
        reg.register(self._engine)
        # Per request in flight: (tokens so far, when the last of them came), for the ITL.
        self._last_token: dict[str, tuple[int, float]] = {}
        self._steps = 0

    def attach(
        self,
        snapshot: Callable[[], EngineSnapshot | None],
        bytes_per_token: float,
        publisher_stats: Callable[[], Any] | None = None,
    ) -> None:
        """Read engine state from ``snapshot()`` (and the KV event publisher's counters from
        ``publisher_stats()``) at scrape time."""
        self._snapshot = snapshot
        self._engine.bytes_per_token = bytes_per_token
        if publisher_stats is not None:
            self._engine.publisher_stats = publisher_stats

    # StatObserver
    def record_finished(self, output: RequestOutput) -> None:
        c = output.outputs[0] if output.outputs else None
        self.success.labels(*self.values, (c and c.finish_reason) or "stop").inc()
        self._last_token.pop(output.request_id, None)
        n_out = len(c.token_ids) if c is not None else 0
        n_prompt = len(output.prompt_token_ids)
        self.prompt_tokens.inc(n_prompt)
        self.generation_tokens.inc(n_out)
        self.req_prompt.observe(n_prompt)
        self.req_generation.observe(n_out)
        self.req_max_generation.observe(n_out)
        self.params_n.observe(1)
        m = output.metrics
        if m is None:
            return
        local, external = m.num_local_cached_tokens, m.num_external_cached_tokens
        computed = max(n_prompt - local - external, 0)
        for source, n in zip(PROMPT_SOURCES, (computed, local, external), strict=True):
            self.prompt_by_source.labels(*self.values, source).inc(n)
        self.prompt_cached.inc(local + external)
        self.prefill_computed.observe(computed)
        if local:
            self.cached_by_source.labels(*self.values, "device").inc(local)
        for source, n in m.external_cache_hit_sources.items():
            self.cached_by_source.labels(*self.values, source).inc(n)
        if m.max_tokens_param:
            self.params_max_tokens.observe(m.max_tokens_param)
        self.req_preemptions.observe(m.num_preemptions)
        self._record_times(m, n_out)

    def _record_times(self, m: Any, n_out: int) -> None:
        first, done, sched = m.first_token_time, m.finished_time, m.first_scheduled_time
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if done is None:
            return
        self.phase["e2e_request_latency"].observe(done - m.arrival_time)
        if sched is not None:
            self.phase["request_queue_time"].observe(max(sched - m.arrival_time, 0.0))
            self.phase["request_inference_time"].observe(max(done - sched, 0.0))
            if first is not None:
                self.phase["request_prefill_time"].observe(max(first - sched, 0.0))
        if first is not None:
            self.phase["request_decode_time"].observe(done - first)
            if n_out > 1:
                self.tpot.observe((done - first) / (n_out - 1))

    def record_ended(self, finish_reason: str) -> None:
        self.success.labels(*self.values, finish_reason).inc()

    def record_step(
        self, outputs: list[RequestOutput], num_tokens: int, live: Collection[str]
    ) -> None:
        """One engine step: its scheduled tokens and the outputs it produced; ``live``: the
        ids of the requests still in flight (aborted ones are forgotten by it)."""
        now = time.time()
        self.iteration_tokens.observe(num_tokens)
        last = self._last_token
        for out in outputs:
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            prev = last.get(out.request_id)
            if prev is not None and n > prev[0]:
                self.itl.observe(now - prev[1])
            if out.finished:
                last.pop(out.request_id, None)
            elif prev is None or n > prev[0]:
                last[out.request_id] = (n, now)
        self._steps += 1
        if self._steps % _PRUNE_EVERY_STEPS == 0:
            for rid in [r for r in last if r not in live]:
                del last[rid]

    def record_kv_connector_stats(self, data: dict[str, Any]) -> None:
        if self.connector_prom is not None:
            try:
                self.connector_prom.observe(data, 0)
            except Exception:  # a connector's metrics must not stop the engine's stats
                logger.exception("the KV connector's Prometheus observe() failed")
        for key, value in data.items():
            if isinstance(value, list):
                samples = self.kv_samples.labels(*self.values, key)
                for v in value:
                    samples.observe(float(v))
            elif isinstance(value, (int, float)) and value >= 0:
                self.kv_totals.labels(*self.values, key).inc(value)

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
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.ttft = Histogram(
            "kvferry_proxy_time_to_first_byte_seconds",
            "Client request to the decode instance's first response byte.",
            buckets=TTFT_BUCKETS,
            registry=reg,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
