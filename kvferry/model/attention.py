"""Paged attention over the engine's KV pool, with the KV connector's per-layer hooks.

Each layer's cache has shape ``(2, num_blocks, block_size, num_kv_heads, head_dim)`` (index 0
keys, 1 values), its memory in either layout of :mod:`kvferry.kv_layout`. A forward writes
the step's new K/V at ``slot_mapping`` and then attends following the plan in
:class:`~kvferry.model.attention_metadata.AttentionMetadata`. Only device-agnostic torch ops
are used, so the same code runs on CPU and CUDA, except for the decode and prefill kernels
that the runner's workspace may offer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvferry.kv_layout import KVCacheLayout, layout_of
from kvferry.model.attention_metadata import DecodePlan, PrefillPlan
from kvferry.model.attention_workspace import AttentionWorkspace, GatherBuffers
from kvferry.model.forward_context import get_forward_context

# From this many tokens (context and chunk), a chunk with context attends in two parts merged
# by log-sum-exp (Attention._context_then_own) rather than one masked SDPA over the sequence;
# in shorter ones the merge and the copy of the chunk's keys per query head cost more than
# the skipped upper triangle saves (docs/benchmarks.md, "Measured facts").
SPLIT_CONTEXT_MIN_SEQ = 2560

# torch's CPU flash attention with its log-sum-exp (a private op: None where a build lacks it).
_FLASH_LSE: Any = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fill(dst: torch.Tensor, rows: torch.Tensor) -> None:
    """``rows`` into ``dst``, unless a kernel already wrote them there."""
    if rows.data_ptr() != dst.data_ptr():
        dst.copy_(rows)


def _gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, buffers: GatherBuffers
) -> torch.Tensor:
    """Copy blocks ``block_ids`` (1-D) of both K and V into ``buffers``; returns a tensor shaped
    ``(2, len(block_ids) * block_size, num_kv_heads, head_dim)`` (with ``HND`` a copy of the
    gathered blocks with tokens outside heads; with ``NHD`` a view of the buffer)."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    per_block = block_size * kv_heads * head_dim
    n = block_ids.numel()
    out = buffers.get(2 * n * per_block, kv_cache.device, kv_cache.dtype).view(2, n, per_block)
    nhd = layout_of(kv_cache) is KVCacheLayout.NHD
    # In memory order, where each block is one run of per_block elements.
    blocks = (kv_cache if nhd else kv_cache.transpose(2, 3)).view(2, num_blocks, per_block)
    torch.index_select(blocks, 1, block_ids, out=out)
    if nhd:  # the blocks are token rows already
        return out.view(2, n * block_size, kv_heads, head_dim)
    hnd = out.view(2, n, kv_heads, block_size, head_dim)
    return hnd.transpose(2, 3).reshape(2, n * block_size, kv_heads, head_dim)


def _wanted_prefills(prefills: list[PrefillPlan], rows: list[int]) -> list[PrefillPlan]:
    """The part of each chunk that reaches ``rows``: its queries from the first wanted row on,
    as a chunk whose context ends just before it (its keys are all in the cache by then).
    A chunk with no wanted row is dropped."""
    wanted = []
    for p in prefills:
        first = min((r for r in rows if p.token_start <= r < p.token_stop), default=None)
        if first is None:
            continue
        if first == p.token_start:
            wanted.append(p)
            continue
        wanted.append(
            PrefillPlan(
                req_index=p.req_index,
                token_start=first,
                token_stop=p.token_stop,
                context_len=p.context_len + first - p.token_start,
                seq_len=p.seq_len,
                block_ids=p.block_ids,
            )
        )
    return wanted


