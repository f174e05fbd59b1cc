"""``KVEventsConfig``: vLLM's KV-event publisher settings, with vLLM's defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["KVEventsConfig"]


@dataclass
class KVEventsConfig:
    """kvferry publishes no KV events, so a view always carries ``enable_kv_cache_events``
    False; the fields are those connectors read."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
