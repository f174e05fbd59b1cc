"""KV cache events in vLLM's wire format: typed events, cross-worker aggregation, publishers.

A plain-data package every layer may use: the block pool and connectors build events, the
scheduler batches them once per step, the engine hands batches to a publisher, and the proxy
decodes them.
"""

import importlib
from typing import TYPE_CHECKING, Any

from kvferry.kv_events.aggregation import (
    CommonKVEvents,
    KVConnectorKVEvents,
    KVEventAggregator,
    UnionKVEvents,
    merge_worker_events,
)
from kvferry.kv_events.events import (
    KV_CACHE_SPEC_FULL_ATTENTION,
    KV_CACHE_SPEC_SLIDING_WINDOW,
    MAIN_ATTENTION_KINDS,
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

if TYPE_CHECKING:
    from kvferry.kv_events.publisher import (
        EventPublisher,
        EventPublisherFactory,
        NullEventPublisher,
        PublisherStats,
        ZmqEventPublisher,
    )

# The publishers load (with ZMQ) on first use: the engine imports this package for the event
# types even when it publishes nothing.
_PUBLISHER_NAMES = frozenset(
    {
        "EventPublisher",
        "EventPublisherFactory",
        "NullEventPublisher",
        "PublisherStats",
        "ZmqEventPublisher",
    }
)


def __getattr__(name: str) -> Any:
    if name in _PUBLISHER_NAMES:
        return getattr(importlib.import_module("kvferry.kv_events.publisher"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KV_CACHE_SPEC_FULL_ATTENTION",
    "KV_CACHE_SPEC_SLIDING_WINDOW",
    "MAIN_ATTENTION_KINDS",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CommonKVEvents",
    "EventBatch",
    "EventPublisher",
    "EventPublisherFactory",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVConnectorKVEvents",
    "KVEventAggregator",
    "KVEventBatch",
    "NullEventPublisher",
    "PublisherStats",
    "UnionKVEvents",
    "ZmqEventPublisher",
    "decode_batch",
    "encode_batch",
    "external_block_hash",
    "merge_worker_events",
]
