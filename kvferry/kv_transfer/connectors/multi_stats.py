"""MultiConnector's stats and Prometheus metrics: one entry per child, each handled by the
child's own class, as vLLM's MultiConnector does.

Children are named ``"<index>.<ClassName>"``. The engine's totals, logs and ``/metrics`` read
``KVConnectorStats.data`` as flat numbers and sample lists, so the multi stats keep ``data``
flat (``"<child>.<key>"``) while aggregating each child's stats object with that child's own
``aggregate`` and reducing it with its own ``reduce``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvferry.config import ConfigError, KVTransferConfig
from kvferry.kv_transfer.base import KVConnectorPromMetrics, KVConnectorStats, PromMetric

if TYPE_CHECKING:
    from kvferry.kv_transfer.base import KVConnectorBase

__all__ = ["MultiKVConnectorPromMetrics", "MultiKVConnectorStats", "split_child_keys"]


def split_child_keys(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat ``"<index>.<ClassName>.<key>"`` data -> child name -> its own data. Keys naming no
    child (added by a wrapper around the MultiConnector) go under the name ``""``."""
    out: dict[str, dict[str, Any]] = {}
    for flat_key, value in data.items():
        index, _, rest = flat_key.partition(".")
        name, _, key = rest.partition(".")
        child, key = (
            (f"{index}.{name}", key) if index.isdigit() and name and key else ("", flat_key)
        )
        out.setdefault(child, {})[key] = value
    return out


def _flat_key(child: str, key: str) -> str:
    return f"{child}.{key}" if child else key


@dataclass
class MultiKVConnectorStats(KVConnectorStats):
    """``by_child``: each child's stats object; ``data``: their flat view (kept in step)."""

    by_child: dict[str, KVConnectorStats] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.data and not self.by_child:
            self.by_child = {n: KVConnectorStats(d) for n, d in split_child_keys(self.data).items()}
        self._flatten()

    def _flatten(self) -> None:
        self.data = {
            _flat_key(name, key): value
            for name, stats in self.by_child.items()
            for key, value in stats.data.items()
        }

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = (
            other.by_child
            if isinstance(other, MultiKVConnectorStats)
            else {n: KVConnectorStats(d) for n, d in split_child_keys(other.data).items()}
        )
        for name, stats in theirs.items():
            mine = self.by_child.get(name)
            self.by_child[name] = stats if mine is None else mine.aggregate(stats)
        self._flatten()
        return self

    def reduce(self) -> dict[str, int | float]:
        return {
            _flat_key(name, key): value
            for name, stats in self.by_child.items()
            for key, value in stats.reduce().items()
        }

    def reset(self) -> None:
        for stats in self.by_child.values():
            stats.reset()
        self._flatten()

    def is_empty(self) -> bool:
        return all(stats.is_empty() for stats in self.by_child.values())


def child_stats_class_by_name(class_name: str) -> type[KVConnectorBase] | None:
    """A registered connector class by name (what a child's stats name carries), or None."""
    from kvferry.kv_transfer.factory import KVConnectorFactory

    try:
        kvt = KVTransferConfig.from_dict({"kv_connector": class_name, "kv_role": "kv_both"})
        return KVConnectorFactory.get_connector_class(kvt)
    except ConfigError:
        return None


class MultiKVConnectorPromMetrics(KVConnectorPromMetrics):
    """Hands each child's part of a step's stats to the metrics its class registered
    (``children``: child name -> that class's metrics; children of one class share them)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetric]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        children: dict[str, KVConnectorPromMetrics],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.children = children

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, data in split_child_keys(transfer_stats_data).items():
            prom = self.children.get(name)
            if prom is not None:  # a child whose class registers no metrics
                prom.observe(data, engine_idx)
