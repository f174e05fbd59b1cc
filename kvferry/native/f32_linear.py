"""fp32 linear layers for steps of a few rows (decode), reading the dense weight once
(``csrc/f32_linear.c``)."""

from __future__ import annotations

import torch

from kvferry.native.rows_linear import RowsLinearKernel, load_rows_kernel
from kvferry.native.variants import IsaVariant

Variant = IsaVariant


class F32LinearKernel(RowsLinearKernel):
    """fp32 ``x``, weight and bias; sums in an order of their own, so results differ from
    ``F.linear``'s by rounding only."""

    NAME = "f32_linear"
    DTYPE = torch.float32


def load_f32_linear(variant: Variant) -> F32LinearKernel | None:
    """The kernel in ``variant`` (see :func:`~kvferry.native.rows_linear.load_rows_kernel`)."""
    return load_rows_kernel(F32LinearKernel, variant)
