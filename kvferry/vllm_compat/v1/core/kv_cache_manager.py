"""``vllm.v1.core.kv_cache_manager``: kvferry's ``KVCacheBlocks`` and ``KVCacheManager``."""

from kvferry.core.kv_cache_manager import KVCacheBlocks, KVCacheManager

__all__ = ["KVCacheBlocks", "KVCacheManager"]
