"""``KVTransferConfig``: kvferry's own class (vLLM's field names and defaults)."""

from kvferry.config import KVTransferConfig

__all__ = ["KVTransferConfig"]
