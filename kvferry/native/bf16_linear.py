"""bf16 linear layers for steps of a few rows, reading bf16 weights as they are
(``csrc/bf16_linear.c``)."""

from __future__ import annotations

import ctypes
from typing import Literal, get_args

import torch

from kvferry.native.rows_linear import RowsLinearKernel, load_rows_kernel
from kvferry.native.variants import VARIANT_CODES

Variant = Literal["scalar", "avx2", "avx512", "avx512bf16", "amx"]
# The kernel's variant numbers (KVF_* in the C source).
VARIANTS: dict[Variant, int] = {v: VARIANT_CODES[v] for v in get_args(Variant)}


class BF16LinearKernel(RowsLinearKernel):
    """bf16 ``x``, weight and bias, computed in fp32 and rounded to bf16 once per output (as
    oneDNN's bf16 product does; only the summation order differs)."""

    NAME = "bf16_linear"
    DTYPE = torch.bfloat16

    def __init__(self, lib: ctypes.CDLL, variant: str) -> None:
        super().__init__(lib, variant)
        # AMX runs only once Linux has granted this process the tile state.
        if variant == "amx" and lib.kvf_bf16_linear_amx_ready() != 0:
            raise ValueError("the AMX tile state is not available to this process")


def load_bf16_linear(variant: Variant) -> BF16LinearKernel | None:
    """The kernel in ``variant`` (see :func:`~kvferry.native.rows_linear.load_rows_kernel`)."""
    return load_rows_kernel(BF16LinearKernel, variant)
