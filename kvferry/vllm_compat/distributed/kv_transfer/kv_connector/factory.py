"""``vllm.distributed.kv_transfer.kv_connector.factory``: kvferry's ``KVConnectorFactory``."""

from kvferry.kv_transfer.factory import KVConnectorFactory

__all__ = ["KVConnectorFactory"]
