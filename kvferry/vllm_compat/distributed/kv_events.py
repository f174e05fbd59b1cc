"""``vllm.distributed.kv_events``: vLLM's KV-cache event types, as plain dataclasses.

kvferry publishes no KV events yet; these let a connector build and return them
(``take_events`` / ``get_kv_connector_kv_cache_events``), with vLLM's names and field order.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KVCacheEvent",
    "KVConnectorKVEvents",
    "KVEventAggregator",
    "KVEventBatch",
]

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class KVCacheEvent:
    """Base of the events below."""


@dataclass
class BlockStored(KVCacheEvent):
    block_hashes: list[Any]
    parent_block_hash: Any | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


@dataclass
class BlockRemoved(KVCacheEvent):
    block_hashes: list[Any]
    medium: str | None = None
    group_idx: int | None = None


@dataclass
class AllBlocksCleared(KVCacheEvent):
    pass


@dataclass
class EventBatch:
    ts: float = field(default_factory=time.time)
    events: list[Any] = field(default_factory=list)
    data_parallel_rank: int | None = None


@dataclass
class KVEventBatch(EventBatch):
    pass


class KVEventAggregator:
    """Events from several workers; by default only those every worker reported are kept."""

    def __init__(self, num_workers: int) -> None:
        if num_workers <= 0:
            raise ValueError("num_workers must be positive")
        self._num_workers = num_workers
        self._counts: dict[str, int] = {}
        self._events: dict[str, KVCacheEvent] = {}

    def add_events(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            key = repr(event)
            self._events.setdefault(key, event)
            self._counts[key] = self._counts.get(key, 0) + 1

    def get_common_events(self) -> list[KVCacheEvent]:
        return [e for k, e in self._events.items() if self._counts[k] >= self._num_workers]

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events.values())

    def clear_events(self) -> None:
        self._counts.clear()
        self._events.clear()

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def reset_workers(self) -> None:
        self._num_workers = 1

    def get_number_of_workers(self) -> int:
        return self._num_workers


class KVConnectorKVEvents(ABC):
    """A connector's own KV events, combined across workers by the engine."""

    @abstractmethod
    def add_events(self, events: list[KVCacheEvent]) -> None: ...

    @abstractmethod
    def aggregate(self) -> KVConnectorKVEvents: ...

    @abstractmethod
    def increment_workers(self, count: int = 1) -> None: ...

    @abstractmethod
    def get_all_events(self) -> list[KVCacheEvent]: ...

    @abstractmethod
    def get_number_of_workers(self) -> int: ...

    @abstractmethod
    def clear_events(self) -> None: ...

    def merge(self, other: KVConnectorKVEvents) -> KVConnectorKVEvents:
        self.add_events(other.get_all_events())
        self.increment_workers(other.get_number_of_workers())
        return self
