"""A complete small KV connector: keeps full prompt blocks in host memory, keyed by block hash.

Load it without touching kvferry's code (as written, from the repository root; a path to
this file, e.g. ``"/path/to/examples/host_prefix_connector.py"``, works from anywhere):

    kvferry generate --model PATH --prompt "..." --kv-transfer-config '{
        "kv_connector": "HostPrefixConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "examples.host_prefix_connector",
        "kv_connector_extra_config": {"max_blocks": 4096}}'

The scheduler side decides; the worker side copies. They share nothing but the metadata:
the scheduler remembers which block hashes it asked the worker to store (saves finish inside
the step, in ``wait_for_save``, so a planned store is a done store by the next step) and plans
loads of those hashes into freshly allocated engine blocks.

The worker keeps a fixed host pool of ``max_blocks`` slots per layer, allocated and touched
once when the KV caches are registered (as LMCache and vLLM's CPU offloading preallocate
theirs): storing a block is one copy into a free slot, never an allocation in the step loop.
Its size is ``max_blocks`` times one block's bytes over all layers (logged at start).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from kvferry.kv_transfer.base import KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from kvferry.logger import init_logger

logger = init_logger(__name__)


@dataclass
class HostPrefixMetadata(KVConnectorMetadata):
    # (block hash, engine block id) pairs
    loads: list[tuple[bytes, int]] = field(default_factory=list)
    stores: list[tuple[bytes, int]] = field(default_factory=list)
    evictions: list[bytes] = field(default_factory=list)


class HostPrefixConnector(KVConnectorBase):
    def __init__(self, config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.max_blocks = int(extra.get("max_blocks", 1024))
        self.block_size = kv_cache_config.block_size
        # scheduler side: hashes the worker holds, oldest first
        self.stored: OrderedDict[bytes, None] = OrderedDict()
        self.plan = HostPrefixMetadata()
        self.requests: dict[str, Any] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.first_hit_block: dict[str, int] = {}
        self.scanned: dict[str, int] = {}  # prompt blocks already planned (or held) per request
        # worker side: layer -> pool (max_blocks, 2, block_size, ...); hash -> pool slot
        self.pool: dict[str, torch.Tensor] = {}
        self.slot: dict[bytes, int] = {}
        self.free_slots: list[int] = []
        self.step_stores: list[tuple[int, int]] = []  # (pool slot, engine block id)
        self.kv_caches: dict[str, torch.Tensor] = {}

    # -- scheduler side
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        first = num_computed_tokens // self.block_size
        limit = (request.num_tokens - 1) // self.block_size  # never the last token's block
        hits = 0
        for h in request.block_hashes[first:limit]:
            if h not in self.stored:
                break
            hits += 1
        self.first_hit_block[request.request_id] = first  # same answer if asked again
        return hits * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.requests[request.request_id] = request
        if num_external_tokens == 0:
            return
        ids = blocks.get_block_ids()[0]
        first = self.first_hit_block.pop(request.request_id)
        for idx in range(first, first + num_external_tokens // self.block_size):
            h = request.block_hashes[idx]
            self.stored.move_to_end(h)
            self.plan.loads.append((h, ids[idx]))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        for new in scheduler_output.scheduled_new_reqs:
            self.block_ids[new.req_id] = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if new_blocks is not None and req_id in self.block_ids:
                self.block_ids[req_id].extend(new_blocks[0])
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            # build_connector_meta runs before the scheduler counts this step's tokens
            done = min(request.num_computed_tokens + n, request.num_prompt_tokens)
            full = done // self.block_size
            # from where the last step stopped: decode steps would rescan the whole prompt
            for idx in range(self.scanned.get(req_id, 0), full):
                h = request.block_hashes[idx]
                if h not in self.stored:
                    self.stored[h] = None
                    self.plan.stores.append((h, self.block_ids[req_id][idx]))
            self.scanned[req_id] = max(full, self.scanned.get(req_id, 0))
        while len(self.stored) > self.max_blocks:
            self.plan.evictions.append(self.stored.popitem(last=False)[0])
        plan, self.plan = self.plan, HostPrefixMetadata()
        return plan

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.requests.pop(request.request_id, None)
        self.block_ids.pop(request.request_id, None)
        self.scanned.pop(request.request_id, None)
        return False, None

    # -- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        # zeros, not empty: the pages are mapped now, not by the first stores mid-run
        self.pool = {
            name: torch.zeros((self.max_blocks, 2, *cache.shape[2:]), dtype=cache.dtype)
            for name, cache in kv_caches.items()
        }
        self.free_slots = list(range(self.max_blocks - 1, -1, -1))
        nbytes = sum(t.numel() * t.element_size() for t in self.pool.values())
        logger.info("host pool: %d blocks, %.1f MiB", self.max_blocks, nbytes / 2**20)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HostPrefixMetadata)
        for h, block_id in meta.loads:  # before the evictions: a load may be evicted too
            slot = self.slot[h]
            for name, cache in self.kv_caches.items():
                cache[:, block_id].copy_(self.pool[name][slot])
        evicted = set(meta.evictions)
        for h in evicted:
            if (slot := self.slot.pop(h, None)) is not None:
                self.free_slots.append(slot)
        # the scheduler evicts down to max_blocks after planning the stores: slots suffice
        self.step_stores = []
        for h, block_id in meta.stores:
            if h not in evicted:
                self.slot[h] = slot = self.free_slots.pop()
                self.step_stores.append((slot, block_id))

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        pool = self.pool[layer_name]
        for slot, block_id in self.step_stores:
            pool[slot].copy_(kv_layer[:, block_id])

    def wait_for_save(self) -> None:
        pass
