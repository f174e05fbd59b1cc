"""The prefill attention benchmark runs end to end: the kernel, fp32 SDPA and SDPA on the
fresh K/V in the model's dtype, one row per length, the kernel agreeing with SDPA."""

from __future__ import annotations

import math
import sys

import pytest

from benchmarks import prefill_kernel
from kvferry.native.paged_prefill import load_paged_prefill, load_paged_prefill_amx


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_row_per_length(
    dtype: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if load_paged_prefill() is None:
        pytest.skip("no C compiler, or native kernels off")
    argv = ["prefill_kernel.py", "--lengths", "40", "100", "--reps", "1", "--dtype", dtype]
    monkeypatch.setattr(sys, "argv", argv + ["--heads", "4", "--kv-heads", "2"])
    prefill_kernel.main()
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["tokens"])
    rows = [line.split() for line in lines[header + 1 :]]
    assert [r[0] for r in rows] == ["40", "100"]
    for r in rows:
        # Times print to 0.1 ms, which these sizes may round down to 0.
        assert len(r) == 8 and all(math.isfinite(float(x)) and float(x) >= 0 for x in r[1:7])
        assert float(r[7]) < (1e-4 if dtype == "float32" else 3e-2)  # max error vs fp32 SDPA


def test_amx_kernel_rows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if load_paged_prefill_amx() is None:
        pytest.skip("no AMX tiles on this CPU")
    argv = ["prefill_kernel.py", "--lengths", "64", "--reps", "1", "--dtype", "bfloat16"]
    monkeypatch.setattr(sys, "argv", argv + ["--kernel", "amx", "--head-dim", "128"])
    prefill_kernel.main()
    rows = capsys.readouterr().out.splitlines()
    last = rows[-1].split()
    assert last[0] == "64" and float(last[-1]) < 3e-2  # agrees with fp32 SDPA


def test_amx_kernel_needs_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["prefill_kernel.py", "--kernel", "amx"])
    with pytest.raises(SystemExit, match="bf16 only"):
        prefill_kernel.main()


def test_against_a_revision_after_a_context(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--baseline``: the kernel built from a git revision's sources, timed in turn; here the
    revision is HEAD, so both builds give the same output and the speed-up is finite."""
    if load_paged_prefill() is None:
        pytest.skip("no C compiler, or native kernels off")
    argv = ["prefill_kernel.py", "--lengths", "40", "--reps", "2", "--context", "70"]
    monkeypatch.setattr(
        sys, "argv", argv + ["--heads", "4", "--kv-heads", "2", "--baseline", "HEAD"]
    )
    prefill_kernel.main()
    last = capsys.readouterr().out.splitlines()[-1].split()
    assert last[0] == "40" and len(last) == 10
    assert float(last[7]) < 1e-4  # the chunk after 70 cached keys agrees with masked SDPA
    assert float(last[8]) >= 0 and math.isfinite(float(last[9].rstrip("x")))


def test_engine_ab_prefills_in_an_engine(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    if load_paged_prefill() is None:
        pytest.skip("no C compiler, or native kernels off")
    from benchmarks.harness import models

    monkeypatch.setattr(models, "MODELS_DIR", tmp_path)
    argv = ["prefill_kernel.py", "--engine", "tiny", "--lengths", "64", "200", "--reps", "2"]
    monkeypatch.setattr(sys, "argv", argv + ["--baseline", "HEAD"])
    prefill_kernel.main()
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["tokens"])
    rows = [line.split() for line in lines[header + 1 :]]
    assert [r[0] for r in rows] == ["64", "200"]
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows)


def test_engine_needs_a_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["prefill_kernel.py", "--engine", "mid"])
    with pytest.raises(SystemExit, match="--baseline"):
        prefill_kernel.main()
