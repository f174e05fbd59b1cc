"""What attention layers borrow from the model runner for a step besides their inputs: scratch
memory for gathered KV blocks and the device's choices of how to attend.

The runner owns one :class:`AttentionWorkspace` for its whole life and hands it to every step
in the forward context (``ForwardContext.attn_workspace``). A device backend may fill in its
choices; the defaults are the portable torch path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvferry.native.kv_write import KVWriteKernel
from kvferry.native.paged_decode import PagedDecodeKernel
from kvferry.native.paged_prefill import PagedPrefillKernel


class GatherBuffers:
    """One reusable buffer per (device, dtype) for gathered KV blocks.

    Layers run one after another, so they can share it. Reuse matters on CPU: a fresh
    multi-megabyte tensor per layer is served by mmap and page-faulted in on every step, which
    costs more than the gather itself.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, numel: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            # A normal tensor even when first needed under inference_mode, so that later
            # forwards under no_grad (or neither) may still write into it.
            with torch.inference_mode(False):
                buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]


@dataclass
class AttentionWorkspace:
    """``buffers``: scratch for gathered KV blocks, shared by all layers.

    ``decode_kernel``: serves decode rows straight from the paged pool where it
    :meth:`~kvferry.native.paged_decode.PagedDecodeKernel.supports` the layer's cache; other
    decodes go through a block gather and SDPA.

    ``prefill_kernel``: serves prefill chunks (with or without cached context) straight from
    the paged pool, causally, where it
    :meth:`~kvferry.native.paged_prefill.PagedPrefillKernel.supports` the layer's cache; other
    prefills use SDPA on the fresh K/V, or a block gather and a mask when there is context.

    ``write_kernel``: writes the step's new K/V into the pool where it
    :meth:`~kvferry.native.kv_write.KVWriteKernel.supports` the layer's cache (keys and values
    in one call); otherwise two torch index copies do.

    ``decode_gather_bytes``: when set, a decode group is gathered a few requests at a time,
    each gather at most about this many bytes, so that the gathered K/V are still in cache when
    attention reads them; None gathers each group at once.
    """

    buffers: GatherBuffers = field(default_factory=GatherBuffers)
    decode_kernel: PagedDecodeKernel | None = None
    prefill_kernel: PagedPrefillKernel | None = None
    write_kernel: KVWriteKernel | None = None
    decode_gather_bytes: int | None = None
