"""KVConnectorOutput: what a worker's KV connector reports back to the scheduler each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVConnectorOutput:
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    kv_connector_stats: Any | None = None
    kv_cache_events: Any | None = None
    kv_connector_worker_meta: Any | None = None
    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    expected_finished_count: int = 0

    def is_empty(self) -> bool:
        return not (
            self.finished_sending
            or self.finished_recving
            or self.kv_connector_stats
            or self.kv_cache_events
            or self.kv_connector_worker_meta
            or self.invalid_block_ids
            or self.failed_recving
        )
