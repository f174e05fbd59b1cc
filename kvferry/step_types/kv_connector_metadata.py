"""Base classes of the payloads a KV connector passes between its two halves.

They are re-exported by :mod:`kvferry.kv_transfer.base`, where connector authors import them;
they live here so that the step types can name them without importing the connector package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class KVConnectorMetadata:  # noqa: B024 - a marker base; connectors subclass with their fields
    """The scheduler side's plan for one step, handed to every worker. Plain data only."""


class KVConnectorWorkerMetadata(ABC):
    """Worker-to-scheduler side data of one step (e.g. completed store jobs)."""

    @abstractmethod
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Fold another worker's metadata of the same step into this one and return the result."""


class KVConnectorHandshakeMetadata:  # noqa: B024 - marker base for out-of-band handshakes
    """Per-worker data a peer needs before it can transfer (addresses, memory descriptors)."""
