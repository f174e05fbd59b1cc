"""HostKVBuffer: the host-memory tier's bytes.

Per layer the buffer is a tensor shaped like the engine's KV, ``(2, num_host_blocks,
block_size, num_kv_heads, head_dim)``, so one host block holds exactly one engine block and
a chunk of ``B`` blocks is host blocks ``[slot * B, (slot + 1) * B)``. On a CUDA engine the
buffer is pinned, so copies run as DMA on a side stream. Memory is reserved with
``torch.empty``: pages are only touched when a block is first written. Blocks move between
it and the engine through the engine's block copy (:mod:`kvferry.kv_transfer.copy_ops`).
"""

from __future__ import annotations

import torch

from kvferry.kv_layout import empty_like_layout, physical


class HostKVBuffer:
    def __init__(
        self, kv_caches: dict[str, torch.Tensor], num_blocks: int, pin_memory: bool
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("the host buffer needs at least one block")
        self.layer_names = list(kv_caches)
        self.num_blocks = num_blocks
        self.layers: dict[str, torch.Tensor] = {}
        for name, cache in kv_caches.items():
            # In the engine's layout, so a block moves as one run of bytes.
            self.layers[name] = empty_like_layout(cache, num_blocks, pin_memory)
        first = next(iter(kv_caches.values()))
        self.bytes_per_block = sum(c[:, 0].numel() * c.element_size() for c in kv_caches.values())
        self.dtype = first.dtype

    def chunk_views(self, host_blocks: list[int]) -> list[torch.Tensor]:
        """Contiguous views (per layer, keys then values) of consecutive host blocks, in the
        order a chunk file stores them."""
        start, n = host_blocks[0], len(host_blocks)
        assert host_blocks == list(range(start, start + n)), "a chunk is consecutive blocks"
        return [
            physical(t)[k, start : start + n]
            for t in self.layers.values()
            for k in range(t.shape[0])
        ]
