"""Offload mechanism, piece by piece: eviction policies, tier index, manager, chunk files,
block copies and the transfer engine, options."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvferry.config import ConfigError
from kvferry.core.kv_cache_manager import KVCacheManager
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec
from kvferry.kv_transfer import copy_ops
from kvferry.kv_transfer.connectors.offloading.options import OffloadingOptions
from kvferry.kv_transfer.connectors.offloading.worker_metadata import (
    JobCounter,
    OffloadWorkerMetadata,
)
from kvferry.kv_transfer.connectors.simple_cpu_offload.options import SimpleCPUOffloadOptions
from kvferry.kv_transfer.copy_ops import CopyPool, coalesce, copy_blocks
from kvferry.kv_transfer.offload.disk import (
    HEADER,
    CorruptChunk,
    DiskStore,
    layout_fingerprint,
    model_fingerprint,
    scan_folder,
)
from kvferry.kv_transfer.offload.host_buffer import HostKVBuffer
from kvferry.kv_transfer.offload.jobs import JobKind, TransferJob
from kvferry.kv_transfer.offload.manager import LookupStatus, TieredOffloadingManager
from kvferry.kv_transfer.offload.policies import ARCPolicy, EvictionPolicy, LRUPolicy, policy_class
from kvferry.kv_transfer.offload.stats import LookupStats
from kvferry.kv_transfer.offload.tier import TierIndex
from kvferry.kv_transfer.offload.transfer import TransferEngine
from kvferry.kv_transfer.options import parse_options


def k(i: int) -> bytes:
    return i.to_bytes(32, "big")


# -- policies -----------------------------------------------------------------------------


def test_lru_evicts_oldest_and_is_atomic() -> None:
    p = LRUPolicy(4)
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    assert p.evict(2, lambda key: True) == [k(1), k(2)]
    assert p.evict(3, lambda key: key != k(3)) is None  # only k(0) evictable: no change
    assert set(p.keys()) == {k(0), k(3)}


def test_arc_keeps_reused_keys_against_a_scan() -> None:
    p = ARCPolicy(4)
    for i in (0, 1):
        p.insert(k(i))
        p.touch(k(i))  # reused: T2
    victims = []
    for i in range(10, 20):  # a scan of one-off keys
        if len(p) == 4:
            victims += p.evict(1, lambda key: True) or []
        p.insert(k(i))
    assert k(0) in p and k(1) in p, "the scan flushed the reused keys"
    assert k(0) not in victims and k(1) not in victims
    # A ghost hit in B1 grows T1's target.
    before = p.target_t1
    ghost = next(iter(p.b1))
    p.evict(1, lambda key: True)
    p.insert(ghost)
    assert p.target_t1 > before and ghost in p.t2


def test_arc_evict_is_atomic_and_respects_pins() -> None:
    p = ARCPolicy(3)
    for i in range(3):
        p.insert(k(i))
    assert p.evict(2, lambda key: key == k(1)) is None
    assert len(p) == 3
    assert p.evict(1, lambda key: key == k(1)) == [k(1)]


class _FifoPolicy(LRUPolicy):
    """A custom policy loaded by module path in a test."""


def test_policy_by_name_and_module_path() -> None:
    assert policy_class("lru") is LRUPolicy and policy_class("arc") is ARCPolicy
    assert policy_class(f"{__name__}:_FifoPolicy") is _FifoPolicy
    assert issubclass(
        policy_class("kvferry.kv_transfer.offload.policies.lru.LRUPolicy"), EvictionPolicy
    )
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        policy_class("mru")
    with pytest.raises(ConfigError, match="cannot import"):
        policy_class("no_such_module:Policy")
    with pytest.raises(ConfigError, match="not an EvictionPolicy"):
        policy_class("collections:OrderedDict")


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


# -- chunk files --------------------------------------------------------------------------


def _views(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 16, 2, 8, generator=g).to(torch.bfloat16) for _ in range(4)]


def test_disk_roundtrip_and_corruption(tmp_path: Path) -> None:
    views = _views(0)
    payload = sum(v.numel() * v.element_size() for v in views)
    fp = "x" * 8 + "0" * 32
    store = DiskStore(tmp_path, fp, payload, fsync=True)
    key = k(7).hex()
    store.write(key, views)
    out = [torch.empty_like(v) for v in views]
    store.read_into(key, out)
    assert all(torch.equal(a, b) for a, b in zip(views, out, strict=True))
    path = store.path(key)
    assert scan_folder(tmp_path, path.stat().st_size) == ([k(7)], [])
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + 10] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunk, match="checksum"):
        store.read_into(key, out)
    path.write_bytes(bytes(raw[:-5]))
    with pytest.raises(CorruptChunk, match="truncated"):
        store.read_into(key, out)
    assert scan_folder(tmp_path, len(raw)) == ([], [k(7)])
    other = DiskStore(tmp_path, "y" * 8 + "1" * 32, payload, fsync=False)
    store.write(key, views)
    with pytest.raises(CorruptChunk, match="header"):
        other.read_into(key, out)  # another layout's file is never read
    with pytest.raises(CorruptChunk, match="missing"):
        store.read_into(k(8).hex(), out)


def test_fingerprint_tells_models_and_layouts_apart(tiny_model_factory) -> None:
    a = model_fingerprint(str(tiny_model_factory("llama", seed=0)))
    b = model_fingerprint(str(tiny_model_factory("llama", seed=1)))
    assert a != b
    fa = layout_fingerprint(a, 4, 2, 64, torch.float32, 16, 1)
    assert fa != layout_fingerprint(a, 4, 2, 64, torch.bfloat16, 16, 1)
    assert fa != layout_fingerprint(a, 4, 2, 64, torch.float32, 16, 2)


# -- copies and the transfer engine -------------------------------------------------------


def test_coalesce_runs() -> None:
    assert coalesce([1, 2, 3, 9, 5], [7, 8, 9, 10, 0]) == [(1, 7, 3), (9, 10, 1), (5, 0, 1)]


@pytest.mark.parametrize("path", ["native", "numpy", "native-split", "numpy-split"])
@pytest.mark.parametrize("seed", range(4))
def test_copy_blocks_matches_indexing(
    seed: int, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host copies through the C row-copy kernel and through numpy, on the calling thread
    and split over a pool's threads."""
    if path.startswith("numpy"):
        monkeypatch.setattr(copy_ops, "load_block_copy", lambda: None)
    elif copy_ops.load_block_copy() is None:
        pytest.skip("no C compiler: the row-copy kernel cannot be built here")
    pool = None
    if path.endswith("split"):
        monkeypatch.setattr(copy_ops, "PARALLEL_COPY_BYTES", 0)
        pool = CopyPool(2)
    g = torch.Generator().manual_seed(seed)
    src = [torch.randn(2, 40, 4, 1, 2, generator=g) for _ in range(2)]
    dst = [torch.zeros(2, 30, 4, 1, 2) for _ in range(2)]
    n = 20
    src_ids = torch.randperm(40, generator=g)[:n].tolist()
    src_ids[3:10] = range(20, 27)  # a long run among random ids
    dst_ids = torch.randperm(30, generator=g)[:n].tolist()
    dst_ids[3:10] = range(5, 12)
    dst_ids = list(dict.fromkeys(dst_ids))[:n]
    src_ids = list(dict.fromkeys(src_ids))[: len(dst_ids)]
    dst_ids = dst_ids[: len(src_ids)]
    before = [d.clone() for d in dst]
    nbytes = copy_blocks(src, dst, src_ids, dst_ids, pool=pool)
    untouched = [i for i in range(30) if i not in dst_ids]
    for s, d, b in zip(src, dst, before, strict=True):
        assert torch.equal(d[:, dst_ids], s[:, src_ids])
        assert torch.equal(d[:, untouched], b[:, untouched])
    assert nbytes == 2 * len(src_ids) * 2 * 4 * 2 * 4
    if pool is not None:
        pool.shutdown()


