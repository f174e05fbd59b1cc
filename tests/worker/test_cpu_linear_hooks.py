"""The linear hooks of the CPU backend: oneDNN-packed bf16 weights where the CPU has bf16
instructions, the bf16 C kernel with widening above its row limit where it has not, and the
fp32 small-step kernels (dense-weight and panel) in front of another path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.native.bf16_linear import BF16LinearKernel, load_bf16_linear
from kvferry.native.f32_linear import load_f32_linear
from kvferry.native.f32_panel_linear import load_f32_panel_linear
from kvferry.worker import cpu_backend
from kvferry.worker.cpu_backend import (
    BF16Linear,
    PackedStepsLinear,
    SmallStepsLinear,
    cpu_linear,
    pack_weight,
)


@pytest.mark.parametrize(
    "rows", [1, 7, cpu_backend.PACKED_MAX_ROWS, cpu_backend.PACKED_MAX_ROWS + 1]
)
def test_packed_bf16_matches_torch_bf16(rows: int) -> None:
    if not cpu_backend.cpu_features().native_bf16:
        pytest.skip("this CPU has no bf16 instructions")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 64, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()[:, :64]  # strided rows
    packed = pack_weight(w)
    assert packed is not None and packed.dtype == torch.bfloat16
    got = cpu_linear(x, w, b, packed)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, F.linear(x, w, b))


class Spy:
    """A kernel that records the row count of each call it serves."""

    def __init__(self, kernel: BF16LinearKernel) -> None:
        self.kernel = kernel
        self.calls: list[int] = []

    def supports(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        return self.kernel.supports(x, w)

    def __call__(
        self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return self.kernel(x, w, b)


class Rest:
    """``F.linear`` as the path behind a hook, recording the row count of each call."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return F.linear(x, w, b)


def test_kernel_hook_widens_above_its_row_limit() -> None:
    kernel = load_bf16_linear("scalar")
    if kernel is None:
        pytest.skip("native kernels are off or unbuildable here")
    spy = Spy(kernel)
    hook = BF16Linear(spy, max_rows=4)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(24, 32, generator=g).bfloat16(), torch.randn(24, generator=g).bfloat16()
    for rows in (1, 4, 5):
        x = torch.randn(rows, 32, generator=g).bfloat16()
        want = F.linear(x.float(), w.float(), b.float())
        got = hook(x, w, b)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=1e-2)
    assert spy.calls == [1, 4]  # five rows took the widening branch


def test_small_steps_hook_sends_larger_steps_to_the_rest() -> None:
    kernel = load_f32_linear("scalar")
    if kernel is None:
        pytest.skip("native kernels are off or unbuildable here")
    spy = Spy(kernel)  # type: ignore[arg-type]
    rest = Rest()
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    for hook in (SmallStepsLinear(spy, 4, rest), SmallStepsLinear(spy, 4, F.linear)):  # type: ignore[arg-type]
        for rows in (1, 4, 5):
            x = torch.randn(rows, 32, generator=g)
            torch.testing.assert_close(hook(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        # a bf16 input is not the kernel's: it goes to the rest whatever its size
        hook(torch.randn(2, 32, generator=g).bfloat16(), w.bfloat16(), None)
    assert spy.calls == [1, 4, 1, 4]
    assert rest.rows == [5, 2]


def test_panel_hook_serves_small_2d_fp32_steps_from_its_own_copy() -> None:
    if cpu_backend.cpu_features().cpu_isa != "avx512":
        pytest.skip("needs an AVX-512 CPU")
    kernel = load_f32_panel_linear()
    if kernel is None:
        pytest.skip("native kernels are off or unbuildable here")
    rest = Rest()
    g = torch.Generator().manual_seed(6)
    w, b = torch.randn(50, 32, generator=g), torch.randn(50, generator=g)
    hook = PackedStepsLinear(kernel, kernel.pack(w), 50, 4, rest)
    for rows in (1, 4, 5):
        x = torch.randn(rows, 32, generator=g)
        torch.testing.assert_close(hook(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    hook(torch.randn(2, 3, 32, generator=g), w, None)  # not 2-D
    hook(torch.randn(2, 32, generator=g).bfloat16(), w.bfloat16(), None)
    assert rest.rows == [5, 2, 2]
    # The kernel reads its panels, not the weight it is handed: the copy made at load time.
    x = torch.randn(3, 32, generator=g)
    torch.testing.assert_close(hook(x, torch.zeros_like(w), b), F.linear(x, w, b))


def test_fp32_small_steps_at_the_avx512_level_by_vendor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On Intel the dense-weight kernel takes 1-2-row steps in front of the panel kernel;
    elsewhere the panel kernel takes them, and the dense kernel only stands in for it."""
    if load_f32_panel_linear() is None or load_f32_linear("avx512") is None:
        pytest.skip("native kernels are off or unbuildable here")

    def backend(vendor: str) -> cpu_backend.CPUBackend:
        cpu = cpu_backend.CPUFeatures(
            model="x", flags=frozenset({"avx512f"}), isa="avx512", vendor=vendor
        )
        return cpu_backend.CPUBackend(torch.float32, features=cpu)

    intel, amd = backend("GenuineIntel"), backend("AuthenticAMD")
    assert intel.panel_linear is not None and amd.panel_linear is not None
    assert intel.small_steps is not None
    assert intel.small_steps[1] == cpu_backend.F32_KERNEL_MAX_ROWS_AVX512
    assert amd.small_steps is None
    monkeypatch.setattr(cpu_backend, "load_f32_panel_linear", lambda: None)
    stand_in = backend("AuthenticAMD")
    assert stand_in.panel_linear is None and stand_in.small_steps is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(9, 40), (2, 5, 40)])
def test_widened_linear_is_the_fp32_product_rounded_once(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*shape, generator=g).to(dtype)
    w = torch.randn(24, 40, generator=g).to(dtype)
    b = torch.randn(24, generator=g).to(dtype)
    for weight in (w, w.t().contiguous().t()):  # a weight stored either way round
        got = cpu_backend.widened_linear(x, weight, b)
        assert got.dtype == dtype and got.shape == (*shape[:-1], 24)
        want = F.linear(x.float(), w.float(), b.float())
        # fp32 sums in another order, then one rounding: within a step of the dtype
        torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=2e-2, rtol=1e-2)
    assert cpu_backend.widened_linear(x, w, None).shape == got.shape
