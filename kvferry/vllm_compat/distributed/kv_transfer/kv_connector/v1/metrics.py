"""``vllm.distributed.kv_transfer.kv_connector.v1.metrics``: connector stats and Prometheus
metric bases, kvferry's own."""

from kvferry.kv_transfer.base import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

__all__ = ["KVConnectorPromMetrics", "KVConnectorStats", "PromMetric", "PromMetricT"]
