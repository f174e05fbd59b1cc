"""Fused RMSNorm (with residual add), rotary embedding and SiLU-and-mul (``csrc/fused_ops.c``),
in fp32 and bf16."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from kvferry.native.build import load_library

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {
    # x, x stride, residual, residual stride, weight, out, out stride, rows, heads, dim, eps,
    # threads
    "add_rms_norm": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _F32, _INT],
    # x, row stride, heads, head_dim, cos rows, sin rows, rows, threads
    "rotary": [_P, _I64, _I64, _I64, _P, _P, _I64, _INT],
    # gate_up, in stride, out, out stride, rows, dim, threads
    "silu_mul": [_P, _I64, _P, _I64, _I64, _I64, _INT],
}
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


class FusedOps:
    """One-pass CPU versions of a decoder layer's elementwise steps, for fp32 and bf16. The
    bf16 kernels round to bf16 wherever the torch ops (and Hugging Face's layers) store a bf16
    result, and compute in fp32 in between as those ops do; fp16 keeps the torch ops.

    Each method takes 2-D tensors whose rows are contiguous (:meth:`supports`), except
    :meth:`rotary_`, which takes 3-D ones whose heads are (:meth:`supports_heads`), and
    :meth:`rms_norm`, which takes either. Results agree with the torch ops to fp32 rounding
    (different summation order, fused multiply-adds); in bf16 that is bit for bit but for rare
    results one bf16 step apart.
    """

    DTYPES = tuple(_SUFFIX)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns: dict[tuple[str, torch.dtype], Any] = {}
        for name, argtypes in _SIGNATURES.items():
            for dtype, suffix in _SUFFIX.items():
                fn = getattr(lib, f"kvf_{name}_{suffix}")
                fn.argtypes = argtypes
                fn.restype = None
                self._fns[name, dtype] = fn

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Rows: an fp32 or bf16 CPU ``[n, d]`` tensor with contiguous rows."""
        return (
            x.device.type == "cpu"
            and x.dtype in FusedOps.DTYPES
            and x.dim() == 2
            and (x.stride(1) == 1)
        )

    @staticmethod
    def supports_heads(x: torch.Tensor) -> bool:
        """Heads: an fp32 or bf16 CPU ``[n, heads, head_dim]`` tensor, each row's heads
        contiguous."""
        return (
            x.device.type == "cpu"
            and x.dtype in FusedOps.DTYPES
            and x.dim() == 3
            and x.stride(2) == 1
            and x.stride(1) == x.shape[2]
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension of rows ``[n, d]``
        (:meth:`supports`) or heads ``[n, heads, head_dim]`` (:meth:`supports_heads`), as a new
        contiguous tensor of ``x``'s shape."""
        out = torch.empty(x.shape, dtype=x.dtype)
        if x.dim() == 3:
            assert x.stride(2) == 1 and x.stride(1) == x.shape[2]
            self._norm(None, x, weight, eps, out, heads=x.shape[1])
        else:
            self._norm(None, x, weight, eps, out)
        return out

    def add_rms_norm_(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """Adds ``x`` into ``residual`` in place and returns the norm of the sum (a new
        tensor); ``residual`` then holds the next residual stream."""
        out = torch.empty(x.shape, dtype=x.dtype)
        self._norm(x, residual, weight, eps, out)
        return out

    def _norm(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out: torch.Tensor,
        heads: int = 1,
    ) -> None:
        rows, dim = residual.shape[0], residual.shape[-1]
        assert weight.is_contiguous() and weight.shape == (dim,) and weight.dtype == out.dtype
        assert residual.dtype == out.dtype and (x is None or x.dtype == out.dtype)
        self._fns["add_rms_norm", out.dtype](
            None if x is None else x.data_ptr(),
            0 if x is None else x.stride(0),
            residual.data_ptr(),
            residual.stride(0),
            weight.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            rows,
            heads,
            dim,
            eps,
            torch.get_num_threads(),
        )

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates ``x`` ``[num_tokens, heads, head_dim]`` (rows may be strided, heads
        contiguous) in place by the half-width ``cos``/``sin`` rows of each token
        (``[num_tokens, 1, head_dim // 2]``, contiguous, in ``x``'s dtype); returns ``x``."""
        n, heads, head_dim = x.shape
        assert x.stride(2) == 1 and x.stride(1) == head_dim
        assert cos.is_contiguous() and sin.is_contiguous() and cos.numel() == n * head_dim // 2
        assert cos.dtype == sin.dtype == x.dtype
        self._fns["rotary", x.dtype](
            x.data_ptr(),
            x.stride(0),
            heads,
            head_dim,
            cos.data_ptr(),
            sin.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        return x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` of shape ``[n, 2 * d]``."""
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._fns["silu_mul", gate_up.dtype](
            gate_up.data_ptr(),
            gate_up.stride(0),
            out.data_ptr(),
            out.stride(0),
            rows,
            width // 2,
            torch.get_num_threads(),
        )
        return out


def load_fused_ops() -> FusedOps | None:
    """The kernels, built on first use; None where native kernels are off or unbuildable."""
    lib = load_library("fused_ops")
    return None if lib is None else FusedOps(lib)
