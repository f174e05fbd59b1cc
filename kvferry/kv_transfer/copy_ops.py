"""copy_kv_blocks: the engine's block copy between the KV pool and a host buffer.

Handed to connectors through ``set_host_xfer_buffer_ops``. Both sides use the engine's
per-layer layout ``(2, num_blocks, block_size, num_kv_heads, head_dim)``; the block dimension
is 1, so one indexed copy per layer moves keys and values of every listed block.
"""

from __future__ import annotations

from typing import Literal

import torch


def copy_kv_blocks(
    src_caches: dict[str, torch.Tensor],
    dst_caches: dict[str, torch.Tensor],
    src_block_ids: list[int],
    dst_block_ids: list[int],
    direction: Literal["h2d", "d2h"],
) -> None:
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError("src_block_ids and dst_block_ids must have the same length")
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    if not src_block_ids:
        return
    # Index tensors are built once per device, not once per layer.
    indices: dict[tuple[torch.device, bool], torch.Tensor] = {}

    def index(device: torch.device, is_src: bool) -> torch.Tensor:
        key = (device, is_src)
        if key not in indices:
            ids = src_block_ids if is_src else dst_block_ids
            indices[key] = torch.tensor(ids, dtype=torch.long, device=device)
        return indices[key]

    for name, src in src_caches.items():
        dst = dst_caches.get(name)
        if dst is None:
            continue
        src_idx, dst_idx = index(src.device, True), index(dst.device, False)
        blocks = src.index_select(1, src_idx)
        if blocks.device != dst.device:
            blocks = blocks.to(dst.device, non_blocking=direction == "d2h")
        dst.index_copy_(1, dst_idx, blocks)
