"""KVCacheConfig: the shape of the engine's paged KV pool, known to scheduler and workers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvferry.kv_events.events import KV_CACHE_SPEC_FULL_ATTENTION, KV_CACHE_SPEC_SLIDING_WINDOW
from kvferry.kv_layout import KVCacheLayout


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table: one group per attention type of the model (full
    attention; a sliding window of ``sliding_window`` tokens, vLLM's ``SlidingWindowSpec``)."""

    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    sliding_window: int | None = None

    @property
    def kv_cache_spec_kind(self) -> str:
        """The group's attention type as KV cache events name it (vLLM's
        ``get_kv_cache_spec_kind``)."""
        if self.sliding_window is not None:
            return KV_CACHE_SPEC_SLIDING_WINDOW
        return KV_CACHE_SPEC_FULL_ATTENTION

    @property
    def bytes_per_block_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class KVCacheConfig:
    """``num_blocks`` blocks of ``block_size`` tokens, per layer a tensor of shape
    ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (index 0 keys, 1 values) whose
    memory is in ``layout`` order (see :mod:`kvferry.kv_layout`)."""

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]
    layout: KVCacheLayout = KVCacheLayout.NHD

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def bytes_per_block(self) -> int:
        return sum(self.groups[0].bytes_per_block_per_layer for _ in self.kv_cache_tensors)

    @property
    def kv_cache_tensors(self) -> tuple[tuple[str, ...], ...]:
        """The layers sharing each KV tensor: the ``i``-th layer of every group. A block id
        belongs to one group at a time, so layers of different groups can share a tensor
        (their groups' pages have one shape); with one group every layer has its own."""
        n = max(len(g.layer_names) for g in self.groups)
        return tuple(
            tuple(g.layer_names[i] for g in self.groups if i < len(g.layer_names)) for i in range(n)
        )

    @property
    def null_block_id(self) -> int | None:
        """The id standing for "no block" in a sliding-window group's table (the pool sets
        block 0 aside for it: never written, never read), or None without such a group.
        Connectors skip it: nothing is loaded into or saved from it."""
        return 0 if any(g.sliding_window is not None for g in self.groups) else None

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(n for g in self.groups for n in g.layer_names)
