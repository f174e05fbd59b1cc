"""``vllm.v1.kv_cache_interface``: the KV pool layout as vLLM describes it, a view over
kvferry's ``KVCacheConfig``.

kvferry's models have one full-attention group, and hybrid ones a sliding-window group
besides (``SlidingWindowSpec``); the ``i``-th layers of all groups share one tensor of shape
``(2, num_blocks, block_size, num_kv_heads, head_size)`` (memory in NHD or HND order:
``layout`` passes through to kvferry's config). The spec classes vLLM connectors
test with ``isinstance`` exist; those kvferry never builds (Mamba, MLA) are there only so
such checks answer False.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvferry.kv_cache_config import KVCacheConfig as KvferryKVCacheConfig
from kvferry.kv_cache_config import KVCacheGroupSpec as KvferryGroupSpec

__all__ = [
    "AttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "MLAAttentionSpec",
    "MambaSpec",
    "SlidingWindowSpec",
]


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer, keys and values."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * elem


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int = 0


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    pass


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    pass


@dataclass(frozen=True)
class KVCacheTensor:
    size: int
    shared_by: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


def _group(g: KvferryGroupSpec) -> KVCacheGroupSpec:
    spec: AttentionSpec
    if g.sliding_window is not None:
        spec = SlidingWindowSpec(
            g.block_size, g.num_kv_heads, g.head_dim, g.dtype, g.sliding_window
        )
    else:
        spec = FullAttentionSpec(g.block_size, g.num_kv_heads, g.head_dim, g.dtype)
    return KVCacheGroupSpec(list(g.layer_names), spec)


class KVCacheConfig:
    """vLLM's ``KVCacheConfig`` fields over kvferry's; other attributes are kvferry's
    (``groups``, ``block_size``, ``bytes_per_block``, ``layer_names``)."""

    def __init__(self, kv_cache_config: KvferryKVCacheConfig) -> None:
        self._wrapped = kv_cache_config

    @classmethod
    def of(cls, config: KvferryKVCacheConfig | KVCacheConfig) -> KVCacheConfig:
        return config if isinstance(config, KVCacheConfig) else cls(config)

    @property
    def num_blocks(self) -> int:
        return self._wrapped.num_blocks

    @property
    def kv_cache_groups(self) -> list[KVCacheGroupSpec]:
        return [_group(g) for g in self._wrapped.groups]

    @property
    def kv_cache_tensors(self) -> list[KVCacheTensor]:
        size = self._wrapped.num_blocks * self._wrapped.groups[0].bytes_per_block_per_layer
        return [KVCacheTensor(size, list(names)) for names in self._wrapped.kv_cache_tensors]

    @property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        return tuple(range(len(self._wrapped.groups)))

    def __getattr__(self, name: str) -> Any:
        if name == "_wrapped":
            raise AttributeError(name)
        return getattr(self._wrapped, name)

    def __repr__(self) -> str:
        return f"KVCacheConfig({self._wrapped!r})"
