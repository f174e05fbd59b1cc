"""fp32 linear layers for steps of up to ~128 rows on AVX-512 CPUs, from a copy of the weight
laid out in panels of outputs (``csrc/f32_panel_linear.c``)."""

from __future__ import annotations

import ctypes

import torch

from kvferry.native.build import load_library
from kvferry.native.packed_linear import PackedLinearKernel


class F32PanelLinearKernel(PackedLinearKernel):
    """``F.linear(x, weight, bias)`` for fp32 CPU tensors, with the weight given as the panels
    :meth:`pack` made of it. Each output sums its products in input order, so results differ
    from ``F.linear``'s by rounding only. Only for a CPU with AVX-512F (the caller decides)."""

    NAME = "f32_panel_linear"
    DTYPE = torch.float32
    REFUSED = "this build has no AVX-512 code"

    def __init__(self, lib: ctypes.CDLL) -> None:
        super().__init__(lib)
        width = lib.kvf_f32_panel_width
        width.restype = ctypes.c_int
        self.width = int(width())

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The panels of an fp32 ``[N, K]`` CPU weight: a new 1-D tensor, ``N`` rounded up to a
        multiple of :attr:`width` times ``K`` elements."""
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError("f32_panel_linear packs 2-D fp32 weights")
        n, k = weight.shape
        full, w = divmod(n, self.width)
        panels = torch.empty(full + (w > 0), k, self.width)
        # One pass over the weight (it may be gigabytes): whole panels, then the last one.
        panels[:full].copy_(weight[: full * self.width].view(full, self.width, k).transpose(1, 2))
        if w:
            panels[full, :, w:] = 0.0
            panels[full, :, :w].copy_(weight[full * self.width :].t())
        return panels.view(-1)


def load_f32_panel_linear() -> F32PanelLinearKernel | None:
    """The kernel, built on first use; None where native kernels are off, the kernel is
    unbuildable or this build has no AVX-512 code (not x86-64, or no GCC/clang)."""
    lib = load_library("f32_panel_linear")
    if lib is None or lib.kvf_f32_panel_linear_available() != 1:
        return None
    return F32PanelLinearKernel(lib)
