"""Decode attention over the paged KV pool, in place (``csrc/paged_decode.c``)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvferry.native.build import load_library
from kvferry.native.paged_kv import PagedKVKernel
from kvferry.native.variants import IsaVariant, VariantChoice

Variant = IsaVariant

_ARGTYPES: list[Any] = [
    ctypes.c_void_p,  # block table
    ctypes.c_int64,  # block table row stride
    ctypes.c_void_p,  # lens
    ctypes.c_int64,  # num_reqs
    ctypes.c_int64,  # group (query heads per kv head)
    ctypes.c_float,  # scale
    ctypes.c_int64,  # sliding window (0: none)
    ctypes.c_int,  # variant
]


class PagedDecodeKernel(PagedKVKernel, VariantChoice):
    """Attention of one query token per request, reading keys and values straight from the
    pool's blocks (the portable path gathers them into a buffer first, reading every byte
    twice). :meth:`supports` says whether a layer can use it (CPU, fp32 or bf16, contiguous
    cache); :meth:`__call__` returns ``[num_reqs, num_heads, head_dim]``.

    ``variant`` (``scalar``, ``avx2`` or ``avx512``) is the widest instruction set its vector
    code may use; it must be one :meth:`compiled` lists and the CPU runs (the caller decides
    from the CPU's features). Calls whose head_dim that width does not tile use the next
    narrower one.
    """

    def __init__(self, lib: ctypes.CDLL, variant: Variant) -> None:
        super().__init__(lib, "kvf_paged_decode", _ARGTYPES, "paged decode attention")
        self._choose_variant(lib, "paged_decode", variant)

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q``: ``[num_reqs, num_heads, head_dim]`` whose rows may be strided, heads and
        head_dim contiguous; ``kv_cache``: ``(2, num_blocks, block_size, kv_heads, head_dim)``, NHD or HND;
        ``block_table``: ``[num_reqs, >= ceil(len / block_size)]`` int64, rows contiguous;
        ``seq_lens``: ``[num_reqs]`` int64, each >= 1. ``window``: a sliding window, the
        query sees only the last ``window`` keys (blocks wholly before them are never read).
        ``out``: where the result goes (contiguous, shaped like ``q``), e.g. the rows of a
        batch-wide output; None: a new tensor."""
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
            self._code,
            out=out,
        )


def load_paged_decode(variant: Variant) -> PagedDecodeKernel | None:
    """The kernel in ``variant``, built on first use; None where native kernels are off, it
    is unbuildable or this build lacks the variant."""
    lib = load_library("paged_decode")
    if lib is None:
        return None
    try:
        return PagedDecodeKernel(lib, variant)
    except ValueError:
        return None
