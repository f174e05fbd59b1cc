"""The MooncakeStoreConnector's worker-side transfers: two threads moving chunks between the
engine's KV blocks and the store through one registered staging buffer.

Why staging instead of registering the engine pool: a value must be one contiguous run (its
checked header, then every layer's K and V of the chunk's blocks, which lie apart in the
pool), and a loaded value must be checked *before* any byte of it reaches the engine's
blocks, so a corrupt or short value never touches the pool. The copy into or out of the
buffer is one pass over the bytes per chunk (:mod:`.slot_copy`); the buffer itself is
registered once, so Mooncake's puts and gets are zero-copy from there. Scattering a get
straight into the pool blocks (``batch_get_into_multi_buffers``) would save that pass, but over
TCP it makes one transfer per block half, which ran at a third of a contiguous get and
overflowed the transport's queues (failed gets).

Stores: the first half of a store job copies its chunks out of the engine blocks (then the
blocks may be reused: ``wait_copied`` for preempted requests, ``finished_sending`` for
finished ones), the second checks which chunks the store already has and puts the others
in one batch. Loads: one batch get per job, every value checked, then copied into the
engine blocks; a failed, corrupt or late (``load_timeout_s``) chunk fails its blocks and
every later block of the job, which are reported as load errors.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from kvferry.config import ConfigError
from kvferry.kv_layout import physical
from kvferry.kv_transfer.connectors.mooncake_store.layout import StoreLayout
from kvferry.kv_transfer.connectors.mooncake_store.metadata import (
    ChunkIO,
    LoadJob,
    MooncakeStoreWorkerMeta,
    StoreJob,
)
from kvferry.kv_transfer.connectors.mooncake_store.slot_copy import SlotCopier
from kvferry.kv_transfer.stores.chunk_codec import HEADER_BYTES, CorruptValue
from kvferry.kv_transfer.stores.chunk_key import key_digest
from kvferry.kv_transfer.stores.link import StoreLink
from kvferry.kv_transfer.stores.mooncake_client import RPC_FAIL
from kvferry.logger import init_logger

logger = init_logger(__name__)

ALIGN = 64
# Chunks per get while the chunks before them are checked and copied in.
LOAD_PIPELINE = 4


def _bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU uint8 tensor (no copy)."""
    return memoryview(cast(Any, t.numpy()))


@dataclass
class _Load:
    job: LoadJob
    deadline: float
    done: bool = False
    abandoned: bool = False
    failed_blocks: list[int] = field(default_factory=list)


