"""The memory order of a layer's KV tensor inside one block (vLLM's "NHD" / "HND").

Every layer's KV tensor has the logical shape ``(2, num_blocks, block_size, num_kv_heads,
head_dim)`` (FlashAttention's ``get_kv_cache_shape``) whatever the layout; the layout says how
its elements lie in memory. With ``NHD`` the tensor is contiguous as it stands: inside a block,
tokens, then heads, then head dims. With ``HND`` memory is ``(2, num_blocks, num_kv_heads,
block_size, head_dim)``: each head's rows of a block are one contiguous run (what a
head-sliced transfer between different tensor-parallel sizes wants). The pool is allocated in
the memory order and permuted back, as vLLM's model runner does, so a connector's
``register_kv_caches``, the forward context and attention all see the logical shape with the
layout's strides.

In both layouts keys and values are the outermost halves and each block of a half is one
contiguous run of bytes, so block copies (offload, disk, whole-block reads) need no change;
only code that addresses tokens or heads inside a block must follow the strides.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch


class KVCacheLayout(enum.Enum):
    """The layouts kvferry allocates; the value is vLLM's name for it."""

    NHD = "NHD"
    HND = "HND"

    @property
    def stride_order(self) -> tuple[int, ...]:
        """The logical dimensions in memory order, outermost first (vLLM's
        ``get_kv_cache_stride_order``)."""
        return (0, 1, 2, 3, 4) if self is KVCacheLayout.NHD else (0, 1, 3, 2, 4)

    @classmethod
    def named(cls, name: str) -> KVCacheLayout | None:
        """The layout called ``name`` (any case): vLLM's ``NHD``/``HND``, or one of vLLM 0.33's
        five-letter names that describes the same memory order (:data:`VLLM_LAYOUT_ALIASES`);
        None for a name kvferry does not allocate."""
        key = name.strip().upper()
        try:
            return cls(VLLM_LAYOUT_ALIASES.get(key, key))
        except ValueError:
            return None

    def physical_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The memory-order shape of a tensor whose logical shape is ``shape``."""
        return tuple(shape[i] for i in self.stride_order)

    def allocate(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        make_tensor: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor],
    ) -> torch.Tensor:
        """A tensor of logical ``shape`` whose memory, made by ``make_tensor`` (contiguous),
        is in this layout's order."""
        order = self.stride_order
        raw = make_tensor(self.physical_shape(shape), dtype, device)
        return raw.permute(*[order.index(i) for i in range(len(order))])


# vLLM 0.33 names a layout by the memory order of a logical (layer, block, head, token,
# content) cache, outermost first. kvferry allocates one tensor per layer (L outermost) whose
# blocks follow each other (B next), so of those orders only the two that differ inside a
# block exist here, and vLLM itself takes NHD / HND as their old names. The block-outermost
# orders (one block spanning every layer: BLHNC, BLNHC, BHLNC) and LHBNC (heads outside
# blocks) are other memory and stay refused.
VLLM_LAYOUT_ALIASES: dict[str, str] = {"LBNHC": "NHD", "LBHNC": "HND"}


def supported_layout_names() -> str:
    """What kvferry allocates, for error messages."""
    aliases = ", ".join(f"{a} (= {n})" for a, n in VLLM_LAYOUT_ALIASES.items())
    return f"{' or '.join(repr(x.value) for x in KVCacheLayout)}; vLLM 0.33's {aliases}"


def layout_of(kv_cache: torch.Tensor) -> KVCacheLayout | None:
    """The layout a 5-d KV tensor is dense in, or None when it is in neither (a slice, a
    copy with odd strides)."""
    if kv_cache.dim() != 5:
        return None
    if kv_cache.is_contiguous():  # NHD, without a permuted view (attention asks every step)
        return KVCacheLayout.NHD
    for layout in KVCacheLayout:
        if physical(kv_cache, layout).is_contiguous():
            return layout
    return None


def physical(kv_cache: torch.Tensor, layout: KVCacheLayout | None = None) -> torch.Tensor:
    """``kv_cache`` with its dimensions in memory order: a contiguous view when the tensor is
    dense in ``layout`` (default: whichever it is dense in), on which ``.view`` and byte-level
    access work. Raises ValueError for a tensor dense in no layout."""
    if layout is None:
        layout = layout_of(kv_cache)
        if layout is None:
            raise ValueError(
                f"a KV tensor of shape {tuple(kv_cache.shape)} and strides {kv_cache.stride()} "
                "is dense in no KV cache layout (NHD or HND)"
            )
    return kv_cache.permute(*layout.stride_order)


def empty_like_layout(
    kv_cache: torch.Tensor, num_blocks: int, pin_memory: bool = False
) -> torch.Tensor:
    """An uninitialised host tensor of ``num_blocks`` blocks shaped and laid out like
    ``kv_cache``, so that block copies between them are plain byte copies."""
    layout = layout_of(kv_cache) or KVCacheLayout.NHD
    shape = (kv_cache.shape[0], num_blocks, *kv_cache.shape[2:])

    def make(s: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(s, dtype=dtype, device=device, pin_memory=pin_memory)

    return layout.allocate(shape, kv_cache.dtype, torch.device("cpu"), make)


# The layout of the pool of the engine most recently started in this process (each worker
# process records its own), which vLLM-style code reads through ``get_kv_cache_layout``.
_engine_layout: KVCacheLayout | None = None


def record_engine_layout(layout: KVCacheLayout) -> None:
    """Called once the engine has decided its pool's layout, before any connector exists."""
    global _engine_layout
    _engine_layout = layout


def engine_layout() -> KVCacheLayout | None:
    """The layout :func:`record_engine_layout` last recorded in this process, or None."""
    return _engine_layout
