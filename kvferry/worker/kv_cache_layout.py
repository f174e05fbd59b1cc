"""How a model's attention layers map onto KV cache groups and tensors.

One group per attention type (vLLM's hybrid KV cache groups): the full-attention layers
first (group 0, whose prefix cache produces KV cache events), then one group per sliding
window. The ``i``-th layers of all groups share one KV tensor (see
:attr:`~kvferry.kv_cache_config.KVCacheConfig.kv_cache_tensors`), so a block costs the
memory of the largest group's layers, not of all layers: the sliding-window group's few
blocks and the full group's many come out of the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvferry.config import ArchConfig
from kvferry.kv_cache_config import KVCacheConfig, KVCacheGroupSpec


def kv_cache_group_specs(
    arch: ArchConfig,
    layer_names: Sequence[str],
    block_size: int,
    dtype: torch.dtype,
    num_kv_heads: int | None = None,
) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of a model whose layer ``i`` is ``layer_names[i]``, each with
    ``num_kv_heads`` heads (default: all of the model's; a tensor-parallel rank holds its
    share)."""
    by_window: dict[int | None, list[str]] = {}
    for i, name in enumerate(layer_names):
        by_window.setdefault(arch.layer_sliding_window(i), []).append(name)
    order = sorted(by_window, key=lambda w: -1 if w is None else w)
    return tuple(
        KVCacheGroupSpec(
            layer_names=tuple(by_window[w]),
            block_size=block_size,
            num_kv_heads=arch.num_key_value_heads if num_kv_heads is None else num_kv_heads,
            head_dim=arch.head_dim,
            dtype=dtype,
            sliding_window=w,
        )
        for w in order
    )


def allocate_kv_caches(
    config: KVCacheConfig,
    device: torch.device,
    make_tensor: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor],
) -> dict[str, torch.Tensor]:
    """layer name -> its KV tensor ``(2, num_blocks, block_size, kv_heads, head_dim)``, one
    tensor per entry of ``config.kv_cache_tensors`` made by ``make_tensor`` in the memory
    order of ``config.layout`` and permuted back to that logical shape, the same object for
    every layer that shares it."""
    g = config.groups[0]
    pages = {(x.block_size, x.num_kv_heads, x.head_dim, x.dtype) for x in config.groups}
    assert len(pages) == 1, "groups sharing KV tensors need one page shape"
    shape = (2, config.num_blocks, g.block_size, g.num_kv_heads, g.head_dim)
    caches: dict[str, torch.Tensor] = {}
    for shared_by in config.kv_cache_tensors:
        tensor = config.layout.allocate(shape, g.dtype, device, make_tensor)
        caches.update(dict.fromkeys(shared_by, tensor))
    # In the model's layer order, which connectors see when they register the caches.
    order = [name for group in config.groups for name in group.layer_names]
    return {name: caches[name] for name in sorted(order, key=_layer_index)}


def _layer_index(name: str) -> tuple[int, str]:
    parts = [p for p in name.split(".") if p.isdigit()]
    return (int(parts[0]) if parts else 0, name)