class Attention(nn.Module):
    """Causal multi-head attention with grouped KV heads over a paged KV cache.

    ``forward(q, k, v)`` takes the flattened tokens of the whole step — ``q`` of shape
    ``[num_tokens, num_heads * head_dim]`` (or ``[num_tokens, num_heads, head_dim]``), ``k``/``v``
    likewise with ``num_kv_heads`` — already projected and rotated, and returns
    ``[num_tokens, num_heads * head_dim]``; ``forward(q, k, v, out_rows)`` (long flat row
    indices) returns those rows' alone, in that order, and a prefill chunk then attends only
    from its first such row on (every row's K/V still reach the cache and the connector).
    It reads the active forward context: this layer's
    :class:`AttentionMetadata` (``ctx.metadata_for``), its cache ``ctx.kv_caches[layer_name]``
    and the runner's :class:`~kvferry.model.attention_workspace.AttentionWorkspace` (scratch memory
    and the device's decode kernel).

    With no metadata (a warm-up or profiling run) the batch is treated as one causal sequence
    and the cache is left alone.

    ``sliding_window`` (a sliding-window layer): a query at position ``p`` sees only the keys
    at ``p - sliding_window + 1 .. p``, in every path. Its metadata is its KV cache group's
    (``ForwardContext.metadata_for``), whose block table may hold null blocks for the keys
    that have left the window; no path reads them.

    KV connector hooks, when ``ctx.kv_connector`` has metadata bound for the step:
    ``wait_for_layer_load(layer_name)`` before the cache is touched, and
    ``save_kv_layer(layer_name, kv_cache, attn_metadata)`` once the new K/V are in the cache
    and attention is computed.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_name: str,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.layer_name = layer_name
        self.scale = head_dim**-0.5 if scale is None else scale
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n = q.shape[0]
        # (a view costs microseconds at decode sizes; callers often pass heads already)
        if q.dim() == 2:
            q = q.view(n, self.num_heads, self.head_dim)
        if k.dim() == 2:
            k = k.view(n, self.num_kv_heads, self.head_dim)
        if v.dim() == 2:
            v = v.view(n, self.num_kv_heads, self.head_dim)
        ctx = get_forward_context()
        meta = ctx.metadata_for(self.layer_name)
        if meta is None:
            out = self._causal(q, k, v).reshape(n, -1)
            return out if out_rows is None else out[out_rows]

        connector = ctx.kv_connector
        if connector is not None and not connector.has_connector_metadata():
            connector = None
        if connector is not None:
            connector.wait_for_layer_load(self.layer_name)
        kv_cache = ctx.kv_caches[self.layer_name]
        ws = ctx.attn_workspace
        if ws.write_kernel is not None and ws.write_kernel.supports(
            kv_cache, k, v, meta.slot_mapping
        ):
            ws.write_kernel(kv_cache, k, v, meta.slot_mapping)
        else:
            self._write(kv_cache, k, v, meta.slot_mapping)
        prefills = meta.prefills
        if out_rows is not None:
            prefills = _wanted_prefills(prefills, out_rows.tolist())
        out = self._attend(q, k, v, kv_cache, meta.decodes, prefills, ws).reshape(n, -1)
        if connector is not None:
            connector.save_kv_layer(self.layer_name, kv_cache, meta)
        return out if out_rows is None else out[out_rows]

    @staticmethod
    def _write(
        kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        if layout_of(kv_cache) is KVCacheLayout.NHD:
            flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # (2, num_slots, kv_heads, d)
            flat[0].index_copy_(0, slots, k)
            flat[1].index_copy_(0, slots, v)
            return
        # HND: a slot's heads are block_size rows apart; address (block, offset) directly.
        block_size = kv_cache.shape[2]
        index = (slots // block_size, slots % block_size)
        kv_cache[0].index_put_(index, k)
        kv_cache[1].index_put_(index, v)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        decodes: list[DecodePlan],
        prefills: list[PrefillPlan],
        ws: AttentionWorkspace,
    ) -> torch.Tensor:
        """Each plan's rows of one output tensor (rows of no plan are left unset); a batch that
        is a single plan returns that plan's result."""
        n = q.shape[0]
        if (
            not decodes
            and len(prefills) == 1
            and prefills[0].token_stop - prefills[0].token_start == n
        ):
            return self._prefill(q, k, v, kv_cache, prefills[0], ws)
        if len(decodes) == 1 and not prefills and decodes[0].token_range == (0, n):
            return self._decode(q, kv_cache, decodes[0], ws)
        out = torch.empty_like(q)
        for plan in decodes:
            if plan.token_range is not None:
                start, stop = plan.token_range
                dst = out[start:stop]
                _fill(dst, self._decode(q[start:stop], kv_cache, plan, ws, dst))
            else:
                assert plan.token_index is not None
                rows = self._decode(q[plan.token_index], kv_cache, plan, ws)
                out.index_copy_(0, plan.token_index, rows)
        for p in prefills:
            dst = out[p.token_start : p.token_stop]
            _fill(dst, self._prefill(q, k, v, kv_cache, p, ws, dst))
        return out

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: DecodePlan,
        ws: AttentionWorkspace,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``q``: the group's rows ``[num_reqs, heads, d]``. The query heads that share a KV
        head are laid along the query-length axis, so one plain SDPA call covers GQA without
        repeating K/V. The decode kernel writes into ``out`` when given (e.g. the group's
        rows of a batch-wide output); the other paths return a new tensor.

        With ``ws.decode_gather_bytes`` the group is processed a few requests at a time so
        that the gathered K/V are still in cache when attention reads them; one big gather that
        spills to DRAM is read back from DRAM at about the cost of the gather itself.
        """
        kernel = ws.decode_kernel
        window = self.sliding_window
        if kernel is not None and kernel.supports(kv_cache, q):
            return kernel(q, kv_cache, plan.block_table, plan.seq_lens, self.scale, window, out=out)
        nreq, nblocks = plan.block_table.shape
        qg = q.view(nreq, self.num_kv_heads, self.group, self.head_dim)
        mask = plan.additive_mask(q.dtype, window)
        step = nreq
        if ws.decode_gather_bytes is not None:
            per_req = 2 * kv_cache[0, 0].numel() * nblocks * kv_cache.element_size()
            step = max(1, ws.decode_gather_bytes // per_req)
        if step >= nreq:
            return self._decode_chunk(qg, kv_cache, plan.block_table, mask, ws.buffers).view(
                q.shape
            )
        res = torch.empty_like(qg)
        for start in range(0, nreq, step):
            rows = slice(start, start + step)
            m = None if mask is None else mask[rows]
            res[rows] = self._decode_chunk(
                qg[rows], kv_cache, plan.block_table[rows], m, ws.buffers
            )
        return res.view(q.shape)

    def _decode_chunk(
        self,
        qg: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        mask: torch.Tensor | None,
        buffers: GatherBuffers,
    ) -> torch.Tensor:
        nreq = block_table.shape[0]
        kv = _gather_blocks(kv_cache, block_table.flatten(), buffers)
        kv = kv.view(2, nreq, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)
        return F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=mask, scale=self.scale)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        p: PrefillPlan,
        ws: AttentionWorkspace,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One request's chunk; its K/V are already in ``kv_cache``. A prefill kernel reads
        the whole sequence from the pool in place; otherwise a fresh sequence attends to its
        own ``k``/``v`` and a chunk with context gathers its blocks and masks (from
        :data:`SPLIT_CONTEXT_MIN_SEQ` tokens on a CPU: :meth:`_context_then_own`). The kernel
        writes into ``out`` when given, as :meth:`_decode`'s does."""
        qs = q[p.token_start : p.token_stop]
        kernel = ws.prefill_kernel
        window = self.sliding_window
        if kernel is not None and kernel.supports(kv_cache, qs):
            return kernel(qs, kv_cache, p.block_ids, p.context_len, self.scale, window, out=out)
        if p.context_len == 0:
            return self._causal(
                qs, k[p.token_start : p.token_stop], v[p.token_start : p.token_stop]
            )
        kv = _gather_blocks(kv_cache, p.block_ids, ws.buffers)[:, : p.seq_len].transpose(1, 2)
        if (
            p.seq_len >= SPLIT_CONTEXT_MIN_SEQ
            and q.is_cpu
            and _FLASH_LSE
            and not p.needs_window(window)
        ):
            return self._context_then_own(qs, kv[:, :, : p.context_len], kv[:, :, p.context_len :])
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0),
            kv[0].unsqueeze(0),
            kv[1].unsqueeze(0),
            attn_mask=p.window_mask(window) if p.needs_window(window) else p.mask,
            scale=self.scale,
            enable_gqa=self.group > 1,
        )
        return o.squeeze(0).transpose(0, 1)

    def _context_then_own(
        self, q: torch.Tensor, ctx: torch.Tensor, own: torch.Tensor
    ) -> torch.Tensor:
        """A chunk with context as two attentions merged by their log-sum-exps: the whole
        context, which every query sees (no mask; the query heads that share a KV head stacked
        along the query axis, so each KV head is read once for all of them), and the chunk's
        own keys, causal (the upper triangle skipped). ``q`` ``[T, heads, d]``; ``ctx``, ``own``
        ``[2, kv_heads, tokens, d]``. The masked SDPA over the whole sequence computes the
        upper triangle and reads each KV head once per query head."""
        n, heads, d = q.shape
        kv_heads, group = self.num_kv_heads, self.group
        qh = q.transpose(0, 1).contiguous()  # [heads, T, d]: the groups' rows stacked
        o1, l1 = _FLASH_LSE(
            qh.view(1, kv_heads, group * n, d), ctx[0:1], ctx[1:2], scale=self.scale
        )
        own_k, own_v = own[0].unsqueeze(0), own[1].unsqueeze(0)
        if group > 1:
            own_k = own_k.repeat_interleave(group, dim=1)
            own_v = own_v.repeat_interleave(group, dim=1)
        o2, l2 = _FLASH_LSE(qh.unsqueeze(0), own_k, own_v, is_causal=True, scale=self.scale)
        l1, l2 = l1.reshape(heads, n, 1), l2.reshape(heads, n, 1)
        top = torch.maximum(l1, l2)
        w1, w2 = torch.exp(l1 - top), torch.exp(l2 - top)
        o = o1.reshape(heads, n, d).float() * w1
        o.addcmul_(o2.reshape(heads, n, d).float(), w2).div_(w1 + w2)
        return o.to(q.dtype).transpose(0, 1)

    def _causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Self-attention of one fresh sequence: ``[T, heads, d]`` in, ``[T, heads, d]`` out."""
        n, window = q.shape[0], self.sliding_window
        mask = None
        if window is not None and n > window:
            pos = torch.arange(n, device=q.device)
            d = pos[:, None] - pos[None, :]
            mask = (d >= 0) & (d < window)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.group > 1,
        )
        return o.squeeze(0).transpose(0, 1)
