"""``vllm.v1.metrics.utils``: ``create_metric_per_engine``, kvferry's own."""

from kvferry.kv_transfer.base import create_metric_per_engine

__all__ = ["create_metric_per_engine"]
