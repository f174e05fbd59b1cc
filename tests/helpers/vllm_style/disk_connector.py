"""A vLLM-style connector that persists each prompt's full blocks to a folder
(``kv_connector_extra_config={"storage_path": ...}``) and loads them synchronously in
``start_load_kv``: the stored KV outlives the engine.

Constructor in vLLM's keyword style, ``kv_cache_config`` optional.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.utils.hashing import safe_hash
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass
class ReqMeta:
    token_ids: list[int]
    block_ids: list[int]
    is_store: bool


@dataclass
class DiskConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)


class VllmDiskConnector(KVConnectorBase_V1):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._dtype = vllm_config.model_config.dtype
        self._num_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self._storage_path = self._kv_transfer_config.get_from_extra_config(
            "storage_path", "/tmp/vllm_disk_kv"
        )
        assert kv_cache_config is not None
        self._layer_names = list(kv_cache_config.kv_cache_groups[0].layer_names)
        self._requests_need_load: dict[str, Request] = {}

    # ---------------------------------------------------------------- worker side
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, DiskConnectorMetadata)
        if forward_context.attn_metadata is None:
            return
        for request in metadata.requests:
            if request.is_store:
                continue
            for layer_name, layer in forward_context.no_compile_layers.items():
                kv_cache = getattr(layer, "kv_cache", None)
                if kv_cache is None:
                    continue
                stored = torch.load(
                    self._filename(layer_name, request.token_ids), weights_only=True
                )
                # (2, num_blocks, block_size, kv_heads, head_size): FlashAttention's layout.
                kv_cache[:, request.block_ids] = stored.to(kv_cache.device, kv_cache.dtype)

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
        assert isinstance(metadata, DiskConnectorMetadata)
        for request in metadata.requests:
            if request.is_store:
                torch.save(
                    kv_layer[:, request.block_ids].detach().cpu().clone(),
                    self._filename(layer_name, request.token_ids, create=True),
                )

    def wait_for_save(self) -> None:
        return

    # ------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = self._aligned(request.prompt_token_ids or [])
        if not tokens or not self._stored(tokens):
            return 0, False
        logger.info("external cache hit for %s", request.request_id)
        return max(0, len(tokens) - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._requests_need_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = DiskConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            tokens = self._aligned(new_req.prompt_token_ids or [])
            block_ids = new_req.block_ids[0][: len(tokens) // self._block_size]
            if new_req.req_id in self._requests_need_load:
                meta.requests.append(ReqMeta(tokens, block_ids, is_store=False))
                continue
            done = (
                new_req.num_computed_tokens + scheduler_output.num_scheduled_tokens[new_req.req_id]
            )
            if tokens and done >= len(tokens) and not self._stored(tokens):
                meta.requests.append(ReqMeta(tokens, block_ids, is_store=True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in cached.resumed_req_ids and req_id in self._requests_need_load:
                request = self._requests_need_load[req_id]
                tokens = self._aligned(request.all_token_ids)
                new_block_ids = cached.new_block_ids[i]
                assert new_block_ids is not None
                ids = new_block_ids[0][: len(tokens) // self._block_size]
                meta.requests.append(ReqMeta(tokens, ids, is_store=False))
        self._requests_need_load.clear()
        return meta

    # --------------------------------------------------------------------- helpers
    def _aligned(self, token_ids: list[int]) -> list[int]:
        # Never the last prompt token: its logits are sampled from.
        n = (len(token_ids) - 1) // self._block_size * self._block_size
        return list(token_ids[: max(n, 0)])

    def _folder(self, token_ids: list[int], create: bool = False) -> str:
        digest = safe_hash(
            torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes(), usedforsecurity=False
        ).hexdigest()
        folder = os.path.join(self._storage_path, digest)
        if create:
            os.makedirs(folder, exist_ok=True)
        return folder

    def _filename(self, layer_name: str, token_ids: list[int], create: bool = False) -> str:
        return os.path.join(self._folder(token_ids, create), f"{layer_name}.pt")

    def _stored(self, token_ids: list[int]) -> bool:
        folder = self._folder(token_ids)
        return len(self._layer_names) == self._num_layers and all(
            os.path.exists(os.path.join(folder, f"{name}.pt")) for name in self._layer_names
        )
