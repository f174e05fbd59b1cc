"""What the paged-pool attention kernels share: one C entry point per dtype, and the layers
they can serve."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvferry.kv_layout import layout_of


class PagedKVKernel:
    """A C attention kernel reading K/V in place from a ``(2, num_blocks, block_size,
    kv_heads, head_dim)`` pool in either layout (the token and head strides are passed in);
    ``<symbol>_f32`` and ``<symbol>_bf16`` are its entry points. :meth:`supports` is what every
    such kernel needs (CPU, fp32 or bf16, a cache dense in NHD or HND order); subclasses add
    their own limits."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL, symbol: str, argtypes: list[Any]) -> None:
        self._fns = {
            torch.float32: getattr(lib, f"{symbol}_f32"),
            torch.bfloat16: getattr(lib, f"{symbol}_bf16"),
        }
        for fn in self._fns.values():
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int

    def supports(self, kv_cache: torch.Tensor, q: torch.Tensor) -> bool:
        return (
            kv_cache.device.type == "cpu"
            and kv_cache.dtype in self.DTYPES
            and q.dtype == kv_cache.dtype
            and layout_of(kv_cache) is not None
        )
