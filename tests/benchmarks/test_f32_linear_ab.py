"""The linear-kernel A/B benchmark runs end to end on a tiny model: fp32 at the AVX2 level, bf16,
and the fp32 panel kernel at the AVX-512 level."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import f32_linear_ab
from kvferry.native.bf16_linear import load_bf16_linear
from kvferry.native.f32_linear import load_f32_linear
from kvferry.native.f32_panel_linear import load_f32_panel_linear
from kvferry.worker import cpu_features as cf


@pytest.fixture
def avx2_level(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if cf.cpu_features().cpu_isa == "scalar" or load_f32_linear("avx2") is None:
        pytest.skip("needs an AVX2 CPU and a C compiler")
    monkeypatch.setenv("KVFERRY_CPU_ISA", "avx2")
    cf.cpu_features.cache_clear()
    yield
    cf.cpu_features.cache_clear()


@pytest.mark.usefixtures("avx2_level")
def test_each_row_limit_runs_paired_rounds_against_onednn(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    out = tmp_path / "ab.json"
    args = ["--model", str(tiny_model_factory()), "--prompts", "2", "--max-tokens", "4"]
    f32_linear_ab.main([*args, "--rounds", "2", "--max-rows", "1,8", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert set(doc["max_rows"]) == {"1", "8"}
    for side in doc["max_rows"].values():
        rates = side["tokens_per_s"]
        assert len(rates["kernel"]) == len(rates["onednn"]) == 2
        assert all(r > 0 for r in rates["kernel"] + rates["onednn"])
        assert len(side["paired_gain"]["per_round"]) == 2


def two_rounds(model: Path, tmp_path: Path, prompts: int, max_rows: str, *ab: str) -> Any:
    """Two paired rounds of 4-token generations at one row limit; their tokens/s."""
    out = tmp_path / "ab.json"
    args = ["--model", str(model), "--prompts", str(prompts), "--max-tokens", "4"]
    f32_linear_ab.main([*args, *ab, "--rounds", "2", "--max-rows", max_rows, "--out", str(out)])
    return json.loads(out.read_text())["max_rows"][max_rows]["tokens_per_s"]


def test_bf16_dot_kernel_runs_paired_rounds_against_onednn(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    if not cf.cpu_features().bf16_dot or load_bf16_linear("avx512bf16") is None:
        pytest.skip("needs a CPU with AVX512_BF16 and a C compiler")
    rates = two_rounds(tiny_model_factory(), tmp_path, 1, "1", "--dtype", "bfloat16")
    assert len(rates["kernel"]) == len(rates["onednn"]) == 2


def test_panel_kernel_runs_paired_rounds_against_onednn(
    tiny_model_factory: Callable[..., Path], tmp_path: Path
) -> None:
    if cf.cpu_features().cpu_isa != "avx512" or load_f32_panel_linear() is None:
        pytest.skip("needs an AVX-512 CPU and a C compiler")
    rates = two_rounds(tiny_model_factory(), tmp_path, 4, "128", "--kernel", "panels")
    assert len(rates["kernel"]) == len(rates["onednn"]) == 2
