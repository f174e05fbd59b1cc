"""A vLLM-style connector that loads asynchronously from a store shared by every engine in
the process (think: a cache server), with the ``*args, **kwargs`` pass-through constructor.

``get_num_new_matched_tokens`` answers ``(n, True)``; ``start_load_kv`` copies on a
background thread, and ``get_finished`` reports the receive on a later step than the one that
started it. ``EVENTS`` records (engine id, hook, request id) for the tests.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger
from vllm.utils import cdiv
from vllm.utils.hashing import safe_hash

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

# prefix key -> layer name -> (2, num_blocks, block_size, kv_heads, head_size) on the CPU
STORE: dict[str, dict[str, torch.Tensor]] = {}
EVENTS: list[tuple[str, str, str]] = []
_LOCK = threading.Lock()


@dataclass
class Transfer:
    req_id: str
    key: str
    block_ids: list[int]


@dataclass
class AsyncConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)


class VllmAsyncConnector(KVConnectorBase_V1):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._block_size = self._vllm_config.cache_config.block_size
        self._engine_id = str(self._kv_transfer_config.engine_id)
        self._rank = get_tensor_model_parallel_rank()
        self._pending_loads: dict[str, Transfer] = {}
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._inflight: dict[str, Future[None]] = {}
        self._started_this_step: set[str] = set()

    def _log(self, hook: str, req_id: str) -> None:
        with _LOCK:
            EVENTS.append((self._engine_id, hook, req_id))

    # ---------------------------------------------------------------- worker side
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, AsyncConnectorMetadata)
        caches = {name: layer.kv_cache for name, layer in forward_context.no_compile_layers.items()}
        for load in metadata.loads:
            self._log("start_load", load.req_id)
            self._inflight[load.req_id] = self._pool.submit(self._copy_in, load, caches)
            self._started_this_step.add(load.req_id)

    def _copy_in(self, load: Transfer, caches: dict[str, torch.Tensor]) -> None:
        stored = STORE[load.key]
        for name, kv_cache in caches.items():
            kv_cache[:, load.block_ids] = stored[name].to(kv_cache.device, kv_cache.dtype)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, AsyncConnectorMetadata)
        for store in metadata.stores:
            with _LOCK:
                STORE.setdefault(store.key, {})[layer_name] = (
                    kv_layer[:, store.block_ids].detach().cpu().clone()
                )

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._log("get_finished", "")
        done = {
            req_id
            for req_id, future in self._inflight.items()
            if req_id not in self._started_this_step and future.done()
        }
        self._started_this_step.clear()
        for req_id in done:
            self._inflight.pop(req_id).result()
            self._log("finished_recving", req_id)
        return None, done or None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        n = self._aligned(len(request.prompt_token_ids))
        key = self._key(request.prompt_token_ids[:n])
        if n <= num_computed_tokens or not self._complete(key):
            return 0, False
        return n - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        n = self._aligned(len(request.prompt_token_ids))
        block_ids = blocks.get_block_ids()[0][: cdiv(n, self._block_size)]
        key = self._key(request.prompt_token_ids[:n])
        self._pending_loads[request.request_id] = Transfer(request.request_id, key, block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = AsyncConnectorMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        for new_req in scheduler_output.scheduled_new_reqs:
            n = self._aligned(len(new_req.prompt_token_ids or []))
            done = (
                new_req.num_computed_tokens + scheduler_output.num_scheduled_tokens[new_req.req_id]
            )
            key = self._key((new_req.prompt_token_ids or [])[:n])
            if n and done >= n and not self._complete(key):
                block_ids = new_req.block_ids[0][: n // self._block_size]
                meta.stores.append(Transfer(new_req.req_id, key, block_ids))
        return meta

    # --------------------------------------------------------------------- helpers
    def _aligned(self, num_tokens: int) -> int:
        return max(0, (num_tokens - 1) // self._block_size * self._block_size)

    def _key(self, token_ids: list[int]) -> str:
        data = torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()
        return safe_hash(data, usedforsecurity=False).hexdigest()

    def _complete(self, key: str) -> bool:
        assert self._kv_cache_config is not None
        layers = self._kv_cache_config.kv_cache_groups[0].layer_names
        with _LOCK:
            return set(layers) <= set(STORE.get(key, {}))
