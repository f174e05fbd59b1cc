"""A publisher that keeps the batches it is handed, and a config that turns events on."""

from __future__ import annotations

from typing import Any

from kvferry.config import KVEventsConfig
from kvferry.kv_events import EventBatch


def events_on() -> KVEventsConfig:
    """KV cache events on (the publisher itself is the test's)."""
    return KVEventsConfig(enable_kv_cache_events=True)


class RecordingPublisher:
    """Records every published batch; ``take()`` returns the events published since the last
    call, flattened in order."""

    def __init__(self) -> None:
        self.batches: list[EventBatch] = []
        self.closed = 0
        self._taken = 0

    def publish(self, events: EventBatch) -> None:
        assert not self.closed, "publish after shutdown"
        self.batches.append(events)

    def shutdown(self) -> None:
        self.closed += 1

    def take(self) -> list[Any]:
        new = self.batches[self._taken :]
        self._taken = len(self.batches)
        return [e for batch in new for e in batch.events]
