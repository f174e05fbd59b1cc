"""The offload bookkeeping: the tier index (slots, pins), the tiered manager (store
threshold, loads, write-through to disk, promotion, verification), the per-worker job
counter, and the KV cache manager's eviction candidates."""

from __future__ import annotations

import torch

from kvferry.core.kv_cache_manager import KVCacheManager
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvferry.kv_transfer.connectors.offloading.worker_metadata import (
    JobCounter,
    OffloadWorkerMetadata,
)
from kvferry.kv_transfer.offload.manager import LookupStatus, TieredOffloadingManager
from kvferry.kv_transfer.offload.policies import LRUPolicy
from kvferry.kv_transfer.offload.stats import LookupStats
from kvferry.kv_transfer.offload.tier import TierIndex
from tests.helpers.offload_keys import k

# -- tier and manager ---------------------------------------------------------------------


def test_tier_reserve_pins_and_slots() -> None:
    t = TierIndex("cpu", 3, LRUPolicy(3))
    slots, evicted = t.reserve([k(0), k(1), k(2)]) or ([], [])
    assert slots == [0, 1, 2] and evicted == []
    assert t.reserve([k(3)]) is None  # nothing ready: nothing evictable
    for i in range(3):
        t.commit(k(i))
    t.pin(k(0))
    # k(0) is pinned and k(1) protected: only k(2) can go, so two new keys do not fit.
    assert t.reserve([k(3), k(4)], protect=[k(1)]) is None
    assert t.reserve([k(3)], protect=[k(1)]) == ([2], [k(2)])
    t.unpin(k(0))
    t.check_integrity()
    assert t.evict_unpinned() == [k(0), k(1)] and len(t) == 1


def _manager(host: int = 4, disk: int | None = None, threshold: int = 1) -> TieredOffloadingManager:
    d = TierIndex("disk", disk, LRUPolicy(disk), with_slots=False) if disk else None
    return TieredOffloadingManager(
        TierIndex("cpu", host, LRUPolicy(host)), d, LookupStats("t"), threshold
    )


def test_manager_store_lifecycle_and_threshold() -> None:
    m = _manager(threshold=2)
    assert m.prepare_store([k(0)]).keys == []  # first offer: below threshold
    plan = m.prepare_store([k(0), k(1)])
    assert plan.keys == [k(0)]
    assert m.lookup(k(0)) is LookupStatus.PENDING
    m.complete_store(plan.keys, ok=True)
    assert m.lookup(k(0)) is LookupStatus.HIT
    plan = m.prepare_store([k(1)])
    m.complete_store(plan.keys, ok=False)  # failed: never published
    assert m.lookup(k(1)) is LookupStatus.MISS
    m.check_integrity(idle=True)


def test_manager_holds_loads_and_eviction() -> None:
    m = _manager(host=2)
    plan = m.prepare_store([k(0), k(1)])
    m.complete_store(plan.keys, True)
    m.pin("r", k(0))
    slots = m.prepare_load([k(1)])
    assert slots == [1]
    assert m.prepare_store([k(2)]).keys == []  # both pinned: no room, skipped
    m.complete_load([k(1)], slots, ok=True)
    m.release("r")
    assert m.prepare_store([k(2)]).keys == [k(2)]  # evicts the least recently used
    m.complete_store([k(2)], True)
    assert [m.lookup(k(i)) for i in range(3)].count(LookupStatus.HIT) == 2
    m.check_integrity(idle=True)


def test_manager_write_through_and_promotion() -> None:
    m = _manager(host=1, disk=4)
    plan = m.prepare_store([k(0)])
    assert plan.disk_keys == [k(0)]
    m.complete_store(plan.keys, True)
    assert m.prepare_store([k(1)]).keys == []  # k(0) pinned until its file is written
    m.complete_disk_write(k(0), True)
    plan = m.prepare_store([k(1)])  # now k(0) can leave the host: it is on disk
    assert plan.keys == [k(1)]
    m.complete_store(plan.keys, True)
    m.complete_disk_write(k(1), True)
    assert m.lookup(k(0)) is LookupStatus.RETRY
    assert m.prefetch("r", k(0))
    assert m.lookup(k(0)) is LookupStatus.PENDING
    ops = m.take_disk_ops()
    assert [key for key, _ in ops.promotions] == [k(0)] and ops.deletes == []
    m.complete_promote(k(0), ok=True)
    assert m.lookup(k(0)) is LookupStatus.HIT and m.came_from_disk(k(0))
    m.release("r")
    m.check_integrity(idle=True)


def test_manager_corrupt_promotion_becomes_a_miss() -> None:
    m = _manager(host=2, disk=2)
    plan = m.prepare_store([k(0)])
    m.complete_store(plan.keys, True)
    m.complete_disk_write(k(0), True)
    m.host.discard(k(0))
    assert m.prefetch("r", k(0))
    m.take_disk_ops()
    m.complete_promote(k(0), ok=False)
    assert m.lookup(k(0)) is LookupStatus.MISS
    assert m.take_disk_ops().deletes == [k(0)]  # the bad file is deleted
    m.release("r")
    assert m.stats.totals["corrupt_chunks"] == 1
    m.check_integrity(idle=True)


def test_manager_verifies_unknown_files_before_offering_them() -> None:
    m = _manager(host=1, disk=4)
    m.disk.insert_ready(k(0))  # type: ignore[union-attr]  # found at start: not verified
    m.disk.insert_ready(k(1))  # type: ignore[union-attr]
    assert m.lookup(k(0)) is LookupStatus.RETRY and not m.disk_loadable(k(0))
    assert m.request_verify(k(0)) and m.request_verify(k(0))  # queued once
    assert m.take_disk_ops().verifies == [k(0)]
    m.complete_verify(k(0), ok=True)
    assert m.disk_loadable(k(0))
    assert m.prepare_load([k(0)]) == [None]  # read straight from its file
    m.complete_load([k(0)], [None], ok=True)
    m.request_verify(k(1))
    m.take_disk_ops()
    m.complete_verify(k(1), ok=False)
    assert m.lookup(k(1)) is LookupStatus.MISS
    assert m.take_disk_ops().deletes == [k(1)]
    m.check_integrity(idle=True)


def test_job_counter_waits_for_every_worker() -> None:
    c = JobCounter(2)
    assert c.add(OffloadWorkerMetadata(completed={1: 1})) == []
    meta = OffloadWorkerMetadata(completed={1: 1, 2: 1})
    meta.aggregate(OffloadWorkerMetadata(failed={2: 1}))
    assert sorted(c.add(meta)) == [(1, True), (2, False)]
    assert len(c) == 0


def test_eviction_candidates_read_the_free_queue_head_without_changing_it() -> None:
    group = KVCacheGroupSpec(("l0",), 16, 1, 4, torch.float32)
    manager = KVCacheManager(KVCacheConfig(6, (group,)), max_model_len=96)
    head = [b.block_id for b in manager.eviction_candidates(4)]
    assert head == [b.block_id for b in manager.block_pool.free_queue.blocks()[:4]]
    assert [b.block_id for b in manager.eviction_candidates(4)] == head
    assert len(manager.eviction_candidates(100)) == manager.get_num_free_blocks() == 6
    manager.check_integrity()
