"""The bf16 linear kernel against the product in fp64, in every variant this CPU runs."""

from __future__ import annotations

import pytest
import torch

from kvferry.native.bf16_linear import VARIANTS, Variant, load_bf16_linear
from kvferry.worker.cpu_features import ISA_LEVELS, cpu_features


def runnable() -> list[Variant]:
    own = cpu_features()
    level = ISA_LEVELS.index(own.cpu_isa)
    out = [v for v in VARIANTS if v in ISA_LEVELS and ISA_LEVELS.index(v) <= level]
    if own.bf16_dot:
        out.append("avx512bf16")
    if own.bf16_dot and own.amx_bf16:
        out.append("amx")
    return out


def error_bound_ratio(
    got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
) -> float:
    """Largest error of ``got`` against ``x @ w.T + b`` in fp64, as a share of what exact
    products summed in fp32 in any order and rounded once to bf16 may be off by: one bf16
    spacing at the result's magnitude, plus the fp32 sums' worst case (K + 1 units of fp32
    rounding on the sum of the terms' magnitudes). Where results cancel, the second part is
    what a reordered sum really moves; a wrong product or a lost term is far past both."""
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T
    mags = x64.abs() @ w64.abs().T
    if b is not None:
        want, mags = want + b.double(), mags + b.double().abs()
    k = x.shape[1] + 1
    bound = torch.finfo(torch.bfloat16).eps * want.abs() + k * 2.0**-24 * mags
    return ((got.double() - want).abs() / bound.clamp_min(1e-30)).max().item()


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize(
    "m,n,k",
    # Rows 1..5 cross every x-tile size and both paths of the AVX2 and AVX512-BF16 variants
    # (1-3 or 1-4 rows stream the weight rows, more take tiles); outputs not a multiple of 4
    # and inputs not a multiple of 16 (or of the 32 a streaming pass takes) exercise the tails;
    # the largest run on several threads.
    [
        (1, 7, 16),
        (2, 33, 40),
        (3, 5, 23),
        (4, 64, 128),
        (5, 9, 1),
        (1, 2051, 1056),
        (3, 1030, 1000),
        (64, 1030, 1024),
        (4, 37, 100),
        (7, 13, 70),
        # AMX: 1-5 blocks of 16 rows (a partial one last), 16-output blocks with 0-15 outputs
        # left over, inputs past the last 32 (none at all below 32).
        (17, 48, 96),
        (33, 50, 200),
        (64, 64, 64),
        (70, 35, 1056),
        (20, 32, 16),
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
    got = kernel(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert error_bound_ratio(got, x, w, b) <= 1.0
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
    assert error_bound_ratio(kernel(x, w), x, w) <= 1.0


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
