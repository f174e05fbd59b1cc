"""The K/V write kernel: the step's new keys and values land where the torch index copies put
them, in either pool layout and any dtype, and a slot outside the pool writes nothing."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvferry.kv_layout import KVCacheLayout, layout_of
from kvferry.model.attention import Attention
from kvferry.native.kv_write import load_kv_write

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler on this machine"
)

BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 6, 4, 3, 8


def _pool(layout: KVCacheLayout, dtype: torch.dtype, blocks: int = BLOCKS) -> torch.Tensor:
    shape = (2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    pool = layout.allocate(
        shape, dtype, torch.device("cpu"), lambda s, d, dev: torch.zeros(s, dtype=d, device=dev)
    )
    pool.copy_(torch.randn(shape).to(dtype))
    assert layout_of(pool) is layout
    return pool


def _step(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as the layers pass them: views into one wider qkv row, so rows are strided."""
    qkv = torch.randn(n, (2 + 2 * KV_HEADS) * HEAD_DIM).to(dtype)
    k = qkv[:, 2 * HEAD_DIM : (2 + KV_HEADS) * HEAD_DIM].view(n, KV_HEADS, HEAD_DIM)
    v = qkv[:, (2 + KV_HEADS) * HEAD_DIM :].view(n, KV_HEADS, HEAD_DIM)
    return k, v


@pytest.mark.parametrize("layout", list(KVCacheLayout))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_writes_what_the_index_copies_write(layout: KVCacheLayout, dtype: torch.dtype) -> None:
    kernel = load_kv_write()
    assert kernel is not None
    k, v = _step(5, dtype)
    # slots across blocks, inside one block, and the pool's last one
    slots = torch.tensor([0, 7, 9, 10, BLOCKS * BLOCK_SIZE - 1], dtype=torch.int64)
    got, want = _pool(layout, dtype), _pool(layout, dtype)
    want.copy_(got)
    assert kernel.supports(got, k, v, slots)
    kernel(got, k, v, slots)
    Attention._write(want, k, v, slots)
    assert torch.equal(got, want)
    assert not torch.equal(got, _pool(layout, dtype))  # something was written


@pytest.mark.parametrize("layout", list(KVCacheLayout))
def test_a_prefill_split_over_threads_writes_what_the_index_copies_write(
    layout: KVCacheLayout,
) -> None:
    """A step of many rows (a prefill chunk) is written by several threads at once."""
    kernel = load_kv_write()
    assert kernel is not None
    n, blocks = 301, 100
    k, v = _step(n, torch.bfloat16)
    slots = torch.randperm(blocks * BLOCK_SIZE)[:n].contiguous()
    got = _pool(layout, torch.bfloat16, blocks)
    want = got.clone()
    kernel(got, k, v, slots)
    Attention._write(want, k, v, slots)
    assert torch.equal(got, want)


@pytest.mark.parametrize("layout", list(KVCacheLayout))
@pytest.mark.parametrize("bad", [-1, BLOCKS * BLOCK_SIZE])
def test_a_slot_outside_the_pool_writes_nothing(layout: KVCacheLayout, bad: int) -> None:
    kernel = load_kv_write()
    assert kernel is not None
    k, v = _step(3, torch.float32)
    pool = _pool(layout, torch.float32)
    before = pool.clone()
    with pytest.raises(IndexError, match="outside the pool"):
        kernel(pool, k, v, torch.tensor([1, bad, 2], dtype=torch.int64))
    assert torch.equal(pool, before)


def test_supports_only_dense_pools_and_contiguous_heads() -> None:
    kernel = load_kv_write()
    assert kernel is not None
    k, v = _step(2, torch.float32)
    pool = _pool(KVCacheLayout.NHD, torch.float32)
    slots = torch.tensor([3, 4], dtype=torch.int64)
    assert kernel.supports(pool, k, v, slots)
    assert not kernel.supports(pool[:, :3], k, v, slots)  # a slice is dense in no layout
    assert not kernel.supports(pool, k.bfloat16(), v.bfloat16(), slots)  # another dtype
    assert not kernel.supports(pool, k.transpose(1, 2).contiguous().transpose(1, 2), v, slots)
    assert not kernel.supports(pool, k, v, slots.int())  # int32 slots: the index copies
    assert not kernel.supports(pool, k, v, torch.tensor([3, 9, 4])[::2])  # strided slots
