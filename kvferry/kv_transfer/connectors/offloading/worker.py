"""The offload connectors' worker half: runs the jobs the scheduler half planned."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvferry.kv_transfer.base import CopyBlocksOp, KVConnectorMetadata, KVConnectorStats
from kvferry.kv_transfer.connectors.offloading.job_runner import OffloadJobRunner
from kvferry.kv_transfer.connectors.offloading.layout import OffloadLayout
from kvferry.kv_transfer.connectors.offloading.metadata import OffloadingConnectorMetadata
from kvferry.kv_transfer.connectors.offloading.worker_metadata import OffloadWorkerMetadata
from kvferry.kv_transfer.connectors.split import WorkerHalf

if TYPE_CHECKING:
    from kvferry.model.forward_context import ForwardContext


def _meta(metadata: KVConnectorMetadata | None) -> OffloadingConnectorMetadata | None:
    assert metadata is None or isinstance(metadata, OffloadingConnectorMetadata)
    return metadata


class OffloadingConnectorWorker(WorkerHalf):
    """Loads start as soon as the step's plan is bound; stores and disk jobs are submitted
    after the forward (they read what it wrote); whole blocks only, so the per-layer hooks
    do nothing."""

    def __init__(
        self, layout: OffloadLayout, fsync: bool, name: str, store_mode: str = "auto"
    ) -> None:
        self.core = OffloadJobRunner(
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

    def set_host_xfer_buffer_ops(self, copy_op: CopyBlocksOp) -> None:
        self.core.set_copy_op(copy_op)

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        meta = _meta(metadata)
        if meta is not None and meta.flush:
            self.core.flush(meta.flush)

    def start_load_kv(self, metadata: KVConnectorMetadata, forward_context: ForwardContext) -> None:
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

    def get_finished(
        self, finished_req_ids: set[str], metadata: KVConnectorMetadata | None
    ) -> tuple[set[str] | None, set[str] | None]:
        meta = _meta(metadata)
        self.core.collect(idle=meta is not None and meta.idle)
        return None, self.core.take_recving() or None

    def get_failed_recving(self) -> set[str]:
        return self.core.take_failed_recving()

    def build_connector_worker_meta(self) -> OffloadWorkerMetadata | None:
        return self.core.take_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.core.take_stats()

    def shutdown(self) -> None:
        self.core.shutdown()
