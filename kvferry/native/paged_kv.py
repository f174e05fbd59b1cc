"""What the paged-pool attention kernels share: one C entry point per dtype, and the layers
they can serve."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvferry.kv_layout import layout_of

# The leading arguments of every entry point: the queries and the pool.
POOL_ARGTYPES: list[Any] = [
    ctypes.c_void_p,  # q
    ctypes.c_int64,  # q row stride (elements)
    ctypes.c_void_p,  # cache
    ctypes.c_int64,  # num_blocks
    ctypes.c_int64,  # block_size
    ctypes.c_int64,  # num_kv_heads
    ctypes.c_int64,  # head_dim
    ctypes.c_int64,  # token stride inside a block (elements)
    ctypes.c_int64,  # kv head stride inside a block (elements)
]
# ... then the kernel's own arguments, then these two.
TAIL_ARGTYPES: list[Any] = [
    ctypes.c_void_p,  # out
    ctypes.c_int,  # threads
]


_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class PagedKVKernel:
    """A C attention kernel reading K/V in place from a ``(2, num_blocks, block_size,
    kv_heads, head_dim)`` pool in either layout (the token and head strides are passed in);
    ``<symbol>_f32`` and ``<symbol>_bf16`` are its entry points (those of its ``DTYPES``).
    :meth:`supports` is what every such kernel needs (CPU, fp32 or bf16, a cache dense in NHD
    or HND order); subclasses add their own limits."""

    DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL, symbol: str, own_argtypes: list[Any], what: str) -> None:
        self._what = what
        argtypes = POOL_ARGTYPES + own_argtypes + TAIL_ARGTYPES
        self._fns = {dt: getattr(lib, f"{symbol}_{_SUFFIX[dt]}") for dt in self.DTYPES}
        for fn in self._fns.values():
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int

    def supports(self, kv_cache: torch.Tensor, q: torch.Tensor) -> bool:
        return (
            kv_cache.is_cpu
            and kv_cache.dtype in self.DTYPES
            and q.dtype == kv_cache.dtype
            and layout_of(kv_cache) is not None
        )

    def _run(
        self, q: torch.Tensor, kv_cache: torch.Tensor, *own: Any, out: torch.Tensor | None
    ) -> torch.Tensor:
        """Calls the entry point for ``q``'s dtype with the pool's geometry and ``own``,
        writing into ``out`` (contiguous, shaped like ``q``; None: a new tensor), which it
        returns."""
        n, heads, head_dim = q.shape
        _, num_blocks, block_size, kv_heads, _ = kv_cache.shape
        if q.stride()[1:] != (head_dim, 1):
            q = q.contiguous()
        if out is None:
            out = torch.empty(n, heads, head_dim, dtype=q.dtype)
        elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError(
                f"{self._what}: out must be a contiguous {q.dtype} tensor of shape "
                f"{tuple(q.shape)}, got {out.dtype} {tuple(out.shape)}"
            )
        strides = kv_cache.stride()
        rc = self._fns[q.dtype](
            q.data_ptr(),
            q.stride(0),
            kv_cache.data_ptr(),
            num_blocks,
            block_size,
            kv_heads,
            head_dim,
            strides[2],
            strides[3],
            *own,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc != 0:
            raise MemoryError(f"{self._what}: could not allocate scratch memory")
        return out
