"""The publisher the scheduler hands its KV cache events to, one batch per step.

As in vLLM, the scheduler owns the publisher: at the end of every ``update_from_output`` it
takes the prefix cache's events and the connector's (``take_events()``, which also carries
what the workers reported through ``KVConnectorOutput.kv_cache_events``, handed to the
connector by ``update_connector_output``) and publishes them as one
:class:`~kvferry.kv_events.KVEventBatch` when there are any.
"""

from __future__ import annotations

from typing import Protocol

from kvferry.config import KVEventsConfig
from kvferry.kv_events.events import EventBatch


class KVEventPublisher(Protocol):
    """What the scheduler needs of a publisher (kvferry's and vLLM's publishers have it)."""

    def publish(self, events: EventBatch) -> None: ...

    def shutdown(self) -> None: ...


def create_publisher(config: KVEventsConfig | None) -> KVEventPublisher | None:
    """The publisher ``config`` asks for, or None when it publishes nothing (then no event
    is even recorded)."""
    if config is None or not config.publishes:
        return None
    # Imported here: the ZMQ machinery loads only when events are on.
    from kvferry.kv_events import EventPublisherFactory

    publisher: KVEventPublisher = EventPublisherFactory.create(config)
    return publisher
