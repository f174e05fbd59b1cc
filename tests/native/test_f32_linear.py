"""The fp32 small-step linear kernel against F.linear, in every variant this CPU runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.native.f32_linear import F32LinearKernel, Variant, load_f32_linear
from kvferry.worker.cpu_features import ISA_LEVELS, cpu_features

VARIANTS: list[Variant] = ["scalar", "avx2", "avx512"]


def runnable() -> list[Variant]:
    own = ISA_LEVELS.index(cpu_features().cpu_isa)
    return [v for v in VARIANTS if ISA_LEVELS.index(v) <= own]


def kernel_or_skip(variant: Variant) -> F32LinearKernel:
    kernel = load_f32_linear(variant)
    if kernel is None:
        pytest.skip("native kernels are off or unbuildable here")
    return kernel


@pytest.mark.parametrize("variant", runnable())
@pytest.mark.parametrize(
    "m,n,k",
    # Rows 1..13 cross every x-tile size of both vector variants (4 and 8 rows deep);
    # outputs not a multiple of 3 and inputs not a multiple of 8 or 16 exercise the tails;
    # 16 x 1030 x 1024 runs on several threads and crosses panels.
    [
        (1, 7, 16),
        (2, 34, 40),
        (3, 5, 23),
        (4, 64, 128),
        (5, 9, 1),
        (6, 11, 50),
        (7, 10, 33),
        (8, 49, 64),
        (9, 37, 100),
        (13, 20, 48),
        (16, 1030, 1024),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(variant: Variant, m: int, n: int, k: int, bias: bool) -> None:
    kernel = kernel_or_skip(variant)
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    got = kernel(x, w, b)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # fp32 sums in another order than torch's: within a few fp32 ulps of the sum's terms.
    scale = F.linear(x.double().abs(), w.double().abs()) + (0 if b is None else b.double().abs())
    assert ((got.double() - want).abs() <= 4 * torch.finfo(torch.float32).eps * scale).all()
    assert torch.equal(got, kernel(x, w, b))


@pytest.mark.parametrize("variant", runnable())
def test_strided_rows(variant: Variant) -> None:
    kernel = kernel_or_skip(variant)
    g = torch.Generator().manual_seed(1)
    wide, big_w = torch.randn(6, 96, generator=g), torch.randn(20, 80, generator=g)
    x, w = wide[:, 8:72], big_w[:, :64]  # rows of both strided, elements contiguous
    assert kernel.supports(x, w)
    torch.testing.assert_close(kernel(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_supports_only_fp32_rows_with_contiguous_elements() -> None:
    kernel = kernel_or_skip("scalar")
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert kernel.supports(x, w)
    assert not kernel.supports(x.bfloat16(), w.bfloat16())
    assert not kernel.supports(x, w.t().contiguous().t())
    assert not kernel.supports(x[None], w)
    assert not kernel.supports(x, torch.randn(4, 9))
    assert "scalar" in kernel.compiled()


def test_a_variant_outside_the_build_is_refused() -> None:
    assert load_f32_linear("avx512bf16") is None  # type: ignore[arg-type]
