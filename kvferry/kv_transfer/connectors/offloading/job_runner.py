"""OffloadJobRunner: what both offload connectors' worker halves run their jobs on.

It owns the host buffer, the optional disk store and the :class:`TransferEngine`, submits
the jobs a connector's metadata names, and turns finished jobs into what the protocol
reports: loads into ``finished_recving`` (and ``failed_recving`` when they failed), every job
into :class:`OffloadWorkerMetadata` counts, and transfer statistics. Copies between the
engine's KV and host memory use the engine's block copy once :meth:`set_copy_op` gave it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kvferry.config import ConfigError
from kvferry.kv_transfer.base import CopyBlocksOp, KVConnectorStats
from kvferry.kv_transfer.connectors.offloading.worker_metadata import OffloadWorkerMetadata
from kvferry.kv_transfer.offload.disk import DEFAULT_READ_TIMEOUT_S, DiskStore
from kvferry.kv_transfer.offload.host_buffer import HostKVBuffer
from kvferry.kv_transfer.offload.jobs import JobKind, TransferJob
from kvferry.kv_transfer.offload.stats import TransferStats
from kvferry.kv_transfer.offload.transfer import JobResult, TransferEngine
from kvferry.logger import fmt_fields, init_logger

logger = init_logger(__name__)

# How long a step with no tokens waits for a transfer to finish before it returns: long
# enough that an idle engine waiting for a load does not spin, short enough to be unnoticed.
IDLE_WAIT_S = 0.005


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_memory_available() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


class OffloadJobRunner:
    def __init__(
        self,
        owner: str,
        num_host_blocks: int,
        disk_folder: Path | None = None,
        fingerprint: str = "",
        chunk_payload: int = 0,
        fsync: bool = False,
        store_mode: str = "auto",
        disk_key: bytes | None = None,
        disk_read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    ) -> None:
        self.owner = owner
        self.num_host_blocks = num_host_blocks
        self.disk_folder = disk_folder
        self.fingerprint = fingerprint
        self.chunk_payload = chunk_payload
        self.fsync = fsync
        self.store_mode = store_mode
        self.disk_key = disk_key
        self.disk_read_timeout_s = disk_read_timeout_s
        self.engine: TransferEngine | None = None
        self.copy_op: CopyBlocksOp | None = None
        self.stats: TransferStats | None = None
        self._recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._meta = OffloadWorkerMetadata()
        self._cuda = False

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Layers of different KV cache groups may share one tensor (hybrid models): a
        # block's bytes are those of each distinct tensor, copied once.
        distinct: dict[int, str] = {}
        for name, cache in kv_caches.items():
            distinct.setdefault(id(cache), name)
        kv_caches = {name: kv_caches[name] for name in distinct.values()}
        first = next(iter(kv_caches.values()))
        self._cuda = first.device.type == "cuda"
        per_block = sum(c[:, 0].numel() * c.element_size() for c in kv_caches.values())
        need = per_block * self.num_host_blocks
        avail = host_memory_available()
        if need > avail:
            raise ConfigError(
                f"{self.owner}: the host tier needs {need / 2**30:.2f} GiB "
                f"({self.num_host_blocks} blocks) but only {avail / 2**30:.2f} GiB of host "
                f"memory is available; lower cpu_bytes_to_use"
            )
        host = HostKVBuffer(kv_caches, self.num_host_blocks, pin_memory=self._cuda)
        disk = None
        if self.disk_folder is not None:
            disk = DiskStore(
                self.disk_folder,
                self.fingerprint,
                self.chunk_payload,
                self.fsync,
                key=self.disk_key,
                read_timeout_s=self.disk_read_timeout_s,
            )
        inline = not self._cuda and (
            self.store_mode == "inline"
            or (self.store_mode == "auto" and torch.get_num_threads() >= usable_cpus())
        )
        self.engine = TransferEngine(kv_caches, host, disk, inline_stores=inline)
        if self.copy_op is not None:
            self.engine.copy_op = self.copy_op
        self.stats = TransferStats(per_block)
        logger.info(
            fmt_fields(
                f"{self.owner} worker ready",
                host_blocks=self.num_host_blocks,
                host_gib=round(need / 2**30, 3),
                disk=str(self.disk_folder) if self.disk_folder else None,
                disk_check=None
                if self.disk_folder is None
                else "keyed-blake2b"
                if self.disk_key is not None
                else "crc32 (no deployment secret: tampering is not detected)",
                device=str(first.device),
                stores="inline" if inline else "background",
            )
        )

    def set_copy_op(self, copy_op: CopyBlocksOp) -> None:
        """Copy blocks between the engine's KV and host memory with the engine's op."""
        self.copy_op = copy_op
        if self.engine is not None:
            self.engine.copy_op = copy_op

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError(f"{self.owner}: register_kv_caches was not called")
        return self.engine

    def submit(self, jobs: Iterable[TransferJob], after_compute: bool = False) -> None:
        """Start jobs. ``after_compute``: they read KV the current forward wrote, so on CUDA
        they wait for an event recorded now on the compute stream."""
        engine = self._engine()
        event: Any = None
        for job in jobs:
            if after_compute and self._cuda and event is None:
                event = torch.cuda.Event()
                event.record()
            engine.submit(job, event)

    def flush(self, job_ids: Iterable[int]) -> None:
        self._engine().wait(job_ids)

    def collect(self, idle: bool = False) -> None:
        """Fold finished jobs in; on an idle step wait briefly for one to finish."""
        engine = self._engine()
        for result in engine.poll(IDLE_WAIT_S if idle else 0.0):
            self._account(result)

    def _account(self, result: JobResult) -> None:
        assert self.stats is not None
        self.stats.add(result)
        job = result.job
        if job.kind == JobKind.DISK_DELETE:
            return
        counts = self._meta.completed if result.ok else self._meta.failed
        counts[job.job_id] = counts.get(job.job_id, 0) + 1
        if job.kind == JobKind.LOAD:
            self._recving.update(job.req_ids)
            if not result.ok:
                self._failed_recving.update(job.req_ids)

    def take_recving(self) -> set[str]:
        out, self._recving = self._recving, set()
        return out

    def take_failed_recving(self) -> set[str]:
        out, self._failed_recving = self._failed_recving, set()
        return out

    def take_worker_meta(self) -> OffloadWorkerMetadata | None:
        if self._meta.is_empty():
            return None
        meta, self._meta = self._meta, OffloadWorkerMetadata()
        return meta

    def take_stats(self) -> KVConnectorStats | None:
        return self.stats.take() if self.stats is not None else None

    def num_in_flight(self) -> int:
        return self.engine.num_in_flight() if self.engine is not None else 0

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
