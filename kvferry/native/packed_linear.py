"""The ctypes side shared by the linear kernels that compute from their own packed copy of
the weight (``f32_panel_linear``, ``bf16_amx_gemm``): one C entry point
``kvf_<name>(x, sx, packed, bias, M, N, K, out, so, threads)`` returning 0, -1 when this build
or these sizes are not the kernel's, -2 when out of memory."""

from __future__ import annotations

import ctypes
from typing import ClassVar

import torch

from kvferry.native.rows_linear import LINEAR_TAIL_ARGTYPES, call_linear


class PackedLinearKernel:
    """``F.linear(x, weight, bias)`` for CPU tensors of :attr:`DTYPE`, with the weight given as
    the copy the subclass's ``pack`` made of it (once, at load time)."""

    NAME: ClassVar[str]
    DTYPE: ClassVar[torch.dtype]
    # What a refused call (-1) means, for the error.
    REFUSED: ClassVar[str]

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = getattr(lib, f"kvf_{self.NAME}")
        self._fn.argtypes = [
            ctypes.c_void_p,  # x
            ctypes.c_int64,  # x row stride (elements)
            ctypes.c_void_p,  # packed weight
            *LINEAR_TAIL_ARGTYPES,
        ]
        self._fn.restype = ctypes.c_int

    @classmethod
    def supports(cls, x: torch.Tensor, k: int) -> bool:
        """Whether ``x`` can meet a weight of ``k`` inputs: 2-D, of :attr:`DTYPE`, with
        contiguous rows."""
        return x.dtype == cls.DTYPE and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == k

    def __call__(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x``: ``[M, K]`` (see :meth:`supports`), ``packed``: the copy of an ``[n, K]``
        weight, ``bias``: ``[n]`` or None; returns a new ``[M, n]`` tensor of :attr:`DTYPE`."""
        return call_linear(
            self._fn, self.NAME, self.DTYPE, (), x, (packed.data_ptr(),), bias, n, self.REFUSED
        )
