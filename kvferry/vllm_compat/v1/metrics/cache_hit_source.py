"""``vllm.v1.metrics.cache_hit_source``: kvferry's ``CacheHitSource``."""

from kvferry.kv_transfer.base import CacheHitSource

__all__ = ["CacheHitSource"]
