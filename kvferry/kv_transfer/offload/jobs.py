"""Plain-data transfer jobs the scheduler side plans and the worker side runs.

Job ids are unique per connector instance and chosen by the scheduler side. Completion of
every job is reported back through :class:`OffloadWorkerMetadata` (counted across workers by
``aggregate``); loads are additionally reported as ``finished_recving`` of their requests,
which is what releases a request waiting for its KV.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvferry.kv_transfer.base import KVConnectorWorkerMetadata


class JobKind(str, enum.Enum):
    LOAD = "load"  # host blocks -> engine blocks
    STORE = "store"  # engine blocks -> host blocks
    DISK_WRITE = "disk_write"  # host chunk -> file (after the store that filled it)
    DISK_STORE = "disk_store"  # engine blocks -> file, when the host tier has no room
    PROMOTE = "promote"  # file -> host chunk, checked before it is offered
    VERIFY = "verify"  # read a file and check it, before it is offered
    DISK_DELETE = "disk_delete"  # remove a file (eviction, corrupt data)


@dataclass
class TransferJob:
    """``engine_blocks[i]`` pairs with ``host_blocks[i]`` (LOAD / STORE). Disk jobs name one
    chunk by ``disk_key`` (hex) and its ``host_blocks`` (its ``engine_blocks`` for
    DISK_STORE). A LOAD may also read chunks straight from files: ``disk_loads`` holds
    ``(key hex, first block of the chunk to load, engine blocks)``. ``req_ids``: requests a
    LOAD finishes. ``after``: a job that must complete first (a DISK_WRITE waits for its
    STORE)."""

    job_id: int
    kind: JobKind
    engine_blocks: list[int] = field(default_factory=list)
    host_blocks: list[int] = field(default_factory=list)
    disk_key: str | None = None
    req_ids: list[str] = field(default_factory=list)
    after: int | None = None
    disk_loads: list[tuple[str, int, list[int]]] = field(default_factory=list)


@dataclass
class OffloadWorkerMetadata(KVConnectorWorkerMetadata):
    """Jobs finished since the last step, ``{job_id: number of workers}``; a job counts as
    done once every worker reported it, and as failed if any worker failed it."""

    completed: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, OffloadWorkerMetadata)
        for mine, theirs in ((self.completed, other.completed), (self.failed, other.failed)):
            for job_id, n in theirs.items():
                mine[job_id] = mine.get(job_id, 0) + n
        return self

    def is_empty(self) -> bool:
        return not (self.completed or self.failed)


class JobCounter:
    """Counts worker reports per job until every worker reported (scheduler side)."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self._seen: dict[int, int] = {}
        self._failed: set[int] = set()

    def add(self, meta: OffloadWorkerMetadata | None) -> list[tuple[int, bool]]:
        """Fold one step's aggregated metadata in; returns ``(job_id, ok)`` of jobs now done."""
        if meta is None:
            return []
        done: list[tuple[int, bool]] = []
        for counts, failed in ((meta.completed, False), (meta.failed, True)):
            for job_id, n in counts.items():
                if failed:
                    self._failed.add(job_id)
                total = self._seen.get(job_id, 0) + n
                if total >= self.num_workers:
                    self._seen.pop(job_id, None)
                    done.append((job_id, job_id not in self._failed))
                    self._failed.discard(job_id)
                else:
                    self._seen[job_id] = total
        return done

    def __len__(self) -> int:
        return len(self._seen)
