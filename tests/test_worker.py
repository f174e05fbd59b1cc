"""The worker's KV pool memory."""

from __future__ import annotations

import gc

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
