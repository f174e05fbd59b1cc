"""OffloadingConnector: KV offloading to tiers behind the engine's KV pool.

On a CPU engine the tiers are a second, larger pool in host memory and, optionally, a folder
of chunk files on disk; on CUDA the host tier is pinned memory filled by DMA on side streams.
The protocol adapter is this facade plus ``connectors/offloading/`` (the shared facade base,
scheduler half, worker half, metadata, options); the mechanism (tiers, eviction policies,
transfers, files) is ``kvferry.kv_transfer.offload``. Copies between the engine's KV and host
memory use the block copy the engine hands over in ``set_host_xfer_buffer_ops``.

Behaviour, in protocol terms:

* ``get_num_new_matched_tokens``: the longest run of stored chunks after the local hit,
  capped so the last prompt token is recomputed, always loaded asynchronously. Chunks being
  written (a store in flight, or a disk chunk being checked and copied back to the host)
  make the lookup answer None ("ask again") for up to ``max_lookup_wait_s`` seconds.
* Stores: chunks a step's forward completes are copied out right after that forward.
* ``request_finished`` never delays frees; stores still reading reused blocks are fenced.
* Completion of every job comes back through worker metadata, counted across workers, before
  anything is published in the offload index.

Options (``kv_connector_extra_config``): see :class:`OffloadingOptions`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.offloading.facade import OffloadConnectorBase
from kvferry.kv_transfer.connectors.offloading.layout import resolve_layout
from kvferry.kv_transfer.connectors.offloading.options import OffloadingOptions
from kvferry.kv_transfer.connectors.offloading.scheduler import OffloadingConnectorScheduler
from kvferry.kv_transfer.connectors.offloading.worker import OffloadingConnectorWorker
from kvferry.kv_transfer.options import parse_options

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig


class OffloadingConnector(OffloadConnectorBase):
    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        name = type(self).__name__
        self.options = parse_options(
            OffloadingOptions, self._kv_transfer_config.kv_connector_extra_config, name
        )
        self.layout = resolve_layout(self.options, kv_cache_config, self.facts, name)
        if role == KVConnectorRole.SCHEDULER:
            self.set_scheduler_half(
                OffloadingConnectorScheduler(
                    self.options, self.layout, kv_cache_config, self.facts.world_size, name
                )
            )
        else:
            self.set_worker_half(
                OffloadingConnectorWorker(
                    self.layout, self.options.disk_fsync, name, self.options.host_store_mode
                )
            )
