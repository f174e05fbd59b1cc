"""The MooncakeStoreConnector's scheduler half: asynchronous lookups, load and store plans,
delayed frees and KV cache events.

Chunk ``c`` of a request is its blocks ``[c * blocks_per_chunk, (c + 1) * blocks_per_chunk)``,
keyed by the hash of its last block. A lookup asks the store (on the lookup thread) about the
chunks after the local hit; until it answers the request gets ``None`` (asked again next step),
after ``lookup_timeout_s`` it is a miss. The hit is the leading run of chunks every rank holds.
Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS): a get can take seconds
when the store is slow, and must never hold up a step.

Stores: after each forward, the prompt's chunks that it completed (not yet known to be in the
store) are handed to the worker. A request that had a store keeps its blocks when it ends
(``request_finished`` -> True) until the worker copied them out (``finished_sending``).

Events: a stored chunk is announced as ``BlockStored`` with medium ``"cpu"``, the medium
vLLM's MooncakeStoreConnector gives the store's chunks, once every rank stored it; a chunk
found corrupt (and removed) is withdrawn with ``BlockRemoved``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvferry.kv_events.block_runs import blocks_removed, blocks_stored
from kvferry.kv_events.events import BlockStored, KVCacheEvent
from kvferry.kv_transfer.base import KVConnectorStats
from kvferry.kv_transfer.connectors.mooncake_store.layout import StoreLayout
from kvferry.kv_transfer.connectors.mooncake_store.lookups import Lookup, LookupService
from kvferry.kv_transfer.connectors.mooncake_store.metadata import (
    ChunkIO,
    LoadJob,
    MooncakeStoreMetadata,
    MooncakeStoreWorkerMeta,
    StoreJob,
)
from kvferry.kv_transfer.connectors.mooncake_store.options import MooncakeStoreOptions
from kvferry.kv_transfer.connectors.mooncake_store.stats import SchedulerStats
from kvferry.kv_transfer.connectors.split import SchedulerHalf
from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView
from kvferry.kv_transfer.stores.link import StoreLink
from kvferry.kv_transfer.stores.mooncake_client import MooncakeStoreClient
from kvferry.kv_transfer.stores.mooncake_config import MooncakeStoreConfig
from kvferry.request import Request
from kvferry.step_types.kv_connector_output import KVConnectorOutput
from kvferry.step_types.scheduler_output import SchedulerOutput

# The medium of the store's chunks in KV cache events: what vLLM's MooncakeStoreConnector
# publishes (lowercase, unlike the engine-local host tier's "CPU").
MEDIUM_MOONCAKE_STORE = "cpu"
# Stored chunks remembered (for BlockRemoved; bounded: oldest forgotten first).
MAX_ANNOUNCED = 65536


@dataclass
class _Request:
    request: Request
    lookup: Lookup | None = None
    lookup_num_computed: int = 0
    timed_out: bool = False
    allocated: bool = False
    block_ids: list[int] = field(default_factory=list)
    next_chunk: int = 0  # chunks below this are in the store or were handed over
    had_store: bool = False


@dataclass
class _StoreRecord:
    keys: list[str]
    events: list[BlockStored]
    hashes: list[list[bytes]]
    reports: int = 0
    failed: bool = False


class MooncakeStoreScheduler(SchedulerHalf):
    def __init__(
        self,
        opts: MooncakeStoreOptions,
        mc_config: MooncakeStoreConfig,
        layout: StoreLayout,
        kv_events: bool,
    ) -> None:
        self.opts = opts
        self.layout = layout
        self.bpc = layout.blocks_per_chunk
        self.stats = SchedulerStats("MooncakeStoreConnector")
        # The scheduler's client only asks questions: it lends no memory to the store.
        self.client = MooncakeStoreClient(mc_config.with_segment(0), opts.replicate)
        self.link = StoreLink(self.client, "MooncakeStoreConnector scheduler",
                              opts.reconnect_interval_s)  # fmt: skip
        self.link.start()
        self.lookups = LookupService(self.link, layout.world_size)
        self.kv_events = kv_events
        self._requests: dict[str, _Request] = {}
        self._step_loads: list[LoadJob] = []
        self._jobs: dict[int, _StoreRecord] = {}
        self._next_job = 0
        self._pending_store_chunks = 0
        self._delayed: set[str] = set()
        self._events: list[KVCacheEvent] = []
        # Chunks this connector stored (newest last), with their block hashes when events
        # are on (for their BlockRemoved).
        self.stored_keys: OrderedDict[str, list[bytes]] = OrderedDict()

    def _job_id(self) -> int:
        self._next_job += 1
        return self._next_job

    def _key(self, request: Request, chunk: int) -> str:
        return self.layout.key(request.block_hashes[(chunk + 1) * self.bpc - 1])

    # -- lookup -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rec = self._requests.setdefault(request.request_id, _Request(request))
        chunk_tokens = self.layout.chunk_tokens
        first = num_computed_tokens // chunk_tokens
        last = min((request.num_tokens - 1) // chunk_tokens, len(request.block_hashes) // self.bpc)
        if first >= last or rec.timed_out:
            return 0, False
        lookup = rec.lookup
        if lookup is None or lookup.first != first or len(lookup.chunk_keys) != last - first:
            if not self.link.up:
                return 0, False  # a store that is down is a miss, at once
            keys = [self._key(request, c) for c in range(first, last)]
            rec.lookup = self.lookups.submit(first, keys)
            rec.lookup_num_computed = num_computed_tokens
            self.stats.add("lookups")
            return None, False
        if not lookup.done:
            if time.monotonic() - lookup.started < self.opts.lookup_timeout_s:
                return None, False
            rec.timed_out = True
            self.stats.add("lookup_timeouts")
            return 0, False
        rec.lookup_num_computed = num_computed_tokens
        if lookup.hits is None:
            return 0, False
        hits = 0
        while hits < len(lookup.hits) and lookup.hits[hits]:
            hits += 1
        num = (first + hits) * chunk_tokens - num_computed_tokens
        return (num, True) if num > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        rec = self._requests.setdefault(request.request_id, _Request(request))
        rec.request = request
        rec.allocated = True
        rec.block_ids = list(blocks.get_block_ids()[0])
        lookup, rec.lookup = rec.lookup, None
        if lookup is None or not lookup.done:
            return  # the second call after an async load, or no lookup was answered
        self.stats.sample("lookup_latency_s", lookup.latency)
        if lookup.hits is None:
            self.stats.add("lookup_failures")
        num_local = rec.lookup_num_computed
        self.stats.add("lookup_tokens", request.num_tokens - num_local)
        if num_external_tokens <= 0:
            return
        self.stats.add("hit_tokens", num_external_tokens)
        end_block = (num_local + num_external_tokens) // self.layout.block_size
        start_block = num_local // self.layout.block_size
        load = LoadJob(self._job_id(), request.request_id)
        for chunk in range(lookup.first, end_block // self.bpc):
            lo = max(start_block, chunk * self.bpc)
            hi = (chunk + 1) * self.bpc
            load.chunks.append(
                ChunkIO(
                    lookup.chunk_keys[chunk - lookup.first],
                    rec.block_ids[lo:hi],
                    lo - chunk * self.bpc,
                )  # fmt: skip
            )
        rec.next_chunk = max(rec.next_chunk, end_block // self.bpc)
        self._step_loads.append(load)

    # -- the step's plan --------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> MooncakeStoreMetadata:
        meta = MooncakeStoreMetadata(loads=self._step_loads,
                                     preempted=sorted(scheduler_output.preempted_req_ids))  # fmt: skip
        self._step_loads = []
        scheduled: list[tuple[_Request, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            rec = self._requests.get(new.req_id)
            if rec is not None and rec.allocated:
                rec.block_ids = list(new.block_ids[0])
                scheduled.append((rec, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            rec = self._requests.get(req_id)
            if rec is None or not rec.allocated:
                continue
            if new_blocks is not None:
                rec.block_ids.extend(new_blocks[0])
            scheduled.append((rec, num_computed))
        for rec, num_computed in scheduled:
            end = num_computed + scheduler_output.num_scheduled_tokens.get(
                rec.request.request_id, 0
            )
            job = self._plan_store(rec, end)
            if job is not None:
                meta.stores.append(job)
        return meta

    def _plan_store(self, rec: _Request, end_tokens: int) -> StoreJob | None:
        request = rec.request
        end_tokens = min(end_tokens, request.num_prompt_tokens)
        num_full = min(
            end_tokens // self.layout.chunk_tokens, len(request.block_hashes) // self.bpc
        )
        if num_full <= rec.next_chunk:
            return None
        first, rec.next_chunk = rec.next_chunk, num_full
        if not self.link.up:
            self.stats.add("store_skipped_chunks", num_full - first)
            return None
        if self._pending_store_chunks + num_full - first > self.opts.max_pending_store_chunks:
            self.stats.add("store_skipped_chunks", num_full - first)
            return None
        job = StoreJob(self._job_id(), request.request_id)
        events: list[BlockStored] = []
        hashes: list[list[bytes]] = []
        for chunk in range(first, num_full):
            blocks = rec.block_ids[chunk * self.bpc : (chunk + 1) * self.bpc]
            job.chunks.append(ChunkIO(self._key(request, chunk), blocks))
            if self.kv_events:
                events.append(
                    blocks_stored(
                        request.block_hashes,
                        request.all_token_ids,
                        chunk * self.bpc,
                        (chunk + 1) * self.bpc,
                        self.layout.block_size,
                        MEDIUM_MOONCAKE_STORE,
                        request.cache_salt,
                    )  # fmt: skip
                )
                hashes.append(list(request.block_hashes[chunk * self.bpc : (chunk + 1) * self.bpc]))
        self._jobs[job.job_id] = _StoreRecord([c.key for c in job.chunks], events, hashes)
        self._pending_store_chunks += len(job.chunks)
        rec.had_store = True
        return job

    # -- completions ------------------------------------------------------------------------
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_sending or ():
            self._delayed.discard(req_id)
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, MooncakeStoreWorkerMeta):
            return
        for counts, failed in ((meta.stored, False), (meta.store_failed, True)):
            for job_id, n in counts.items():
                record = self._jobs.get(job_id)
                if record is None:
                    continue
                record.reports += n
                record.failed = record.failed or failed
                if record.reports >= self.layout.world_size:
                    self._store_done(job_id, record)
        for key in meta.removed:
            hashes = self.stored_keys.pop(key, None)
            if hashes:
                self._events.append(blocks_removed(hashes, MEDIUM_MOONCAKE_STORE))

    def _store_done(self, job_id: int, record: _StoreRecord) -> None:
        del self._jobs[job_id]
        self._pending_store_chunks -= len(record.keys)
        if record.failed:
            self.stats.add("store_failed_jobs")
            return
        self.stats.add("stored_chunks", len(record.keys))
        for i, key in enumerate(record.keys):
            if key in self.stored_keys:
                continue
            hashes: list[bytes] = []
            if i < len(record.events):
                self._events.append(record.events[i])
                hashes = record.hashes[i]
            self.stored_keys[key] = hashes
            if len(self.stored_keys) > MAX_ANNOUNCED:
                self.stored_keys.popitem(last=False)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rec = self._requests.pop(request.request_id, None)
        if rec is not None and rec.had_store:
            self._delayed.add(request.request_id)
            return True, None
        return False, None

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def has_pending_work(self) -> bool:
        return bool(self._delayed or self._jobs)

    def has_pending_block_frees(self) -> bool:
        return bool(self._delayed)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats.take()

    def check_integrity(self, idle: bool = False) -> None:
        """Leak check: with ``idle``, nothing held or in flight."""
        if idle:
            assert not self._requests, f"requests left: {sorted(self._requests)}"
            assert not self._delayed, f"delayed frees left: {sorted(self._delayed)}"
            assert not self._jobs, f"store jobs left: {sorted(self._jobs)}"
            assert self._pending_store_chunks == 0

    def shutdown(self) -> None:
        self.lookups.shutdown()
        self.link.stop()
        self.client.close()
