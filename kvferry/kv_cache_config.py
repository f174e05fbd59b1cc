"""KVCacheConfig: the shape of the engine's paged KV pool, known to scheduler and workers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table (kvferry's models have a single full-attention group)."""

    layer_names: tuple[str, ...]
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class KVCacheConfig:
    """``num_blocks`` blocks of ``block_size`` tokens, per layer a tensor of shape
    ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (index 0 keys, 1 values)."""

    num_blocks: int
    groups: tuple[KVCacheGroupSpec, ...]

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def bytes_per_block(self) -> int:
        return sum(g.bytes_per_block_per_layer * len(g.layer_names) for g in self.groups)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(n for g in self.groups for n in g.layer_names)
