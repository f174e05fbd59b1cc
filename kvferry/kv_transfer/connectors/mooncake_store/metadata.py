"""What passes between the MooncakeStoreConnector's halves: the step's plan going down, and
job completions coming up (folded across workers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv_transfer.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class ChunkIO:
    """One chunk to move: its store key (without the rank), the engine blocks, and the index
    of the chunk's first block that is moved (a load may start inside a chunk whose first
    blocks are already local)."""

    key: str
    block_ids: list[int]
    first_block: int = 0


@dataclass
class StoreJob:
    job_id: int
    req_id: str
    chunks: list[ChunkIO] = field(default_factory=list)


@dataclass
class LoadJob:
    job_id: int
    req_id: str
    chunks: list[ChunkIO] = field(default_factory=list)


@dataclass
class MooncakeStoreMetadata(KVConnectorMetadata):
    """``loads`` start at once (async: the request waits in WAITING_FOR_REMOTE_KVS);
    ``stores`` read blocks this step's forward completes, after it. ``preempted``: requests
    whose blocks were freed this step (their stores must have copied them first)."""

    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


@dataclass
class MooncakeStoreWorkerMeta(KVConnectorWorkerMetadata):
    """Store jobs finished since the last step, ``{job_id: workers}`` (ok / failed), and store
    keys found corrupt (removed from the store)."""

    stored: dict[int, int] = field(default_factory=dict)
    store_failed: dict[int, int] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, MooncakeStoreWorkerMeta)
        for mine, theirs in ((self.stored, other.stored), (self.store_failed, other.store_failed)):
            for job_id, n in theirs.items():
                mine[job_id] = mine.get(job_id, 0) + n
        self.removed += [k for k in other.removed if k not in self.removed]
        return self

    def is_empty(self) -> bool:
        return not (self.stored or self.store_failed or self.removed)
