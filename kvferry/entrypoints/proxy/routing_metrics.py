"""The proxy's routing metrics, registered beside its request counters on ``/metrics``."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

# Why a request went where it went (``kvferry_proxy_routing_decisions_total{reason}``).
ROUTING_REASONS = (
    "round_robin",  # the round_robin policy
    "least_loaded",  # the least_loaded policy
    "kv_hit",  # kv_aware: the instance holding the longest (tier-weighted) prefix
    "kv_load",  # kv_aware: the best holder is too busy: one holding less (or none) of it
    "no_match",  # kv_aware: no instance holds any of the prompt -> least loaded
    "holder_down",  # kv_aware: only unhealthy instances hold it -> least loaded
    "stale",  # kv_aware: no instance's index is in sync -> least loaded
    "no_prompt",  # kv_aware: the prompt could not be tokenized here -> least loaded
    "all_down",  # every instance is marked unhealthy: tried in turn anyway
)


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        reg = registry
        self.decisions = Counter(
            "kvferry_proxy_routing_decisions",
            "Routing decisions by reason and chosen instance.",
            ["reason", "instance"],
            registry=reg,
        )
        self.instance_up = Gauge(
            "kvferry_proxy_instance_up",
            "1 while the instance answers /health, else 0.",
            ["instance"],
            registry=reg,
        )
        self.instance_load = Gauge(
            "kvferry_proxy_instance_load",
            "The load the proxy balances on: max(in flight via the proxy, running + waiting).",
            ["instance"],
            registry=reg,
        )
        self.index_blocks = Gauge(
            "kvferry_proxy_kv_index_blocks",
            "Blocks in the proxy's prefix index per instance.",
            ["instance"],
            registry=reg,
        )
        self.event_lag = Gauge(
            "kvferry_proxy_kv_event_lag_seconds",
            "Seconds from an event batch's timestamp to the proxy applying it (latest batch).",
            ["instance"],
            registry=reg,
        )
        self.event_batches = Counter(
            "kvferry_proxy_kv_event_batches",
            "KV event batches applied to the index, live or replayed.",
            ["instance", "source"],
            registry=reg,
        )
        self.event_errors = Counter(
            "kvferry_proxy_kv_event_errors",
            "KV event frames dropped: bad_frame (not topic/seq/payload), decode (not a batch).",
            ["instance", "kind"],
            registry=reg,
        )
        self.event_gaps = Counter(
            "kvferry_proxy_kv_event_gaps",
            "Missed sequence numbers: replayed (recovered) or lost (index dropped).",
            ["instance", "outcome"],
            registry=reg,
        )
        self.resyncs = Counter(
            "kvferry_proxy_kv_index_resyncs",
            "Index of an instance dropped and rebuilt: restart (sequence went back), "
            "reconnect (instance back after being down).",
            ["instance", "cause"],
            registry=reg,
        )
