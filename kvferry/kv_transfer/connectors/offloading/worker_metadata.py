"""What the offload connectors' workers report back each step, and how the scheduler half
counts those reports across workers.

Completion of every transfer job is reported through :class:`OffloadWorkerMetadata`
(counted across workers by ``aggregate``); loads are additionally reported as
``finished_recving`` of their requests, which is what releases a request waiting for its KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvferry.kv_transfer.base import KVConnectorWorkerMetadata


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
