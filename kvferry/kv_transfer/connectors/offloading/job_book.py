"""JobBook: the offload scheduler half's jobs in flight.

It hands out job ids, packs a step's planned transfers into jobs, keeps a record of each
until every worker reported it done, and keeps the *fence*: the engine blocks that store jobs
still read. A step that reallocates a fenced block must flush those jobs first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from kvferry.kv_transfer.connectors.offloading.plans import RequestTransfer
from kvferry.kv_transfer.connectors.offloading.state import JobRecord
from kvferry.kv_transfer.connectors.offloading.worker_metadata import (
    JobCounter,
    OffloadWorkerMetadata,
)
from kvferry.kv_transfer.offload.jobs import JobKind, TransferJob
from kvferry.kv_transfer.offload.policies import Key


class JobBook:
    def __init__(self, world_size: int, host_blocks: Callable[[int], list[int]]) -> None:
        self.jobs: dict[int, JobRecord] = {}
        self._host_blocks = host_blocks  # host slot -> its host blocks
        self._reports = JobCounter(world_size)
        self._ids = itertools.count()
        self._fence: dict[int, set[int]] = {}  # engine block -> store jobs reading it

    def next_id(self) -> int:
        """An id for a job nobody waits for (a file deletion)."""
        return next(self._ids)

    def new(
        self,
        kind: JobKind,
        keys: list[Key],
        engine_blocks: list[int] | None = None,
        slots: list[int | None] | None = None,
    ) -> int:
        job_id = next(self._ids)
        self.jobs[job_id] = JobRecord(kind, keys, engine_blocks or [], slots or [])
        return job_id

    def package(
        self, kind: JobKind, parts: list[RequestTransfer], one_job: bool
    ) -> tuple[list[TransferJob], list[TransferJob]]:
        """Turn a step's transfers into jobs (one per request, or with ``one_job`` one for
        all) and record them. Returns the jobs and, for stores, the disk jobs that go with
        them: writes from the engine straight to disk, and write-throughs that run after
        their store."""
        if one_job and len(parts) > 1:
            groups = [(RequestTransfer.merged(parts), [p.req_id for p in parts])]
        else:
            groups = [(p, [p.req_id]) for p in parts]
        jobs: list[TransferJob] = []
        disk_jobs: list[TransferJob] = []
        for part, req_ids in groups:
            for key, blocks in part.disk_only:
                direct_id = self.new(JobKind.DISK_STORE, [key], blocks)
                disk_jobs.append(TransferJob(direct_id, JobKind.DISK_STORE, blocks, [], key.hex()))
            if not part.chunks:
                continue
            engine_blocks, host_blocks = part.host_copies()
            if kind == JobKind.LOAD:
                job_id = self.new(kind, part.keys, slots=part.slots)
                job = TransferJob(job_id, kind, engine_blocks, host_blocks, req_ids=req_ids)
                job.disk_loads = part.file_loads()
            else:
                job_id = self.new(kind, part.keys, engine_blocks)
                job = TransferJob(job_id, kind, engine_blocks, host_blocks)
            jobs.append(job)
            for key, slot in part.write_through:
                write_id = self.new(JobKind.DISK_WRITE, [key])
                disk_jobs.append(
                    TransferJob(
                        write_id,
                        JobKind.DISK_WRITE,
                        [],
                        self._host_blocks(slot),
                        key.hex(),
                        after=job_id,
                    )
                )
        return jobs, disk_jobs

    # -- the fence --------------------------------------------------------------------------

    def fence(self, jobs: Iterable[TransferJob]) -> None:
        """Fence the engine blocks these jobs read until they are done."""
        for job in jobs:
            for block in job.engine_blocks:  # only jobs that read engine blocks have any
                self._fence.setdefault(block, set()).add(job.job_id)

    def readers_of(self, blocks: Iterable[int]) -> list[int]:
        """The jobs still reading any of ``blocks``, in id order."""
        return sorted({job for block in blocks for job in self._fence.get(block, ())})

    # -- completions ------------------------------------------------------------------------

    def taint(self, job_ids: Iterable[int]) -> None:
        """These jobs may have read bad KV: what they wrote is dropped, not published."""
        for job_id in job_ids:
            if job_id in self.jobs:
                self.jobs[job_id].tainted = True

    def take_done(self, meta: OffloadWorkerMetadata) -> list[tuple[JobRecord, bool]]:
        """Fold one step's worker reports in; returns the jobs every worker finished (and
        whether all succeeded), no longer recorded nor fenced."""
        done: list[tuple[JobRecord, bool]] = []
        for job_id, ok in self._reports.add(meta):
            job = self.jobs.pop(job_id, None)
            if job is None:
                continue
            for block in job.engine_blocks:
                readers = self._fence.get(block)
                if readers is not None:
                    readers.discard(job_id)
                    if not readers:
                        del self._fence[block]
            done.append((job, ok))
        return done

    def check_integrity(self, idle: bool = False) -> None:
        fenced = {job for readers in self._fence.values() for job in readers}
        assert fenced <= set(self.jobs), "a fence names a job that is done"
        if idle:
            assert not self.jobs, f"jobs in flight: {sorted(self.jobs)}"
            assert not self._fence, "fences left"
            assert len(self._reports) == 0, "partial job reports left"
