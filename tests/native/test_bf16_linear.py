"""The bf16 linear kernel against F.linear computed in fp32, in every variant this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.native.bf16_linear import VARIANTS, Variant, load_bf16_linear
from kvferry.worker.cpu_features import ISA_LEVELS, cpu_features


def runnable() -> list[Variant]:
    own = ISA_LEVELS.index(cpu_features().cpu_isa)
    return [v for v in VARIANTS if ISA_LEVELS.index(v) <= own]


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the bf16 spacing at ``want``'s magnitude."""
    spacing = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-3)
    return ((got.float() - want) / spacing).abs().max().item()


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize(
    "m,n,k",
    # Rows 1..5 cross every x-tile size and both AVX2 paths (1-3 rows stream the weight
    # rows, more take tiles); outputs not a multiple of 4 and inputs not a multiple of 16
    # (or of the 32 a streaming pass takes) exercise the tails; the largest run on several
    # threads.
    [
        (1, 7, 16),
        (2, 33, 40),
        (3, 5, 23),
        (4, 64, 128),
        (5, 9, 1),
        (1, 2051, 1056),
        (3, 1030, 1000),
        (64, 1030, 1024),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_in_fp32(variant: Variant, m: int, n: int, k: int, bias: bool) -> None:
    kernel = load_bf16_linear(variant)
    if kernel is None:
        pytest.skip("native kernels are off or unbuildable here")
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = kernel(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # Exact products summed in fp32 in another order, then one rounding: within one bf16 ulp.
    assert bf16_ulps(got, want) <= 1.01
    # The result is bf16-rounded fp32, as torch's own bf16 product gives.
    assert torch.equal(got, kernel(x, w, b))


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize("m", [2, 6])
def test_strided_rows(variant: Variant, m: int) -> None:
    kernel = load_bf16_linear(variant)
    if kernel is None:
        pytest.skip("native kernels are off or unbuildable here")
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(m, 96, generator=g).bfloat16()
    big_w = torch.randn(20, 80, generator=g).bfloat16()
    x, w = wide[:, 8:72], big_w[:, :64]  # rows of both strided, elements contiguous
    assert kernel.supports(x, w)
    assert bf16_ulps(kernel(x, w), F.linear(x.float(), w.float())) <= 1.01


def test_supports_only_bf16_rows_with_contiguous_elements() -> None:
    kernel = load_bf16_linear("scalar")
    if kernel is None:
        pytest.skip("native kernels are off or unbuildable here")
    x, w = torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16()
    assert kernel.supports(x, w)
    assert not kernel.supports(x.float(), w)
    assert not kernel.supports(x, w.t().contiguous().t())
    assert not kernel.supports(x[None], w)
    assert "scalar" in kernel.compiled()
