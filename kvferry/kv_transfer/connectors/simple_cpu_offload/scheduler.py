"""SimpleCPUOffloadConnector's scheduler half: a host block pool keyed by block hashes.

It is the OffloadingConnector's scheduler with chunks of one block, a host tier only, LRU,
and these differences:

* lookups never wait: only blocks already complete on the host count (a block still being
  stored ends the hit), and the hit is pinned until the allocation;
* all of a step's loads form one load event and all its stores one store event;
* eager mode stores every block a step completes (prompt and output); lazy mode stores
  instead the cached blocks at the head of the engine's free queue, the next ones the engine
  would evict, ``lazy_window_blocks`` of them.
"""

from __future__ import annotations

from kvferry.core.kv_cache_config import KVCacheConfig
from kvferry.core.kv_cache_manager import KVCacheManager
from kvferry.core.sched_output import SchedulerOutput
from kvferry.kv_transfer.connectors.offloading.layout import OffloadLayout
from kvferry.kv_transfer.connectors.offloading.scheduler import OffloadingScheduler
from kvferry.kv_transfer.connectors.offloading.state import Part, ReqState
from kvferry.kv_transfer.connectors.simple_cpu_offload.metadata import SimpleCPUOffloadMetadata
from kvferry.kv_transfer.offload.manager import LookupStatus
from kvferry.kv_transfer.offload.options import OffloadingOptions, SimpleCPUOffloadOptions
from kvferry.request import Request


class SimpleCPUOffloadScheduler(OffloadingScheduler):
    one_job_per_step = True

    def __init__(
        self,
        opts: SimpleCPUOffloadOptions,
        layout: OffloadLayout,
        kv_cache_config: KVCacheConfig,
        world_size: int,
        name: str,
    ) -> None:
        inner = OffloadingOptions(
            num_cpu_chunks=layout.num_host_chunks,
            offload_prompt_only=False,
            max_lookup_wait_s=0.0,
        )
        super().__init__(inner, layout, kv_cache_config, world_size, name)
        self.lazy = opts.lazy_offload
        self.lazy_window = opts.lazy_window_blocks or max(1, kv_cache_config.num_blocks // 8)
        self._kv_manager: KVCacheManager | None = None

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        self._kv_manager = manager

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid in self._failed_loads:  # see OffloadingScheduler: recompute, do not loop
            self._lookups[rid] = (num_computed_tokens, [])
            return 0, False
        old = self.mgr.take_holds(rid)  # a repeated lookup replaces the earlier pin
        first = num_computed_tokens // self.bs
        last = min((request.num_tokens - 1) // self.bs, len(request.block_hashes))
        keys = []
        for b in range(first, last):
            key = request.block_hashes[b]
            if self.mgr.lookup(key) is not LookupStatus.HIT:
                break
            keys.append(key)
        for key in keys:
            self.mgr.pin(rid, key)
        self.mgr.drop_holds(old)
        self._lookups[rid] = (num_computed_tokens, keys)
        if not keys:
            return 0, False
        return len(keys) * self.bs, True

    def _new_meta(self, so: SchedulerOutput) -> SimpleCPUOffloadMetadata:
        return SimpleCPUOffloadMetadata(idle=so.is_empty)

    def _plan_stores(self, progress: list[tuple[ReqState, int]], so: SchedulerOutput) -> list[Part]:
        if not self.lazy:
            return super()._plan_stores(progress, so)
        if self._kv_manager is None:
            raise RuntimeError(
                "SimpleCPUOffloadConnector: lazy_offload needs the engine's KV cache manager "
                "(bind_kv_cache_manager was never called; is the connector wrapped?)"
            )
        # Walk the free queue from the head (next to be evicted) over the window.
        keys: list[bytes] = []
        engine_of: dict[bytes, int] = {}
        block = self._kv_manager.block_pool.free_queue.head
        for _ in range(self.lazy_window):
            if block is None:
                break
            h = block.block_hash
            if h is not None and h not in engine_of and h not in self.mgr.host:
                keys.append(h)
                engine_of[h] = block.block_id
            block = block.next_free
        if not keys:
            return []
        plan = self.mgr.prepare_store(keys)
        if not plan.keys:
            return []
        return [Part("", [engine_of[k] for k in plan.keys], list(plan.slots), plan.keys)]