def _engine(tmp_path: Path | None = None) -> tuple[TransferEngine, dict[str, torch.Tensor]]:
    kv = {f"l{i}": torch.randn(2, 8, 4, 1, 2) for i in range(2)}
    host = HostKVBuffer(kv, 6, pin_memory=False)
    disk = None
    if tmp_path is not None:
        disk = DiskStore(tmp_path, "ab" * 16, 2 * host.bytes_per_block, fsync=False)
    return TransferEngine(kv, host, disk), kv


def test_transfer_engine_store_load_disk_roundtrip(tmp_path: Path) -> None:
    engine, kv = _engine(tmp_path)
    original = {n: t.clone() for n, t in kv.items()}
    engine.submit(TransferJob(1, JobKind.STORE, [3, 5], [0, 1]))
    engine.submit(TransferJob(2, JobKind.DISK_WRITE, [], [0, 1], k(1).hex(), after=1))
    engine.wait([1, 2])
    engine.submit(TransferJob(3, JobKind.PROMOTE, [], [2, 3], k(1).hex()))
    engine.wait([3])
    engine.submit(TransferJob(4, JobKind.LOAD, [0, 1], [2, 3], req_ids=["r"]))
    engine.wait([4])
    results = {r.job.job_id: r for r in engine.poll()}
    assert all(r.ok for r in results.values()) and sorted(results) == [1, 2, 3, 4]
    for n, t in kv.items():
        assert torch.equal(t[:, [0, 1]], original[n][:, [3, 5]])
    engine.shutdown()


