"""``vllm.distributed.kv_transfer.kv_connector.v1.base``: kvferry's connector protocol,
re-exported (``KVConnectorBase_V1`` is ``kvferry.kv_transfer.base.KVConnectorBase``)."""

from kvferry.kv_transfer.base import (
    CopyBlocksOp,
    KVConnectorBase,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)

__all__ = [
    "CopyBlocksOp",
    "KVConnectorBase",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "SupportsHMA",
    "supports_hma",
]
