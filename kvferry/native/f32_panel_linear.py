"""fp32 linear layers for steps of up to ~128 rows on AVX-512 CPUs, from a copy of the weight
laid out in panels of outputs (``csrc/f32_panel_linear.c``)."""

from __future__ import annotations

import ctypes

import torch

from kvferry.native.build import load_library


class F32PanelLinearKernel:
    """``F.linear(x, weight, bias)`` for fp32 CPU tensors, with the weight given as the panels
    :meth:`pack` made of it. Each output sums its products in input order, so results differ
    from ``F.linear``'s by rounding only. Only for a CPU with AVX-512F (the caller decides)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvf_f32_panel_linear
        self._fn.argtypes = [
            ctypes.c_void_p,  # x
            ctypes.c_int64,  # x row stride (elements)
            ctypes.c_void_p,  # panels
            ctypes.c_void_p,  # bias or NULL
            ctypes.c_int64,  # M (rows of x)
            ctypes.c_int64,  # N (outputs)
            ctypes.c_int64,  # K (inputs)
            ctypes.c_void_p,  # out
            ctypes.c_int64,  # out row stride
            ctypes.c_int,  # threads
        ]
        self._fn.restype = ctypes.c_int
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

    @staticmethod
    def supports(x: torch.Tensor, k: int) -> bool:
        """Whether ``x`` can meet a weight of ``k`` inputs: 2-D fp32 with contiguous rows."""
        return x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] == k

    def __call__(
        self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x``: ``[M, K]`` (see :meth:`supports`), ``panels``: :meth:`pack` of an ``[n, K]``
        weight, ``bias``: ``[n]`` or None; returns a new ``[M, n]`` fp32 tensor."""
        m, k = x.shape
        if bias is not None:
            bias = bias.float().contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        rc = self._fn(
            x.data_ptr(),
            x.stride(0),
            panels.data_ptr(),
            None if bias is None else bias.data_ptr(),
            m,
            n,
            k,
            out.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError("f32_panel_linear: this build has no AVX-512 code")
        return out


def load_f32_panel_linear() -> F32PanelLinearKernel | None:
    """The kernel, built on first use; None where native kernels are off, the kernel is
    unbuildable or this build has no AVX-512 code (not x86-64, or no GCC/clang)."""
    lib = load_library("f32_panel_linear")
    if lib is None or lib.kvf_f32_panel_linear_available() != 1:
        return None
    return F32PanelLinearKernel(lib)
