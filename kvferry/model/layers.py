"""Building blocks shared by the model families: RMSNorm, rotary embedding, gated SiLU MLP.

Numerics follow Hugging Face ``transformers`` operation by operation (same dtypes at each
step), so an fp32 kvferry model reproduces the reference logits to rounding noise and a bf16
one rounds the same way in the places that matter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.native.fused_ops import FusedOps


def weight_of(module: nn.Module) -> torch.Tensor:
    """``module.weight`` read from its parameter dict: ``Module.__getattr__`` costs about a
    microsecond a lookup, and a decode step looks up every layer's weights."""
    return cast(torch.Tensor, module._parameters["weight"])


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in fp32 like HF.

    ``add_norm(x, residual)`` is the fused form used between sub-layers: it adds ``residual``
    to ``x`` in the input dtype (as HF's decoder layers do) and returns
    ``(norm(x + residual), x + residual)``; the sum is the next residual stream. With
    ``fused`` ops (set by a device backend) the sum is written into ``residual`` itself, so
    callers must own that tensor.
    """

    fused: FusedOps | None = None

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Heads: Qwen3's per-head q/k norm, on views into the qkv projection.
        if self.fused is not None and (self.fused.supports(x) or self.fused.supports_heads(x)):
            return self.fused.rms_norm(x, weight_of(self), self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None and self.fused.supports(x) and self.fused.supports(residual):
            return self.fused.add_rms_norm_(x, residual, weight_of(self), self.eps), residual
        x = x + residual
        return self.forward(x), x


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int
) -> torch.Tensor:
    """Inverse rotary frequencies (fp32, length ``head_dim // 2``) as HF computes them.

    ``scaling`` is a HF ``rope_scaling`` / ``rope_parameters`` dict with ``rope_type`` (or the
    legacy ``type``) "default", "linear" (``factor``) or "llama3" (``factor``,
    ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    """
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exps)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", max_position))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in HF's "rotate half" layout.

    cos/sin tables for ``max_position`` positions are built lazily per (device, dtype), in
    fp32 and then cast, which is exactly what HF does per step; a table is never a parameter,
    so models can be built on the meta device and loaded later.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary head_dim must be even, got {head_dim}")
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None:
            inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling, self.max_position)
            pos = torch.arange(self.max_position, dtype=torch.int64).float()
            freqs = pos[:, None] * inv_freq[None, :]
            with torch.inference_mode(False):  # usable outside inference_mode later
                table = (freqs.cos().to(device, dtype), freqs.sin().to(device, dtype))
            self._tables[key] = table
        return table

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width cos/sin rows for ``positions``, shaped ``[num_tokens, 1, head_dim // 2]``
        to broadcast over heads. Compute once per forward and reuse in every layer."""
        cos, sin = self._table(positions.device, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: FusedOps | None = None
) -> torch.Tensor:
    """Rotate ``x`` of shape ``[num_tokens, heads, head_dim]`` by the half-width ``cos``/``sin``
    from :meth:`RotaryEmbedding.cos_sin`; returns a new contiguous tensor. Same products and
    sums as HF's ``x * cos + rotate_half(x) * sin``, written into one output without a concat.
    With ``fused`` ops and an fp32 or bf16 CPU ``x`` whose heads are contiguous (``cos`` in its
    dtype), ``x`` is rotated in place and returned instead."""
    if fused is not None and fused.supports_heads(x) and cos.dtype == x.dtype:
        return fused.rotary_(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.sub(x1 * cos, x2 * sin, out=out[..., :half])
    torch.add(x2 * cos, x1 * sin, out=out[..., half:])
    return out


# ``(x, weight, bias) -> F.linear(x, weight, bias)`` up to rounding, computed another way
# (e.g. from a copy of the weight laid out for this device's GEMMs).
LinearKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class Linear(nn.Linear):
    """``nn.Linear``. A device backend may set ``kernel`` to compute the product in place of
    ``F.linear``; the parameters keep the checkpoint's values."""

    kernel: LinearKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = weight_of(self), self._parameters["bias"]
        if self.kernel is not None:
            return self.kernel(x, weight, bias)
        return F.linear(x, weight, bias)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul (and the
    activation into one pass with ``fused`` ops)."""

    fused: FusedOps | None = None
    # Largest gate/up buffer of one pass over a 2-D input (None: one pass); set by a backend
    # that wants it kept small, the rows per pass follow from the input's dtype.
    max_pass_bytes: int | None = None

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_pass_bytes is None or x.dim() != 2:
            return self._rows(x)
        step = max(1, self.max_pass_bytes // (2 * self.intermediate * x.element_size()))
        if x.shape[0] <= step:
            return self._rows(x)
        out = x.new_empty(x.shape[0], self.down_proj.out_features)
        for i in range(0, x.shape[0], step):
            out[i : i + step] = self._rows(x[i : i + step])
        return out

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and self.fused.supports(gate_up):
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up[..., : self.intermediate], gate_up[..., self.intermediate :]
        return self.down_proj(F.silu(gate) * up)
