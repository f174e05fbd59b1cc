"""DecodeBenchConnector: pretends every prompt was prefilled elsewhere, for decode benchmarks.

The first lookup of a request offers all prompt tokens but the last as a synchronous external
hit; the worker fills those blocks with dummy values (``fill_mean`` + ``fill_std`` noise), so
the engine goes straight to decoding. Outputs are meaningless; speeds are what it measures.

Extra config: ``fill_mean`` (0.015), ``fill_std`` (0.0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kvferry.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from kvferry.kv_transfer.options import parse_options

if TYPE_CHECKING:
    from kvferry.config import EngineConfig
    from kvferry.kv_cache_config import KVCacheConfig
    from kvferry.kv_transfer.kv_cache_view import KVCacheBlocksView
    from kvferry.model.forward_context import ForwardContext
    from kvferry.request import Request
    from kvferry.step_types.scheduler_output import SchedulerOutput


@dataclass
class DecodeBenchOptions:
    fill_mean: float = 0.015
    fill_std: float = 0.0

    def validate(self, owner: str) -> None:
        from kvferry.config import ConfigError

        if self.fill_std < 0:
            raise ConfigError(f"{owner}: fill_std must be >= 0")


@dataclass
class DecodeBenchMetadata(KVConnectorMetadata):
    # req_id -> engine block ids to fill
    reqs_to_fill: dict[str, list[int]] = field(default_factory=dict)


class DecodeBenchConnector(KVConnectorBase, SupportsHMA):
    def __init__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(config, role, kv_cache_config)
        self.opts = parse_options(
            DecodeBenchOptions,
            self._kv_transfer_config.kv_connector_extra_config,
            "DecodeBenchConnector",
        )
        self.block_size = kv_cache_config.block_size
        self._filled: set[str] = set()
        self._pending: dict[str, list[int]] = {}
        self._kv_caches: dict[str, torch.Tensor] = {}

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self._filled:
            return 0, False
        return max(0, request.num_tokens - 1 - num_computed_tokens), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocksView, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        self._filled.add(request.request_id)
        end = request.num_tokens - 1
        start = end - num_external_tokens
        ids = blocks.get_block_ids()[0]
        first, last = start // self.block_size, -(-end // self.block_size)
        self._pending[request.request_id] = ids[first:last]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = DecodeBenchMetadata(reqs_to_fill=self._pending)
        self._pending = {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._filled.discard(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DecodeBenchMetadata)
        ids = [b for blocks in meta.reqs_to_fill.values() for b in blocks]
        if not ids:
            return
        for cache in self._kv_caches.values():
            idx = torch.tensor(ids, dtype=torch.long, device=cache.device)
            shape = (2, len(ids), *cache.shape[2:])
            values = torch.full(shape, self.opts.fill_mean, dtype=cache.dtype, device=cache.device)
            if self.opts.fill_std > 0:
                values += torch.randn_like(values) * self.opts.fill_std
            cache.index_copy_(1, idx, values)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
