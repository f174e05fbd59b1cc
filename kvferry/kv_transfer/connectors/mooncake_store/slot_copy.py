"""Copies between a staging slot's payload and the engine's KV blocks.

A payload holds, per layer, the keys then the values of the chunk's blocks, each half a
contiguous ``(blocks_per_chunk, block_size, heads, head_dim)`` run; the pool holds per layer
``(2, num_blocks, ...)``. So a chunk is ``2 * layers`` regions whose rows (blocks) map one to
one, and on the host one C call moves them all with the GIL released (about twice the rate of
one ``index_copy_`` per layer, which also holds the load thread in the interpreter while the
store's receive threads want the cores). Device pools, or hosts where the kernel cannot be
built, take one indexed copy per layer.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvferry.kv_layout import physical
from kvferry.native.block_copy import BlockCopyKernel, load_block_copy


class SlotCopier:
    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        blocks_per_chunk: int,
        payload_ptrs: list[int],
        payload_of: list[torch.Tensor],
    ) -> None:
        """``payload_ptrs[s]`` / ``payload_of[s]``: slot ``s``'s payload (after the header), as
        an address and as a ``(layers, 2, blocks_per_chunk, ...)`` tensor view, the inner
        dimensions in the pool's memory order."""
        # In memory order (NHD or HND): a block of a half is one run of bytes, and payloads
        # hold blocks as those bytes on every path (the store namespace names the layout).
        self.kv = [physical(t) for t in kv_caches]
        kv_caches = self.kv
        self.bpc = blocks_per_chunk
        self.num_blocks = int(kv_caches[0].shape[1])
        self.payload_of = payload_of
        first = kv_caches[0]
        self.device = first.device
        on_host = all(t.device.type == "cpu" and t.is_contiguous() for t in kv_caches)
        self.kernel: BlockCopyKernel | None = load_block_copy() if on_host else None
        if self.kernel is None:
            return
        block_bytes = first[0, 0].nbytes
        regions = 2 * len(kv_caches)
        self._pool = (ctypes.c_void_p * regions)(
            *(t[h].data_ptr() for t in kv_caches for h in range(2))
        )
        self._row_bytes = (ctypes.c_int64 * regions)(*([block_bytes] * regions))
        self._slots = [
            (ctypes.c_void_p * regions)(
                *(ptr + r * blocks_per_chunk * block_bytes for r in range(regions))
            )
            for ptr in payload_ptrs
        ]
        self._rows = np.arange(blocks_per_chunk, dtype=np.int64)

    def _ids(self, block_ids: list[int], first: int) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise IndexError("block id out of range for the KV pool")
        if first < 0 or first + len(ids) > self.bpc:
            raise IndexError("chunk rows out of range")
        return ids

    def into_pool(self, slot: int, first: int, block_ids: list[int]) -> None:
        """Payload rows ``first ..`` of ``slot`` into the pool blocks ``block_ids``."""
        ids = self._ids(block_ids, first)
        if self.kernel is not None:
            rows = self._rows[first : first + len(ids)]
            self.kernel.copy_pointers(self._slots[slot], self._pool, self._row_bytes, rows, ids)
            return
        payload = self.payload_of[slot]
        index = torch.from_numpy(ids).to(self.device)
        hi = first + len(ids)
        for layer, kv in enumerate(self.kv):
            kv.index_copy_(1, index, payload[layer][:, first:hi].to(self.device))

    def out_of_pool(self, slot: int, block_ids: list[int]) -> None:
        """The pool blocks ``block_ids`` into payload rows ``0 ..`` of ``slot``."""
        ids = self._ids(block_ids, 0)
        if self.kernel is not None:
            rows = self._rows[: len(ids)]
            self.kernel.copy_pointers(self._pool, self._slots[slot], self._row_bytes, ids, rows)
            return
        payload = self.payload_of[slot]
        index = torch.from_numpy(ids).to(self.device)
        for layer, kv in enumerate(self.kv):
            payload[layer][:, : len(ids)].copy_(kv.index_select(1, index))
