"""The worker's KV pool memory."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
from collections.abc import Callable
from pathlib import Path

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
    eager = zeroed_kv_tensor(shape, torch.float32, torch.device("cpu"), prefault=True)
    assert resident(eager) == nbytes // mmap.PAGESIZE and not eager.any()


@pytest.mark.parametrize(
    "argv,env,want",
    [
        (["generate", "--model", "m"], None, True),
        (["generate", "--model", "m", "--no-kv-pool-prefault"], None, False),
        (["generate", "--model", "m"], "0", False),
        (["generate", "--model", "m", "--no-kv-pool-prefault"], "1", True),
        (["serve", "m"], None, True),
        (["serve", "m", "--no-kv-pool-prefault"], None, False),
        (["serve", "m"], "", True),
    ],
)
def test_the_pool_is_prefaulted_unless_the_user_says_not(
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_factory: Callable[..., Path],
    argv: list[str],
    env: str | None,
    want: bool,
) -> None:
    """Every engine takes its pool's pages at start-up, as vLLM does, unless the flag says
    not to; the env var, when set to a value, decides for every engine."""
    from kvferry.engine.arg_utils import EngineArgs
    from kvferry.entrypoints.cli import build_parser
    from kvferry.worker import worker

    monkeypatch.delenv("KVFERRY_KV_POOL_PREFAULT", raising=False)
    if env is not None:
        monkeypatch.setenv("KVFERRY_KV_POOL_PREFAULT", env)
    argv = [a if a != "m" else str(tiny_model_factory()) for a in argv]
    config = EngineArgs.from_cli_args(build_parser().parse_args(argv)).create_engine_config()
    seen: list[bool] = []

    def allocate(kv_cache_config: object, device: object, alloc: object) -> list[object]:
        seen.append(alloc.keywords["prefault"])  # type: ignore[attr-defined]
        raise StopIteration

    monkeypatch.setattr(worker, "allocate_kv_caches", allocate)
    with pytest.raises(StopIteration):
        worker.Worker(config)
    assert seen == [want]
