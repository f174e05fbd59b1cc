"""The planned faults, sent from the scheduler side to the worker side each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv_transfer.base import KVConnectorMetadata


@dataclass
class InjectedLoad:
    """A fault on one request's load: ``block_ids`` are the blocks it writes."""

    req_id: str
    block_ids: list[int]
    is_async: bool
    fail: bool = False
    corrupt: bool = False
    delay_s: float = 0.0


@dataclass
class FaultInjectionMetadata(KVConnectorMetadata):
    inner: KVConnectorMetadata
    loads: list[InjectedLoad] = field(default_factory=list)
    store_delay_s: float = 0.0
