"""The step's new K/V into the paged pool at their slots, keys and values in one call
(``csrc/kv_write.c``)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvferry.kv_layout import layout_of
from kvferry.native.build import load_library

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
# k, k row stride, v, v row stride, slots, n, cache, then the pool's geometry (strides in
# bytes): keys-to-values stride, block stride, num_blocks, block_size, token stride, head
# stride, kv_heads, bytes per head; threads
_ARGTYPES: list[Any] = [_P, _I64, _P, _I64, _P, _I64, _P] + [_I64] * 8 + [ctypes.c_int]


class KVWriteKernel:
    """``cache[0][slot] = k[t]`` and ``cache[1][slot] = v[t]`` for each token ``t`` of a step,
    on a CPU pool dense in either layout, any dtype. :meth:`supports` says whether a layer can
    use it; a slot outside the pool raises IndexError with nothing written."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvf_write_kv
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(
        kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> bool:
        """A CPU pool dense in a layout; ``k``/``v`` ``[n, kv_heads, head_dim]`` of its dtype,
        rows possibly strided, each row's heads contiguous; ``slots`` ``[n]`` int64,
        contiguous."""
        d = k.shape[-1]
        return (
            kv_cache.is_cpu
            and slots.dtype == torch.int64
            and slots.is_contiguous()
            and layout_of(kv_cache) is not None
            and k.dtype == v.dtype == kv_cache.dtype
            and k.stride()[1:] == (d, 1)
            and v.stride()[1:] == (d, 1)
        )

    def __call__(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """See :meth:`supports`."""
        n, kv_heads, head_dim = k.shape
        _, num_blocks, block_size, _, _ = kv_cache.shape
        size = kv_cache.element_size()
        cs = kv_cache.stride()
        assert slots.numel() == n
        rc = self._fn(
            k.data_ptr(),
            k.stride(0) * size,
            v.data_ptr(),
            v.stride(0) * size,
            slots.data_ptr(),
            n,
            kv_cache.data_ptr(),
            cs[0] * size,
            cs[1] * size,
            num_blocks,
            block_size,
            cs[2] * size,
            cs[3] * size,
            kv_heads,
            head_dim * size,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise IndexError(f"a slot lies outside the pool's {num_blocks * block_size} slots")


def load_kv_write() -> KVWriteKernel | None:
    """The kernel, built on first use; None where native kernels are off or unbuildable."""
    lib = load_library("kv_write")
    return None if lib is None else KVWriteKernel(lib)
