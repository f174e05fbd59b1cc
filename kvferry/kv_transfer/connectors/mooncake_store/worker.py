"""The MooncakeStoreConnector's worker half: starts the step's loads and stores on the
transfer threads and reports what finished."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_transfer.base import KVConnectorMetadata, KVConnectorStats
from kvferry.kv_transfer.connectors.mooncake_store.layout import StoreLayout
from kvferry.kv_transfer.connectors.mooncake_store.metadata import (
    MooncakeStoreMetadata,
    MooncakeStoreWorkerMeta,
)
from kvferry.kv_transfer.connectors.mooncake_store.options import MooncakeStoreOptions
from kvferry.kv_transfer.connectors.mooncake_store.transfer import StoreTransfers
from kvferry.kv_transfer.connectors.split import WorkerHalf
from kvferry.kv_transfer.stores.link import StoreLink
from kvferry.kv_transfer.stores.mooncake_client import MooncakeStoreClient
from kvferry.kv_transfer.stores.mooncake_config import MooncakeStoreConfig
from kvferry.logger import fmt_fields, init_logger

if TYPE_CHECKING:
    from kvferry.model.forward_context import ForwardContext

logger = init_logger(__name__)


def _meta(metadata: KVConnectorMetadata | None) -> MooncakeStoreMetadata | None:
    assert metadata is None or isinstance(metadata, MooncakeStoreMetadata)
    return metadata


class MooncakeStoreWorker(WorkerHalf):
    """Loads start when the plan is bound; stores are handed over after the forward (they
    read what it wrote). Whole blocks only, so the per-layer hooks do nothing."""

    def __init__(
        self,
        opts: MooncakeStoreOptions,
        mc_config: MooncakeStoreConfig,
        layout: StoreLayout,
        kv_cache_config: KVCacheConfig,
        rank: int = 0,
    ) -> None:
        self.opts = opts
        self.layout = layout
        self.kv_cache_config = kv_cache_config
        self.rank = rank
        self.client = MooncakeStoreClient(mc_config, opts.replicate)
        self.link = StoreLink(
            self.client, "MooncakeStoreConnector worker", opts.reconnect_interval_s
        )
        self.transfers: StoreTransfers | None = None
        self._cuda = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = [n for g in self.kv_cache_config.groups for n in g.layer_names]
        ordered = [kv_caches[n] for n in names if n in kv_caches] or list(kv_caches.values())
        self._cuda = ordered[0].device.type == "cuda"
        self.transfers = StoreTransfers(
            ordered,
            self.layout,
            self.link,
            self.opts.staging_buffer_bytes,
            self.opts.load_timeout_s,
            self.rank,
        )
        up = self.link.start()
        logger.info(
            fmt_fields(
                "MooncakeStoreConnector worker ready",
                master=self.client.config.master_server_address,
                connected=up,
                namespace=self.layout.namespace,
                chunk_tokens=self.layout.chunk_tokens,
                value_bytes=self.transfers.codec.value_bytes,
                staging_slots=2 * self.transfers.slots_per_region,
                check=self.transfers.codec.check_name,
            )
        )

    def _t(self) -> StoreTransfers:
        if self.transfers is None:
            raise RuntimeError("MooncakeStoreConnector: register_kv_caches was not called")
        return self.transfers

    def handle_preemptions(self, metadata: KVConnectorMetadata) -> None:
        meta = _meta(metadata)
        if meta is not None:
            for req_id in meta.preempted:
                self._t().wait_copied(req_id)

    def start_load_kv(self, metadata: KVConnectorMetadata, forward_context: ForwardContext) -> None:
        meta = _meta(metadata)
        assert meta is not None
        for job in meta.loads:
            self._t().submit_load(job)

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        meta = _meta(metadata)
        assert meta is not None
        event: Any = None
        if meta.stores and self._cuda:
            event = torch.cuda.Event()
            event.record()
        for job in meta.stores:
            self._t().submit_store(job, event)

    def get_finished(
        self, finished_req_ids: set[str], metadata: KVConnectorMetadata | None
    ) -> tuple[set[str] | None, set[str] | None]:
        t = self._t()
        recving = t.take_recving()
        sending = t.finished_sending(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._t().take_load_errors() if self.transfers is not None else set()

    def build_connector_worker_meta(self) -> MooncakeStoreWorkerMeta | None:
        return self.transfers.take_meta() if self.transfers is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.transfers.take_stats() if self.transfers is not None else None
        return KVConnectorStats(data=data) if data else None

    def shutdown(self) -> None:
        self.link.stop()
        if self.transfers is not None:
            self.transfers.shutdown()
        self.client.close()
