"""Causal prefill attention over the paged KV pool, in place (``csrc/paged_prefill.c``, and
``csrc/paged_prefill_amx.c`` for bf16 on AMX tiles)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvferry.logger import init_logger
from kvferry.native.build import load_library
from kvferry.native.paged_kv import PagedKVKernel

logger = init_logger(__name__)

_ARGTYPES: list[Any] = [
    ctypes.c_void_p,  # block ids of the request
    ctypes.c_int64,  # context length (tokens before the chunk)
    ctypes.c_int64,  # query length (tokens in the chunk)
    ctypes.c_int64,  # group (query heads per kv head)
    ctypes.c_float,  # scale
    ctypes.c_int64,  # sliding window (0: none)
]


class PagedPrefillKernel(PagedKVKernel):
    """Causal attention of one request's chunk of new tokens to its whole sequence so far,
    reading keys and values straight from the pool's blocks: no gather, no mask, and key
    tiles past a query's position are never computed. The chunk's own K/V must already be in
    the pool. :meth:`supports` says whether a layer can use it (CPU, fp32 or bf16, contiguous
    cache, head_dim a multiple of 16, at most :attr:`max_group` (64) query heads per kv head);
    :meth:`__call__` returns ``[q_len, num_heads, head_dim]``.
    """

    SYMBOL = "kvf_paged_prefill"
    PATH = "c-paged"  # as the CPU paths line names it
    # The fp32 arithmetic of csrc/paged_prefill.c serves any head_dim that is a multiple of it.
    HEAD_DIM_MULTIPLE: int = 16
    MAX_HEAD_DIM: int | None = None

    OWN_ARGTYPES: list[Any] = _ARGTYPES

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib, self.SYMBOL, self.OWN_ARGTYPES, "paged prefill attention")
        # Query heads per kv head that one query tile can stack (IROWS in the C source).
        rows = getattr(lib, f"{self.SYMBOL}_rows")
        rows.restype = ctypes.c_int
        self.max_group = int(rows())

    def supports(self, kv_cache: torch.Tensor, q: torch.Tensor) -> bool:
        return (
            super().supports(kv_cache, q)
            and kv_cache.shape[-1] % self.HEAD_DIM_MULTIPLE == 0
            and (self.MAX_HEAD_DIM is None or kv_cache.shape[-1] <= self.MAX_HEAD_DIM)
            and q.dim() == 3
            and q.shape[1] // kv_cache.shape[3] <= self.max_group
        )

    def __call__(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        block_ids: torch.Tensor,
        context_len: int,
        scale: float,
        window: int | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q``: ``[q_len, num_heads, head_dim]`` whose rows may be strided, heads and
        head_dim contiguous, for positions ``context_len .. context_len + q_len - 1``;
        ``kv_cache``: ``(2, num_blocks, block_size, kv_heads, head_dim)``, NHD or HND; ``block_ids``:
        contiguous int64 covering ``context_len + q_len`` tokens. ``window``: a sliding window,
        each query sees only the last ``window`` keys up to its own position (blocks wholly
        before every query's window are never read). ``out``: as for the decode kernel."""
        q_len, heads, _ = q.shape
        block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        assert block_ids.dtype == torch.int64 and block_ids.is_contiguous()
        assert block_ids.numel() * block_size >= context_len + q_len
        return self._run(
            q,
            kv_cache,
            block_ids.data_ptr(),
            context_len,
            q_len,
            heads // kv_heads,
            scale,
            window or 0,
            *self._scratch(context_len + q_len, kv_cache),
            out=out,
        )

    def _scratch(self, seq: int, kv_cache: torch.Tensor) -> tuple[int, ...]:
        """Extra pointer arguments a variant's entry point takes (none here)."""
        return ()


class PagedPrefillAMXKernel(PagedPrefillKernel):
    """The same attention for bf16 pools with bf16 tile products (scores and output summed in
    fp32, probabilities rounded to bf16 before they meet the values, as torch's bf16 flash
    attention does): head_dim a multiple of 32 up to 256, at most 32 query heads per kv head.
    Only where the CPU has AMX and Linux grants this process the tile state."""

    DTYPES = (torch.bfloat16,)
    SYMBOL = "kvf_paged_prefill_amx"
    PATH = "c-paged-amx"
    HEAD_DIM_MULTIPLE = 32
    MAX_HEAD_DIM = 256
    OWN_ARGTYPES = [*_ARGTYPES, ctypes.c_void_p]  # the K/V layout buffer

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        if lib.kvf_paged_prefill_amx_ready() != 0:
            raise ValueError("the AMX tile state is not available to this process")
        self._layout_elems = lib.kvf_paged_prefill_amx_layout_elems
        self._layout_elems.argtypes = [ctypes.c_int64] * 3
        self._layout_elems.restype = ctypes.c_int64
        # Each call lays the sequence's keys and values out here; kept between calls (layers
        # run one after another), since a fresh buffer of many MiB is paged in every time.
        self._layout = torch.empty(0, dtype=torch.bfloat16)

    def _scratch(self, seq: int, kv_cache: torch.Tensor) -> tuple[int, ...]:
        need = int(self._layout_elems(seq, kv_cache.shape[4], kv_cache.shape[3]))
        if self._layout.numel() < need:
            # A normal tensor even when first needed under inference_mode, so that later
            # calls under no_grad (or neither) may still write into it.
            with torch.inference_mode(False):
                self._layout = torch.empty(need, dtype=torch.bfloat16)
        return (self._layout.data_ptr(),)


def load_paged_prefill_amx() -> PagedPrefillAMXKernel | None:
    """The AMX kernel, built on first use; None where native kernels are off, the kernel is
    unbuildable or the tiles are not available."""
    lib = load_library("paged_prefill_amx")
    if lib is None:
        return None
    try:
        return PagedPrefillAMXKernel(lib)
    except ValueError as e:
        logger.warning("AMX prefill attention unavailable: %s", e)
        return None


def load_paged_prefill() -> PagedPrefillKernel | None:
    """The kernel, built on first use; None where native kernels are off or unbuildable."""
    lib = load_library("paged_prefill")
    return None if lib is None else PagedPrefillKernel(lib)
