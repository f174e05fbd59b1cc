"""What the scheduler counts for logging and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    """A snapshot for logging; prefix-cache numbers are in tokens since the last reset."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    # KV connector (all zero without one). Of num_waiting_reqs, how many wait for a load.
    num_waiting_for_remote_kvs: int = 0
    # Finished requests whose blocks the connector still holds (delayed frees, orphaned loads).
    num_held_by_connector: int = 0
    # External lookups of admitted requests, in tokens: queried beyond the local hit, and hit.
    connector_prefix_cache_queries: int = 0
    connector_prefix_cache_hits: int = 0
    connector_prefix_cache_hits_by_source: dict[str, int] = field(default_factory=dict)


@dataclass
class ConnectorPrefixStats:
    """External lookups of admitted requests, in tokens (first admissions only)."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    # Of ``hits``, tokens by the tier that held them (``CacheHitSource`` values).
    hits_by_source: dict[str, int] = field(default_factory=dict)
