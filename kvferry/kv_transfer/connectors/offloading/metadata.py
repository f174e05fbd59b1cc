"""What the OffloadingConnector's scheduler half sends its worker half each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv_transfer.base import KVConnectorMetadata
from kvferry.kv_transfer.offload.jobs import TransferJob


@dataclass
class OffloadingConnectorMetadata(KVConnectorMetadata):
    """``flush``: store jobs to finish before this step's forward (their source blocks were
    reallocated this step). ``loads`` start right away; ``stores`` copy blocks this step's
    forward completes, after it; ``disk_jobs`` (promotions, file writes and deletions) run in
    order on the disk thread. ``idle``: the step computes nothing, so the worker may wait a
    moment for transfers instead of returning at once."""

    loads: list[TransferJob] = field(default_factory=list)
    stores: list[TransferJob] = field(default_factory=list)
    disk_jobs: list[TransferJob] = field(default_factory=list)
    flush: list[int] = field(default_factory=list)
    idle: bool = False
