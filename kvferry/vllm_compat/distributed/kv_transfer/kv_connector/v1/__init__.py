"""``vllm.distributed.kv_transfer.kv_connector.v1``: the V1 connector base and role."""

from kvferry.vllm_compat.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

__all__ = ["KVConnectorBase_V1", "KVConnectorRole", "SupportsHMA"]
