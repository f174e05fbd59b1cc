"""Bookkeeping records of the OffloadingConnector's scheduler half, and the disk index
restore that a new engine runs on a folder an earlier one filled."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv_transfer.connectors.offloading.layout import OffloadLayout
from kvferry.kv_transfer.offload.disk import scan_folder
from kvferry.kv_transfer.offload.jobs import JobKind
from kvferry.kv_transfer.offload.manager import TieredOffloadingManager
from kvferry.kv_transfer.offload.policies import Key
from kvferry.kv_transfer.offload.tier import TierIndex
from kvferry.logger import init_logger, kv
from kvferry.request import Request

logger = init_logger(__name__)


@dataclass
class ReqState:
    request: Request
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0  # chunks below this were offered for storing already


@dataclass
class Part:
    """One request's share of a load or store: block pairs and the chunk keys they cover;
    for stores also the keys written to disk from the host (with their host slots) and the
    keys written to disk straight from the engine (with their engine blocks)."""

    req_id: str
    engine: list[int]
    host: list[int]
    keys: list[Key]
    disk: list[tuple[Key, int]] = field(default_factory=list)
    direct: list[tuple[Key, list[int]]] = field(default_factory=list)
    # Loads: where each key is read from (host slot, or None: its file) and the file reads.
    slots: list[int | None] = field(default_factory=list)
    disk_loads: list[tuple[str, int, list[int]]] = field(default_factory=list)


@dataclass
class JobRecord:
    kind: JobKind
    keys: list[Key]
    engine_blocks: list[int] = field(default_factory=list)
    tainted: bool = False
    slots: list[int | None] = field(default_factory=list)  # loads: see Part.slots


def restore_disk_index(
    layout: OffloadLayout, disk: TierIndex, mgr: TieredOffloadingManager
) -> None:
    """Register the chunk files an earlier engine left in this model's folder (unverified:
    each is checked before it is first offered); files of the wrong size, and the oldest ones
    beyond the capacity, are deleted."""
    assert layout.disk_folder is not None
    good, bad = scan_folder(layout.disk_folder, layout.file_size)
    excess = good[: max(0, len(good) - disk.capacity)]
    for key in good[len(excess) :]:
        disk.insert_ready(key)
    mgr.forget_files(excess + bad)
    if good or bad:
        logger.info(
            kv(
                "offload disk tier restored",
                folder=str(layout.disk_folder),
                chunks=len(disk),
                dropped_wrong_size=len(bad),
                dropped_over_capacity=len(excess),
            )
        )
