"""KV cache events in vLLM's wire format: typed events, cross-worker aggregation, publishers.

A plain-data package every layer may use: the block pool and connectors build events, the
scheduler batches them once per step, the engine hands batches to a publisher, and the proxy
decodes them.
"""

from kvferry.kv_events.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVCacheEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
    external_block_hash,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "external_block_hash",
]
