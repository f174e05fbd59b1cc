"""A vLLM-style connector in the manner of vLLM's ExampleConnector and LMCache's adapter: it
reads ``get_forward_context().attn_metadata[layer_name]`` in ``save_kv_layer`` and
``start_load_kv``, saves each prompt's full blocks token by token, layer by layer, into a
store shared by every engine in the process, and loads them synchronously into the next
engine's blocks. Hybrid models too (``SupportsHMA``): each layer uses its own KV cache group's
block ids, and a sliding-window layer's null blocks (keys out of its window) are skipped.

``CHECKS`` records, per hook and layer, whether the per-layer metadata is the layer's own
group's (the step's new slots are in its ``slot_mapping``; the request's block ids are a row
of its ``block_table``), for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.forward_context import ForwardContext, get_forward_context
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.kv_cache_interface import SlidingWindowSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# (prompt tokens, layer name) -> (2, num_tokens, kv_heads, head_size) on the CPU (zeros where
# a sliding-window layer's block was null)
STORE: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}
CHECKS: list[dict[str, Any]] = []
# A hybrid pool sets block 0 aside as the null block of sliding-window tables.
_NULL_BLOCK = 0


@dataclass
class ReqMeta:
    token_ids: tuple[int, ...]
    # One list per KV cache group, covering the stored tokens.
    block_ids: tuple[list[int], ...]
    is_store: bool
    # Positions this step computes (a store's new tokens).
    start: int = 0
    end: int = 0


@dataclass
class LayerwiseConnectorMetadata(KVConnectorMetadata):
    requests: list[ReqMeta] = field(default_factory=list)


class VllmLayerwiseConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ):
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._group_of: dict[str, int] = {}
        self._sliding: list[bool] = []
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            self._sliding.append(isinstance(group.kv_cache_spec, SlidingWindowSpec))
            self._group_of.update(dict.fromkeys(group.layer_names, g))
        self._need_load: set[str] = set()

    # ---------------------------------------------------------------- worker side
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, LayerwiseConnectorMetadata)
        attn_metadata = forward_context.attn_metadata
        if attn_metadata is None:
            return
        for request in metadata.requests:
            if request.is_store:
                continue
            for layer_name, layer in forward_context.no_compile_layers.items():
                kv_cache = getattr(layer, "kv_cache", None)
                if kv_cache is None:
                    continue
                meta = attn_metadata[layer_name] if isinstance(attn_metadata, dict) else None
                ids = request.block_ids[self._group_of[layer_name]]
                CHECKS.append(
                    dict(
                        hook="load",
                        layer=layer_name,
                        is_metadata=isinstance(meta, AttentionMetadata),
                        in_block_table=meta is not None
                        and any(row[: len(ids)].tolist() == ids for row in meta.block_table),
                    )
                )
                blocks, offsets, keep = self._slots(layer_name, request)
                stored = STORE[(request.token_ids, layer_name)][:, keep]
                kv_cache[:, blocks, offsets] = stored.to(kv_cache.device, kv_cache.dtype)

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
        assert isinstance(metadata, LayerwiseConnectorMetadata)
        per_layer = get_forward_context().attn_metadata
        meta = per_layer[layer_name] if isinstance(per_layer, dict) else None
        for request in metadata.requests:
            if not request.is_store:
                continue
            ids = request.block_ids[self._group_of[layer_name]]
            new_slots = [
                ids[p // self._block_size] * self._block_size + p % self._block_size
                for p in range(request.start, request.end)
            ]
            CHECKS.append(
                dict(
                    hook="save",
                    layer=layer_name,
                    same_object=meta is attn_metadata,
                    in_slot_mapping=meta is not None
                    and set(new_slots) <= set(meta.slot_mapping.tolist()),
                )
            )
            blocks, offsets, keep = self._slots(layer_name, request)
            stored = kv_layer.new_zeros((2, len(request.token_ids), *kv_layer.shape[3:]))
            stored[:, keep] = kv_layer[:, blocks, offsets]
            STORE[(request.token_ids, layer_name)] = stored.cpu()

    def wait_for_save(self) -> None:
        return

    def _slots(
        self, layer_name: str, request: ReqMeta
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block and offset of each stored token in the layer's group, and which tokens to
        touch (a sliding-window layer's null blocks hold keys nobody reads)."""
        group = self._group_of[layer_name]
        ids = torch.tensor(request.block_ids[group])
        pos = torch.arange(len(request.token_ids))
        blocks = ids[pos // self._block_size]
        keep = blocks != _NULL_BLOCK if self._sliding[group] else torch.ones_like(pos, dtype=bool)
        return blocks[keep], (pos % self._block_size)[keep], keep

    # ------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = self._aligned(request.prompt_token_ids or [])
        if not tokens or not self._stored(tokens):
            return 0, False
        return max(0, len(tokens) - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            self._need_load.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = LayerwiseConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            tokens = self._aligned(new_req.prompt_token_ids or [])
            n_blocks = len(tokens) // self._block_size
            block_ids = tuple(ids[:n_blocks] for ids in new_req.block_ids)
            if new_req.req_id in self._need_load:
                meta.requests.append(ReqMeta(tokens, block_ids, is_store=False))
                continue
            start = new_req.num_computed_tokens
            end = start + scheduler_output.num_scheduled_tokens[new_req.req_id]
            if tokens and end >= len(tokens) and not self._stored(tokens):
                meta.requests.append(ReqMeta(tokens, block_ids, True, start, min(end, len(tokens))))
        self._need_load.clear()
        return meta

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    # --------------------------------------------------------------------- helpers
    def _aligned(self, token_ids: list[int]) -> tuple[int, ...]:
        # Never the last prompt token: its logits are sampled from.
        n = (len(token_ids) - 1) // self._block_size * self._block_size
        return tuple(token_ids[: max(n, 0)])

    def _stored(self, tokens: tuple[int, ...]) -> bool:
        return all((tokens, name) in STORE for name in self._group_of)
