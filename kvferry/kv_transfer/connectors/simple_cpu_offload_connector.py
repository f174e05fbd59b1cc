"""SimpleCPUOffloadConnector: a second prefix cache in host memory, keyed by block hashes.

The engine's KV pool is the first tier; this connector keeps blocks in a larger, cheaper host
pool (on a CPU engine: more host memory; on CUDA: pinned memory filled by DMA on side streams)
with LRU eviction, and loads them back when a request's prefix was evicted from the pool.

* Lookups skip the local prefix hit, stop at ``num_tokens - 1``, pin the blocks they offer
  (a repeated lookup replaces its pin) and are always asynchronous.
* Eager mode (default) copies every block out once a forward completed it; lazy mode copies
  the cached blocks the engine is about to evict. At most one load event and one store event
  per step; loads run on background threads (CUDA: side streams) while the model computes,
  stores too unless ``host_store_mode`` puts them right after the forward (see the options).
* A store is published in the host pool only once every worker reported it done (worker
  metadata). Stores still reading blocks that a step reuses are flushed in
  ``handle_preemptions`` before that step's forward.

Options (``kv_connector_extra_config``): see :class:`SimpleCPUOffloadOptions`. Prefix
caching must be on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry.kv_transfer.base import KVConnectorRole
from kvferry.kv_transfer.connectors.offloading.facade import OffloadConnectorBase
from kvferry.kv_transfer.connectors.offloading.layout import OffloadLayout
from kvferry.kv_transfer.connectors.offloading.worker import OffloadingConnectorWorker
from kvferry.kv_transfer.connectors.simple_cpu_offload.options import SimpleCPUOffloadOptions
from kvferry.kv_transfer.connectors.simple_cpu_offload.scheduler import (
    SimpleCPUOffloadConnectorScheduler,
)
from kvferry.kv_transfer.options import parse_options

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig


class SimpleCPUOffloadConnector(OffloadConnectorBase):
    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        name = type(self).__name__
        self.options = parse_options(
            SimpleCPUOffloadOptions, self._kv_transfer_config.kv_connector_extra_config, name
        )
        per_block = kv_cache_config.bytes_per_block
        self.layout = OffloadLayout(
            block_size=kv_cache_config.block_size,
            blocks_per_chunk=1,
            bytes_per_block=per_block,
            num_host_chunks=self.options.num_blocks(per_block, self.facts.world_size, name),
            num_disk_chunks=0,
            disk_folder=None,
            fingerprint="",
        )
        if role == KVConnectorRole.SCHEDULER:
            self.set_scheduler_half(
                SimpleCPUOffloadConnectorScheduler(
                    self.options, self.layout, kv_cache_config, self.facts.world_size, name
                )
            )
        else:
            store_mode = self.options.host_store_mode
            self.set_worker_half(OffloadingConnectorWorker(self.layout, False, name, store_mode))
