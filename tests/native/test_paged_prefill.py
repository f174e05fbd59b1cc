"""The paged prefill attention kernel against torch's SDPA on random data."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvferry.native.build import CSRC, load_library
from kvferry.native.paged_prefill import (
    PagedPrefillKernel,
    load_paged_prefill,
    load_paged_prefill_amx,
)

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler on this machine"
)


def _reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_ids: torch.Tensor,
    ctx: int,
    scale: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """SDPA in ``dtype`` on the gathered sequence with a causal mask shifted by ``ctx``."""
    q_len, _, head_dim = q.shape
    seq = ctx + q_len
    k = cache[0][block_ids].flatten(0, 1)[:seq].to(dtype)
    v = cache[1][block_ids].flatten(0, 1)[:seq].to(dtype)
    mask = torch.arange(seq)[None, :] <= (torch.arange(q_len) + ctx)[:, None]
    o = F.scaled_dot_product_attention(
        q.to(dtype).transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    # (16, 1, ...): a group of 16 fills a whole register tile with one query's heads on AVX2
    [(16, 4, 64, 16), (4, 4, 32, 16), (8, 1, 64, 4), (6, 2, 128, 32), (16, 1, 64, 16)],
)
@pytest.mark.parametrize(
    ("ctx", "q_len"),
    # fresh prompts (one tile, several, a partial last tile) and chunks after a cached prefix
    [(0, 2), (0, 17), (0, 150), (1, 5), (37, 64), (100, 29), (256, 96)],
)
def test_matches_sdpa(
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    ctx: int,
    q_len: int,
) -> None:
    kernel = load_paged_prefill()
    assert kernel is not None
    _check_case(kernel, dtype, heads, kv_heads, head_dim, block_size, ctx, q_len)


def _check_case(
    kernel: PagedPrefillKernel,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    ctx: int,
    q_len: int,
) -> None:
    gen = torch.Generator().manual_seed(ctx * 1000 + q_len)
    seq = ctx + q_len
    nblocks = -(-seq // block_size)
    pool = nblocks + 5
    cache = torch.randn(2, pool, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    # The request's blocks sit at scattered places in the pool.
    block_ids = torch.randperm(pool, generator=gen)[:nblocks].contiguous()
    # q as the model hands it over: a strided view into a wider row (qkv projection).
    qkv = torch.randn(q_len, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads]
    scale = head_dim**-0.5
    out = kernel(q, cache, block_ids, ctx, scale)
    assert out.shape == (q_len, heads, head_dim) and out.dtype == dtype
    ref = _reference(q, cache, block_ids, ctx, scale)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    else:  # the output's rounding to bf16 (and with AMX the probabilities')
        torch.testing.assert_close(out.float(), ref, atol=1e-2, rtol=1e-2)
        assert (out.float() - ref.to(dtype).float()).abs().max() <= 2e-2


def _built_with(first_line: str, name: str, tmp_path) -> PagedPrefillKernel:  # type: ignore[no-untyped-def]
    """The kernel built from its source with ``first_line`` put in front: the whole source,
    not an #include of it, since the build cache is keyed by the file's text."""
    src = tmp_path / f"{name}.c"
    src.write_text(first_line + "\n" + (CSRC / "paged_prefill.c").read_text())
    lib = load_library(name, source=src)
    assert lib is not None
    return PagedPrefillKernel(lib)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx512_tiles_match_sdpa(dtype: torch.dtype, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The AVX-512 build's tile shapes (one 64-row register tile, 4 vectors of 16), built
    here with the vectors split by the compiler, so CPUs without AVX-512 check them too."""
    kernel = _built_with("#define KVF_WIDE_TILES 1", "paged_prefill_wide", tmp_path)
    for shape in [(16, 4, 64, 16), (8, 1, 64, 4), (6, 2, 128, 32)]:
        for ctx, q_len in [(0, 150), (100, 29)]:
            _check_case(kernel, dtype, *shape, ctx, q_len)


def _hidden_avx512_kernel(tmp_path) -> PagedPrefillKernel:  # type: ignore[no-untyped-def]
    """The build an AVX2-only CPU gets (16-row register tiles, the portable 2^x), made here by
    hiding AVX-512 from the source, so that AVX-512 CPUs check it too."""
    return _built_with("#undef __AVX512F__", "paged_prefill_avx2", tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_tiles_match_sdpa(dtype: torch.dtype, tmp_path) -> None:  # type: ignore[no-untyped-def]
    kernel = _hidden_avx512_kernel(tmp_path)
    for shape in [(16, 4, 64, 16), (8, 1, 64, 4), (6, 2, 128, 32)]:
        for ctx, q_len in [(0, 150), (100, 29)]:
            _check_case(kernel, dtype, *shape, ctx, q_len)


@pytest.mark.parametrize("build", ["native", "avx2"])
def test_running_max_moves_and_stays(build: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Scores that grow along the sequence, by more than the kernel's slack for its running
    max in some tiles and less in others, row by row (rows of one vector parting ways), and
    then fall (about two thirds of the tiles move some row's max): against a float64
    reference, as close as torch's fp32 SDPA."""
    kernel = load_paged_prefill() if build == "native" else _hidden_avx512_kernel(tmp_path)
    assert kernel is not None
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size, ctx, q_len = 16, 4, 64, 16, 300, 200
    seq = ctx + q_len
    nblocks = -(-seq // block_size)
    cache = torch.randn(2, nblocks + 3, block_size, kv_heads, head_dim, generator=gen)
    block_ids = torch.randperm(nblocks + 3, generator=gen)[:nblocks].contiguous()
    # Key norms rise to 40x at position 250, then fall: scores past 100 (natural units), more
    # than fp32 could hold as 2^(score - first max).
    t = torch.arange(seq, dtype=torch.float32)
    growth = 1.0 + 39.0 * torch.minimum(t / 250.0, (seq - t) / (seq - 250.0)).clamp(min=0.0)
    cache[0, block_ids[t.long() // block_size], t.long() % block_size] *= growth[:, None, None]
    q = torch.randn(q_len, heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = kernel(q, cache, block_ids, ctx, scale)
    ref = _reference(q, cache, block_ids, ctx, scale, torch.float64)
    sdpa_err = (_reference(q, cache, block_ids, ctx, scale).double() - ref).abs().max().item()
    assert 0 < (out.double() - ref).abs().max().item() <= 2 * sdpa_err


def test_supports() -> None:
    kernel = load_paged_prefill()
    assert kernel is not None
    cache = torch.zeros(2, 4, 16, 2, 64)
    assert kernel.supports(cache, torch.zeros(3, 8, 64))
    assert not kernel.supports(cache, torch.zeros(3, 8, 64, dtype=torch.bfloat16))
    assert not kernel.supports(torch.zeros(2, 4, 16, 2, 24), torch.zeros(3, 8, 24))
    assert not kernel.supports(cache.to(torch.float16), torch.zeros(3, 8, 64).half())
    # The query heads of one kv head share one work item of 64 rows.
    assert kernel.max_group == 64
    one_kv_head = torch.zeros(2, 4, 16, 1, 64)
    assert kernel.supports(one_kv_head, torch.zeros(3, kernel.max_group, 64))
    assert not kernel.supports(one_kv_head, torch.zeros(3, kernel.max_group + 1, 64))


def amx_kernel() -> PagedPrefillKernel:
    """The AMX kernel, or a skip where this CPU (or this process) has no AMX tiles."""
    kernel = load_paged_prefill_amx()
    if kernel is None:
        pytest.skip("no AMX tiles on this CPU (or no compiler for them)")
    return kernel


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    # Qwen3-0.6B's shape, the mid model's, a group filling a whole work item (32 rows), one
    # that does not divide it, small blocks, the widest head_dim
    [(16, 8, 128, 16), (16, 4, 64, 16), (32, 1, 64, 16), (6, 2, 32, 4), (3, 1, 64, 32),
     (4, 2, 256, 16)],
)  # fmt: skip
@pytest.mark.parametrize(
    ("ctx", "q_len"),
    # one query, partial and whole work items, several key blocks (128) with a partial last
    # one, chunks after a cached prefix that is and is not a multiple of 32
    [(0, 1), (0, 2), (0, 17), (0, 150), (1, 5), (37, 64), (100, 29), (256, 96), (0, 300)],
)
def test_amx_matches_sdpa(
    heads: int, kv_heads: int, head_dim: int, block_size: int, ctx: int, q_len: int
) -> None:
    kernel = amx_kernel()
    _check_case(kernel, torch.bfloat16, heads, kv_heads, head_dim, block_size, ctx, q_len)


def test_amx_supports() -> None:
    kernel = amx_kernel()
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    assert kernel.supports(cache, torch.zeros(3, 8, 64, dtype=torch.bfloat16))
    # bf16 only: fp32 keeps the fp32 kernel's arithmetic
    assert not kernel.supports(cache.float(), torch.zeros(3, 8, 64))
    # head_dim: whole tiles of 32, at most 256
    for d in (48, 16, 512):
        assert not kernel.supports(
            torch.zeros(2, 4, 16, 2, d, dtype=torch.bfloat16),
            torch.zeros(3, 8, d, dtype=torch.bfloat16),
        )
    # The query heads of one kv head share one work item of 32 rows.
    assert kernel.max_group == 32
    one = torch.zeros(2, 4, 16, 1, 64, dtype=torch.bfloat16)
    assert kernel.supports(one, torch.zeros(3, 32, 64, dtype=torch.bfloat16))
    assert not kernel.supports(one, torch.zeros(3, 33, 64, dtype=torch.bfloat16))


def test_amx_layout_buffer_kept_between_calls() -> None:
    """The keys' and values' layout lives in one buffer that grows to the longest sequence
    and is reused (a fresh one per call would be paged in every time); a shorter call after a
    longer one still reads only its own keys."""
    kernel = amx_kernel()
    _check_case(kernel, torch.bfloat16, 16, 8, 128, 16, 256, 96)
    buf = kernel._layout  # type: ignore[attr-defined]
    _check_case(kernel, torch.bfloat16, 16, 8, 128, 16, 0, 17)
    assert kernel._layout.data_ptr() == buf.data_ptr()  # type: ignore[attr-defined]
    _check_case(kernel, torch.bfloat16, 16, 8, 128, 16, 1000, 300)
    assert kernel._layout.numel() > buf.numel()  # type: ignore[attr-defined]


@pytest.mark.parametrize("amx", [False, True])
def test_writes_into_the_rows_it_is_given(amx: bool) -> None:
    """``out``: a chunk's rows of a mixed batch's output receive the same bits a fresh output
    would, the rows around them stay as they were; a misshapen ``out`` is refused."""
    kernel = amx_kernel() if amx else load_paged_prefill()
    assert kernel is not None
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 12, 16, 2, 64, generator=gen).bfloat16()
    block_ids = torch.randperm(12, generator=gen)[:8].contiguous()
    q = torch.randn(40, 8, 64, generator=gen).bfloat16()
    batch = torch.full((50, 8, 64), 5.0, dtype=torch.bfloat16)
    got = kernel(q, cache, block_ids, 60, 0.125, out=batch[6:46])
    assert got.data_ptr() == batch[6:46].data_ptr()
    assert torch.equal(batch[6:46], kernel(q, cache, block_ids, 60, 0.125))
    assert (batch[:6] == 5).all() and (batch[46:] == 5).all()
    with pytest.raises(ValueError, match="out must be"):
        kernel(q, cache, block_ids, 60, 0.125, out=batch[6:45])
