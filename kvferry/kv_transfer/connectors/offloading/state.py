"""Bookkeeping records of the offload connectors' scheduler half, and the disk index restore
that a new engine runs on a folder an earlier one filled."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv_transfer.base import CacheHitSource
from kvferry.kv_transfer.connectors.offloading.layout import OffloadLayout
from kvferry.kv_transfer.offload.disk import scan_folder
from kvferry.kv_transfer.offload.jobs import JobKind
from kvferry.kv_transfer.offload.manager import TieredOffloadingManager
from kvferry.kv_transfer.offload.policies import Key
from kvferry.kv_transfer.offload.tier import TierIndex
from kvferry.logger import fmt_fields, init_logger
from kvferry.request import Request

logger = init_logger(__name__)


@dataclass
class Lookup:
    """A lookup's answer, kept until the request's allocation: the local hit it followed and
    the chunks it offered (pinned for the request meanwhile)."""

    num_local_tokens: int
    keys: list[Key]
    # Hybrid models: the other groups' chunk copies the hit needs, as (group, chunk, key).
    group_keys: list[tuple[int, int, Key]] = field(default_factory=list)


@dataclass
class OffloadRequest:
    """What the scheduler half knows of one request, from its first lookup to its end."""

    request: Request
    # Set by the first allocation; from then on the request holds ``block_ids`` (its table).
    allocated: bool = False
    block_ids: list[int] = field(default_factory=list)
    # Hybrid models: every group's table (group 0's is ``block_ids``). A sliding-window
    # group's may keep ids of blocks the engine gave back (never read from here).
    group_block_ids: list[list[int]] = field(default_factory=list)
    next_chunk: int = 0  # chunks below this were offered for storing already
    lookup: Lookup | None = None
    deferred_since: float | None = None  # monotonic time of the first lookup that waited
    # Its load failed once: later lookups offer nothing, so the request recomputes.
    load_failed: bool = False
    # The last planned load's tokens by the tier each chunk is read from.
    hit_sources: dict[CacheHitSource, int] = field(default_factory=dict)


@dataclass
class JobRecord:
    """A job in flight: its chunk keys, the engine blocks it reads (stores, fenced until it
    is done) and, for loads, where each key is read from (host slot, or None: its file).
    ``tainted``: a store that may have read bad KV, dropped instead of published."""

    kind: JobKind
    keys: list[Key]
    engine_blocks: list[int] = field(default_factory=list)
    slots: list[int | None] = field(default_factory=list)
    tainted: bool = False


def restore_disk_index(
    layout: OffloadLayout, disk: TierIndex, mgr: TieredOffloadingManager
) -> None:
    """Register the chunk files an earlier engine left in this model's folder (unverified:
    each is checked before it is first offered); files of the wrong size, and the oldest ones
    beyond the capacity, are deleted. Under tensor parallelism a chunk counts only when every
    rank's folder holds its file; a chunk some rank lacks is deleted from the others."""
    assert layout.disk_folder is not None
    scans = [scan_folder(folder, layout.file_size) for folder in layout.rank_folders()]
    good, bad = scans[0]
    if len(scans) > 1:
        everywhere = set(good).intersection(*(set(g) for g, _ in scans[1:]))
        partial = {k for g, _ in scans for k in g} - everywhere
        bad = list(dict.fromkeys([*bad, *(k for _, b in scans[1:] for k in b), *partial]))
        good = [k for k in good if k in everywhere]  # rank 0's order: oldest first
    excess = good[: max(0, len(good) - disk.capacity)]
    for key in good[len(excess) :]:
        disk.insert_ready(key)
    mgr.forget_files(excess + bad)
    if good or bad:
        logger.info(
            fmt_fields(
                "offload disk tier restored",
                folder=str(layout.disk_folder),
                chunks=len(disk),
                dropped_wrong_size=len(bad),
                dropped_over_capacity=len(excess),
            )
        )