def test_transfer_engine_copies_through_the_engine_op(tmp_path: Path) -> None:
    """Host and staging copies go through the op the connector was handed, both ways."""
    engine, kv = _engine(tmp_path)
    op = copy_ops.KVBlockCopy()
    calls: list[str] = []

    def recording_op(src, dst, src_ids, dst_ids, direction):  # noqa: ANN001, ANN202
        calls.append(direction)
        op(src, dst, src_ids, dst_ids, direction)

    engine.copy_op = recording_op
    original = {n: t.clone() for n, t in kv.items()}
    engine.submit(TransferJob(1, JobKind.STORE, [3, 5], [0, 1]))
    engine.submit(TransferJob(2, JobKind.DISK_STORE, [6, 7], [], k(4).hex()))
    engine.wait([1, 2])
    engine.submit(TransferJob(3, JobKind.LOAD, [0, 1], [0, 1], req_ids=["r"]))
    engine.submit(TransferJob(4, JobKind.LOAD, [], [], disk_loads=[(k(4).hex(), 0, [2, 4])]))
    engine.wait([3, 4])
    assert all(r.ok for r in engine.poll())
    assert sorted(calls) == ["d2h", "d2h", "h2d", "h2d"]
    for n, t in kv.items():
        assert torch.equal(t[:, [0, 1]], original[n][:, [3, 5]])
        assert torch.equal(t[:, [2, 4]], original[n][:, [6, 7]])
    engine.shutdown()
    op.close()


@pytest.mark.parametrize("op", ["KVBlockCopy", "copy_kv_blocks"])
def test_engine_copy_op_matches_indexing(op: str) -> None:
    g = torch.Generator().manual_seed(0)
    src = {f"l{i}": torch.randn(2, 12, 4, 1, 2, generator=g) for i in range(3)}
    dst = {f"l{i}": torch.zeros(2, 9, 4, 1, 2) for i in range(2)}  # l2 has no destination
    copy = copy_ops.KVBlockCopy() if op == "KVBlockCopy" else copy_ops.copy_kv_blocks
    for _ in range(2):  # the second call reuses the cached copier
        copy(src, dst, [7, 1, 2, 3, 11], [0, 4, 5, 6, 8], "d2h")
    for n, d in dst.items():
        assert torch.equal(d[:, [0, 4, 5, 6, 8]], src[n][:, [7, 1, 2, 3, 11]])
        assert torch.equal(d[:, [1, 2, 3, 7]], torch.zeros_like(d[:, [1, 2, 3, 7]]))
    with pytest.raises(ValueError, match="same length"):
        copy(src, dst, [1], [], "d2h")
    with pytest.raises(ValueError, match="direction"):
        copy(src, dst, [1], [2], "sideways")  # type: ignore[arg-type]
    if isinstance(copy, copy_ops.KVBlockCopy):
        copy.close()


def test_transfer_engine_failures_and_ordering(tmp_path: Path) -> None:
    engine, _ = _engine(tmp_path)
    gate = threading.Event()
    real_store = engine._store

    def slow_failing_store(p):  # noqa: ANN001
        gate.wait(5)
        raise RuntimeError("injected")

    engine._store = slow_failing_store  # type: ignore[method-assign]
    engine.submit(TransferJob(1, JobKind.STORE, [0], [0]))
    engine.submit(TransferJob(2, JobKind.DISK_WRITE, [], [0, 1], k(2).hex(), after=1))
    engine.submit(TransferJob(3, JobKind.LOAD, [1], [1], req_ids=["r"]))
    engine.wait([3])  # the load ran although the store is stuck ahead of it
    assert engine.num_in_flight() == 2
    assert engine.poll(block_s=0.01)[0].job.job_id == 3
    gate.set()
    engine.wait([1, 2])
    results = {r.job.job_id: r.ok for r in engine.poll()}
    assert results == {1: False, 2: False}  # the write after a failed store fails too
    assert not (tmp_path / f"{k(2).hex()}.kvc").exists()
    engine._store = real_store  # type: ignore[method-assign]
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit(TransferJob(9, JobKind.LOAD, [0], [0]))


