"""The paged decode kernel against an fp64 reference, in every variant this CPU runs, over the
shapes that pick its paths: head dims a multiple of 16 (AVX-512 items), of 8 only (AVX2
items, also under the AVX-512 variant) or of neither (the portable ones), query-head groups
of 1, 2, 3 and 8 (pairs of query heads and a single one left over), lengths that end inside
a 4-token run, and request counts that split a request's heads over several items or not."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kvferry.native.build import load_library
from kvferry.native.paged_decode import PagedDecodeKernel, Variant, load_paged_decode
from kvferry.worker.cpu_features import cpu_features
from tests.native.test_f32_linear import runnable

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler on this machine"
)

BLOCK = 16


def decode_kernel(variant: Variant | None = None) -> PagedDecodeKernel:
    """The kernel in ``variant`` (default: the engine's, at this CPU's level)."""
    kernel = load_paged_decode(variant or cpu_features().isa)
    assert kernel is not None
    return kernel


SHORT = (1, 3, 17, 64, 130)
# Long enough for a call of a few requests to split each one's keys into parts (4 blocks and
# up, 8 at most), merged afterwards; 70 tokens makes one part, 1,000 the most.
LONG = (1000, 70, 333)


def _case(
    num_reqs: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    base: tuple[int, ...] = SHORT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor([base[r % len(base)] + r for r in range(num_reqs)])
    width = int(-(-lens.max() // BLOCK))
    pool = num_reqs * width + 2
    cache = torch.randn(2, pool, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(pool, generator=gen)[: num_reqs * width].view(num_reqs, width)
    q = torch.randn(num_reqs, heads, head_dim, generator=gen).to(dtype)
    return q, cache, table.contiguous(), lens


def _reference(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    out = []
    for r, n in enumerate(lens.tolist()):
        k = cache[0][table[r]].flatten(0, 1)[:n].double()
        v = cache[1][table[r]].flatten(0, 1)[:n].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", q[r].double(), k) * q.shape[-1] ** -0.5
        out.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 40, 36])
@pytest.mark.parametrize(("heads", "kv_heads"), [(16, 8), (12, 4), (4, 4), (8, 1)])
@pytest.mark.parametrize(
    ("num_reqs", "base"), [(1, SHORT), (3, SHORT), (40, SHORT), (1, LONG), (3, LONG)]
)
def test_decode_kernel_matches_the_reference(
    variant: Variant,
    dtype: torch.dtype,
    head_dim: int,
    heads: int,
    kv_heads: int,
    num_reqs: int,
    base: tuple[int, ...],
) -> None:
    kernel = decode_kernel(variant)
    q, cache, table, lens = _case(num_reqs, heads, kv_heads, head_dim, dtype, heads, base)
    out = kernel(q, cache, table, lens, head_dim**-0.5)
    ref = _reference(q, cache, table, lens)
    tol = 2e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_reqs", "base"), [(1, SHORT), (3, SHORT), (8, SHORT), (2, LONG)])
def test_decode_kernel_gives_the_same_bits_whatever_the_thread_count(
    variant: Variant, dtype: torch.dtype, num_reqs: int, base: tuple[int, ...]
) -> None:
    """The thread count decides how a request's heads are split into work items; each head's
    arithmetic, and how a long request's keys are split into parts, must not depend on it."""
    kernel = decode_kernel(variant)
    q, cache, table, lens = _case(num_reqs, 16, 8, 128, dtype, num_reqs, base)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(kernel(q, cache, table, lens, 128**-0.5))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_a_variant_outside_the_build_is_refused() -> None:
    lib = load_library("paged_decode")
    assert lib is not None
    assert "scalar" in PagedDecodeKernel(lib, "scalar").compiled()
    with pytest.raises(ValueError, match="not in this build"):
        PagedDecodeKernel(lib, "sve")  # type: ignore[arg-type]
    assert load_paged_decode("sve") is None  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_writes_into_the_rows_it_is_given(dtype: torch.dtype) -> None:
    """``out``: the rows of a wider output (a mixed batch's) receive the same bits a fresh
    output would, the rows around them stay as they were; a misshapen ``out`` is refused."""
    kernel = decode_kernel()
    q, cache, table, lens = _case(3, 16, 8, 128, dtype, 7)
    batch = torch.full((7, 16, 128), 5.0, dtype=dtype)
    got = kernel(q, cache, table, lens, 128**-0.5, out=batch[2:5])
    assert got.data_ptr() == batch[2:5].data_ptr()
    assert torch.equal(batch[2:5], kernel(q, cache, table, lens, 128**-0.5))
    assert (batch[:2] == 5).all() and (batch[5:] == 5).all()
    for bad in (batch[2:4], batch[2:5].double()):
        with pytest.raises(ValueError, match="out must be"):
            kernel(q, cache, table, lens, 128**-0.5, out=bad)
