"""The machine-speed probe the serving benchmark takes before each launch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.harness.speed_probe import main, probe, probe_in_subprocess, spread_text


def test_probe_measures_gemm_and_copy() -> None:
    speed = probe("float32", 64, min_time=0.01)
    assert speed.dtype == "float32"
    assert speed.gemm_gflops > 0 and speed.copy_gbps > 0 and speed.seconds > 0


def test_probe_in_its_own_process() -> None:
    doc = probe_in_subprocess(sys.executable, "bfloat16", 64)
    assert doc["dtype"] == "bfloat16"
    assert doc["gemm_gflops"] > 0 and doc["copy_gbps"] > 0


def test_probe_refuses_a_bad_width(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--hidden", "0"])
    assert e.value.code == 2
    assert "--hidden must be positive" in capsys.readouterr().err


def test_spread_text() -> None:
    probes = [
        {"dtype": "bfloat16", "gemm_gflops": 2000.0, "copy_gbps": 25.0},
        {"dtype": "bfloat16", "gemm_gflops": 2300.0, "copy_gbps": 26.0},
    ]
    assert spread_text(probes) == (
        "GEMM (bfloat16) 2,000-2,300 GFLOP/s (spread 15%), copy 25.0-26.0 GB/s (4%)"
    )
    assert spread_text([]) == ""


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("echo not json", "printed no result"),
        ("echo '{}'", "printed no result"),
        ("exit 3", "exited with 3"),
    ],
)
def test_a_probe_without_a_result_is_an_error(tmp_path: Path, script: str, message: str) -> None:
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=message):
        probe_in_subprocess(str(fake), "float32", 64)
