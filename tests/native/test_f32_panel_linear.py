"""The fp32 panel linear kernel (AVX-512) against F.linear, and its weight panels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.native.f32_panel_linear import F32PanelLinearKernel, load_f32_panel_linear
from kvferry.worker.cpu_features import cpu_features


@pytest.fixture(scope="module")
def kernel() -> F32PanelLinearKernel:
    if cpu_features().cpu_isa != "avx512":
        pytest.skip("needs an AVX-512 CPU")
    k = load_f32_panel_linear()
    if k is None:
        pytest.skip("native kernels are off or unbuildable here")
    return k


@pytest.mark.parametrize(
    "m,n,k",
    # Rows 1..9 cross the micro-kernel's depths (1-8 rows) and a second pass; outputs 1, 47,
    # 49, 97 leave a panel partly empty; 64 x 1000 x 1024 runs on several threads with the
    # next-panel prefetch; 130 rows is past the engine's limit (the kernel has none).
    [
        (1, 1, 1),
        (2, 47, 5),
        (3, 48, 16),
        (4, 49, 17),
        (5, 97, 33),
        (6, 96, 64),
        (7, 150, 100),
        (8, 48, 1024),
        (9, 200, 40),
        (17, 97, 2048),
        (64, 1000, 1024),
        (130, 300, 256),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(
    kernel: F32PanelLinearKernel, m: int, n: int, k: int, with_bias: bool
) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    x = torch.randn(m, k + 3, generator=g)[:, :k]  # rows with a stride of their own
    panels = kernel.pack(w)
    assert panels.numel() == -(-n // kernel.width) * kernel.width * k
    got = kernel(x, panels, n, bias)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * k**0.5)


def test_panels_hold_each_output_side_by_side_and_zeros_past_the_last(
    kernel: F32PanelLinearKernel,
) -> None:
    w = torch.arange(50 * 3, dtype=torch.float32).view(50, 3)
    panels = kernel.pack(w).view(-1, 3, kernel.width)  # [panel, input, output]
    assert panels.shape[0] == 2
    assert torch.equal(panels[0, 1], w[: kernel.width, 1])
    assert torch.equal(panels[1, 2, : 50 - kernel.width], w[kernel.width :, 2])
    assert not panels[1, :, 50 - kernel.width :].any()
    # a weight whose rows are strided packs the same
    assert torch.equal(kernel.pack(torch.cat([w, w], 1)[:, :3]), kernel.pack(w))


def test_no_rows_and_refusals(kernel: F32PanelLinearKernel) -> None:
    w = torch.randn(10, 8)
    assert kernel(torch.empty(0, 8), kernel.pack(w), 10).shape == (0, 10)
    with pytest.raises(ValueError, match="fp32"):
        kernel.pack(w.bfloat16())
    assert kernel.supports(torch.randn(3, 8), 8)
    assert not kernel.supports(torch.randn(3, 8), 9)
    assert not kernel.supports(torch.randn(3, 8).bfloat16(), 8)
    assert not kernel.supports(torch.randn(2, 3, 8), 8)
    assert not kernel.supports(torch.randn(8, 3).t(), 8)


def test_one_thread_and_two_agree(kernel: F32PanelLinearKernel) -> None:
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(500, 256, generator=g), torch.randn(24, 256, generator=g)
    panels = kernel.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, panels, 500)
        torch.set_num_threads(max(2, before))
        many = kernel(x, panels, 500)
    finally:
        torch.set_num_threads(before)
    # each output is one sum in input order, whichever thread computes it
    assert torch.equal(one, many)
