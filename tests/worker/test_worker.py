"""The worker's KV pool memory."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os

import pytest
import torch

from kvferry.worker.worker import zeroed_kv_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_kv_tensors_start_zeroed_and_own_their_memory(dtype: torch.dtype) -> None:
    shape = (2, 40, 16, 2, 8)
    a = zeroed_kv_tensor(shape, dtype, torch.device("cpu"))
    b = zeroed_kv_tensor(shape, dtype, torch.device("cpu"))
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
    assert not a.any() and not b.any()
    gc.collect()  # the tensor alone keeps its memory map alive
    a[1, 39] = 3.0
    a[0, 0, 0, 0, 0] = -1.0
    assert a[1, 39].eq(3.0).all() and a[0, 0, 0, 0, 0].item() == -1.0
    assert not b.any()  # separate maps
    assert a.data_ptr() % 4096 == 0  # page-aligned: good for copies and NIXL registration
    assert a.float().sum().item() == 3.0 * 16 * 2 * 8 - 1.0


def test_prefault_makes_the_pool_resident_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = (2, 64, 16, 4, 64)  # 2 MiB of fp32
    nbytes = 2 * 64 * 16 * 4 * 64 * 4

    def resident(t: torch.Tensor) -> int:
        """Pages of ``t`` in memory (mincore)."""
        libc = ctypes.CDLL(None, use_errno=True)
        pages = nbytes // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(nbytes), vec) == 0, (
            os.strerror(ctypes.get_errno())
        )
        return sum(b & 1 for b in vec)

    lazy = zeroed_kv_tensor(shape, torch.float32, torch.device("cpu"))
    assert resident(lazy) == 0
    monkeypatch.setenv("KVFERRY_KV_POOL_PREFAULT", "1")
    eager = zeroed_kv_tensor(shape, torch.float32, torch.device("cpu"))
    assert resident(eager) == nbytes // mmap.PAGESIZE and not eager.any()
