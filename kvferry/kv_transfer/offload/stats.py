"""Offload statistics: what moved each way (worker side) and where hits came from
(scheduler side), as :class:`KVConnectorStats` the engine logs and returns with outputs.

Worker keys, per job kind ``load | store | disk_write | promote``: ``<kind>_jobs``,
``<kind>_blocks``, ``<kind>_bytes``, ``<kind>_failed`` (counters) and ``<kind>_seconds``,
``<kind>_latency_s``, ``<kind>_gbps`` (per-job samples: copy time, submit-to-done time,
bandwidth). Scheduler keys: ``lookup_tokens`` (tokens looked up beyond the local hit),
``hit_tokens_host`` / ``hit_tokens_disk`` (tokens loaded whose chunks were on the host /
came back from disk), ``evicted_<tier>``, ``store_skipped`` and ``corrupt_chunks``.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from kvferry import envs
from kvferry.kv_transfer.base import KVConnectorStats
from kvferry.kv_transfer.offload.jobs import JobKind
from kvferry.kv_transfer.offload.transfer import JobResult
from kvferry.logger import fmt_fields, init_logger

logger = init_logger(__name__)


class TransferStats:
    """Worker side: folds job results in; :meth:`take` returns and resets them."""

    def __init__(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block
        self._data: dict[str, Any] = {}

    def add(self, result: JobResult) -> None:
        kind = result.job.kind
        if kind == JobKind.DISK_DELETE:
            return
        k = kind.value
        d = self._data
        d[f"{k}_jobs"] = d.get(f"{k}_jobs", 0) + 1
        if not result.ok:
            d[f"{k}_failed"] = d.get(f"{k}_failed", 0) + 1
            return
        job = result.job
        if kind in (JobKind.PROMOTE, JobKind.DISK_WRITE):
            n_blocks = len(job.host_blocks)
        else:  # engine blocks moved, whether from the host or straight from files
            n_blocks = len(job.engine_blocks) + sum(len(b) for _, _, b in job.disk_loads)
        d[f"{k}_blocks"] = d.get(f"{k}_blocks", 0) + n_blocks
        d[f"{k}_bytes"] = d.get(f"{k}_bytes", 0) + result.nbytes
        d.setdefault(f"{k}_seconds", []).append(result.seconds)
        d.setdefault(f"{k}_latency_s", []).append(result.latency)
        if result.seconds > 0:
            d.setdefault(f"{k}_gbps", []).append(result.nbytes / result.seconds / 1e9)

    def take(self) -> KVConnectorStats | None:
        if not self._data:
            return None
        data, self._data = self._data, {}
        return KVConnectorStats(data=data)


class LookupStats:
    """Scheduler side: hit sources and tier events, plus a periodic summary log line."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.counts: Counter[str] = Counter()
        self.totals: Counter[str] = Counter()
        self._last_log = time.monotonic()

    def add(self, key: str, n: int = 1) -> None:
        if n:
            self.counts[key] += n
            self.totals[key] += n

    def take(self) -> KVConnectorStats | None:
        self._maybe_log()
        if not self.counts:
            return None
        data = dict(self.counts)
        self.counts.clear()
        return KVConnectorStats(data=data)

    def hit_rates(self) -> dict[str, float]:
        """Share of looked-up tokens served per tier, since the connector started."""
        queried = self.totals["lookup_tokens"]
        return {
            tier: (self.totals[f"hit_tokens_{tier}"] / queried if queried else 0.0)
            for tier in ("host", "disk")
        }

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_log < envs.log_stats_interval_s() or not self.totals:
            return
        self._last_log = now
        rates = self.hit_rates()
        logger.info(
            fmt_fields(
                f"{self.name} offload",
                lookup_tokens=self.totals["lookup_tokens"],
                host_hit_rate=round(rates["host"], 4),
                disk_hit_rate=round(rates["disk"], 4),
                **{k: v for k, v in self.totals.items() if k.startswith(("evicted", "store_"))},
            )
        )
