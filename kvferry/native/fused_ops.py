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
    # x, row stride, q heads, k heads, head_dim, q weight, k weight, eps, cos rows, sin rows,
    # rows, threads
    "qk_norm_rotary": [_P, _I64, _I64, _I64, _I64, _P, _P, _F32, _P, _P, _I64, _INT],
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
        return x.dtype in FusedOps.DTYPES and x.is_cpu and x.dim() == 2 and x.stride()[1] == 1

    @staticmethod
    def supports_heads(x: torch.Tensor) -> bool:
        """Heads: an fp32 or bf16 CPU ``[n, heads, head_dim]`` tensor, each row's heads
        contiguous."""
        return (
            x.dtype in FusedOps.DTYPES
            and x.is_cpu
            and x.dim() == 3
            and x.stride()[1:] == (x.shape[2], 1)
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension of rows ``[n, d]``
        (:meth:`supports`) or heads ``[n, heads, head_dim]`` (:meth:`supports_heads`), as a new
        contiguous tensor of ``x``'s shape."""
        # (empty_like: x's strides where x is dense, which the rows and heads it takes are
        # only when contiguous; half the cost of torch.empty at decode sizes)
        out = torch.empty_like(x)
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
        out = torch.empty_like(x)
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
        assert weight.dtype == residual.dtype == out.dtype and (x is None or x.dtype == out.dtype)
        assert weight.is_contiguous() and weight.shape[0] == dim and weight.dim() == 1
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

    def qk_norm_rotary_(
        self,
        qk: torch.Tensor,
        q_heads: int,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Qwen3's ``rotary(q_norm(q))`` and ``rotary(k_norm(k))`` in place, in one call:
        ``qk`` ``[num_tokens, q_heads + k_heads, head_dim]`` (:meth:`supports_heads`, head_dim
        at most 1024) holds each token's query heads then its key heads; ``q_weight`` and
        ``k_weight`` ``[head_dim]`` are the norms' weights, ``cos``/``sin`` as for
        :meth:`rotary_`. The same results as :meth:`rms_norm` then :meth:`rotary_` on each
        part; returns ``qk``."""
        n, heads, head_dim = qk.shape
        assert qk.stride(2) == 1 and qk.stride(1) == head_dim and head_dim <= 1024
        assert cos.is_contiguous() and sin.is_contiguous() and cos.numel() == n * head_dim // 2
        assert cos.dtype == sin.dtype == q_weight.dtype == k_weight.dtype == qk.dtype
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
        self._fns["qk_norm_rotary", qk.dtype](
            qk.data_ptr(),
            qk.stride(0),
            q_heads,
            heads - q_heads,
            head_dim,
            q_weight.data_ptr(),
            k_weight.data_ptr(),
            eps,
            cos.data_ptr(),
            sin.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        return qk

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` of shape ``[n, 2 * d]``."""
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
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
