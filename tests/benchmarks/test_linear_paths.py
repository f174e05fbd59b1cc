"""The linear-path timing script runs each path it names, in bf16 and in fp32."""

from __future__ import annotations

import pytest

from benchmarks import bf16_linear_paths
from kvferry.native.bf16_amx_gemm import load_bf16_amx_gemm
from kvferry.native.f32_panel_linear import load_f32_panel_linear
from kvferry.worker.cpu_features import cpu_features


def test_bf16_paths(capsys: pytest.CaptureFixture[str]) -> None:
    bf16_linear_paths.main(["--rows", "1,3", "--reps", "1", "--paths", "torch,widen"])
    out = capsys.readouterr().out
    assert "dtype=bfloat16" in out
    assert "rows=3 torch=" in out and " widen=" in out


def test_fp32_paths_with_the_panel_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    if cpu_features().cpu_isa != "avx512" or load_f32_panel_linear() is None:
        pytest.skip("needs an AVX-512 CPU and a C compiler")
    bf16_linear_paths.main(["--dtype", "float32", "--rows", "1,5", "--reps", "1"])
    out = capsys.readouterr().out
    assert "dtype=float32" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("rows=5 "))
    for path in ("torch=", "packed=", "c-avx512=", "panels="):
        assert path in line, line


def test_bf16_paths_with_the_amx_gemm_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    if not cpu_features().amx_bf16 or load_bf16_amx_gemm() is None:
        pytest.skip("needs a CPU with AMX and a C compiler")
    args = ["--rows", "40", "--reps", "1", "--no-logits", "--paths", "packed,amx-gemm"]
    bf16_linear_paths.main(args)
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("rows=40 "))
    assert "packed=" in line and "amx-gemm=" in line, line
