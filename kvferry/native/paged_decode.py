"""Decode attention over the paged KV pool, in place (``csrc/paged_decode.c``)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvferry.native.build import load_library
from kvferry.native.paged_kv import PagedKVKernel

_ARGTYPES: list[Any] = [
    ctypes.c_void_p,  # block table
    ctypes.c_int64,  # block table row stride
    ctypes.c_void_p,  # lens
    ctypes.c_int64,  # num_reqs
    ctypes.c_int64,  # group (query heads per kv head)
    ctypes.c_float,  # scale
    ctypes.c_int64,  # sliding window (0: none)
]


class PagedDecodeKernel(PagedKVKernel):
    """Attention of one query token per request, reading keys and values straight from the
    pool's blocks (the portable path gathers them into a buffer first, reading every byte
    twice). :meth:`supports` says whether a layer can use it (CPU, fp32 or bf16, contiguous
    cache); :meth:`__call__` returns ``[num_reqs, num_heads, head_dim]``.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib, "kvf_paged_decode", _ARGTYPES, "paged decode attention")

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        """``q``: ``[num_reqs, num_heads, head_dim]`` whose rows may be strided, heads and
        head_dim contiguous; ``kv_cache``: ``(2, num_blocks, block_size, kv_heads, head_dim)``, NHD or HND;
        ``block_table``: ``[num_reqs, >= ceil(len / block_size)]`` int64, rows contiguous;
        ``seq_lens``: ``[num_reqs]`` int64, each >= 1. ``window``: a sliding window, the
        query sees only the last ``window`` keys (blocks wholly before them are never read)."""
        nreq, heads, _ = q.shape
        assert block_table.dtype == torch.int64 and block_table.stride()[1] == 1
        assert seq_lens.dtype == torch.int64 and seq_lens.is_contiguous()
        return self._run(
            q,
            kv_cache,
            block_table.data_ptr(),
            block_table.stride(0),
            seq_lens.data_ptr(),
            nreq,
            heads // kv_cache.shape[3],
            scale,
            window or 0,
        )


def load_paged_decode() -> PagedDecodeKernel | None:
    """The kernel, built on first use; None where native kernels are off or unbuildable."""
    lib = load_library("paged_decode")
    return None if lib is None else PagedDecodeKernel(lib)