class StoreTransfers:
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        layout: StoreLayout,
        link: StoreLink,
        staging_bytes: int,
        load_timeout_s: float,
        rank: int = 0,
    ) -> None:
        self.kv = kv_caches
        self.layout = layout
        self.link = link
        self.codec = layout.codec()
        self.rank = rank
        self.load_timeout_s = load_timeout_s
        self.slot_bytes = -(-self.codec.value_bytes // ALIGN) * ALIGN
        per_region = staging_bytes // 2 // self.slot_bytes
        if per_region < 1:
            raise ConfigError(
                f"MooncakeStoreConnector: staging_buffer_bytes={staging_bytes} holds no chunk "
                f"pair (a value is {self.codec.value_bytes} bytes; need at least "
                f"{2 * self.slot_bytes}); raise it or lower blocks_per_chunk"
            )
        self.slots_per_region = per_region
        cuda = kv_caches[0].device.type == "cuda"
        self.device = kv_caches[0].device
        self.staging = torch.zeros(2 * per_region * self.slot_bytes, dtype=torch.uint8,
                                   pin_memory=cuda)  # fmt: skip
        self.base_ptr = int(self.staging.data_ptr())
        link.client.register_buffer(self.base_ptr, self.staging.numel())
        first = kv_caches[0]
        self._shape = (2, layout.blocks_per_chunk, *physical(first).shape[2:])
        self._dtype = first.dtype
        slots = range(2 * per_region)
        self.copier = SlotCopier(
            kv_caches,
            layout.blocks_per_chunk,
            [self.base_ptr + g * self.slot_bytes + HEADER_BYTES for g in slots],
            [self._payload(self._slot_value(g)) for g in slots],
        )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._loads: queue.Queue[_Load | None] = queue.Queue()
        self._stores: queue.Queue[tuple[StoreJob, Any] | None] = queue.Queue()
        self._pending_loads: dict[int, _Load] = {}
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._copy_pending: Counter[str] = Counter()
        self._had_store: set[str] = set()
        self._finishing: set[str] = set()
        self._meta = MooncakeStoreWorkerMeta()
        self._stats: dict[str, Any] = {}
        self._getter = ThreadPoolExecutor(1, thread_name_prefix="mc-store-get")
        self._threads = [
            threading.Thread(target=self._load_loop, name="mc-store-load", daemon=True),
            threading.Thread(target=self._store_loop, name="mc-store-put", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- staging ----------------------------------------------------------------------------
    def _slot_value(self, g: int) -> torch.Tensor:
        off = g * self.slot_bytes
        return self.staging[off : off + self.codec.value_bytes]

    def _slot(self, region: int, i: int) -> tuple[int, torch.Tensor]:
        g = region * self.slots_per_region + i
        return self.base_ptr + g * self.slot_bytes, self._slot_value(g)

    def _payload(self, value: torch.Tensor) -> torch.Tensor:
        raw = value[HEADER_BYTES:]
        return raw.view(self._dtype).view(len(self.kv), *self._shape)

    def _rank_key(self, key: str) -> str:
        return self.layout.rank_key(key, self.rank)

    def _stat(self, key: str, value: float, sample: bool = False) -> None:
        with self._lock:
            if sample:
                self._stats.setdefault(key, []).append(value)
            else:
                self._stats[key] = self._stats.get(key, 0) + value

    # -- submit (engine thread) -------------------------------------------------------------
    def submit_load(self, job: LoadJob) -> None:
        load = _Load(job, time.monotonic() + self.load_timeout_s)
        with self._lock:
            self._pending_loads[job.job_id] = load
        self._loads.put(load)

    def submit_store(self, job: StoreJob, event: Any = None) -> None:
        with self._lock:
            self._copy_pending[job.req_id] += 1
            self._had_store.add(job.req_id)
        self._stores.put((job, event))

    def wait_copied(self, req_id: str) -> None:
        """Block until every store job of ``req_id`` copied its blocks out (a memcpy each;
        called for preempted requests, whose blocks this step may reuse)."""
        with self._cond:
            self._cond.wait_for(lambda: self._copy_pending[req_id] <= 0)

    # -- results (engine thread) ------------------------------------------------------------
    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        with self._lock:
            self._finishing |= finished_req_ids & self._had_store
            done = {r for r in self._finishing if self._copy_pending[r] <= 0}
            self._finishing -= done
            self._had_store -= done
            for r in done:
                self._copy_pending.pop(r, None)
        return done

    def take_recving(self) -> set[str]:
        now = time.monotonic()
        with self._lock:
            for load in list(self._pending_loads.values()):
                if not load.done and now > load.deadline:
                    load.abandoned = True
                    self._finish_load(load, self._all_blocks(load.job.chunks))
                    self._stats["load_timeouts"] = self._stats.get("load_timeouts", 0) + 1
            out, self._recving = self._recving, set()
        return out

    def take_load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def take_meta(self) -> MooncakeStoreWorkerMeta | None:
        with self._lock:
            if self._meta.is_empty():
                return None
            meta, self._meta = self._meta, MooncakeStoreWorkerMeta()
        return meta

    def take_stats(self) -> dict[str, Any] | None:
        with self._lock:
            out, self._stats = self._stats, {}
        return out or None

    # -- loads (load thread) ----------------------------------------------------------------
    @staticmethod
    def _all_blocks(chunks: list[ChunkIO]) -> list[int]:
        return [b for c in chunks for b in c.block_ids]

    def _finish_load(self, load: _Load, failed: list[int]) -> None:
        """Under the lock: report the load (once)."""
        if load.done:
            return
        load.done = True
        self._pending_loads.pop(load.job.job_id, None)
        self._recving.add(load.job.req_id)
        self._load_errors.update(failed)

    def _load_loop(self) -> None:
        while (load := self._loads.get()) is not None:
            try:
                failed = self._run_load(load)
            except Exception:  # never let a bug kill the thread: fail the load
                logger.exception("MooncakeStoreConnector: load job %d failed", load.job.job_id)
                failed = self._all_blocks(load.job.chunks)
            with self._lock:
                self._finish_load(load, failed)

    def _run_load(self, load: _Load) -> list[int]:
        chunks = load.job.chunks
        if not self.link.up:
            self._stat("load_failed_chunks", len(chunks))
            return self._all_blocks(chunks)
        n = self.slots_per_region
        for start in range(0, len(chunks), n):
            part = chunks[start : start + n]
            keys = [self._rank_key(c.key) for c in part]
            slots = [self._slot(0, i) for i in range(len(part))]
            # Gets of the next few chunks overlap the checks and copies of the ones that
            # arrived (the store's client works without the GIL): a load that waited for
            # its whole batch before checking anything reached ~40% of a raw get.
            groups = [range(g, min(g + LOAD_PIPELINE, len(part)))
                      for g in range(0, len(part), LOAD_PIPELINE)]  # fmt: skip
            pending = self._getter.submit(self._get, keys, slots, groups[0])
            for gi, idx in enumerate(groups):
                codes = pending.result()
                if gi + 1 < len(groups):
                    pending = self._getter.submit(self._get, keys, slots, groups[gi + 1])
                failed = self._take_group(load, part, keys, slots, idx, codes)
                if failed is not None:
                    pending.result()  # its bytes land in slots the next load reuses
                    return [] if failed < 0 else self._all_blocks(chunks[start + failed :])
        return []

    def _get(self, keys: list[str], slots: list[tuple[int, torch.Tensor]], idx: range) -> list[int]:
        t0 = time.monotonic()
        codes = self.link.client.get_into(
            [keys[i] for i in idx], [slots[i][0] for i in idx], [self.slot_bytes] * len(idx)
        )
        self._stat("get_latency_s", time.monotonic() - t0, sample=True)
        return codes

    def _take_group(
        self,
        load: _Load,
        part: list[ChunkIO],
        keys: list[str],
        slots: list[tuple[int, torch.Tensor]],
        idx: range,
        codes: list[int],
    ) -> int | None:
        """Check and copy in the chunks ``idx`` of ``part``; None when all loaded, else the
        index of the first chunk that failed (-1: the load was abandoned). The chunks before
        a failed one are still copied in."""
        good: list[int] = []
        failed: int | None = None
        for i, code in zip(idx, codes, strict=True):
            bad = self._check(keys[i], code, slots[i][1])
            if bad is not None:
                self._stat("load_failed_chunks", 1)
                if bad:
                    logger.warning("MooncakeStoreConnector: %s (%s); the chunk is a miss",
                                   bad, keys[i])  # fmt: skip
                failed = i
                break
            good.append(i)
        if good:
            with self._lock:
                if load.abandoned:
                    return -1
                for i in good:
                    chunk = part[i]
                    self.copier.into_pool(i, chunk.first_block, chunk.block_ids)
            self._stat("get_bytes", sum(codes[i - idx.start] for i in good))
            self._stat("get_chunks", len(good))
        return failed

    def _check(self, key: str, code: int, value: torch.Tensor) -> str | None:
        """None when the value is good; "" for a plain miss, else what was wrong."""
        if code < 0:
            if code == RPC_FAIL:
                self.link.report_failure("a get failed: master unreachable")
            return ""
        try:
            self.codec.open(_bytes(value), code, key_digest(key))
        except CorruptValue as e:
            self._stat("corrupt_chunks", 1)
            self.link.client.remove([key])
            with self._lock:
                self._meta.removed.append(key.rsplit("/", 1)[0])
            return f"corrupt store value: {e}"
        return None

    # -- stores (store thread) --------------------------------------------------------------
    def _store_loop(self) -> None:
        while (item := self._stores.get()) is not None:
            job, event = item
            released = False

            def release(job: StoreJob = job) -> None:
                nonlocal released
                if not released:
                    released = True
                    with self._cond:  # its engine blocks may be reused now
                        self._copy_pending[job.req_id] -= 1
                        self._cond.notify_all()

            ok = False
            try:
                ok = self._run_store(job, event, release)
            except Exception:
                logger.exception("MooncakeStoreConnector: store job %d failed", job.job_id)
            finally:
                release()
                with self._lock:
                    counts = self._meta.stored if ok else self._meta.store_failed
                    counts[job.job_id] = counts.get(job.job_id, 0) + 1

    def _run_store(self, job: StoreJob, event: Any, release: Any) -> bool:
        if event is not None:
            event.synchronize()
        if not self.link.up:
            self._stat("store_skipped_chunks", len(job.chunks))
            return False
        n = self.slots_per_region
        ok = True
        for start in range(0, len(job.chunks), n):
            part = job.chunks[start : start + n]
            keys = [self._rank_key(c.key) for c in part]
            slots = [self._slot(1, i) for i in range(len(part))]
            for i, (chunk, key, (_, value)) in enumerate(zip(part, keys, slots, strict=True)):
                self.copier.out_of_pool(self.slots_per_region + i, chunk.block_ids)
                self.codec.seal(_bytes(value), key_digest(key))
            if start + n >= len(job.chunks):
                release()
            ok = self._put(keys, slots) and ok
        return ok

    def _put(self, keys: list[str], slots: list[tuple[int, torch.Tensor]]) -> bool:
        client = self.link.client
        have = client.exists(keys)
        if have is None:
            self.link.report_failure("an existence check failed")
            return False
        todo = [i for i, h in enumerate(have) if not h]
        self._stat("store_dedup_chunks", len(keys) - len(todo))
        if not todo:
            return True
        t0 = time.monotonic()
        codes = client.put_from([keys[i] for i in todo], [slots[i][0] for i in todo],
                                [self.codec.value_bytes] * len(todo))  # fmt: skip
        self._stat("put_latency_s", time.monotonic() - t0, sample=True)
        good = sum(1 for c in codes if c >= 0)
        self._stat("put_chunks", good)
        self._stat("put_bytes", good * self.codec.value_bytes)
        if good < len(codes):
            self._stat("put_failed_chunks", len(codes) - good)
            if RPC_FAIL in codes:
                self.link.report_failure("a put failed: master unreachable")
            return False
        return True

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._pending_loads) + sum(max(0, v) for v in self._copy_pending.values())

    def shutdown(self) -> None:
        self._loads.put(None)
        self._stores.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self._getter.shutdown(wait=True)
