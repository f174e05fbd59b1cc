"""Building, caching and falling back from the C decode-attention kernel."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch

from kvferry.config import ModelConfig
from kvferry.model import native
from kvferry.model.loader import load_model

needs_cc = pytest.mark.skipif(
    shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler on this machine"
)


def _build(
    monkeypatch: pytest.MonkeyPatch, cache: Path, **env: str
) -> native.PagedDecodeKernel | None:
    monkeypatch.setenv("KVFERRY_KERNEL_CACHE", str(cache))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return native.load_paged_decode.__wrapped__()


@needs_cc
def test_built_once_then_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _build(monkeypatch, tmp_path) is not None
    (so,) = tmp_path.glob("paged_decode-*.so")
    stamp = so.stat().st_mtime_ns
    assert _build(monkeypatch, tmp_path) is not None
    assert [p.name for p in tmp_path.iterdir()] == [so.name]  # no temp files left behind
    assert so.stat().st_mtime_ns == stamp


def test_disabled_by_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert _build(monkeypatch, tmp_path, KVFERRY_NATIVE_KERNELS="0") is None
    assert not list(tmp_path.iterdir())


def test_no_compiler_falls_back_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert _build(monkeypatch, tmp_path, CC="kvferry-no-such-cc") is None
    assert "no C compiler" in caplog.text


@needs_cc
def test_failing_build_falls_back_with_the_compiler_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C;\n")
    monkeypatch.setattr(native, "_SOURCE", bad)
    with caplog.at_level(logging.WARNING, logger="kvferry"):
        assert _build(monkeypatch, tmp_path / "cache") is None
    assert "failed" in caplog.text and "error" in caplog.text
    assert not list((tmp_path / "cache").glob("*.so"))


@needs_cc
def test_supports_only_contiguous_cpu_fp32_and_bf16() -> None:
    kernel = native.load_paged_decode()
    assert kernel is not None
    cache = torch.zeros(2, 4, 16, 2, 8)
    q = torch.zeros(3, 4, 8)
    assert kernel.supports(cache, q)
    assert kernel.supports(cache.bfloat16(), q.bfloat16())
    assert not kernel.supports(cache.half(), q.half())
    assert not kernel.supports(cache, q.bfloat16())
    assert not kernel.supports(cache.transpose(2, 3), q)


@needs_cc
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_loader_attaches_the_kernel_on_cpu(
    tiny_model_factory: object, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tiny_model_factory()  # type: ignore[operator]
    model = load_model(ModelConfig(model=str(folder), dtype=dtype), torch.device("cpu"))
    assert model.has_decode_kernel == (dtype != "float16")
    monkeypatch.setenv("KVFERRY_NATIVE_KERNELS", "0")
    native.load_paged_decode.cache_clear()
    try:
        model = load_model(ModelConfig(model=str(folder), dtype=dtype), torch.device("cpu"))
        assert not model.has_decode_kernel
    finally:
        native.load_paged_decode.cache_clear()
