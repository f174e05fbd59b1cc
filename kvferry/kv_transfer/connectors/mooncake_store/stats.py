"""MooncakeStoreConnector statistics, as ``KVConnectorStats`` data (summed across steps and
workers by the engine; lists are per-call samples).

Scheduler keys: ``lookups``, ``lookup_timeouts``, ``lookup_failures``, ``lookup_tokens``
(tokens looked up beyond the local hit), ``hit_tokens`` (tokens offered from the store),
``lookup_latency_s``, ``stored_chunks``, ``store_failed_jobs``, ``store_skipped_chunks``.
Worker keys: ``put_chunks``, ``put_bytes``, ``put_failed_chunks``, ``put_latency_s``,
``get_chunks``, ``get_bytes``, ``get_latency_s``, ``load_failed_chunks``, ``load_timeouts``,
``corrupt_chunks``, ``store_dedup_chunks``. The scheduler half also logs totals and the hit
rate every ``KVFERRY_LOG_STATS_INTERVAL`` seconds.
"""

from __future__ import annotations

import time
from typing import Any

from kvferry import envs
from kvferry.kv_transfer.base import KVConnectorStats
from kvferry.logger import fmt_fields, init_logger

logger = init_logger(__name__)


class SchedulerStats:
    def __init__(self, name: str) -> None:
        self.name = name
        self._data: dict[str, Any] = {}
        self.totals: dict[str, float] = {}
        self._last_log = time.monotonic()

    def add(self, key: str, n: float = 1) -> None:
        if n:
            self._data[key] = self._data.get(key, 0) + n
            self.totals[key] = self.totals.get(key, 0) + n

    def sample(self, key: str, value: float) -> None:
        self._data.setdefault(key, []).append(value)

    def hit_rate(self) -> float:
        looked = self.totals.get("lookup_tokens", 0)
        return self.totals.get("hit_tokens", 0) / looked if looked else 0.0

    def take(self) -> KVConnectorStats | None:
        self._maybe_log()
        if not self._data:
            return None
        data, self._data = self._data, {}
        return KVConnectorStats(data=data)

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < envs.log_stats_interval_s() or not self.totals:
            return
        self._last_log = now
        logger.info(
            fmt_fields(
                f"{self.name} store",
                hit_rate=round(self.hit_rate(), 4),
                **{k: int(v) for k, v in sorted(self.totals.items())},
            )
        )
