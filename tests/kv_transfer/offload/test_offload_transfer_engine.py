"""The offload transfer engine: store, load, disk write and promotion round trips, copies
through the op it was handed, failures and ordering, idle polls, and a CUDA round trip."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from kvferry.kv_transfer import copy_ops
from kvferry.kv_transfer.offload.disk import DiskStore
from kvferry.kv_transfer.offload.host_buffer import HostKVBuffer
from kvferry.kv_transfer.offload.jobs import JobKind, TransferJob
from kvferry.kv_transfer.offload.transfer import TransferEngine
from tests.helpers.offload_keys import k


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
