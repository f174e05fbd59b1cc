"""The paged decode and prefill kernels read an HND pool (heads outside tokens inside a block)
exactly as they read the same values in an NHD pool, and both match SDPA."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvferry.kv_layout import KVCacheLayout, layout_of
from kvferry.native.paged_decode import Variant, load_paged_decode
from kvferry.native.paged_prefill import load_paged_prefill
from kvferry.worker.cpu_features import cpu_features
from tests.native.test_paged_decode_kernel import decode_kernel, runnable
from tests.native.test_paged_prefill import amx_kernel
from tests.native.test_sliding_window_kernels import _reference as windowed_reference

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler on this machine"
)


def _as_hnd(cache: torch.Tensor) -> torch.Tensor:
    shape = tuple(cache.shape)
    hnd = KVCacheLayout.HND.allocate(
        shape, cache.dtype, cache.device, lambda s, d, dev: torch.zeros(s, dtype=d, device=dev)
    )
    hnd.copy_(cache)
    assert layout_of(hnd) is KVCacheLayout.HND and not hnd.is_contiguous()
    return hnd


def _reference(
    q: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, ctx: int, window: int | None
) -> torch.Tensor:
    """fp32 SDPA over the gathered sequence (no window: one wider than the sequence)."""
    return windowed_reference(q, cache, block_ids, ctx, window or ctx + q.shape[0] + 1)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("dtype", "amx"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(8, 2, 16), (4, 4, 4), (6, 3, 8)])
@pytest.mark.parametrize(("ctx", "q_len", "window"), [(0, 40, None), (37, 29, None), (20, 30, 9)])
def test_prefill_reads_hnd_like_nhd(
    dtype: torch.dtype, heads: int, kv_heads: int, block_size: int, ctx: int, q_len: int,
    window: int | None, amx: bool,
) -> None:  # fmt: skip
    kernel = amx_kernel() if amx else load_paged_prefill()
    assert kernel is not None
    head_dim = 32
    gen = torch.Generator().manual_seed(ctx + q_len)
    nblocks = -(-(ctx + q_len) // block_size)
    pool = nblocks + 3
    nhd = torch.randn(2, pool, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    block_ids = torch.randperm(pool, generator=gen)[:nblocks].contiguous()
    q = torch.randn(q_len, heads, head_dim, generator=gen).to(dtype)
    hnd = _as_hnd(nhd)
    assert kernel.supports(hnd, q)
    out = kernel(q, hnd, block_ids, ctx, head_dim**-0.5, window)
    assert torch.equal(out, kernel(q, nhd, block_ids, ctx, head_dim**-0.5, window))
    _close(out, _reference(q, nhd, block_ids, ctx, window), dtype)


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_reqs", [3, 40])  # one head per item, and whole requests
@pytest.mark.parametrize("window", [None, 11])
def test_decode_reads_hnd_like_nhd(
    variant: Variant, dtype: torch.dtype, num_reqs: int, window: int | None
) -> None:
    kernel = decode_kernel(variant)
    heads, kv_heads, head_dim, block_size = 8, 4, 32, 16
    gen = torch.Generator().manual_seed(num_reqs)
    lens = torch.randint(1, 70, (num_reqs,), generator=gen)
    width = int(-(-lens.max() // block_size))
    pool = num_reqs * width + 2
    nhd = torch.randn(2, pool, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(pool, generator=gen)[: num_reqs * width].view(num_reqs, width)
    q = torch.randn(num_reqs, heads, head_dim, generator=gen).to(dtype)
    hnd = _as_hnd(nhd)
    out = kernel(q, hnd, table, lens, head_dim**-0.5, window)
    # A whole-request item (NHD, many requests) sums in the same order as one head per item.
    assert torch.equal(out, kernel(q, nhd, table, lens, head_dim**-0.5, window))
    for r in range(num_reqs):
        n = int(lens[r])
        ref = _reference(q[r : r + 1], nhd, table[r, : -(-n // block_size)], n - 1, window)
        _close(out[r : r + 1], ref, dtype)


def test_kernels_refuse_a_cache_dense_in_no_layout() -> None:
    decode, prefill = load_paged_decode(cpu_features().isa), load_paged_prefill()
    assert decode is not None and prefill is not None
    cache = torch.zeros(2, 4, 16, 2, 32)
    q = torch.zeros(3, 4, 32)
    for kernel in (decode, prefill):
        assert kernel.supports(cache, q) and kernel.supports(_as_hnd(cache), q)
        assert not kernel.supports(cache[:, :, :8], q)  # every other token row missing
