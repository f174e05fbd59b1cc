"""SimpleCPUOffloadConnector's scheduler half: a preset of the OffloadingConnector's.

Chunks of one block, a host tier only, LRU, every computed block stored (not only the
prompt's), and lookups that never wait (``max_lookup_wait_s=0``): only blocks already
complete on the host count (a block still being stored ends the hit), and the hit is pinned
until the allocation. What the preset adds:

* all of a step's loads form one load event and all its stores one store event;
* lazy mode: instead of every block a step completes, store the cached blocks the engine
  would evict next (:meth:`KVCacheManagerView.eviction_candidates`), ``lazy_window_blocks`` of
  them.
"""

from __future__ import annotations

from kvferry.kv_cache_config import KVCacheConfig
from kvferry.kv_transfer.connectors.offloading.groups import group_key
from kvferry.kv_transfer.connectors.offloading.layout import OffloadLayout
from kvferry.kv_transfer.connectors.offloading.options import OffloadingOptions
from kvferry.kv_transfer.connectors.offloading.plans import ChunkTransfer, RequestTransfer
from kvferry.kv_transfer.connectors.offloading.scheduler import (
    OffloadingConnectorScheduler,
    ScheduledRequest,
)
from kvferry.kv_transfer.connectors.simple_cpu_offload.metadata import SimpleCPUOffloadMetadata
from kvferry.kv_transfer.connectors.simple_cpu_offload.options import SimpleCPUOffloadOptions
from kvferry.kv_transfer.kv_cache_view import KVCacheManagerView
from kvferry.kv_transfer.offload.policies import Key
from kvferry.step_types.scheduler_output import SchedulerOutput


class SimpleCPUOffloadConnectorScheduler(OffloadingConnectorScheduler):
    one_job_per_step = True

    def __init__(
        self,
        opts: SimpleCPUOffloadOptions,
        layout: OffloadLayout,
        kv_cache_config: KVCacheConfig,
        world_size: int,
        name: str,
    ) -> None:
        preset = OffloadingOptions(
            num_cpu_chunks=layout.num_host_chunks,
            offload_prompt_only=False,
            max_lookup_wait_s=0.0,
        )
        super().__init__(preset, layout, kv_cache_config, world_size, name)
        self.lazy = opts.lazy_offload
        self.lazy_window = opts.lazy_window_blocks or max(1, kv_cache_config.num_blocks // 8)
        self._kv_cache_manager: KVCacheManagerView | None = None

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManagerView) -> None:
        self._kv_cache_manager = kv_cache_manager

    def _new_meta(self, scheduler_output: SchedulerOutput) -> SimpleCPUOffloadMetadata:
        return SimpleCPUOffloadMetadata(idle=scheduler_output.is_empty)

    def _plan_stores(
        self, scheduled: list[ScheduledRequest], scheduler_output: SchedulerOutput
    ) -> list[RequestTransfer]:
        if not self.lazy:
            return super()._plan_stores(scheduled, scheduler_output)
        if self._kv_cache_manager is None:
            raise RuntimeError(
                "SimpleCPUOffloadConnector: lazy_offload needs the engine's KV cache manager "
                "(bind_kv_cache_manager was never called; is the connector wrapped?)"
            )
        keys: list[Key] = []
        engine_block_of: dict[Key, int] = {}
        for block in self._kv_cache_manager.eviction_candidates(self.lazy_window):
            # A block of another KV cache group holds that group's copy of the chunk.
            key = None if block.block_hash is None else group_key(block.block_hash, block.group_id)
            if key is not None and key not in engine_block_of and not self.mgr.on_host(key):
                keys.append(key)
                engine_block_of[key] = block.block_id
        if not keys:
            return []
        plan = self.mgr.prepare_store(keys)
        if not plan.keys:
            return []
        store = RequestTransfer("")
        for key, slot in zip(plan.keys, plan.slots, strict=True):
            store.chunks.append(
                ChunkTransfer(key, [engine_block_of[key]], slot, self._host_blocks(slot))
            )
        return [store]
