"""The OffloadingConnector's scheduler half: lookups, load and store plans, fencing.

Chunks: chunk ``c`` of a request is its blocks ``[c*B, (c+1)*B)``; its key is the block hash
of its last block (chained, so it names the whole prefix up to there). Only whole chunks are
looked up and stored.

Per request there is at most one load job in flight; store jobs are one per request and step
(the chunks that step's forward completes). A store job's source blocks are indexed in
``_fence``: when a step reallocates one of them (the request finished or was preempted),
the job is listed in the step's ``flush`` and the worker waits for it before the forward.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from kvferry.core.kv_cache_config import KVCacheConfig
from kvferry.core.kv_cache_manager import KVCacheBlocks
from kvferry.core.sched_output import SchedulerOutput
from kvferry.kv_transfer.base import KVConnectorStats
from kvferry.kv_transfer.connectors.offloading.layout import OffloadLayout
from kvferry.kv_transfer.connectors.offloading.metadata import OffloadingConnectorMetadata
from kvferry.kv_transfer.connectors.offloading.state import (
    JobRecord,
    Part,
    ReqState,
    restore_disk_index,
)
from kvferry.kv_transfer.offload.connector_base import SchedulerHalf
from kvferry.kv_transfer.offload.jobs import JobCounter, JobKind, OffloadWorkerMetadata, TransferJob
from kvferry.kv_transfer.offload.manager import LookupStatus, TieredOffloadingManager
from kvferry.kv_transfer.offload.options import OffloadingOptions
from kvferry.kv_transfer.offload.policies import Key, policy_class
from kvferry.kv_transfer.offload.stats import LookupStats
from kvferry.kv_transfer.offload.tier import TierIndex
from kvferry.kv_transfer.output import KVConnectorOutput
from kvferry.logger import init_logger
from kvferry.request import Request

logger = init_logger(__name__)


class OffloadingScheduler(SchedulerHalf):
    # One load job and one store job per step for all requests (SimpleCPUOffloadConnector's
    # "events"), instead of one per request.
    one_job_per_step = False

    def __init__(
        self,
        opts: OffloadingOptions,
        layout: OffloadLayout,
        kv_cache_config: KVCacheConfig,
        world_size: int,
        name: str = "OffloadingConnector",
    ) -> None:
        self.opts = opts
        self.layout = layout
        self.bs = layout.block_size
        self.B = layout.blocks_per_chunk
        self.stats = LookupStats(name)
        n_host = layout.num_host_chunks
        host = TierIndex("cpu", n_host, policy_class(opts.eviction_policy)(n_host))
        disk = None
        if layout.disk_folder is not None:
            n = layout.num_disk_chunks
            disk = TierIndex("disk", n, policy_class(opts.disk_eviction_policy)(n), False)
        self.mgr = TieredOffloadingManager(
            host, disk, self.stats, opts.store_threshold, opts.max_tracker_size
        )
        self._reqs: dict[str, ReqState] = {}
        self._jobs: dict[int, JobRecord] = {}
        self._counter = JobCounter(world_size)
        self._ids = itertools.count()
        self._fence: dict[int, set[int]] = {}  # engine block -> store jobs reading it
        self._lookups: dict[str, tuple[int, list[Key]]] = {}  # req -> (local tokens, hit keys)
        # request id -> monotonic time of its first deferred lookup
        self._deferred_since: dict[str, float] = {}
        self._failed_loads: set[str] = set()
        self._step_loads: list[Part] = []
        self._step_allocated: set[int] = set()
        self._last_stores: list[int] = []
        self._step_disk: list[TransferJob] = []
        if disk is not None:
            restore_disk_index(layout, disk, self.mgr)

    def _key(self, request: Request, chunk: int) -> Key:
        return request.block_hashes[(chunk + 1) * self.B - 1]

    def _new_job(self, kind: JobKind, keys: list[Key], blocks: list[int] | None = None) -> int:
        job_id = next(self._ids)
        self._jobs[job_id] = JobRecord(kind, keys, blocks or [])
        return job_id

    # -- lookup ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid, ct = request.request_id, self.layout.chunk_tokens
        if rid in self._failed_loads:
            # Its load failed once: recompute rather than offer the same chunks again (a
            # chunk that keeps failing would otherwise loop lookup -> fail -> rewind).
            self._lookups[rid] = (num_computed_tokens, [])
            return 0, False
        old = self.mgr.take_holds(rid)  # dropped after the new holds are taken
        self._lookups.pop(rid, None)
        first = num_computed_tokens // ct
        last = min((request.num_tokens - 1) // ct, len(request.block_hashes) // self.B)
        hits: list[tuple[Key, str]] = []  # the leading run of loadable chunks, and where
        waiting, in_prefix = False, True
        for c in range(first, last):
            key = self._key(request, c)
            status = self.mgr.lookup(key)
            if status is LookupStatus.MISS:
                break
            if status is LookupStatus.HIT or (
                status is LookupStatus.RETRY and self.mgr.disk_loadable(key)
            ):
                if in_prefix:
                    hits.append((key, "cpu" if status is LookupStatus.HIT else "disk"))
                continue
            in_prefix = False
            if status is LookupStatus.PENDING:
                waiting = True
                if ("cpu", key) in old:  # keep holding a chunk being promoted for us
                    self.mgr.pin(rid, key)
            elif self.mgr.prefetch(rid, key) or self.mgr.request_verify(key):
                waiting = True  # a file not checked yet: through the host if there is room
            else:
                break
        for key, tier in hits:
            self.mgr.pin(rid, key, tier)
        self.mgr.drop_holds(old)
        keys = [key for key, _ in hits]
        if waiting:
            since = self._deferred_since.setdefault(rid, time.monotonic())
            if time.monotonic() - since < self.opts.max_lookup_wait_s:
                return None, False
        n = (first + len(hits)) * ct - num_computed_tokens
        self._lookups[rid] = (num_computed_tokens, keys if n > 0 else [])
        if n <= 0:
            self.mgr.release(rid)
            return 0, False
        return n, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        state = self._reqs.setdefault(rid, ReqState(request))
        state.request = request
        state.block_ids = list(blocks.get_block_ids()[0])
        lookup = self._lookups.pop(rid, None)
        self._deferred_since.pop(rid, None)
        if lookup is None:
            self.mgr.release(rid)
            return  # the second call after an async load, or a resumed request
        num_local, keys = lookup
        self.stats.add("lookup_tokens", request.num_tokens - num_local)
        # Blocks after the local hit were allocated now: fence them against pending stores.
        self._step_allocated.update(state.block_ids[num_local // self.bs :])
        if num_external_tokens > 0:
            self._plan_load(state, num_local, num_external_tokens, keys)
        self.mgr.release(rid)  # the load took its own pins

    def _plan_load(
        self, state: ReqState, num_local: int, num_external: int, keys: list[Key]
    ) -> None:
        first_chunk = num_local // self.layout.chunk_tokens
        start = num_local // self.bs
        end = min(-(-(num_local + num_external) // self.bs), (first_chunk + len(keys)) * self.B)
        num_chunks = -(-end // self.B) - first_chunk
        load_keys = keys[:num_chunks]
        slots = self.mgr.prepare_load(load_keys)
        part = Part(state.request.request_id, [], [], load_keys, slots=slots)
        for i, (key, slot) in enumerate(zip(load_keys, slots, strict=True)):
            c = first_chunk + i
            lo, hi = max(start, c * self.B), min(end, (c + 1) * self.B)
            if slot is None:  # straight from the file
                part.disk_loads.append((key.hex(), lo - c * self.B, state.block_ids[lo:hi]))
            else:
                part.engine += state.block_ids[lo:hi]
                part.host += [slot * self.B + b - c * self.B for b in range(lo, hi)]
            from_disk = slot is None or self.mgr.came_from_disk(key)
            self.stats.add(
                "hit_tokens_disk" if from_disk else "hit_tokens_host", (hi - lo) * self.bs
            )
        self._step_loads.append(part)

    # -- the step's plan ------------------------------------------------------------------

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> OffloadingConnectorMetadata:
        so = scheduler_output
        allocated = self._step_allocated
        progress: list[tuple[ReqState, int]] = []
        for new in so.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids, state.next_chunk = list(new.block_ids[0]), 0
            allocated.update(state.block_ids[new.num_computed_tokens // self.bs :])
            progress.append((state, new.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        for rid, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self._reqs.get(rid)
            if state is None:
                continue
            if new_blocks is not None:
                state.block_ids.extend(new_blocks[0])
                allocated.update(new_blocks[0])
            progress.append((state, computed))
        meta = self._new_meta(so)
        meta.flush = sorted({j for b in allocated for j in self._fence.get(b, ())})
        meta.loads = self._package(JobKind.LOAD, self._step_loads)
        meta.stores = self._package(JobKind.STORE, self._plan_stores(progress, so))
        for job in meta.stores + self._step_disk:
            for block in job.engine_blocks:  # only jobs that read engine blocks have any
                self._fence.setdefault(block, set()).add(job.job_id)
        # Disk order matters (one thread, FIFO): deletions first (they name files of earlier
        # steps, and this step may write the same key again), then writes, then promotions.
        ops = self.mgr.take_disk_ops()
        for key in ops.deletes:  # fire and forget
            job_id = next(self._ids)
            meta.disk_jobs.append(TransferJob(job_id, JobKind.DISK_DELETE, disk_key=key.hex()))
        meta.disk_jobs += self._step_disk
        self._step_disk = []
        for key, slot in ops.promotions:
            job_id = self._new_job(JobKind.PROMOTE, [key])
            host = list(range(slot * self.B, (slot + 1) * self.B))
            meta.disk_jobs.append(TransferJob(job_id, JobKind.PROMOTE, [], host, key.hex()))
        for key in ops.verifies:
            job_id = self._new_job(JobKind.VERIFY, [key])
            meta.disk_jobs.append(TransferJob(job_id, JobKind.VERIFY, disk_key=key.hex()))
        self._last_stores = [j.job_id for j in meta.stores + meta.disk_jobs if j.engine_blocks]
        self._step_loads, self._step_allocated = [], set()
        return meta

    def _new_meta(self, so: SchedulerOutput) -> OffloadingConnectorMetadata:
        return OffloadingConnectorMetadata(idle=so.is_empty)

    def _package(self, kind: JobKind, parts: list[Part]) -> list[TransferJob]:
        """Turn the step's parts into jobs (one per request, or one for all) and record
        them; stores also get their disk writes, queued to run after them."""
        if self.one_job_per_step and len(parts) > 1:
            merged = Part("", [], [], [])
            for part in parts:
                merged.engine += part.engine
                merged.host += part.host
                merged.keys += part.keys
                merged.disk += part.disk
                merged.direct += part.direct
                merged.slots += part.slots
                merged.disk_loads += part.disk_loads
            groups = [(merged, [p.req_id for p in parts])]
        else:
            groups = [(p, [p.req_id]) for p in parts]
        jobs = []
        for part, req_ids in groups:
            for key, blocks in part.direct:
                direct_id = self._new_job(JobKind.DISK_STORE, [key], blocks)
                self._step_disk.append(
                    TransferJob(direct_id, JobKind.DISK_STORE, blocks, [], key.hex())
                )
            if not part.keys:
                continue
            job_id = self._new_job(kind, part.keys, part.engine if kind == JobKind.STORE else [])
            self._jobs[job_id].slots = part.slots
            load_reqs = req_ids if kind == JobKind.LOAD else []
            job = TransferJob(job_id, kind, part.engine, part.host, req_ids=load_reqs)
            job.disk_loads = part.disk_loads
            jobs.append(job)
            for key, slot in part.disk:
                write_id = self._new_job(JobKind.DISK_WRITE, [key])
                host = list(range(slot * self.B, (slot + 1) * self.B))
                self._step_disk.append(
                    TransferJob(write_id, JobKind.DISK_WRITE, [], host, key.hex(), after=job_id)
                )
        return jobs

    def _plan_stores(self, progress: list[tuple[ReqState, int]], so: SchedulerOutput) -> list[Part]:
        """Eager stores: the chunks each scheduled request's forward completes this step."""
        parts = []
        for state, computed in progress:
            end = computed + so.num_scheduled_tokens.get(state.request.request_id, 0)
            part = self._plan_request_store(state, end)
            if part is not None:
                parts.append(part)
        return parts

    def _plan_request_store(self, state: ReqState, end_tokens: int) -> Part | None:
        request = state.request
        if self.opts.offload_prompt_only:
            end_tokens = min(end_tokens, request.num_prompt_tokens)
        full = min(end_tokens // self.layout.chunk_tokens, len(request.block_hashes) // self.B)
        if full <= state.next_chunk:
            return None
        first = state.next_chunk
        state.next_chunk = full
        keys = [self._key(request, c) for c in range(first, full)]
        plan = self.mgr.prepare_store(keys)
        if not plan.keys and not plan.disk_only:
            return None
        index = {k: first + i for i, k in enumerate(keys)}
        part = Part(request.request_id, [], [], plan.keys)
        for key in plan.disk_only:
            c = index[key]
            part.direct.append((key, state.block_ids[c * self.B : (c + 1) * self.B]))
        for key, slot in zip(plan.keys, plan.slots, strict=True):
            c = index[key]
            part.engine.extend(state.block_ids[c * self.B : (c + 1) * self.B])
            part.host.extend(range(slot * self.B, (slot + 1) * self.B))
        slot_of = dict(zip(plan.keys, plan.slots, strict=True))
        part.disk = [(key, slot_of[key]) for key in plan.disk_keys]
        return part

    # -- completions ----------------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.invalid_block_ids:
            # Some sync load (another connector's) was bad: this step's forward may have
            # computed on it, so nothing it wrote is published.
            for job_id in self._last_stores:  # engine-block readers of the last step
                if job_id in self._jobs:
                    self._jobs[job_id].tainted = True
        self._failed_loads |= connector_output.failed_recving & set(self._reqs)
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, OffloadWorkerMetadata):
            return
        for job_id, ok in self._counter.add(meta):
            job = self._jobs.pop(job_id, None)
            if job is None:
                continue
            if job.kind == JobKind.LOAD:
                self.mgr.complete_load(job.keys, job.slots, ok)
            elif job.kind in (JobKind.STORE, JobKind.DISK_STORE):
                if job.kind == JobKind.STORE:
                    self.mgr.complete_store(job.keys, ok and not job.tainted)
                else:
                    self.mgr.complete_disk_write(job.keys[0], ok and not job.tainted)
                for block in job.engine_blocks:
                    jobs = self._fence.get(block)
                    if jobs is not None:
                        jobs.discard(job_id)
                        if not jobs:
                            del self._fence[block]
            elif job.kind == JobKind.DISK_WRITE:
                self.mgr.complete_disk_write(job.keys[0], ok)
            elif job.kind == JobKind.PROMOTE:
                self.mgr.complete_promote(job.keys[0], ok)
            elif job.kind == JobKind.VERIFY:
                self.mgr.complete_verify(job.keys[0], ok)

    def request_finished(self, request: Request) -> None:
        rid = request.request_id
        self._reqs.pop(rid, None)
        self._lookups.pop(rid, None)
        self._deferred_since.pop(rid, None)
        self._failed_loads.discard(rid)
        self.mgr.release(rid)

    def take_events(self) -> list[dict[str, Any]]:
        return self.mgr.take_events()

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or self.mgr.has_queued_ops()

    def take_stats(self) -> KVConnectorStats | None:
        return self.stats.take()

    def reset_cache(self) -> bool:
        return self.mgr.reset() and not self._jobs

    def check_integrity(self, idle: bool = False) -> None:
        self.mgr.check_integrity(idle)
        fenced = {j for jobs in self._fence.values() for j in jobs}
        assert fenced <= set(self._jobs), "a fence names a job that is done"
        if idle:
            assert not self._jobs, f"jobs in flight: {sorted(self._jobs)}"
            assert not self._fence and not self._reqs and not self._lookups
            assert not self._failed_loads and not self._deferred_since
            assert len(self._counter) == 0, "partial job reports left"
