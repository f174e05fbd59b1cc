"""The bf16 AMX GEMM kernel (prefill-sized steps) against F.linear, its packed weight, and the
hook that puts it in front of the plain weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.native.bf16_amx_gemm import BF16AMXGemmKernel, load_bf16_amx_gemm
from kvferry.worker.cpu_backend import CPULinear, PackedStepsLinear
from kvferry.worker.cpu_features import cpu_features

KC = 256  # inputs per chunk in the packed layout (csrc/bf16_amx_gemm.c)


@pytest.fixture(scope="module")
def kernel() -> BF16AMXGemmKernel:
    if not cpu_features().amx_bf16:
        pytest.skip("needs a CPU with AMX-BF16")
    k = load_bf16_amx_gemm()
    if k is None:
        pytest.skip("native kernels are off or unbuildable here")
    return k


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact product of the bf16 values, rounded to bf16 once."""
    b = None if bias is None else bias.double()
    return F.linear(x.double(), w.double(), b).to(torch.bfloat16)


@pytest.mark.parametrize(
    "m,n,k",
    # Rows: one, a partial block of 16, one block, a block and a row (a lone last block), an
    # odd number of blocks (the last pair has one), 529 (past a serving prompt's step). Inputs:
    # one step, one chunk, a chunk and a step (a short last chunk), several chunks. Outputs:
    # one panel, several, and enough that each thread walks several blocks of panels with
    # the next one's prefetch crossing from block to block.
    [
        (1, 32, 32),
        (15, 64, 64),
        (16, 32, 256),
        (17, 96, 288),
        (47, 64, 512),
        (200, 160, 96),
        (529, 128, 544),
        (70, 4096, 64),
        (300, 1024, 1024),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(
    kernel: BF16AMXGemmKernel, m: int, n: int, k: int, with_bias: bool
) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    x = torch.randn(m, k + 32, generator=g).bfloat16()[:, :k]  # rows with a stride of their own
    packed = kernel.pack(w)
    assert packed.shape == (n * k,) and packed.dtype == torch.bfloat16
    got = kernel(x, packed, n, bias)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # fp32 sums in another order than the exact one: at most a bf16 rounding step apart
    torch.testing.assert_close(got.float(), reference(x, w, bias).float(), rtol=8e-3, atol=2e-2)
    # and as close to oneDNN's bf16 product
    onednn = F.linear(x, w, bias)
    torch.testing.assert_close(got.float(), onednn.float(), rtol=1.6e-2, atol=4e-2)


def test_packed_tiles_hold_input_pairs_of_16_outputs(kernel: BF16AMXGemmKernel) -> None:
    n, k = 64, 320  # two panels; a full chunk and a 2-step one
    w = torch.arange(n * k, dtype=torch.float32).remainder(251).view(n, k).bfloat16()
    packed = kernel.pack(w)
    for out, inp in [(0, 0), (5, 1), (17, 40), (33, 255), (63, 256), (40, 319)]:
        panel, half, o = out // 32, out % 32 // 16, out % 16
        k0 = inp // KC * KC
        steps = min(KC, k - k0) // 32
        t, pair, e = (inp - k0) // 32, (inp - k0) % 32 // 2, inp % 2
        at = panel * 32 * k + k0 * 32 + (half * steps + t) * 512 + pair * 32 + o * 2 + e
        assert packed[at] == w[out, inp], (out, inp)
    # a weight whose rows are strided packs the same
    assert torch.equal(kernel.pack(torch.cat([w, w], 1)[:, :k]), packed)


def test_no_rows_and_refusals(kernel: BF16AMXGemmKernel) -> None:
    w = torch.randn(64, 32).bfloat16()
    assert kernel(torch.empty(0, 32, dtype=torch.bfloat16), kernel.pack(w), 64).shape == (0, 64)
    assert kernel.packs(w)
    for bad in (w.float(), torch.randn(48, 32).bfloat16(), torch.randn(64, 40).bfloat16()):
        assert not kernel.packs(bad)
        with pytest.raises(ValueError, match="multiple of 32"):
            kernel.pack(bad)
    assert not kernel.packs(torch.randn(32, 64).bfloat16().t())  # columns not contiguous
    assert kernel.supports(torch.randn(3, 32).bfloat16(), 32)
    assert not kernel.supports(torch.randn(3, 32).bfloat16(), 64)
    assert not kernel.supports(torch.randn(3, 32), 32)
    assert not kernel.supports(torch.randn(2, 3, 32).bfloat16(), 32)
    assert not kernel.supports(torch.randn(32, 3).bfloat16().t(), 32)
    # sizes the kernel does not take are refused, not computed
    with pytest.raises(RuntimeError, match="multiples of 32"):
        kernel(torch.randn(3, 32).bfloat16(), kernel.pack(w), 48)


def test_one_thread_and_two_agree(kernel: BF16AMXGemmKernel) -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(512, 512, generator=g).bfloat16()
    x = torch.randn(260, 512, generator=g).bfloat16()
    packed = kernel.pack(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(x, packed, 512)
        torch.set_num_threads(max(2, before))
        many = kernel(x, packed, 512)
    finally:
        torch.set_num_threads(before)
    # each output is summed in the same order, whichever thread computes it
    assert torch.equal(one, many)


class Rest:
    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return CPULinear(None)(x, w, b)


def test_hook_serves_steps_up_to_its_rows_from_its_own_copy(kernel: BF16AMXGemmKernel) -> None:
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    rest = Rest()
    hook = PackedStepsLinear(kernel, kernel.pack(w), 96, 40, rest)
    for rows in (1, 40, 41):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        torch.testing.assert_close(hook(x, w, b).float(), F.linear(x, w, b).float(), **TOL)
    hook(torch.randn(2, 3, 64, generator=g).bfloat16(), w, None)  # not 2-D
    assert rest.rows == [41, 2]
    # The kernel reads its copy, not the weight it is handed: the copy made at load time.
    x = torch.randn(3, 64, generator=g).bfloat16()
    got = hook(x, torch.zeros_like(w), b)
    torch.testing.assert_close(got.float(), F.linear(x, w, b).float(), **TOL)


TOL = {"rtol": 1.6e-2, "atol": 4e-2}
