"""A vLLM-style connector that moves nothing and records the KV cache layout as a connector
sees it: ``get_kv_cache_layout()`` imported from vLLM's module path, asked in ``__init__``
(both roles) and in ``register_kv_caches`` next to the strides of the tensors it is handed,
into ``SEEN`` for the tests. ``kv_connector_extra_config={"layout": NAME}`` makes
``get_required_kvcache_layout`` ask for NAME (default: nothing)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.attention.backends.utils import get_kv_cache_layout, is_valid_kv_cache_layout

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

SEEN: list[dict[str, Any]] = []


class VllmLayoutConnector(KVConnectorBase_V1):
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return vllm_config.kv_transfer_config.kv_connector_extra_config.get("layout")

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        layout = get_kv_cache_layout()
        assert is_valid_kv_cache_layout(layout)
        SEEN.append({"hook": "init", "role": role, "layout": layout})

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        t = next(iter(kv_caches.values()))
        SEEN.append(
            {
                "hook": "register",
                "layout": get_kv_cache_layout(),
                "shape": tuple(t.shape),
                "stride": t.stride(),
            }
        )

    # -- nothing to transfer -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return

    def wait_for_save(self) -> None:
        return
