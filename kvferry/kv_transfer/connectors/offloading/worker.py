"""The OffloadingConnector's worker half: runs the jobs the scheduler half planned."""

from __future__ import annotations

import torch

from kvferry.kv_transfer.base import KVConnectorMetadata, KVConnectorStats
from kvferry.kv_transfer.connectors.offloading.layout import OffloadLayout
from kvferry.kv_transfer.connectors.offloading.metadata import OffloadingConnectorMetadata
from kvferry.kv_transfer.offload.connector_base import WorkerHalf
from kvferry.kv_transfer.offload.jobs import OffloadWorkerMetadata
from kvferry.kv_transfer.offload.worker_core import OffloadWorker


def _meta(metadata: KVConnectorMetadata | None) -> OffloadingConnectorMetadata | None:
    assert metadata is None or isinstance(metadata, OffloadingConnectorMetadata)
    return metadata


class OffloadingWorker(WorkerHalf):
    def __init__(
        self, layout: OffloadLayout, fsync: bool, name: str, store_mode: str = "auto"
    ) -> None:
        self.core = OffloadWorker(
            name,
            layout.num_host_chunks * layout.blocks_per_chunk,
            layout.disk_folder,
            layout.fingerprint,
            layout.chunk_payload,
            fsync,
            store_mode,
            layout.disk_key,
            layout.disk_read_timeout_s,
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.core.register(kv_caches)

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        meta = _meta(metadata)
        if meta is not None and meta.flush:
            self.core.flush(meta.flush)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        meta = _meta(metadata)
        assert meta is not None
        self.core.submit(meta.loads)

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        meta = _meta(metadata)
        assert meta is not None
        # Stores (and direct disk stores) read what this step's forward wrote; disk jobs keep
        # their order on the disk thread.
        self.core.submit(meta.stores, after_compute=True)
        self.core.submit(meta.disk_jobs, after_compute=True)

    def get_finished(self, metadata: KVConnectorMetadata | None) -> set[str]:
        meta = _meta(metadata)
        self.core.collect(idle=meta is not None and meta.idle)
        return self.core.take_recving()

    def get_failed_recving(self) -> set[str]:
        return self.core.take_failed_recving()

    def build_worker_meta(self) -> OffloadWorkerMetadata | None:
        return self.core.take_worker_meta()

    def take_stats(self) -> KVConnectorStats | None:
        return self.core.take_stats()

    def shutdown(self) -> None:
        self.core.shutdown()
