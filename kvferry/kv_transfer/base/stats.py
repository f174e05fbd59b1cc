"""Connector statistics: ``KVConnectorStats`` (one interval, JSON-serializable) and
``KVConnectorStatsTotals`` (running totals in constant memory)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["KVConnectorStats", "KVConnectorStatsTotals"]


@dataclass
class KVConnectorStats:
    """Interval statistics of a connector. ``data`` must stay JSON-serializable.

    Workers return one per step (reset on read); the executor folds them with ``aggregate``
    and the engine logs ``reduce()``. A connector with its own subclass rebuilds it from
    ``data`` in ``KVConnectorBase.build_kv_connector_stats``.
    """

    data: dict[str, Any] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            mine = self.data.get(key)
            if mine is None:
                self.data[key] = list(value) if isinstance(value, list) else value
            elif isinstance(mine, list):
                mine.extend(value)
            else:
                self.data[key] = mine + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """One number per key: sums for counters, means for lists of samples."""
        out: dict[str, int | float] = {}
        for key, value in self.data.items():
            if isinstance(value, list):
                out[f"{key}_avg"] = sum(value) / len(value) if value else 0.0
                out[f"{key}_count"] = len(value)
            else:
                out[key] = value
        return out

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not self.data

    def to_dict(self) -> dict[str, Any]:
        return dict(self.data)


@dataclass
class KVConnectorStatsTotals:
    """Running totals of many ``KVConnectorStats`` in constant memory: counters are summed,
    sample lists are kept as sum and count (so long-running engines do not grow)."""

    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, stats: KVConnectorStats) -> None:
        for key, value in stats.data.items():
            if isinstance(value, list):
                self.sums[key] = self.sums.get(key, 0.0) + float(sum(value))
                self.counts[key] = self.counts.get(key, 0) + len(value)
            elif isinstance(value, (int, float)):
                self.sums[key] = self.sums.get(key, 0) + value

    def as_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for key, total in self.sums.items():
            if key in self.counts:
                n = self.counts[key]
                out[f"{key}_avg"] = total / n if n else 0.0
                out[f"{key}_count"] = n
            else:
                out[key] = total
        return out

    def is_empty(self) -> bool:
        return not self.sums

    def reset(self) -> None:
        self.sums, self.counts = {}, {}
