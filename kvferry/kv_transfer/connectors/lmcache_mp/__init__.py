"""LMCacheMPConnector: KV shared across engines through LMCache's multi-process server."""

from kvferry.kv_transfer.connectors.lmcache_mp.connector import LMCacheMPConnector

__all__ = ["LMCacheMPConnector"]
