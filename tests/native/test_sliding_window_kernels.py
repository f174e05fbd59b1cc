"""The paged decode and prefill kernels with a sliding window, against SDPA with a window
mask; blocks wholly outside every query's window are NaN, so a kernel that reads one fails."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvferry.native.paged_decode import Variant
from kvferry.native.paged_prefill import load_paged_prefill
from tests.native.test_paged_decode_kernel import decode_kernel, runnable
from tests.native.test_paged_prefill import amx_kernel

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler on this machine"
)


def _reference(
    q: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, ctx: int, window: int
) -> torch.Tensor:
    """fp32 SDPA: the query at position p sees keys p - window + 1 .. p."""
    q_len, _, head_dim = q.shape
    seq = ctx + q_len
    k = cache[0][block_ids].flatten(0, 1)[:seq].float().nan_to_num(0.0)
    v = cache[1][block_ids].flatten(0, 1)[:seq].float().nan_to_num(0.0)
    keys = torch.arange(seq)[None, :]
    pos = (torch.arange(q_len) + ctx)[:, None]
    mask = (keys <= pos) & (keys > pos - window)
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=head_dim**-0.5,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def _pool(
    seq: int, ctx: int, window: int, block_size: int, kv_heads: int, head_dim: int,
    dtype: torch.dtype, seed: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """A pool holding one sequence in scattered blocks, the blocks before the first query's
    window poisoned with NaN (as the null blocks of a sliding-window group may hold)."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = -(-seq // block_size)
    pool = nblocks + 3
    cache = torch.randn(2, pool, block_size, kv_heads, head_dim, generator=gen)
    block_ids = torch.randperm(pool, generator=gen)[:nblocks].contiguous()
    first_key = max(0, ctx - window + 1)
    for i in range(first_key // block_size):
        cache[:, block_ids[i]] = float("nan")
    return cache.to(dtype), block_ids


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("dtype", "amx"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(8, 2, 16), (4, 4, 4)])
@pytest.mark.parametrize(
    ("ctx", "q_len", "window"),
    # fresh prompts longer than the window, windows smaller than a key tile (16) and spanning
    # several, chunks whose first queries' windows end before the chunk, window 1; long chunks
    # whose work items hold several query tiles each, over several key blocks (120 keys)
    [(0, 40, 7), (0, 70, 20), (33, 29, 16), (100, 9, 5), (64, 64, 31), (50, 20, 1), (3, 4, 100),
     (300, 400, 150), (0, 512, 130), (1000, 256, 37)],
)  # fmt: skip
def test_prefill_window(
    dtype: torch.dtype, heads: int, kv_heads: int, block_size: int, ctx: int, q_len: int,
    window: int, amx: bool,
) -> None:  # fmt: skip
    kernel = amx_kernel() if amx else load_paged_prefill()
    assert kernel is not None
    head_dim = 32
    cache, block_ids = _pool(ctx + q_len, ctx, window, block_size, kv_heads, head_dim, dtype, ctx)
    q = torch.randn(q_len, heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = kernel(q, cache, block_ids, ctx, head_dim**-0.5, window)
    _close(out, _reference(q, cache, block_ids, ctx, window), dtype)


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("window", "lens"),
    # Six requests: one work item each. Two long ones: their windowed keys split into parts
    # (from the window's first block on), merged afterwards.
    [(w, [1, 6, 17, 40, 95, 130]) for w in (1, 5, 16, 37)] + [(150, [300, 700]), (37, [700])],
)
def test_decode_window(variant: Variant, dtype: torch.dtype, window: int, lens: list[int]) -> None:
    kernel = decode_kernel(variant)
    heads, kv_heads, head_dim, block_size = 8, 2, 32, 16
    caches, tables = [], []
    pool_blocks = sum(-(-n // block_size) for n in lens)
    cache = torch.empty(2, pool_blocks, block_size, kv_heads, head_dim)
    width = max(-(-n // block_size) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    gen = torch.Generator().manual_seed(window)
    order = torch.randperm(pool_blocks, generator=gen)
    used = 0
    for r, n in enumerate(lens):
        c, ids = _pool(n, n - 1, window, block_size, kv_heads, head_dim, torch.float32, r)
        for i in range(len(ids)):
            cache[:, order[used]] = c[:, ids[i]]
            table[r, i] = order[used]
            used += 1
        caches.append(c)
        tables.append(ids)
    cache = cache.to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    out = kernel(q, cache, table, torch.tensor(lens), head_dim**-0.5, window)
    for r, n in enumerate(lens):
        ref = _reference(q[r : r + 1], cache, table[r, : -(-n // block_size)], n - 1, window)
        _close(out[r : r + 1], ref, dtype)