def test_idle_poll_waits_for_a_result() -> None:
    engine, _ = _engine()
    real_load = engine._load

    def slow_load(p):  # noqa: ANN001
        time.sleep(0.002)
        return real_load(p)

    engine._load = slow_load  # type: ignore[method-assign]
    engine.submit(TransferJob(1, JobKind.LOAD, [0], [0]))
    assert [r.job.job_id for r in engine.poll(block_s=1.0)] == [1]
    engine.shutdown()


# -- options ------------------------------------------------------------------------------


def test_options_are_typed_and_unknown_ones_rejected() -> None:
    opts = parse_options(
        OffloadingOptions, {"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 4}, "O"
    )
    assert opts.num_host_chunks(1 << 16, "O") == 16
    with pytest.raises(ConfigError, match="valid options are .*blocks_per_chunk"):
        parse_options(OffloadingOptions, {"cpu_bytes": 1}, "O")
    with pytest.raises(ConfigError, match="set cpu_bytes_to_use"):
        parse_options(OffloadingOptions, {}, "O")
    with pytest.raises(ConfigError, match="invalid value"):
        parse_options(OffloadingOptions, {"cpu_bytes_to_use": "1G"}, "O")
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        parse_options(OffloadingOptions, {"num_cpu_chunks": 4, "eviction_policy": "x"}, "O")
    s = parse_options(SimpleCPUOffloadOptions, {"cpu_bytes_to_use": 4096}, "S")
    assert s.num_blocks(1024, world_size=2, owner="S") == 2
    assert (
        parse_options(SimpleCPUOffloadOptions, {"num_cpu_blocks": 7}, "S").num_blocks(1, 1, "S")
        == 7
    )
    with pytest.raises(ConfigError, match="hold no KV block"):
        s.num_blocks(1 << 20, 1, "S")
    with pytest.raises(ConfigError, match="must be positive"):
        parse_options(SimpleCPUOffloadOptions, {"num_cpu_blocks": 0}, "S")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_transfer_engine_roundtrip(tmp_path: Path) -> None:
    dev = torch.device("cuda")
    kv = {f"l{i}": torch.randn(2, 64, 16, 2, 8, device=dev, dtype=torch.bfloat16) for i in range(2)}
    host = HostKVBuffer(kv, 32, pin_memory=True)
    assert host.layers["l0"].is_pinned()
    disk = DiskStore(tmp_path, "cd" * 16, 4 * host.bytes_per_block, fsync=False)
    engine = TransferEngine(kv, host, disk)
    original = {n: t.clone() for n, t in kv.items()}
    src = [3, 4, 5, 6, 9, 40, 41, 2]
    event = torch.cuda.Event()
    event.record()
    engine.submit(TransferJob(1, JobKind.STORE, src, list(range(8))), event)
    engine.submit(TransferJob(2, JobKind.DISK_STORE, [10, 11, 12, 13], [], k(3).hex()), event)
    engine.wait([1, 2])
    for t in kv.values():
        t.zero_()
    dst = [0, 1, 2, 3, 20, 22, 21, 63]
    engine.submit(TransferJob(3, JobKind.LOAD, dst, list(range(8)), req_ids=["r"]))
    engine.submit(TransferJob(4, JobKind.LOAD, [], [], disk_loads=[(k(3).hex(), 1, [30, 31, 32])]))
    engine.wait([3, 4])
    assert all(r.ok for r in engine.poll())
    for n, t in kv.items():
        assert torch.equal(t[:, dst], original[n][:, src])
        assert torch.equal(t[:, [30, 31, 32]], original[n][:, [11, 12, 13]])
    engine.shutdown()


def test_eviction_candidates_read_the_free_queue_head_without_changing_it() -> None:
    group = KVCacheGroupSpec(("l0",), 16, 1, 4, torch.float32)
    manager = KVCacheManager(KVCacheConfig(6, (group,)), max_model_len=96)
    head = [b.block_id for b in manager.eviction_candidates(4)]
    assert head == [b.block_id for b in manager.block_pool.free_queue.blocks()[:4]]
    assert [b.block_id for b in manager.eviction_candidates(4)] == head
    assert len(manager.eviction_candidates(100)) == manager.get_num_free_blocks() == 6
    manager.check_integrity()


def test_split_connector_names_the_hook_called_on_the_wrong_role() -> None:
    from tests.helpers.offload_harness import OffloadHarness

    h = OffloadHarness("SimpleCPUOffloadConnector", {"num_cpu_blocks": 8})
    with pytest.raises(RuntimeError, match="register_kv_caches is a worker-side hook"):
        h.sched_conn.register_kv_caches({})
    with pytest.raises(RuntimeError, match="build_connector_meta is a scheduler-side hook"):
        h.worker_conn.build_connector_meta(None)  # type: ignore[arg-type]
    h.shutdown()
