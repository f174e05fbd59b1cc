"""SimpleCPUOffloadConnector's step plan: at most one load event and one store event."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.kv_transfer.connectors.offloading.metadata import OffloadingConnectorMetadata


@dataclass
class SimpleCPUOffloadMetadata(OffloadingConnectorMetadata):
    """Same fields as :class:`OffloadingConnectorMetadata`, with ``loads`` and ``stores``
    holding at most one job each: the step's load event (every request whose load starts
    this step) and store event. ``flush`` names earlier store events to finish first."""

    @property
    def load_event(self) -> int | None:
        return self.loads[0].job_id if self.loads else None

    @property
    def store_event(self) -> int | None:
        return self.stores[0].job_id if self.stores else None
