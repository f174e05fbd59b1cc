"""Attention layers with the paged prefill kernel: every prefill (fresh or after a cached
prefix) read in place from the pool gives the reference result, in mixed batches too."""

from __future__ import annotations

import os
import shutil
from typing import Any, Literal, cast

import pytest
import torch

from kvferry.model.attention_workspace import AttentionWorkspace
from kvferry.native.paged_decode import load_paged_decode
from kvferry.native.paged_prefill import (
    PagedPrefillAMXKernel,
    PagedPrefillKernel,
    load_paged_prefill,
    load_paged_prefill_amx,
)
from kvferry.worker.cpu_backend import DECODE_GATHER_BYTES, CPUBackend
from kvferry.worker.cpu_features import CPUFeatures, cpu_features
from tests.model.test_model_attention import MIXED, Scenario
from tests.native.test_paged_prefill import amx_kernel

pytestmark = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler on this machine"
)


class _Counting:
    """The real kernel (whichever class), counting its calls."""

    calls = 0

    def __init__(self, kernel: PagedPrefillKernel) -> None:
        self.kernel = kernel

    def supports(self, kv_cache: torch.Tensor, q: torch.Tensor) -> bool:
        return self.kernel.supports(kv_cache, q)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        _Counting.calls += 1
        return self.kernel(*args, **kwargs)


def _workspace(amx: bool = False) -> AttentionWorkspace:
    kernel = amx_kernel() if amx else load_paged_prefill()
    assert kernel is not None
    counting = cast(PagedPrefillKernel, _Counting(kernel))
    _Counting.calls = 0
    return AttentionWorkspace(
        decode_kernel=load_paged_decode(cpu_features().isa),
        prefill_kernel=counting,
        decode_gather_bytes=DECODE_GATHER_BYTES,
    )


@pytest.mark.parametrize(
    "steps",
    [
        MIXED,
        [(0, 40)],  # one fresh prefill
        [(31, 17)],  # one chunk with context
        [(2048 - 64, 64), (0, 300), (5, 1)],  # a long prefix, a fresh prompt, a decode
    ],
)
@pytest.mark.parametrize(
    ("dtype", "amx"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_prefills_through_the_kernel_match_reference(
    steps: list[tuple[int, int]], dtype: torch.dtype, amx: bool
) -> None:
    s = Scenario(8, 2, 32, 16, steps, dtype=dtype, seed=len(steps))
    out = s.run(workspace=_workspace(amx))
    assert _Counting.calls == sum(1 for _, n in steps if n > 1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), s.expected(), atol=tol, rtol=tol)


def test_unsupported_head_dim_falls_back() -> None:
    s = Scenario(4, 4, 8, 4, [(0, 9), (7, 5)], seed=1)
    out = s.run(workspace=_workspace())
    assert _Counting.calls == 0
    torch.testing.assert_close(out.double(), s.expected(), atol=1e-5, rtol=1e-5)


_AVX512 = frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"})
_AMX = _AVX512 | {"amx_tile", "amx_bf16"}


@pytest.mark.parametrize(
    ("dtype", "flags", "isa", "offered"),
    [
        (torch.float32, _AVX512, "avx512", True),
        (torch.bfloat16, _AVX512, "avx512", True),
        (torch.float32, _AMX, "avx512", True),
        # AMX: bf16 prefills take the AMX kernel (where this process gets the tiles; torch's
        # SDPA otherwise); capped below AVX-512, the fp32-arithmetic kernel.
        (torch.bfloat16, _AMX, "avx512", None),
        (torch.bfloat16, _AMX, "avx2", True),
    ],
)
def test_cpu_backend_offers_the_kernel(
    dtype: torch.dtype, flags: frozenset[str], isa: Literal["avx2", "avx512"], offered: bool | None
) -> None:
    features = CPUFeatures("x", flags, isa, forced=None if isa == "avx512" else isa)
    backend = CPUBackend(dtype, features=features)
    kernel = backend.attention_workspace().prefill_kernel
    if offered is None:  # the AMX kernel, if this machine runs it
        amx = load_paged_prefill_amx()
        assert (kernel is None) == (amx is None)
        assert kernel is None or isinstance(kernel, PagedPrefillAMXKernel)
    else:
        assert (kernel is not None) == offered
        assert not isinstance(kernel, PagedPrefillAMXKernel)
    off = CPUBackend(dtype, native_kernels=False, features=features)
    assert off.attention_workspace().prefill_kernel is None
