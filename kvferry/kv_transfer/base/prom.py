"""``KVConnectorPromMetrics``: the base of a connector's own Prometheus metrics.

A connector's ``build_prom_metrics`` returns one (or None). The server builds it once with
the metric classes to use (``metric_types``: prometheus_client's ``Gauge``, ``Counter`` and
``Histogram`` mapped to classes bound to the server's registry), the label names of every
series (``model_name``, ``engine``) and each engine's label values, and calls ``observe`` with
the ``KVConnectorStats.data`` of every step that has stats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from kvferry.config import KVTransferConfig

__all__ = ["KVConnectorPromMetrics", "PromMetric", "PromMetricT", "create_metric_per_engine"]

PromMetric: TypeAlias = Gauge | Counter | Histogram
PromMetricT = TypeVar("PromMetricT", bound=PromMetric)


class KVConnectorPromMetrics:
    """Registers a connector's metrics in ``__init__`` (with ``self._gauge_cls`` etc., so they
    land on the server's ``/metrics``) and records stats in ``observe``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetric]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        self._kv_transfer_config: KVTransferConfig | None = vllm_config.kv_transfer_config
        self._gauge_cls = metric_types[Gauge]
        self._counter_cls = metric_types[Counter]
        self._histogram_cls = metric_types[Histogram]
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one step's ``KVConnectorStats.data`` of engine ``engine_idx``."""
        raise NotImplementedError


def create_metric_per_engine(
    metric: PromMetric, per_engine_labelvalues: dict[int, list[object]]
) -> dict[int, Any]:
    """``metric`` bound to each engine's label values, by engine index."""
    return {i: metric.labels(*values) for i, values in per_engine_labelvalues.items()}
