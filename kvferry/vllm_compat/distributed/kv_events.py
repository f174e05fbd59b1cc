"""``vllm.distributed.kv_events``: kvferry's own KV event types, aggregation and publishers.

The very classes the engine publishes (``kvferry.kv_events``), with vLLM's names, fields and
wire format, so a vLLM-style connector's events are the engine's own events.
"""

from kvferry.config.kv_events import KVEventsConfig
from kvferry.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventPublisher,
    EventPublisherFactory,
    ExternalBlockHash,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
    KVEventBatch,
    NullEventPublisher,
    ZmqEventPublisher,
)

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventPublisher",
    "EventPublisherFactory",
    "ExternalBlockHash",
    "KVCacheEvent",
    "KVConnectorKVEvents",
    "KVEventAggregator",
    "KVEventBatch",
    "KVEventsConfig",
    "NullEventPublisher",
    "ZmqEventPublisher",
]
