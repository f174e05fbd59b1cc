"""The OffloadingConnector's scheduler half: lookups, load and store plans, fencing.

Chunks: chunk ``c`` of a request is its blocks ``[c * blocks_per_chunk, (c + 1) *
blocks_per_chunk)``; its key is the block hash of its last block (chained, so it names the
whole prefix up to there). Only whole chunks are looked up and stored.

Per request there is at most one load job in flight; store jobs are one per request and step
(the chunks that step's forward completes). A store job's source blocks are fenced
(:class:`JobBook`): when a step reallocates one of them (the request finished or was
preempted), the job is listed in the step's ``flush`` and the worker waits for it before the
forward.

KV cache events (:meth:`OffloadingConnectorScheduler.enable_kv_events`): the tiers announce
and withdraw chunks block by block, host memory as ``CPU`` and the disk as ``STORAGE``.

Hybrid models: each KV cache group's copy of a chunk is offloaded on its own (see
:mod:`~kvferry.kv_transfer.connectors.offloading.groups`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_events.events import KVCacheEvent
from kvferry.kv_transfer.base import CacheHitSource, KVConnectorStats
from kvferry.kv_transfer.connectors.offloading.groups import (
    first_window_block,
    group_key,
    window_chunks,
)
from kvferry.kv_transfer.connectors.offloading.job_book import JobBook
from kvferry.kv_transfer.connectors.offloading.layout import OffloadLayout
from kvferry.kv_transfer.connectors.offloading.metadata import OffloadingConnectorMetadata
from kvferry.kv_transfer.connectors.offloading.options import OffloadingOptions
from kvferry.kv_transfer.connectors.offloading.plans import ChunkTransfer, RequestTransfer
from kvferry.kv_transfer.connectors.offloading.state import (
    JobRecord,
    Lookup,
    OffloadRequest,
    restore_disk_index,
)
from kvferry.kv_transfer.connectors.offloading.worker_metadata import OffloadWorkerMetadata
from kvferry.kv_transfer.connectors.split import SchedulerHalf
from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView
from kvferry.kv_transfer.offload.events import ChunkEvents
from kvferry.kv_transfer.offload.jobs import JobKind, TransferJob
from kvferry.kv_transfer.offload.manager import LookupStatus, TieredOffloadingManager
from kvferry.kv_transfer.offload.policies import Key, policy_class
from kvferry.kv_transfer.offload.stats import LookupStats
from kvferry.kv_transfer.offload.tier import TierIndex
from kvferry.request import Request
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.scheduler_output import SchedulerOutput


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class ScheduledRequest:
    """A request this step computes, and how many of its tokens were computed before."""

    record: OffloadRequest
    num_computed_tokens: int


class OffloadingConnectorScheduler(SchedulerHalf):
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
        self.block_size = layout.block_size
        self.blocks_per_chunk = layout.blocks_per_chunk
        self.stats = LookupStats(name)
        num_host = layout.num_host_chunks
        host = TierIndex("cpu", num_host, policy_class(opts.eviction_policy)(num_host))
        disk = None
        if layout.disk_folder is not None:
            num_disk = layout.num_disk_chunks
            disk_policy = policy_class(opts.disk_eviction_policy)(num_disk)
            disk = TierIndex("disk", num_disk, disk_policy, False)
        self.mgr = TieredOffloadingManager(
            host, disk, self.stats, opts.store_threshold, opts.max_tracker_size
        )
        self._requests: dict[str, OffloadRequest] = {}
        # KV cache groups beyond group 0, by index: their sliding windows (hybrid models).
        self._windows = {
            i: g.sliding_window
            for i, g in enumerate(kv_cache_config.groups)
            if i > 0 and g.sliding_window is not None
        }
        if len(kv_cache_config.groups) != 1 + len(self._windows):
            raise ValueError(f"{name} handles one full-attention group and sliding windows")
        self._null_block_id = kv_cache_config.null_block_id
        self._jobs = JobBook(world_size, self._host_blocks)
        # The step being planned: loads of the requests allocated so far, and the engine
        # blocks allocated (any store still reading one of them is flushed first).
        self._step_loads: list[RequestTransfer] = []
        self._step_allocated: set[int] = set()
        # Jobs of the last planned step that read engine blocks (tainted by a bad load).
        self._last_step_readers: list[int] = []
        # Chunk descriptions for the tiers' KV cache events; None: events are off.
        self.events: ChunkEvents | None = None
        if disk is not None:
            restore_disk_index(layout, disk, self.mgr)

    def enable_kv_events(self) -> None:
        """Record the tiers' KV cache events for :meth:`take_events` (off by default)."""
        self.events = ChunkEvents(self.block_size, self.blocks_per_chunk)
        self.mgr.events = self.events

    def _chunk_key(self, request: Request, chunk: int) -> Key:
        return request.block_hashes[(chunk + 1) * self.blocks_per_chunk - 1]

    def _engine_blocks(self, record: OffloadRequest, chunk: int) -> list[int]:
        per_chunk = self.blocks_per_chunk
        return record.block_ids[chunk * per_chunk : (chunk + 1) * per_chunk]

    def _host_blocks(self, slot: int) -> list[int]:
        return list(range(slot * self.blocks_per_chunk, (slot + 1) * self.blocks_per_chunk))

    # -- lookup ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        req_id, chunk_tokens = request.request_id, self.layout.chunk_tokens
        record = self._requests.setdefault(req_id, OffloadRequest(request))
        if record.load_failed:
            # Recompute rather than offer the same chunks again (a chunk that keeps failing
            # would otherwise loop lookup -> fail -> rewind).
            record.lookup = Lookup(num_computed_tokens, [])
            return 0, False
        old_holds = self.mgr.take_holds(req_id)  # dropped after the new holds are taken
        record.lookup = None
        first = num_computed_tokens // chunk_tokens
        last = min(
            (request.num_tokens - 1) // chunk_tokens,
            len(request.block_hashes) // self.blocks_per_chunk,
        )
        hits, waiting = self._scan(request, first, last, old_holds)
        group_hits: list[tuple[int, int, Key, str]] = []
        if self._windows and hits:
            end = self._group_hit_end(request, first, first + len(hits))
            hits = hits[: end - first]
            group_hits = self._group_hits(request, first, end) if hits else []
        for key, tier in hits:
            self.mgr.pin(req_id, key, tier)
        for _, _, key, tier in group_hits:
            self.mgr.pin(req_id, key, tier)
        self.mgr.drop_holds(old_holds)
        if waiting:
            if record.deferred_since is None:
                record.deferred_since = time.monotonic()
            if time.monotonic() - record.deferred_since < self.opts.max_lookup_wait_s:
                return None, False
        num_tokens = (first + len(hits)) * chunk_tokens - num_computed_tokens
        keys = [key for key, _ in hits] if num_tokens > 0 else []
        record.lookup = Lookup(num_computed_tokens, keys, [(g, c, k) for g, c, k, _ in group_hits])
        if num_tokens <= 0:
            self.mgr.release(req_id)
            return 0, False
        return num_tokens, True

    def _tier_of(self, key: Key) -> str | None:
        """Where a complete copy of ``key`` can be loaded from ("cpu", "disk"), or None."""
        status = self.mgr.lookup(key)
        if status is LookupStatus.HIT:
            return "cpu"
        if status is LookupStatus.RETRY and self.mgr.disk_loadable(key):
            return "disk"
        return None

    def _group_hits(
        self, request: Request, first: int, end: int
    ) -> list[tuple[int, int, Key, str]]:
        """The other groups' chunk copies a hit of chunks ``[first, end)`` loads, with their
        tiers, or [] when one of them is missing."""
        found = []
        for group, window in self._windows.items():
            for chunk in window_chunks(end, first, window, self.block_size, self.blocks_per_chunk):
                key = group_key(self._chunk_key(request, chunk), group)
                tier = self._tier_of(key)
                if tier is None:
                    return []
                found.append((group, chunk, key, tier))
        return found

    def _group_hit_end(self, request: Request, first: int, end: int) -> int:
        """The largest hit end at most ``end`` whose window chunks every group has."""
        while end > first and not self._group_hits(request, first, end):
            end -= 1
        return end

    def _scan(
        self, request: Request, first: int, last: int, old_holds: dict[tuple[str, Key], int]
    ) -> tuple[list[tuple[Key, str]], bool]:
        """The leading run of loadable chunks in ``[first, last)`` with the tier each is read
        from ("cpu" or "disk"), and whether a chunk after it is on its way (being written,
        or a file being checked or copied to the host for this request)."""
        req_id = request.request_id
        hits: list[tuple[Key, str]] = []
        waiting, in_leading_run = False, True
        for chunk in range(first, last):
            key = self._chunk_key(request, chunk)
            status = self.mgr.lookup(key)
            if status is LookupStatus.MISS:
                break
            if self.events is not None:  # a file found at start has no description yet
                self.events.describe(request, chunk, key)
            if status is LookupStatus.HIT or (
                status is LookupStatus.RETRY and self.mgr.disk_loadable(key)
            ):
                if in_leading_run:
                    hits.append((key, "cpu" if status is LookupStatus.HIT else "disk"))
                continue
            in_leading_run = False
            if status is LookupStatus.PENDING:
                waiting = True
                if ("cpu", key) in old_holds:  # keep holding a chunk being promoted for us
                    self.mgr.pin(req_id, key)
            elif self.mgr.prefetch(req_id, key) or self.mgr.request_verify(key):
                waiting = True  # a file not checked yet: through the host if there is room
            else:
                break
        return hits, waiting

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        record = self._requests.setdefault(req_id, OffloadRequest(request))
        record.request = request
        record.allocated = True
        record.group_block_ids = [list(ids) for ids in blocks.get_block_ids()]
        record.block_ids = record.group_block_ids[0]
        lookup, record.lookup = record.lookup, None
        record.deferred_since = None
        if lookup is None:
            self.mgr.release(req_id)
            return  # the second call after an async load, or a resumed request
        num_local = lookup.num_local_tokens
        self.stats.add("lookup_tokens", request.num_tokens - num_local)
        # Blocks after the local hit were allocated now: fence them against pending stores.
        for table in record.group_block_ids:
            self._step_allocated.update(table[num_local // self.block_size :])
        self._step_allocated.discard(self._null_block_id)  # type: ignore[arg-type]
        if num_external_tokens > 0:
            self._plan_load(record, lookup, num_external_tokens)
        self.mgr.release(req_id)  # the load took its own pins

    def _plan_load(self, record: OffloadRequest, lookup: Lookup, num_external: int) -> None:
        per_chunk, block_size = self.blocks_per_chunk, self.block_size
        num_local = lookup.num_local_tokens
        first_chunk = num_local // self.layout.chunk_tokens
        start = num_local // block_size
        end = min(
            _cdiv(num_local + num_external, block_size),
            (first_chunk + len(lookup.keys)) * per_chunk,
        )
        keys = lookup.keys[: _cdiv(end, per_chunk) - first_chunk]
        # Other groups' copies: the chunks their windows read below the hit's end.
        extra = [(g, c, k) for g, c, k in lookup.group_keys if c < first_chunk + len(keys)]
        slots = self.mgr.prepare_load(keys + [k for _, _, k in extra])
        load = RequestTransfer(record.request.request_id)
        self._plan_group_loads(record, extra, slots[len(keys) :], start, end, load)
        slots = slots[: len(keys)]
        record.hit_sources = {}
        hit_end = num_local + num_external
        for i, (key, slot) in enumerate(zip(keys, slots, strict=True)):
            chunk_start = (first_chunk + i) * per_chunk
            lo, hi = max(start, chunk_start), min(end, chunk_start + per_chunk)
            engine_blocks = record.block_ids[lo:hi]
            if slot is None:  # straight from the file
                load.chunks.append(ChunkTransfer(key, engine_blocks, None, [], lo - chunk_start))
            else:
                host_start = slot * per_chunk - chunk_start
                host_blocks = [host_start + block for block in range(lo, hi)]
                load.chunks.append(ChunkTransfer(key, engine_blocks, slot, host_blocks))
            from_disk = slot is None or self.mgr.came_from_disk(key)
            tier = "hit_tokens_disk" if from_disk else "hit_tokens_host"
            self.stats.add(tier, (hi - lo) * block_size)
            # The tokens of this chunk that the load brings (the hit may end mid-block).
            n = max(0, min(hi * block_size, hit_end) - max(lo * block_size, num_local))
            source = CacheHitSource.DISK if from_disk else CacheHitSource.HOST
            record.hit_sources[source] = record.hit_sources.get(source, 0) + n
        self._step_loads.append(load)

    def _plan_group_loads(
        self,
        record: OffloadRequest,
        extra: list[tuple[int, int, Key]],
        slots: list[int | None],
        start: int,
        end: int,
        load: RequestTransfer,
    ) -> None:
        """Chunk transfers of other groups' copies into the blocks ``[start, end)`` of their
        tables that are not null (a sliding-window table has null blocks before its window,
        so a chunk's loaded blocks are its last ones)."""
        per_chunk = self.blocks_per_chunk
        for (group, chunk, key), slot in zip(extra, slots, strict=True):
            table = record.group_block_ids[group]
            chunk_start = chunk * per_chunk
            lo, hi = max(start, chunk_start), min(end, chunk_start + per_chunk)
            while lo < hi and table[lo] == self._null_block_id:
                lo += 1
            engine_blocks = table[lo:hi]
            if slot is None:
                load.chunks.append(ChunkTransfer(key, engine_blocks, None, [], lo - chunk_start))
            else:
                host_start = slot * per_chunk - chunk_start
                host_blocks = [host_start + block for block in range(lo, hi)]
                load.chunks.append(ChunkTransfer(key, engine_blocks, slot, host_blocks))

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int] | None:
        record = self._requests.get(request.request_id)
        sources = record.hit_sources if record is not None else {}
        # None (the facade's own tier for all) when the split does not cover the hit.
        return dict(sources) if sum(sources.values()) == num_external_tokens else None

    # -- the step's plan ------------------------------------------------------------------

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput
    ) -> OffloadingConnectorMetadata:
        scheduled = self._follow_block_tables(scheduler_output)
        meta = self._new_meta(scheduler_output)
        meta.flush = self._jobs.readers_of(self._step_allocated)
        one_job = self.one_job_per_step
        meta.loads, _ = self._jobs.package(JobKind.LOAD, self._step_loads, one_job)
        stores = self._plan_stores(scheduled, scheduler_output)
        meta.stores, store_disk_jobs = self._jobs.package(JobKind.STORE, stores, one_job)
        self._jobs.fence(meta.stores + store_disk_jobs)
        # Disk order matters (one thread, FIFO): deletions first (they name files of earlier
        # steps, and this step may write the same key again), then writes, then promotions.
        ops = self.mgr.take_disk_ops()
        for key in ops.deletes:  # fire and forget
            delete = TransferJob(self._jobs.next_id(), JobKind.DISK_DELETE, disk_key=key.hex())
            meta.disk_jobs.append(delete)
        meta.disk_jobs += store_disk_jobs
        for key, slot in ops.promotions:
            job_id = self._jobs.new(JobKind.PROMOTE, [key])
            host_blocks = self._host_blocks(slot)
            meta.disk_jobs.append(TransferJob(job_id, JobKind.PROMOTE, [], host_blocks, key.hex()))
        for key in ops.verifies:
            job_id = self._jobs.new(JobKind.VERIFY, [key])
            meta.disk_jobs.append(TransferJob(job_id, JobKind.VERIFY, disk_key=key.hex()))
        readers = meta.stores + meta.disk_jobs
        self._last_step_readers = [job.job_id for job in readers if job.engine_blocks]
        self._step_loads, self._step_allocated = [], set()
        return meta

    def _follow_block_tables(self, scheduler_output: SchedulerOutput) -> list[ScheduledRequest]:
        """Update the block tables of this step's requests (new blocks are fenced)."""
        scheduled: list[ScheduledRequest] = []
        for new in scheduler_output.scheduled_new_reqs:
            record = self._requests.get(new.req_id)
            if record is None or not record.allocated:
                continue
            record.group_block_ids = [list(ids) for ids in new.block_ids]
            record.block_ids, record.next_chunk = record.group_block_ids[0], 0
            num_computed = new.num_computed_tokens
            for table in record.group_block_ids:
                self._step_allocated.update(table[num_computed // self.block_size :])
            scheduled.append(ScheduledRequest(record, num_computed))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            record = self._requests.get(req_id)
            if record is None or not record.allocated:
                continue
            if new_blocks is not None:
                for table, ids in zip(record.group_block_ids, new_blocks, strict=True):
                    table.extend(ids)
                    self._step_allocated.update(ids)
            scheduled.append(ScheduledRequest(record, num_computed))
        if self._null_block_id is not None:
            self._step_allocated.discard(self._null_block_id)
        return scheduled

    def _new_meta(self, scheduler_output: SchedulerOutput) -> OffloadingConnectorMetadata:
        return OffloadingConnectorMetadata(idle=scheduler_output.is_empty)

    def _plan_stores(
        self, scheduled: list[ScheduledRequest], scheduler_output: SchedulerOutput
    ) -> list[RequestTransfer]:
        """Eager stores: the chunks each scheduled request's forward completes this step."""
        stores = []
        for item in scheduled:
            req_id = item.record.request.request_id
            end = item.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            store = self._plan_request_store(item.record, end)
            if self._windows:
                store = self._plan_group_stores(item, end, store)
            if store is not None:
                stores.append(store)
        return stores

    def _plan_group_stores(
        self, item: ScheduledRequest, end_tokens: int, store: RequestTransfer | None
    ) -> RequestTransfer | None:
        """Add the other groups' copies of the chunks this step completes to ``store``: a
        sliding-window group's only where all the chunk's blocks are still held (at or
        after the first block the step's first token reads)."""
        record = item.record
        request = record.request
        if self.opts.offload_prompt_only:
            end_tokens = min(end_tokens, request.num_prompt_tokens)
        per_chunk = self.blocks_per_chunk
        num_full = min(
            end_tokens // self.layout.chunk_tokens, len(request.block_hashes) // per_chunk
        )
        done = item.num_computed_tokens // self.layout.chunk_tokens  # stored before, or not at all
        for group, window in self._windows.items():
            held_from = first_window_block(item.num_computed_tokens, window, self.block_size)
            table = record.group_block_ids[group]
            chunks = [c for c in range(done, num_full) if c * per_chunk >= held_from]
            keys = [group_key(self._chunk_key(request, c), group) for c in chunks]
            plan = self.mgr.prepare_store(keys)
            if not plan.keys and not plan.disk_only:
                continue
            store = store or RequestTransfer(request.request_id)
            chunk_of = dict(zip(keys, chunks, strict=True))
            blocks_of = {k: table[c * per_chunk : (c + 1) * per_chunk] for k, c in chunk_of.items()}
            for key in plan.disk_only:
                store.disk_only.append((key, blocks_of[key]))
            for key, slot in zip(plan.keys, plan.slots, strict=True):
                store.chunks.append(
                    ChunkTransfer(key, blocks_of[key], slot, self._host_blocks(slot))
                )
            slot_of = dict(zip(plan.keys, plan.slots, strict=True))
            store.write_through += [(key, slot_of[key]) for key in plan.disk_keys]
        return store

    def _plan_request_store(
        self, record: OffloadRequest, end_tokens: int
    ) -> RequestTransfer | None:
        request = record.request
        if self.opts.offload_prompt_only:
            end_tokens = min(end_tokens, request.num_prompt_tokens)
        num_full = min(
            end_tokens // self.layout.chunk_tokens,
            len(request.block_hashes) // self.blocks_per_chunk,
        )
        if num_full <= record.next_chunk:
            return None
        first = record.next_chunk
        record.next_chunk = num_full
        keys = [self._chunk_key(request, chunk) for chunk in range(first, num_full)]
        plan = self.mgr.prepare_store(keys)
        if not plan.keys and not plan.disk_only:
            return None
        chunk_of = {key: first + i for i, key in enumerate(keys)}
        if self.events is not None:
            for key in plan.keys + plan.disk_only:
                self.events.describe(request, chunk_of[key], key)
        store = RequestTransfer(request.request_id)
        for key in plan.disk_only:
            store.disk_only.append((key, self._engine_blocks(record, chunk_of[key])))
        for key, slot in zip(plan.keys, plan.slots, strict=True):
            engine_blocks = self._engine_blocks(record, chunk_of[key])
            store.chunks.append(ChunkTransfer(key, engine_blocks, slot, self._host_blocks(slot)))
        slot_of = dict(zip(plan.keys, plan.slots, strict=True))
        store.write_through = [(key, slot_of[key]) for key in plan.disk_keys]
        return store

    # -- completions ----------------------------------------------------------------------

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if connector_output.invalid_block_ids:
            # Some sync load (another connector's) was bad: this step's forward may have
            # computed on it, so nothing it wrote is published.
            self._jobs.taint(self._last_step_readers)
        for req_id in connector_output.failed_recving:
            record = self._requests.get(req_id)
            if record is not None and record.allocated:
                record.load_failed = True
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, OffloadWorkerMetadata):
            return
        for job, ok in self._jobs.take_done(meta):
            self._complete(job, ok)

    def _complete(self, job: JobRecord, ok: bool) -> None:
        """Publish (or drop) what a job that every worker finished wrote."""
        if job.kind == JobKind.LOAD:
            self.mgr.complete_load(job.keys, job.slots, ok)
        elif job.kind == JobKind.STORE:
            self.mgr.complete_store(job.keys, ok and not job.tainted)
        elif job.kind == JobKind.DISK_STORE:
            self.mgr.complete_disk_write(job.keys[0], ok and not job.tainted)
        elif job.kind == JobKind.DISK_WRITE:
            self.mgr.complete_disk_write(job.keys[0], ok)
        elif job.kind == JobKind.PROMOTE:
            self.mgr.complete_promote(job.keys[0], ok)
        elif job.kind == JobKind.VERIFY:
            self.mgr.complete_verify(job.keys[0], ok)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # (Every group at once: nothing here is per group.)
        self._requests.pop(request.request_id, None)
        self.mgr.release(request.request_id)
        return False, None

    def take_events(self) -> list[KVCacheEvent]:
        return self.mgr.take_events()

    def has_pending_work(self) -> bool:
        return bool(self._jobs.jobs) or self.mgr.has_queued_ops()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats.take()

    def reset_cache(self) -> bool:
        return self.mgr.reset() and not self._jobs.jobs

    def check_integrity(self, idle: bool = False) -> None:
        """Assert the offload pool's invariants; ``idle``: also that nothing is in flight,
        pinned or held (the end of a lifecycle test, once the engine stopped stepping)."""
        self.mgr.check_integrity(idle)
        self._jobs.check_integrity(idle)
        if self.events is not None:
            disk = self.mgr.disk
            for key in self.events.described_keys():
                held = key in self.mgr.host or (disk is not None and key in disk)
                assert held, f"a description of {key.hex()[:8]} outlives its chunk"
        if idle:
            assert not self._requests, f"requests left: {sorted(self._requests)}"
