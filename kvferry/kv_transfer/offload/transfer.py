"""TransferEngine: runs transfer jobs in the background, next to the model's compute.

Three threads per worker: the *copy* thread moves blocks between the engine's KV and the host
buffer (loads before stores: a load is on some request's critical path, a store is not); the
*disk-read* thread serves file reads (promotions, checks, loads straight from files); the
*disk-write* thread writes and deletes files in submission order (a deletion and a later
rewrite of the same key must not swap). Reads never race writes of the same file: a file is
read only while the scheduler pins it, and a pinned file is neither rewritten nor deleted.
PyTorch releases the GIL inside its copy kernels and file I/O releases it too, so the threads
overlap the forward pass.

On a CUDA engine the copy thread issues its copies on its own stream into pinned host memory
(DMA, no SMs used) and waits for that stream, never for the compute stream; a store first
waits for the CUDA event the worker recorded after the forward that wrote its blocks.

With ``inline_stores`` (a CPU engine whose forward already uses every core) a store runs in
:meth:`submit`, on the worker's thread right after the forward, split over the copy op's
threads: a background copy there could only preempt the forward's OpenMP threads, and a
preempted thread stalls the whole team at its next barrier.

Every copy between the engine's KV and host memory (the host tier, or a staging buffer of a
chunk file) goes through ``copy_op``: the engine's block copy that the connector received
through ``set_host_xfer_buffer_ops`` (:class:`~kvferry.kv_transfer.copy_ops.KVBlockCopy`
until one is set).

Completion is polled (:meth:`poll`); :meth:`wait` blocks until given jobs are done (used to
fence engine blocks that are about to be reused while a store still reads them).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvferry.kv_layout import empty_like_layout, physical
from kvferry.kv_transfer.base import CopyBlocksOp
from kvferry.kv_transfer.copy_ops import KVBlockCopy
from kvferry.kv_transfer.offload.disk import CorruptChunk, DiskStore
from kvferry.kv_transfer.offload.host_buffer import HostKVBuffer
from kvferry.kv_transfer.offload.jobs import JobKind, TransferJob
from kvferry.logger import init_logger

logger = init_logger(__name__)

_PRIORITY = {JobKind.LOAD: 0, JobKind.STORE: 1}
_STOP = 99


@dataclass
class JobResult:
    """``seconds``: time spent moving the bytes; ``latency``: from submit to done."""

    job: TransferJob
    ok: bool
    nbytes: int
    seconds: float
    latency: float
    error: str | None = None


class _Pending:
    __slots__ = ("job", "done", "ok", "submitted", "compute_event")

    def __init__(self, job: TransferJob, compute_event: Any) -> None:
        self.job = job
        self.done = threading.Event()
        self.ok = False
        self.submitted = time.perf_counter()
        self.compute_event = compute_event


class TransferEngine:
    def __init__(
        self,
        kv_caches: dict[str, torch.Tensor],
        host: HostKVBuffer,
        disk: DiskStore | None,
        inline_stores: bool = False,
    ) -> None:
        self.host = host
        self.inline_stores = inline_stores
        self.background_seconds = 0.0  # copy-thread time on loads and stores (benchmarks)
        self.disk = disk
        self._engine_kv = {n: kv_caches[n] for n in host.layer_names}
        self._host_kv = {n: host.layers[n] for n in host.layer_names}
        self.device = next(iter(self._engine_kv.values())).device
        cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._disk_stream = torch.cuda.Stream(self.device) if cuda else None
        self._own_copy_op = KVBlockCopy()
        self.copy_op: CopyBlocksOp = self._own_copy_op
        self._stagings: dict[str, dict[str, torch.Tensor]] = {}
        self._lock = threading.Condition()
        self._pending: dict[int, _Pending] = {}
        self._results: list[JobResult] = []
        self._failed: set[int] = set()
        self._seq = itertools.count()
        self._copy_q: queue.PriorityQueue[tuple[int, int, _Pending | None]] = queue.PriorityQueue()
        self._read_q: queue.Queue[_Pending | None] = queue.Queue()
        self._write_q: queue.Queue[_Pending | None] = queue.Queue()
        loops = [("copy", self._copy_loop)]
        if disk is not None:
            loops += [("disk-read", self._read_loop), ("disk-write", self._write_loop)]
        self._threads = [
            threading.Thread(target=fn, name=f"kv-offload-{name}", daemon=True)
            for name, fn in loops
        ]
        for t in self._threads:
            t.start()
        self._closed = False

    # -- submission and completion (worker thread) ----------------------------------------

    def submit(self, job: TransferJob, compute_event: Any = None) -> None:
        if self._closed:
            raise RuntimeError("the transfer engine is shut down")
        pending = _Pending(job, compute_event)
        with self._lock:
            assert job.job_id not in self._pending, f"job {job.job_id} submitted twice"
            self._pending[job.job_id] = pending
        reads_file = job.kind in (JobKind.PROMOTE, JobKind.VERIFY) or bool(job.disk_loads)
        if self.inline_stores and job.kind == JobKind.STORE:
            self._run(pending, self._store)  # on the caller's thread, before it returns
        elif not reads_file and job.kind in _PRIORITY:
            self._copy_q.put((_PRIORITY[job.kind], next(self._seq), pending))
        elif self.disk is None:
            self._finish(pending, False, 0, 0.0, "no disk tier is configured")
        elif reads_file:
            self._read_q.put(pending)
        else:
            self._write_q.put(pending)

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until every listed job is done (unknown ids count as done)."""
        for job_id in job_ids:
            with self._lock:
                pending = self._pending.get(job_id)
            if pending is not None:
                pending.done.wait()

    def poll(self, block_s: float = 0.0) -> list[JobResult]:
        """Results since the last poll. With ``block_s`` > 0 and jobs in flight, wait up to
        that long for the first result (so an idle engine does not spin)."""
        with self._lock:
            if block_s > 0 and not self._results and self._pending:
                self._lock.wait(timeout=block_s)
            results, self._results = self._results, []
        return results

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def shutdown(self) -> None:
        """Finish queued jobs, then stop the threads."""
        if self._closed:
            return
        self._closed = True
        self._copy_q.put((_STOP, next(self._seq), None))
        self._read_q.put(None)
        self._write_q.put(None)
        for t in self._threads:
            t.join(timeout=60)
        self._own_copy_op.close()
        if self.disk is not None:
            self.disk.shutdown()

    # -- the threads ----------------------------------------------------------------------

    def _finish(self, p: _Pending, ok: bool, nbytes: int, seconds: float, err: str | None) -> None:
        p.ok = ok
        latency = time.perf_counter() - p.submitted
        with self._lock:
            self._pending.pop(p.job.job_id, None)
            if not ok:
                # A later disk write of a chunk this job was filling must fail too.
                self._failed.add(p.job.job_id)
            self._results.append(JobResult(p.job, ok, nbytes, seconds, latency, err))
            p.done.set()
            self._lock.notify_all()

    def _run(self, p: _Pending, body: Callable[[_Pending], int]) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = body(p)
        except CorruptChunk as e:
            # The file is dropped from the index after this, so each bad file logs once.
            logger.warning(
                "offload: %s job %d: chunk file refused, treated as a miss: %s",
                p.job.kind.value,
                p.job.job_id,
                e,
            )
            self._finish(p, False, 0, time.perf_counter() - t0, str(e))
        except Exception as e:  # a failed job is reported, never fatal to the engine
            logger.warning("offload: %s job %d failed: %s", p.job.kind.value, p.job.job_id, e)
            self._finish(p, False, 0, time.perf_counter() - t0, repr(e))
        else:
            self._finish(p, True, nbytes, time.perf_counter() - t0, None)

    def _copy_loop(self) -> None:
        while True:
            _, _, p = self._copy_q.get()
            if p is None:
                return
            t0 = time.perf_counter()
            self._run(p, self._load if p.job.kind == JobKind.LOAD else self._store)
            self.background_seconds += time.perf_counter() - t0

    def _read_loop(self) -> None:
        bodies = {JobKind.PROMOTE: self._promote, JobKind.VERIFY: self._verify}
        while True:
            p = self._read_q.get()
            if p is None:
                return
            self._run(p, bodies.get(p.job.kind, self._load))

    def _write_loop(self) -> None:
        bodies = {
            JobKind.DISK_WRITE: self._disk_write,
            JobKind.DISK_STORE: self._disk_store,
            JobKind.DISK_DELETE: self._disk_delete,
        }
        while True:
            p = self._write_q.get()
            if p is None:
                return
            self._run(p, bodies[p.job.kind])

    def _copy(self, job: TransferJob, event: Any, to_host: bool) -> int:
        direction: Literal["h2d", "d2h"]
        if to_host:
            src, dst = self._engine_kv, self._host_kv
            src_ids, dst_ids, direction = job.engine_blocks, job.host_blocks, "d2h"
        else:
            src, dst = self._host_kv, self._engine_kv
            src_ids, dst_ids, direction = job.host_blocks, job.engine_blocks, "h2d"
        if self._stream is None:
            self.copy_op(src, dst, src_ids, dst_ids, direction)
        else:
            with torch.cuda.stream(self._stream):
                if event is not None:
                    self._stream.wait_event(event)
                self.copy_op(src, dst, src_ids, dst_ids, direction)
            self._stream.synchronize()
        return len(src_ids) * self.host.bytes_per_block

    def _load(self, p: _Pending) -> int:
        nbytes = 0
        if p.job.host_blocks:
            nbytes = self._copy(p.job, None, to_host=False)
        for key_hex, first, blocks in p.job.disk_loads:
            nbytes += self._load_file(key_hex, first, blocks)
        return nbytes

    def _staging(self, which: str, num_blocks: int) -> dict[str, torch.Tensor]:
        """A chunk-sized host buffer shaped like the engine's layers, kept per disk thread
        (``which``: "read" | "write")."""
        cached = self._stagings.get(which)
        if cached is not None and next(iter(cached.values())).shape[1] == num_blocks:
            return cached
        buf = {n: empty_like_layout(t, num_blocks) for n, t in self._engine_kv.items()}
        self._stagings[which] = buf
        return buf

    def _on_disk_stream(self, event: Any = None) -> Any:
        if self._disk_stream is None:
            return contextlib.nullcontext()
        if event is not None:
            self._disk_stream.wait_event(event)
        return torch.cuda.stream(self._disk_stream)

    def _load_file(self, key_hex: str, first: int, blocks: list[int]) -> int:
        """Read a chunk file into a staging copy, check it, then copy the wanted blocks into
        the engine: a file that does not check out never touches the engine's KV."""
        assert self.disk is not None
        staging = self._staging("read", self.disk.payload // self.host.bytes_per_block)
        nbytes = self.disk.read_into(key_hex, _halves(staging))
        with self._on_disk_stream():
            self.copy_op(
                staging, self._engine_kv, list(range(first, first + len(blocks))), blocks, "h2d"
            )
        if self._disk_stream is not None:
            self._disk_stream.synchronize()
        return nbytes

    def _store(self, p: _Pending) -> int:
        return self._copy(p.job, p.compute_event, to_host=True)

    def _disk_write(self, p: _Pending) -> int:
        job = p.job
        assert self.disk is not None and job.disk_key is not None
        if job.after is not None:
            with self._lock:
                before = self._pending.get(job.after)
            if before is not None:
                before.done.wait()
            with self._lock:
                failed = job.after in self._failed
            if failed:
                raise RuntimeError(f"store job {job.after} that fills this chunk failed")
        return self.disk.write(job.disk_key, self.host.chunk_views(job.host_blocks))

    def _disk_store(self, p: _Pending) -> int:
        """Gather a chunk's engine blocks into a temporary host copy and write the file."""
        job = p.job
        assert self.disk is not None and job.disk_key is not None
        staging = self._staging("write", len(job.engine_blocks))
        with self._on_disk_stream(p.compute_event):
            n = len(job.engine_blocks)
            self.copy_op(self._engine_kv, staging, job.engine_blocks, list(range(n)), "d2h")
        if self._disk_stream is not None:
            self._disk_stream.synchronize()
        return self.disk.write(job.disk_key, _halves(staging))

    def _verify(self, p: _Pending) -> int:
        assert self.disk is not None and p.job.disk_key is not None
        return self.disk.check(p.job.disk_key)

    def _promote(self, p: _Pending) -> int:
        assert self.disk is not None and p.job.disk_key is not None
        return self.disk.read_into(p.job.disk_key, self.host.chunk_views(p.job.host_blocks))

    def _disk_delete(self, p: _Pending) -> int:
        assert self.disk is not None and p.job.disk_key is not None
        self.disk.delete(p.job.disk_key)
        return 0


def _halves(layers: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Per layer its keys then its values, each contiguous in memory order: the order a
    chunk file stores them."""
    return [physical(t)[k] for t in layers.values() for k in range(t.shape[0])]
