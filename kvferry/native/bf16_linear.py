"""bf16 linear layers for steps of a few rows, reading bf16 weights as they are
(``csrc/bf16_linear.c``)."""

from __future__ import annotations

import ctypes
from typing import Literal

import torch

from kvferry.native.build import load_library

Variant = Literal["scalar", "avx2", "avx512"]
# The kernel's variant numbers (KVF_SCALAR, KVF_AVX2, KVF_AVX512 in the C source).
VARIANTS: dict[Variant, int] = {"scalar": 0, "avx2": 1, "avx512": 2}


class BF16LinearKernel:
    """``F.linear(x, weight, bias)`` for bf16 CPU tensors, computed in fp32 and rounded to
    bf16 once per output (as oneDNN's bf16 product does; only the summation order differs).

    ``variant`` picks the instruction set; it must be one :meth:`compiled` lists and the CPU
    runs (the caller decides from the CPU's features). :meth:`supports` says whether a call
    can use it: a 2-D bf16 input with contiguous rows, a bf16 weight with contiguous rows.
    """

    def __init__(self, lib: ctypes.CDLL, variant: Variant) -> None:
        self._fn = lib.kvf_bf16_linear
        self._fn.argtypes = [
            ctypes.c_int,  # variant
            ctypes.c_void_p,  # x
            ctypes.c_int64,  # x row stride (elements)
            ctypes.c_void_p,  # weight
            ctypes.c_int64,  # weight row stride
            ctypes.c_void_p,  # bias or NULL
            ctypes.c_int64,  # M (rows of x)
            ctypes.c_int64,  # N (outputs)
            ctypes.c_int64,  # K (inputs)
            ctypes.c_void_p,  # out
            ctypes.c_int64,  # out row stride
            ctypes.c_int,  # threads
        ]
        self._fn.restype = ctypes.c_int
        variants = lib.kvf_bf16_linear_variants
        variants.restype = ctypes.c_int
        mask = variants()
        self._compiled = tuple(name for name, bit in VARIANTS.items() if mask & (1 << bit))
        if variant not in self._compiled:
            raise ValueError(f"bf16 linear variant {variant!r} is not in this build")
        self.variant: Variant = variant
        self._code = VARIANTS[variant]

    def compiled(self) -> tuple[Variant, ...]:
        """The variants this build of the kernel holds."""
        return self._compiled

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16
            and x.dim() == 2
            and weight.dim() == 2
            and x.shape[1] == weight.shape[1]
            and x.stride(1) == 1
            and weight.stride(1) == 1
        )

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x``: ``[M, K]``, ``weight``: ``[N, K]``, ``bias``: ``[N]`` or None, all bf16 (see
        :meth:`supports`); returns a new ``[M, N]`` bf16 tensor."""
        m, k = x.shape
        n = weight.shape[0]
        if bias is not None:
            bias = bias.to(torch.bfloat16).contiguous()
        out = torch.empty((m, n), dtype=torch.bfloat16)
        rc = self._fn(
            self._code,
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            weight.stride(0),
            None if bias is None else bias.data_ptr(),
            m,
            n,
            k,
            out.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        if rc == -2:
            raise MemoryError("bf16 linear: could not allocate scratch memory")
        if rc != 0:
            raise RuntimeError(f"bf16 linear variant {self.variant!r} failed (rc={rc})")
        return out


def load_bf16_linear(variant: Variant) -> BF16LinearKernel | None:
    """The kernel in ``variant``, built on first use; None where native kernels are off, the
    kernel is unbuildable or this build lacks the variant."""
    lib = load_library("bf16_linear")
    if lib is None:
        return None
    try:
        return BF16LinearKernel(lib, variant)
    except ValueError:
        return None
